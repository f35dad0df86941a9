"""Offload on a real GPU: flat memory with depth, exact gradients, no corruption.

Every test here needs CUDA and is skipped without it (see conftest.py).
"""
import copy
import gc
import random

import pytest
import torch
import torch.nn as nn

import matepoint

pytestmark = pytest.mark.cuda


@pytest.fixture
def cuda_offload():
    saved = matepoint.options
    matepoint.set_options(offload=True, min_offload_bytes=1 << 16)
    yield
    torch.cuda.synchronize()
    gc.collect()
    matepoint.set_options(**{n: getattr(saved, n) for n in saved.__dataclass_fields__})


def block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def forward_memory(depth: int, width: int = 1024, batch: int = 512) -> int:
    """Device bytes held after the forward of `depth` offloaded checkpoints."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(block(width) for _ in range(depth)).cuda()
    x = torch.randn(batch, width, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    h = x
    for b in blocks:
        h = matepoint.checkpoint(b, h)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    h.sum().backward()
    del h
    return held


def test_device_memory_does_not_grow_with_depth(cuda_offload) -> None:
    one_input = 512 * 1024 * 4
    shallow = forward_memory(4)
    deep = forward_memory(32)
    # parameters grow with depth, activations must not: compare the rest
    params_per_block = sum(p.numel() * 4 for p in block(1024).parameters())
    extra = (deep - 28 * params_per_block) - shallow
    assert extra < 2 * one_input, f"held {extra} bytes more at depth 32 than at depth 4"


def test_gradients_equal_non_offloaded_run(cuda_offload) -> None:
    torch.manual_seed(0)
    model = nn.ModuleList(block(256) for _ in range(6)).cuda()
    x = torch.randn(64, 256, device="cuda")

    def run(wrap):
        replica = copy.deepcopy(model)
        inp = x.clone().requires_grad_(True)
        h = inp
        for b in replica:
            h = wrap(b, h)
        h.pow(2).mean().backward()
        return [inp.grad] + [p.grad for p in replica.parameters()]

    ref = run(lambda f, t: f(t))
    got = run(matepoint.checkpoint)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert matepoint.pool_stats()["backend"] == "cuda-pinned"


def test_pool_returns_to_zero_and_is_reused(cuda_offload) -> None:
    model = nn.ModuleList(block(512) for _ in range(4)).cuda()
    x = torch.randn(128, 512, device="cuda", requires_grad=True)

    def train_steps(count: int) -> None:
        for _ in range(count):
            h = x
            for b in model:
                h = matepoint.checkpoint(b, h)
            h.sum().backward()

    train_steps(3)
    allocations = matepoint.pool_stats()["host_allocations"]
    train_steps(3)
    torch.cuda.synchronize()
    gc.collect()
    stats = matepoint.pool_stats()
    assert stats["host_allocations"] == allocations
    assert stats["bytes_in_use"] == 0


def test_random_sizes_stress_finds_no_corruption(cuda_offload) -> None:
    rng = random.Random(0)
    matepoint.set_options(min_offload_bytes=0, prefetch_depth=2)
    for step in range(200):
        width = rng.choice([8, 64, 333, 1024])
        rows = rng.randint(1, 300)
        depth = rng.randint(1, 6)
        weights = [torch.randn(width, width, device="cuda") / width ** 0.5 for _ in range(depth)]
        x = torch.randn(rows, width, device="cuda", requires_grad=True)

        def run(wrap):
            h = x
            for w in weights:
                h = wrap(lambda t, w=w: torch.tanh(t @ w) * 1.5, h)
            (h ** 2).sum().backward()
            grad = x.grad.clone()
            x.grad = None
            return grad

        ref = run(lambda f, t: f(t))
        got = run(matepoint.checkpoint)
        assert torch.allclose(ref, got, rtol=0, atol=0), f"step {step}: gradients differ"


def test_data_parallel_replicas_in_threads(cuda_offload) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[block(128) for _ in range(3)]).cuda()

    class Checkpointed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            for b in self.inner:
                x = matepoint.checkpoint(b, x)
            return x

    x = torch.randn(64, 128, device="cuda")
    ref_model = copy.deepcopy(model)
    ref_model(x).pow(2).mean().backward()
    parallel = nn.DataParallel(Checkpointed(model))
    parallel(x).pow(2).mean().backward()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


FSDP_SCRIPT = """
import os, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard
import matepoint
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:29533")
torch.manual_seed(0)
blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)).cuda()
reference = [p.detach().clone() for p in blocks.parameters()]
for b in blocks:
    fully_shard(b)
x = torch.randn(32, 256, device="cuda")
h = x
for b in blocks:
    h = matepoint.checkpoint(b, h)
h.pow(2).mean().backward()
assert all(p.grad is not None for p in blocks.parameters())
dist.destroy_process_group()
print("fsdp2 ok")
"""


def test_fsdp2_fully_shard_with_checkpoint() -> None:
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", FSDP_SCRIPT], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "fsdp2 ok" in result.stdout


def test_offloaded_inputs_stay_within_the_window_while_the_cpu_runs_ahead(cuda_offload) -> None:
    """Each block sleeps on the GPU, so the CPU queues the whole forward long
    before the GPU gets there; device memory must not follow the CPU."""
    window, depth, numel = 2, 32, 16 << 20          # 64 MiB inputs
    matepoint.set_options(offload_window=window)

    def slow_block(t: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(2_000_000)
        return t * 1.0001 + 1.0

    x = torch.randn(numel, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    h = x
    for _ in range(depth):
        h = matepoint.checkpoint(slow_block, h)
    forward_done = torch.cuda.Event()
    forward_done.record()
    assert not forward_done.query(), "the GPU kept up: this test shows nothing"
    peak = torch.cuda.max_memory_allocated() - base
    in_flight = matepoint.pool_stats()["device_bytes_in_flight"]
    h.sum().backward()
    torch.cuda.synchronize()
    one_input = numel * 4
    assert peak <= (window + 3) * one_input, f"{peak / one_input:.1f} inputs held"
    assert in_flight <= window * one_input
    assert torch.allclose(x.grad, torch.full_like(x, 1.0001 ** depth))
