"""Every check, in the order ``python -m matepoint check`` runs them, with
its group, its claim in one line, whether ``--quick`` runs it and its time
limit. The "allocator" group runs in a process of its own (its first check
installs the allocator, which must happen before CUDA is used)."""
from __future__ import annotations

from typing import Dict, List

from matepoint.bench.selfcheck import (allocator_checks, host_checks, link_checks, memory_checks,
                                  training_checks)
from matepoint.bench.selfcheck.outcome import Check

HOST, ALLOCATOR, TRAINING, LINK, MEMORY = "host", "allocator", "training", "link", "memory"
GROUPS = (HOST, ALLOCATOR, TRAINING, LINK, MEMORY)

CHECKS: List[Check] = [
    Check("checkpoint_cpu", HOST, "matepoint.checkpoint gives torch's checkpoint's gradients "
          "bit for bit on the CPU (fp32, dropout)", host_checks.check_checkpoint_cpu,
          needs_gpu=False),
    Check("allocator_units", HOST, "install_allocator() gets its C++ adapter and OOM unit for "
          "this torch", host_checks.check_allocator_units, needs_gpu=False),
    Check("allocator_install", ALLOCATOR, "install_allocator() installs the allocator with its "
          "C++ adapter; out of memory raises", allocator_checks.check_install, limit_s=120),
    Check("memory_api", ALLOCATOR, "torch.cuda.max_memory_allocated() and memory_allocated() "
          "are the allocator's figures during checkpointed training",
          allocator_checks.check_memory_api),
    Check("cudnn_benchmark", ALLOCATOR, "cudnn.benchmark runs under the allocator",
          allocator_checks.check_cudnn),
    Check("cuda_graph", ALLOCATOR, "a CUDA graph captures and replays, a second one shares its "
          "pool, make_graphed_callables trains", allocator_checks.check_cuda_graph),
    Check("compile_reduce_overhead", ALLOCATOR, "torch.compile(mode='reduce-overhead') trains "
          "and infers like eager", allocator_checks.check_compile, quick=False, limit_s=180),
    Check("mempool", ALLOCATOR, "torch.cuda.MemPool keeps its allocations in its own segments",
          allocator_checks.check_mempool),
    Check("memory_snapshot", ALLOCATOR, "a memory snapshot tags each block with its checkpoint "
          "region and renders in torch's viewer", allocator_checks.check_snapshot),
    Check("ipc_spawn", ALLOCATOR, "a CUDA tensor's view shared with spawned processes reads "
          "right", allocator_checks.check_ipc, quick=False, limit_s=120),
    Check("offload_prefetch", TRAINING, "training steps that offload and prefetch give torch's "
          "checkpoint's gradients bit for bit (fp32)", training_checks.check_offload_prefetch),
    Check("side_streams", TRAINING, "the same with regions on two side streams",
          training_checks.check_side_streams, quick=False),
    Check("two_threads", TRAINING, "the same from two threads at once",
          training_checks.check_two_threads, quick=False),
    Check("disk_tier", TRAINING, "the same with pinned memory capped and the disk tier "
          "spilling", training_checks.check_disk_tier, quick=False),
    Check("copy_bandwidth", LINK, "host memory pins; pinned H2D and D2H bandwidth",
          link_checks.check_copy_bandwidth),
    Check("offload_link_use", LINK, f"a transfer-bound offload reaches at least "
          f"{link_checks.LINK_FLOOR:.0%} of the D2H bandwidth on a warm pool",
          link_checks.check_link_use, quick=False),
    Check("host_waits", LINK, "a training step that offloads makes the host wait for the GPU "
          "no more than torch's checkpoint", link_checks.check_host_waits),
    Check("deep_stack_peak", MEMORY, f"a deep stack that offloads peaks within "
          f"{memory_checks.PEAK_TOLERANCE:.0%} of the planner's prediction",
          memory_checks.check_deep_stack_peak, quick=False, limit_s=180),
]
BY_NAME: Dict[str, Check] = {check.name: check for check in CHECKS}
