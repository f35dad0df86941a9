"""``python -m matepoint check`` on the simulated GPU of test builds: the
command runs its GPU checks on tests/sim_target.py's Target, so the checks'
own logic is tested here, not only their printing. Every check that the
simulated GPU can stand in for passes; each fails for its own reason when
the simulator drops one of the engine's waits, a runtime call fails, host
memory or the disk tier gives out, or the adapter cannot be compiled
(SIMCHECK_FAULT), and the command then exits non-zero. The checks the
simulated GPU cannot stand in for (cuDNN, graph capture, torch.compile's
graphs, MemPool, IPC) say so.

Each case is one run of the command in a subprocess (the allocator's checks
in a process of their own, as on a GPU): seconds each."""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, Optional, Tuple

import pytest
import torch

import sim
import sim_target
import matepoint
from matepoint.bench.machine import report as machine_report
from matepoint.bench.selfcheck import registry
from package_under_test import PACKAGE_PARENT

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_TORCH = torch.version.cuda is not None
NOT_SIMULATED = {"cudnn_benchmark", "cuda_graph", "compile_reduce_overhead", "mempool",
                 "ipc_spawn"}
ALLOCATOR = [check.name for check in registry.CHECKS if check.group == registry.ALLOCATOR]


def run_command(tmp_path, *args: str, fault: Optional[str] = None,
                **env: str) -> Tuple[subprocess.CompletedProcess, Dict[str, Any]]:
    """``python -m matepoint check --target sim_target:SimTarget ARGS`` with
    SIMCHECK_FAULT=``fault``: the finished process and its --json file."""
    sim.require_test_build()
    out = tmp_path / "check.json"
    environ = dict(os.environ, **env)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, environ.get("PYTHONPATH")]))
    environ.pop(sim_target.FAULT_VARIABLE, None)
    if fault is not None:
        environ[sim_target.FAULT_VARIABLE] = fault
    done = subprocess.run([sys.executable, "-m", "matepoint", "check", "--target",
                           "sim_target:SimTarget", "--json", str(out), *args], cwd=PACKAGE_PARENT,
                          env=environ, capture_output=True, text=True, timeout=900)
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def by_name(results: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {check["name"]: check for check in results["checks"]}


def expected_status(name: str) -> str:
    if name in NOT_SIMULATED:
        return "SKIP"
    if not CUDA_TORCH and (name in ALLOCATOR or name == "allocator_units"):
        return "SKIP"
    return "PASS"


def test_every_check_passes_or_says_why_not_on_the_simulated_gpu(tmp_path) -> None:
    done, results = run_command(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    checks = by_name(results)
    assert list(checks) == [check.name for check in registry.CHECKS]
    got = {name: check["status"] for name, check in checks.items()}
    assert got == {name: expected_status(name) for name in checks}, \
        {name: check["reason"] for name, check in checks.items() if check["status"] != "PASS"}
    for name in NOT_SIMULATED:
        assert checks[name]["reason"].startswith("the simulated GPU has no "), checks[name]
    if not CUDA_TORCH:
        assert "CPU build" in checks["allocator_install"]["reason"]
    # premises: the steps offloaded, prefetched, spilled; nothing waited
    figures = {name: check["figures"] for name, check in checks.items()}
    target = sim_target.SimTarget
    assert figures["offload_prefetch"]["offloaded"] >= 2 * target.depth
    assert figures["offload_prefetch"]["prefetched"] > 0
    assert figures["side_streams"]["offloaded"] >= 2 * target.depth
    assert figures["two_threads"]["offloaded"] >= 2 * 2 * target.depth
    assert figures["disk_tier"]["spill_writes"] > 0 and figures["disk_tier"]["spill_reads"] > 0
    assert figures["host_waits"] == {"host_waits_per_step": 0, "pageable_offloads_per_step": 0,
                                     "torch_checkpoint_host_waits_per_step": 0}
    peak = figures["deep_stack_peak"]
    assert 0 < peak["measured_peak_bytes"] <= 1.15 * peak["predicted_peak_bytes"]
    assert peak["predicted_peak_bytes"] < peak["keep_all_predicted_peak_bytes"]
    if CUDA_TORCH:
        assert figures["memory_snapshot"]["region_tags"] > 0
        assert figures["allocator_install"]["adapter"] in ("prebuilt", "compiled here")
    # the file: the target, the versions, the date, the counts, the report
    assert results["target"] == target.name and results["gpu"]["name"] == target.name
    assert results["versions"]["torch"] == torch.__version__
    assert results["versions"]["build"] == "test"
    datetime.datetime.fromisoformat(results["date"])
    assert results["summary"] == {status: list(got.values()).count(status)
                                  for status in ("PASS", "FAIL", "SKIP")}
    assert machine_report.shape_problems(results["report"]) == []
    # the text: one line per check, then the counts
    lines = done.stdout.splitlines()
    for name, status in got.items():
        assert any(line.startswith(f"{status:<4}  {name} ") for line in lines), name
    assert f"{results['summary']['PASS']} passed, 0 failed" in done.stdout


# (check, SIMCHECK_FAULT, more environment, what its reason must say, needs a
# CUDA build of torch: the allocator's checks install the adapter)
FAULTS = [
    ("offload_prefetch", "drop:reader_after_copy_in", {},
     r"the gradient of .+ differs from torch's checkpoint's: \d+ of \d+ elements", False),
    ("side_streams", "drop:source_on_copy_out", {},
     r"the gradient of .+ differs from torch's checkpoint's", False),
    ("two_threads", "drop:reader_after_copy_in", {},
     r"the gradient of .+ differs from torch's checkpoint's", False),
    ("disk_tier", "spill_writes", {},
     r"\d+ writes to the disk tier in .+ failed: those inputs stayed in host memory", False),
    ("copy_bandwidth", "fail:cudaHostAlloc", {},
     r"pinning 1 host buffer\(s\) of \d+ bytes failed: .*the host refused", False),
    ("offload_link_use", "no_host_memory", {},
     r"premise: 0 of \d+ inputs were offloaded while measured", False),
    ("host_waits", "fail:cudaHostAlloc", {},
     r"made the host wait for the GPU \d+ times \(\d+ synchronizing calls, [1-9]\d* offloads "
     r"to pageable memory\), the same step under torch's checkpoint 0", False),
    ("deep_stack_peak", "no_host_memory", {},
     r"the step peaked at \d+ bytes .+x the planner's prediction of \d+ for \d+ offloaded", False),
    ("allocator_install", "no_cuda_headers", {"MATEPOINT_PREBUILT": "0"},
     r"installed without its torch_adapter: MATEPOINT_PREBUILT=0 asks to compile it here; and "
     r"compiling it here failed: .*(crt/host_defines\.h|no CUDA runtime headers).* To fix: "
     r".*nvidia-cuda-runtime", True),
    ("memory_api", "fail:cudaMalloc", {}, r"OutOfMemoryError: CUDA out of memory", True),
    ("memory_snapshot", "fail:cudaMalloc", {}, r"OutOfMemoryError: CUDA out of memory", True),
]


@pytest.mark.parametrize("check, fault, env, reason, needs_cuda_torch", FAULTS,
                         ids=[row[0] for row in FAULTS])
def test_each_check_fails_for_its_own_reason(tmp_path, check, fault, env, reason,
                                             needs_cuda_torch) -> None:
    if needs_cuda_torch and not CUDA_TORCH:
        pytest.skip(f"torch {torch.__version__} is a CPU build: the allocator's checks need "
                    f"its CUDA libraries (they are SKIP there: the test above)")
    done, results = run_command(tmp_path, "--only", check, fault=f"{check}:{fault}", **env)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    checks = by_name(results)
    assert checks[check]["status"] == "FAIL", checks[check]
    assert re.search(reason, checks[check]["reason"]), checks[check]["reason"]
    assert f"FAIL  {check} " in done.stdout and "1 failed" in done.stdout
    # only that check failed: the install before an allocator check passed
    assert [name for name, row in checks.items() if row["status"] == "FAIL"] == [check]


def test_a_crash_in_the_allocators_process_fails_what_it_never_reported(tmp_path) -> None:
    """The allocator's checks report one line each as they end: a process
    dying inside one keeps what it reported, and each check left says how
    the process ended."""
    done, results = run_command(tmp_path, "--only", "memory_api,memory_snapshot",
                                fault="memory_api:exit:3")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    checks = by_name(results)
    assert checks["allocator_install"]["status"] == ("PASS" if CUDA_TORCH else "SKIP")
    for name in ("memory_api", "memory_snapshot"):
        assert checks[name]["status"] == "FAIL"
        assert checks[name]["reason"].startswith(
            "the allocator's process ended before this check reported (exit 3"), checks[name]
