"""Offload on the GPU's timeline, proven on the simulated GPU (tests/sim.py):
several devices driven from one thread, inputs from side streams, failed
pinning, out of memory while prefetching, failed event records, contexts.

Every test runs with the "GPU" as far behind the CPU as CUDA allows and with
memory reused, poisoned, the moment the stream-ordered allocator allows it:
whatever the engine frees or reuses too early shows up as wrong gradients
(compared bit for bit with a run that does not offload) or wrong data."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import matepoint
import sim
from matepoint import _C
from conftest import MLP, assert_bitwise_equal, no_checkpoint, run_in_thread, train_step

WIDTH, BATCH, DEPTH = 64, 32, 8
INPUT_BYTES = WIDTH * BATCH * 4


class OnDevice(nn.Module):
    """A block whose parameters and work live on simulated GPU `index`: its
    ops run under that device (as torch's kernels run under a device guard),
    while the caller's current device stays 0."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        with sim.device(index):
            self.inner = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with sim.device(self.index):
            return self.inner(x)


class TwoDevices(nn.Module):
    """Naive model parallelism (as device_map="auto" places layers): blocks
    alternate between GPU `first` and the other one."""

    def __init__(self, depth: int = DEPTH, first: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(OnDevice((first + i) % 2) for i in range(depth))

    def forward(self, x: torch.Tensor, wrap) -> torch.Tensor:
        for layer in self.layers:
            with sim.device(layer.index):
                x = x * 1.0           # x.to(layer's device)
            x = wrap(layer, x)
        return x


def devices_offloaded_to(seen: set):
    # no RNG state to keep (no dropout): its CPU tensors would be "kernels"
    # on device 0 here, catching its stream up and hiding a wait put there
    def wrap(fn, x):
        out = matepoint.checkpoint(fn, x, preserve_rng_state=False)
        seen.update(row[4] for row in _C._offload_copies())
        return out
    return wrap


@pytest.mark.parametrize("window", [1, 2])
def test_regions_alternating_between_two_gpus(simulated, window):
    """The release of GPU 1's input waits on GPU 1's stream though the
    thread's current device is 0 (stream handle NULL is the current
    device's): else GPU 1 reuses the input while its copy out still reads it."""
    matepoint.set_options(offload_window=window)
    model, x = TwoDevices(), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    seen: set = set()
    _, grads = train_step(model, x, devices_offloaded_to(seen))
    assert seen == {0, 1}
    assert _C._sim_get_device() == 0
    assert_bitwise_equal(grads, expected)
    sim.assert_no_cuda_error()


def test_inputs_from_another_stream_are_reused_only_after_their_copy(simulated):
    """Regions alternate between two side streams, so each one's input was
    allocated on the other stream: released, it returns to that stream's
    pool, which never waited for the copy out (record_stream fixes it)."""
    matepoint.set_options(offload_window=1)
    streams = sim.side_streams()
    calls = [0]

    def on_alternate_streams(fn, x):
        stream = streams[calls[0] % 2]
        calls[0] += 1
        with sim.stream(0, stream):
            return matepoint.checkpoint(fn, x)

    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    _C._sim_drop_site(None)                     # counts each site's calls from here
    _, grads = train_step(model, x, on_alternate_streams)
    assert calls[0] == DEPTH
    assert_bitwise_equal(grads, expected)
    # premise: inputs were let go with their copies pending, marked used
    # by the copy-out stream (their producer no longer current)
    assert _C._sim_site_counts()["source_on_copy_out"] > 0
    sim.assert_no_cuda_error()


def test_failed_pinning_falls_back_and_leaves_no_cuda_error(simulated):
    """A refused cudaHostAlloc is recovered from (pageable memory), so it must
    not stay as the last error torch checks after its next kernel. (The GPU
    keeps up here: a query answering "not ready" would clear it by chance.)"""
    _C._sim_set_progress(sim.EVERYTHING)
    _C._sim_fail("cudaHostAlloc", 0, 1 << 40, 2)   # cudaErrorMemoryAllocation
    try:
        model, x = MLP(WIDTH, 4), torch.randn(BATCH, WIDTH)
        _, expected = train_step(model, x, no_checkpoint)
        with pytest.warns(RuntimeWarning, match="pageable"):
            _, grads = train_step(model, x, matepoint.checkpoint)
        sim.assert_no_cuda_error()
    finally:
        _C._sim_fail("cudaHostAlloc", 0, 0, 0)
    assert_bitwise_equal(grads, expected)
    assert matepoint.pool_stats()["fallbacks"] >= 4
    assert _C._sim_stats()["pageable_copies"] >= 4


def test_polling_copies_in_flight_leaves_no_cuda_error(simulated):
    """cudaEventQuery's cudaErrorNotReady is an answer: it is cleared."""
    model, x = MLP(WIDTH, 4), torch.randn(BATCH, WIDTH, requires_grad=True)
    out = model(x, matepoint.checkpoint)
    before = _C._sim_stats()["calls"]["cudaEventQuery"]
    assert matepoint.pool_stats()["device_bytes_in_flight"] > 0   # polls, none done
    assert _C._sim_stats()["calls"]["cudaEventQuery"] > before
    sim.assert_no_cuda_error()
    out.sum().backward()


def test_out_of_memory_while_prefetching_then_retry(simulated):
    """A restore that fails after its group was prefetched drops the copies
    back only once the compute stream waits for them: fresh tensors taking
    that memory are never overwritten, and a retry gives exact gradients."""
    model, x = MLP(WIDTH, 4), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    leaf = x.detach().clone().requires_grad_(True)
    loss = (model(leaf, matepoint.checkpoint).float() ** 2).mean()
    # the last two regions' inputs are still on the device (used in place);
    # the second-to-last's restore prefetches the one before it, whose
    # restore then prefetches the next, which finds no memory
    _C._sim_fail_fetches(1, 1)
    before = matepoint.pool_stats()["prefetched"]
    with pytest.raises(torch.OutOfMemoryError, match="simulated GPU: out of memory"):
        loss.backward(retain_graph=True)
    assert matepoint.pool_stats()["prefetched"] > before, "nothing was prefetched before"
    fresh = [torch.full((BATCH, WIDTH), 7.0) for _ in range(64)]
    sim.finish()
    assert all(bool((tensor == 7.0).all()) for tensor in fresh), "a copy back overwrote it"
    sim.assert_no_cuda_error()
    model.zero_grad(set_to_none=True)
    leaf.grad = None
    loss.backward()
    grads = [leaf.grad] + [p.grad for p in model.parameters()]
    assert_bitwise_equal(grads, expected[:len(grads)])


def test_failed_completion_record_keeps_the_buffer_until_the_copy_ran(simulated):
    """The copy out was queued but its completion event could not be
    recorded: its host buffer goes back to the pool only once the copy ran,
    or the next offload (here GPU 1's) gets a buffer still being written."""
    hidden = torch.randn(BATCH, WIDTH, requires_grad=True) * 1.0
    _C._sim_fail("cudaEventRecord", 1, 1, 1)        # the second record: the copy's own
    with pytest.raises(RuntimeError, match="cudaEventRecord failed"):
        matepoint.checkpoint(nn.Linear(WIDTH, WIDTH), hidden)
    sim.assert_no_cuda_error()
    del hidden
    matepoint.set_options(offload_window=1)
    model, x = TwoDevices(first=1), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    _, grads = train_step(model, x, matepoint.checkpoint)
    assert_bitwise_equal(grads, expected)


def test_pinning_from_a_new_thread_creates_no_context_on_gpu_0(simulated):
    """One process per GPU: this rank uses GPU 1 only. reserve_pool() from a
    background thread (whose current device is 0) and the offloads pin and
    copy in GPU 1's context; GPU 0 never gets one."""
    _C._sim_forget_contexts()
    _C._sim_set_device(1)           # torch.cuda.set_device(local_rank)
    try:
        run_in_thread(lambda: matepoint.reserve_pool(INPUT_BYTES, count=2))
        assert _C._sim_stats()["contexts"] == [False, True]
        model, x = MLP(WIDTH, 4), torch.randn(BATCH, WIDTH)
        _, expected = train_step(model, x, no_checkpoint)
        _, grads = train_step(model, x, matepoint.checkpoint)
        assert_bitwise_equal(grads, expected)
        assert _C._sim_stats()["contexts"] == [False, True]
        assert matepoint.pool_stats()["hits"] >= 2
    finally:
        _C._sim_set_device(0)


def test_no_host_synchronization_with_the_gil_held(simulated):
    """Pinning, freeing pinned buffers (cudaFreeHost), copies into pageable
    memory and waits for copies in flight all make the host wait for the
    GPU: never with the GIL held, which would stall every Python thread."""
    before = dict(_C._sim_stats()["synchronized_under_gil"])
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    _, grads = train_step(model, x, matepoint.checkpoint)
    matepoint.set_options(pool_limit_bytes=3 * INPUT_BYTES)   # drops cache, then pageable
    with pytest.warns(RuntimeWarning, match="host synchronization"):
        _, limited = train_step(model, x, matepoint.checkpoint)
    matepoint.empty_pool()
    hidden = torch.randn(BATCH, WIDTH, requires_grad=True) * 1.0
    out = matepoint.checkpoint(nn.Linear(WIDTH, WIDTH), hidden)
    del out, hidden                                              # dropped with copies in flight
    after = _C._sim_stats()["synchronized_under_gil"]
    assert {name: after[name] - before.get(name, 0) for name in after
            if after[name] != before.get(name, 0)} == {}
    assert_bitwise_equal(grads, expected)
    assert_bitwise_equal(limited, expected)
    assert _C._sim_stats()["pageable_copies"] > 0


def test_torch_keeps_its_current_device_when_the_engine_leaves_another(simulated):
    """A block on GPU 1 checkpointed while GPU 0 is current: the engine
    enters GPU 1 to copy its input out, and leaves. With a context on GPU 0
    it makes GPU 0 current again. Without one (a new thread that never used
    GPU 0) it stays on GPU 1, as torch's own guards do, and then, as they
    do, tells torch that GPU 0 is still the current device (its target
    device): torch.cuda.current_device() must not answer 1, or the next
    torch.empty(device="cuda") lands on GPU 1."""
    torch.manual_seed(0)
    with sim.device(1):
        layer = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        x = torch.randn(BATCH, WIDTH).requires_grad_()
    expected = layer(x).detach().clone()
    seen: dict = {}

    def checkpoint_on_gpu_1(case: str) -> None:
        out = matepoint.checkpoint(layer, x, preserve_rng_state=False)
        seen[case] = (_C._sim_get_device(), _C._sim_torch_device(),
                      _C._sim_stats()["contexts"][0], [row[4] for row in _C._offload_copies()])
        assert_bitwise_equal([out], [expected])
        out.float().sum().backward()

    assert _C._sim_get_device() == 0
    checkpoint_on_gpu_1("GPU 0 has a context")
    _C._sim_forget_contexts()
    try:
        run_in_thread(lambda: checkpoint_on_gpu_1("GPU 0 has none"))
    finally:
        _C._sim_set_device(0)           # the context every other test assumes
    # (CUDA's current device, torch's, whether GPU 0 has a context, where inputs went)
    assert seen["GPU 0 has a context"] == (0, 0, True, [1]), seen
    assert seen["GPU 0 has none"] == (1, 0, False, [1]), seen
