"""The offload engine's CUDA path (streams, events, in-flight window,
release, prefetch) on the simulated GPU (tests/sim.py): its work runs only
when something waits for it, so the CPU runs ahead of the "GPU" as on a
real one."""
from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.nn as nn

import matepoint
from matepoint import _C

from conftest import MLP, assert_bitwise_equal, no_checkpoint, run_in_thread, train_step

WIDTH, BATCH, DEPTH = 64, 32, 12
INPUT_BYTES = WIDTH * BATCH * 4


def check_invariants(window: int) -> None:
    """Held sources only of the last `window` regions. (A source dropped
    before its copy completed is legal when dropped in stream order; done
    out of order, the poisoned memory shows in the gradients.)"""
    in_flight = matepoint.pool_stats()["device_bytes_in_flight"]   # polls first
    rows = _C._offload_copies()
    held_regions = {region for region, _, held, _, _ in rows if held}
    if held_regions:
        assert max(held_regions) - min(held_regions) < window, held_regions
    held_bytes = sum(nbytes for _, nbytes, held, _, _ in rows if held)
    assert held_bytes == in_flight
    assert held_bytes <= window * INPUT_BYTES


def watched(window: int):
    def wrap(fn, x):
        out = matepoint.checkpoint(fn, x)
        check_invariants(window)
        return out
    return wrap


@pytest.mark.parametrize("window", [1, 2, 3])
def test_window_bounds_device_memory_while_the_gpu_lags(simulated, window):
    matepoint.set_options(offload_window=window)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    _, grads = train_step(model, x, watched(window))
    assert_bitwise_equal(grads, expected)
    assert matepoint.pool_stats()["peak_device_bytes_in_flight"] == window * INPUT_BYTES


def test_without_the_window_the_lag_holds_every_input(simulated):
    """The model is real: a window as deep as the model keeps every input."""
    matepoint.set_options(offload_window=DEPTH + 1)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH, requires_grad=True)
    out = model(x, matepoint.checkpoint)
    assert matepoint.pool_stats()["device_bytes_in_flight"] == DEPTH * INPUT_BYTES
    assert _C._sim_stats()["ops_queued"] > 0
    out.sum().backward()
    assert matepoint.pool_stats()["device_bytes_in_flight"] == 0


class Probe(nn.Module):
    """Records what the engine holds when its recompute starts."""

    def __init__(self, inner: nn.Module, seen: list) -> None:
        super().__init__()
        self.inner, self.seen = inner, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if matepoint.is_recomputing():
            self.seen.append(matepoint.pool_stats()["device_bytes_in_flight"])
        return self.inner(x)


def test_backward_begins_by_releasing_the_rest(simulated):
    seen: list = []
    model = MLP(WIDTH, 6)
    model.layers = nn.ModuleList(Probe(layer, seen) for layer in model.layers)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    out = model(x, matepoint.checkpoint)
    assert matepoint.pool_stats()["device_bytes_in_flight"] == 2 * INPUT_BYTES
    out.sum().backward()
    assert seen == [0] * 6


@pytest.mark.parametrize("progress", [0, 1, 3, 7])
@pytest.mark.parametrize("pipeline", [True, False])
def test_gradients_exact_however_late_copies_complete(simulated, progress, pipeline):
    matepoint.set_options(pipeline=pipeline, prefetch_depth=2)
    _C._sim_set_progress(progress)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    before = matepoint.pool_stats()
    for _ in range(2):
        _, grads = train_step(model, x, watched(2))
        assert_bitwise_equal(grads, expected)
    stats = matepoint.pool_stats()
    assert stats["host_allocations"] <= DEPTH + 2    # the second step reused the pool
    assert (stats["prefetched"] > before["prefetched"]) == pipeline


def test_backward_on_another_thread(simulated):
    """Autograd runs a CUDA backward on its own device thread."""
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    leaf = x.detach().clone().requires_grad_(True)
    out = model(leaf, matepoint.checkpoint)
    before = matepoint.pool_stats()
    run_in_thread(lambda: (out.float() ** 2).mean().backward())
    grads = [leaf.grad] + [p.grad for p in model.parameters()]
    assert_bitwise_equal(grads, expected[:len(grads)])
    # premise: that thread copied spans back (prefetched, the pipeline being on)
    assert matepoint.pool_stats()["prefetched"] > before["prefetched"]


def test_runtime_switch_refused_while_inputs_are_offloaded(simulated):
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    out = matepoint.checkpoint(nn.Linear(WIDTH, WIDTH), x)
    with pytest.raises(RuntimeError, match="offloaded inputs are alive"):
        _C._simulate_cuda(False)
    out.sum().backward()
    del out


def test_reserve_pool_pays_for_buffers_up_front(simulated):
    assert matepoint.reserve_pool(INPUT_BYTES, count=DEPTH) == DEPTH
    before = matepoint.pool_stats()
    assert before["host_allocations"] == DEPTH and before["bytes_in_use"] == 0
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    train_step(model, x, matepoint.checkpoint)
    after = matepoint.pool_stats()
    assert after["host_allocations"] == DEPTH and after["misses"] == 0
    assert after["hits"] - before["hits"] == DEPTH


def test_reserve_pool_rejects_bad_sizes_and_reports_a_limit(offload):
    with pytest.raises(ValueError, match="count must be positive"):
        matepoint.reserve_pool(1024, count=0)
    with pytest.raises(TypeError, match="buffer_bytes must be an int"):
        matepoint.reserve_pool(1.5)
    matepoint.set_options(pool_limit_bytes=3 << 20)
    with pytest.raises(MemoryError, match="pinned 3 of 5 buffers"):
        matepoint.reserve_pool(1 << 20, count=5)
    assert matepoint.pool_stats()["bytes_reserved"] == 3 << 20
    matepoint.empty_pool()


def test_offload_window_option_is_checked():
    with pytest.raises(ValueError, match="offload_window must be positive"):
        matepoint.set_options(offload_window=0)
    assert matepoint.options.offload_window == 2


def test_threads_share_one_device_window(simulated):
    """Replicas in threads (as DataParallel runs them) offload to the same
    device: each one's regions may release the others' inputs, in stream
    order, and every gradient stays exact. The GPU runs nothing until
    waited for: one that moved at every call could catch up between the
    threads' calls, and then no source was let go before its copy. Over
    torch's adapter (test_runtime_torch.py: `simulated` yields its
    stand-in) the window's bound is not checked from the threads: there a
    source retired in stream order runs torch's record_stream, Python code
    where another thread may run, while the sweep holds what it took off
    the device's list, so another thread may see more than the window."""
    step = watched(2) if simulated is None else matepoint.checkpoint
    models = [MLP(WIDTH, 6) for _ in range(4)]
    inputs = [torch.randn(BATCH, WIDTH) for _ in models]
    expected = [train_step(m, x, no_checkpoint)[1] for m, x in zip(models, inputs)]
    barrier, results, errors = threading.Barrier(len(models)), {}, []

    def worker(index: int) -> None:
        try:
            barrier.wait()
            for _ in range(3):
                results[index] = train_step(models[index], inputs[index], step)[1]
        except BaseException as error:  # noqa: BLE001 (re-raised below)
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(models))]
    _C._sim_drop_site(None)                     # counts each site's calls from here
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    # premise: the window let sources go in stream order, the GPU behind
    counts = _C._sim_site_counts()
    assert counts["producer_after_copy_out"] + counts["source_on_copy_out"] > 0, counts
    for index, grads in enumerate(expected):
        assert_bitwise_equal(results[index], grads)


def test_a_lagging_gpu_costs_no_query_per_region(simulated):
    """A copy the window must let go of is ordered behind its producer
    without asking first whether it completed (the stream wait costs as
    much as the query), and nothing newer is asked after it: with the GPU
    lagging, the forward asks only while nothing is forced yet."""
    matepoint.set_options(offload_window=2)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    queries = []

    def counting(fn, t):
        out = matepoint.checkpoint(fn, t)     # pool_stats() would poll: not here
        queries.append(_C._sim_stats()["calls"].get("cudaEventQuery", 0))
        return out

    before = _C._sim_stats()["calls"].get("cudaEventQuery", 0)
    _, grads = train_step(model, x, counting)
    assert_bitwise_equal(grads, expected)
    # the forward's queries (before: 2 a region, 22 for 12 blocks)
    assert queries[-1] - before <= 2, queries
