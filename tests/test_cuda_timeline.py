"""The GPU-timeline cases of tests/test_gpu_timeline.py on a real GPU, with
the GPU held back (torch.cuda._sleep) so the CPU runs far ahead of it and
every release and reuse happens while copies are still in flight.

Skipped without CUDA (see conftest.py); two-GPU cases need two GPUs."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn

import matepoint

pytestmark = pytest.mark.cuda

WIDTH, BATCH, DEPTH = 1024, 256, 8
SLEEP_CYCLES = 20_000_000   # about 10 ms per block on a current GPU


@pytest.fixture
def cuda_offload():
    saved = matepoint.options
    matepoint.set_options(offload=True, min_offload_bytes=1 << 16, offload_window=1)
    yield
    torch.cuda.synchronize()
    gc.collect()
    matepoint.set_options(**{n: getattr(saved, n) for n in saved.__dataclass_fields__})


class Slow(nn.Module):
    """A block the GPU is slow to run: the CPU queues far ahead of it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SLEEP_CYCLES)
        return self.inner(x)


def grads_of(blocks: nn.ModuleList, x: torch.Tensor, wrap, devices) -> list:
    blocks.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_(True)
    h = leaf
    for block, device in zip(blocks, devices):
        h = wrap(block, h.to(device))
    (h.float() ** 2).mean().backward()
    torch.cuda.synchronize()
    return [leaf.grad.cpu()] + [p.grad.cpu() for p in blocks.parameters()]


def plain(fn, x):
    return fn(x)


def assert_exact(got: list, expected: list) -> None:
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_regions_alternating_between_two_gpus(cuda_offload) -> None:
    torch.manual_seed(0)
    devices = [f"cuda:{i % 2}" for i in range(DEPTH)]
    blocks = nn.ModuleList(Slow().to(d) for d in devices)
    x = torch.randn(BATCH, WIDTH, device="cuda:0")
    expected = grads_of(blocks, x, plain, devices)
    torch.cuda.set_device(0)
    got = grads_of(blocks, x, matepoint.checkpoint, devices)
    assert_exact(got, expected)


def test_checkpoint_under_side_streams(cuda_offload) -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Slow() for _ in range(DEPTH)).cuda()
    x = torch.randn(BATCH, WIDTH, device="cuda")
    devices = ["cuda"] * DEPTH
    expected = grads_of(blocks, x, plain, devices)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    calls = [0]

    def alternate(fn, h):
        stream = streams[calls[0] % 2]
        calls[0] += 1
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = matepoint.checkpoint(fn, h)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    got = grads_of(blocks, x, alternate, devices)
    assert_exact(got, expected)


def test_pageable_fallback_leaves_no_cuda_error(cuda_offload) -> None:
    matepoint.set_options(pool_limit_bytes=1 << 16)   # smaller than one input: all pageable
    matepoint.empty_pool()
    torch.manual_seed(0)
    blocks = nn.ModuleList(Slow() for _ in range(4)).cuda()
    x = torch.randn(BATCH, WIDTH, device="cuda")
    devices = ["cuda"] * 4
    expected = grads_of(blocks, x, plain, devices)
    with pytest.warns(RuntimeWarning, match="pageable"):
        got = grads_of(blocks, x, matepoint.checkpoint, devices)
    torch.cuda.synchronize()    # raises if a CUDA error was left behind
    assert_exact(got, expected)
    assert matepoint.pool_stats()["fallbacks"] >= 4


def test_out_of_memory_in_backward_then_retry(cuda_offload) -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Slow() for _ in range(DEPTH)).cuda()
    x = torch.randn(BATCH, WIDTH, device="cuda")
    devices = ["cuda"] * DEPTH
    expected = grads_of(blocks, x, plain, devices)
    blocks.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_(True)
    h = leaf
    for block in blocks:
        h = matepoint.checkpoint(block, h)
    loss = (h.float() ** 2).mean()
    # hold nearly all free memory: backward's copies back run out of it
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(max(free - (8 << 20), 0), dtype=torch.uint8, device="cuda")
    with pytest.raises(torch.OutOfMemoryError):
        loss.backward(retain_graph=True)
    del hog
    fresh = [torch.full((BATCH, WIDTH), 7.0, device="cuda") for _ in range(32)]
    torch.cuda.synchronize()
    assert all(bool((t == 7.0).all()) for t in fresh), "a copy back overwrote fresh memory"
    blocks.zero_grad(set_to_none=True)
    leaf.grad = None
    loss.backward()
    torch.cuda.synchronize()
    got = [leaf.grad.cpu()] + [p.grad.cpu() for p in blocks.parameters()]
    assert_exact(got, expected)


def test_branching_graph_with_regions_on_streams(cuda_offload) -> None:
    """Two branches of one graph run on two side streams, each region
    checkpointed where it runs, the GPU far behind, prefetching two ahead:
    backward runs each region's recompute on its forward stream (torch's
    engine), so every prefetch allocates on one stream what another reads,
    and reused memory shows as wrong gradients."""
    matepoint.set_options(pipeline=True, prefetch_depth=2)
    torch.manual_seed(0)
    left = nn.ModuleList(Slow() for _ in range(DEPTH // 2)).cuda()
    right = nn.ModuleList(Slow() for _ in range(DEPTH // 2)).cuda()
    x = torch.randn(BATCH, WIDTH, device="cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def run(wrap) -> list:
        left.zero_grad(set_to_none=True)
        right.zero_grad(set_to_none=True)
        leaf = x.detach().clone().requires_grad_(True)
        outs = []
        for blocks, stream in zip((left, right), streams):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                h = leaf
                for block in blocks:
                    h = wrap(block, h)
            outs.append(h)
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        ((outs[0] * outs[1]).float() ** 2).mean().backward()
        torch.cuda.synchronize()
        return [leaf.grad.cpu()] + [p.grad.cpu() for p in [*left.parameters(),
                                                              *right.parameters()]]

    expected = run(plain)
    for _ in range(2):
        assert_exact(run(matepoint.checkpoint), expected)


def test_pool_stats_polled_by_another_thread_during_training(cuda_offload) -> None:
    """A monitoring thread reading pool_stats() while the training thread
    offloads and restores (it retires completed copies of the same window):
    gradients stay exact and the window's counters end at zero."""
    import threading
    torch.manual_seed(0)
    blocks = nn.ModuleList(Slow() for _ in range(DEPTH)).cuda()
    x = torch.randn(BATCH, WIDTH, device="cuda")
    devices = ["cuda"] * DEPTH
    expected = grads_of(blocks, x, plain, devices)
    stop = threading.Event()
    errors: list = []

    def monitor() -> None:
        try:
            while not stop.is_set():
                matepoint.pool_stats()
        except BaseException as error:  # noqa: BLE001 (re-raised below)
            errors.append(error)

    thread = threading.Thread(target=monitor)
    thread.start()
    try:
        for _ in range(3):
            assert_exact(grads_of(blocks, x, matepoint.checkpoint, devices), expected)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    torch.cuda.synchronize()
    gc.collect()
    assert matepoint.pool_stats()["device_bytes_in_flight"] == 0


def test_two_threads_train_with_the_disk_tier(cuda_offload, tmp_path) -> None:
    """Two training threads, each its own model, with pinned memory capped
    below one step's inputs so the disk tier spills and reads back while
    the other thread offloads (issue 43's crash on the simulated GPU):
    every step exact in both threads."""
    import threading
    spill = tmp_path / "spill"
    spill.mkdir()
    one_input = BATCH * WIDTH * 4
    matepoint.set_options(spill_dir=str(spill), host_limit_bytes=3 * one_input)
    torch.manual_seed(0)
    models = [nn.ModuleList(Slow() for _ in range(DEPTH)).cuda() for _ in range(2)]
    inputs = [torch.randn(BATCH, WIDTH, device="cuda") for _ in range(2)]
    devices = ["cuda"] * DEPTH
    expected = [grads_of(m, x, plain, devices) for m, x in zip(models, inputs)]
    before = matepoint.pool_stats()
    errors: list = []

    def train(index: int) -> None:
        try:
            for _ in range(3):
                got = grads_of(models[index], inputs[index], matepoint.checkpoint, devices)
                assert_exact(got, expected[index])
        except BaseException as error:  # noqa: BLE001 (re-raised below)
            errors.append(error)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        matepoint.set_options(spill_dir=None, host_limit_bytes=None)
    assert not errors, errors
    stats = matepoint.pool_stats()
    assert stats["spill_writes"] > before["spill_writes"], "nothing was spilled"
    assert stats["spill_reads"] > before["spill_reads"], "nothing was read back"


EXPANDABLE_CHILD = """
import sys, torch, torch.nn as nn
sys.path.insert(0, {tests!r})
import matepoint
import test_cuda_timeline as t
matepoint.set_options(offload=True, min_offload_bytes=1 << 16, offload_window=1,
                      prefetch_depth=2)
torch.manual_seed(0)
blocks = nn.ModuleList(t.Slow() for _ in range(t.DEPTH)).cuda()
x = torch.randn(t.BATCH, t.WIDTH, device="cuda")
devices = ["cuda"] * t.DEPTH
expected = t.grads_of(blocks, x, t.plain, devices)
emptied = [0]

def empty_cache(grad):
    torch.cuda.empty_cache()      # unmaps what is free: pages a late copy would still use
    emptied[0] += 1

def checkpoint_then_empty_in_backward(block, h):
    out = matepoint.checkpoint(block, h)
    out.register_hook(empty_cache)    # in backward, just before this region's recompute
    return out

before = matepoint.pool_stats()["prefetched"]
for _ in range(2):
    got = t.grads_of(blocks, x, checkpoint_then_empty_in_backward, devices)
    t.assert_exact(got, expected)
assert emptied[0] >= 2 * t.DEPTH and matepoint.pool_stats()["prefetched"] > before
print("exact", emptied[0], "caches emptied")
"""


def test_expandable_segments_with_the_cache_emptied_in_backward() -> None:
    """torch's allocator with expandable_segments unmaps freed pages after
    syncing only their segment's stream; empty_cache() in every block's
    backward while prefetches and copies out are in flight: a copy left
    reading or writing a released source faults (illegal address) or
    reads wrong data."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    code = EXPANDABLE_CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "exact" in done.stdout
