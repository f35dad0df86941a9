"""Defects of the offload engine found by the audit of issue 34, each pinned
by a test that fails without its fix, on the simulated GPU (tests/sim.py):
host waits in the hot path, prefetched buffers read on another stream,
the window counting selective-checkpoint ops as regions, a producer stream
destroyed before its region retires, and two threads copying one span back
at once. Every test compares gradients bit for bit with a run without
checkpointing."""
from __future__ import annotations

import functools
import gc
import sys
import threading
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import matepoint
from matepoint import _C
import sim

import fake_torch_cuda
from conftest import MLP, assert_bitwise_equal, no_checkpoint, run_in_thread, train_step

WIDTH, BATCH, DEPTH = 64, 32, 8
INPUT_BYTES = WIDTH * BATCH * 4
HOST_WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")
MM = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def host_waits() -> Dict[str, int]:
    calls = _C._sim_stats()["calls"]
    return {name: calls.get(name, 0) for name in HOST_WAITS}


def waits_since(before: Dict[str, int]) -> Dict[str, int]:
    now = host_waits()
    return {name: now[name] - before[name] for name in HOST_WAITS if now[name] != before[name]}


def offload_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_CPU_OFFLOAD if func in MM else CheckpointPolicy.PREFER_RECOMPUTE


def selective_offload(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    context_fn = functools.partial(create_selective_checkpoint_contexts, offload_policy)
    return matepoint.checkpoint(fn, x, context_fn=context_fn)


MODES = {
    "offload": ({}, matepoint.checkpoint),
    "no-pipeline": ({"pipeline": False}, matepoint.checkpoint),
    "prefetch-1": ({"pipeline": True, "prefetch_depth": 1}, matepoint.checkpoint),
    "prefetch-2": ({"pipeline": True, "prefetch_depth": 2}, matepoint.checkpoint),
    "selective": ({}, selective_offload),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_no_host_wait_in_forward_or_backward(simulated, mode: str) -> None:
    """Defect 2: a copy dying with its copy out or back still pending gives
    its host buffer back with its last event (reused once that completed),
    as torch's CachingHostAllocator does: neither forward nor backward makes
    the host wait for the GPU, in any offload mode."""
    options, wrap = MODES[mode]
    matepoint.set_options(**options)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    for _ in range(2):      # the second step reuses the pool's buffers
        before, stats = host_waits(), matepoint.pool_stats()
        _, grads = train_step(model, x, wrap)
        assert waits_since(before) == {}
        assert_bitwise_equal(grads, expected)
        # premise: spans went out and came back (prefetched, when the mode does)
        after = matepoint.pool_stats()
        assert after["misses"] + after["hits"] > stats["misses"] + stats["hits"]
        fetched = after["fetched_at_need"] - stats["fetched_at_need"]
        prefetched = after["prefetched"] - stats["prefetched"]
        assert fetched + prefetched > 0, "nothing was copied back"
        assert (prefetched > 0) == matepoint.options.pipeline, (mode, prefetched)
    sim.finish()
    assert matepoint.pool_stats()["blocks_in_use"] == 0


def test_no_host_wait_when_graphs_are_dropped(simulated) -> None:
    """Defect 2: three forwards whose graphs are dropped with every copy out
    pending wait for nothing; their buffers come back once the GPU ran the
    copies, and the next step is exact."""
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    before = host_waits()
    for wrap in (matepoint.checkpoint, selective_offload, matepoint.checkpoint):
        out = model(x.clone().requires_grad_(True), wrap)
        del out
        gc.collect()
    assert waits_since(before) == {}
    assert matepoint.pool_stats()["blocks_in_use"] > 0     # their copies out have not run
    sim.finish()
    assert matepoint.pool_stats()["blocks_in_use"] == 0
    _, grads = train_step(model, x, matepoint.checkpoint)
    assert_bitwise_equal(grads, expected)


def test_switching_the_runtime_waits_for_copies_of_dropped_graphs(simulated) -> None:
    """The window's drain: graphs dropped with their copies out still
    pending leave copies in the window and buffers on their way back; the
    runtime switch waits for those copies (the one place the host waits),
    gives every buffer, event and stream back, and the engine works on."""
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    out = model(x.clone().requires_grad_(True), matepoint.checkpoint)
    del out
    gc.collect()
    assert matepoint.pool_stats()["device_bytes_in_flight"] > 0     # the window holds them
    before = host_waits()["cudaEventSynchronize"]
    _C._simulate_cuda(False)
    try:
        assert host_waits()["cudaEventSynchronize"] > before
        stats = _C._sim_stats()
        assert stats["events_live"] == 0 and stats["host_bytes_live"] == 0, stats
        assert stats["streams_live"] == sim.long_lived_streams(), stats
        sim.assert_no_cuda_error()
    finally:
        _C._simulate_cuda(True)
    _, grads = train_step(model, x, matepoint.checkpoint)
    assert_bitwise_equal(grads, expected)


class TwoMatmuls(nn.Module):
    """Regions of two matmuls each, both outputs offloaded by the policy."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))
        self.second = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))

    def forward(self, x: torch.Tensor, wrap: Callable, **kwargs: Any) -> torch.Tensor:
        for first, second in zip(self.first, self.second):
            x = wrap(lambda h, a=first, b=second: torch.tanh(b(torch.tanh(a(h)))) * torch.sigmoid(h),
                     x, **kwargs)
        return x


@pytest.mark.parametrize("inputs_offloaded", [True, False], ids=["inputs-offloaded", "inputs-kept"])
def test_the_window_counts_regions_not_offloaded_ops(simulated, inputs_offloaded: bool) -> None:
    """Defect 5: the outputs a policy offloads join their region in the
    window; they end none. With a window of 2 on a GPU far behind, the
    sources held after the forward are those of the last two regions (each
    op ending a region kept those of the last two ops), and the gradients
    are exact."""
    depth = 4
    matepoint.set_options(offload_window=2)
    model, x = TwoMatmuls(depth), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    wrap = functools.partial(selective_offload_kw, matepoint_offload=inputs_offloaded)
    xg = x.clone().requires_grad_(True)
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    out = model(xg, wrap)
    rows = _C._offload_copies()
    regions = sorted({row[0] for row in rows})
    # one region per checkpoint call (outputs may join the one after theirs)
    assert len(regions) <= depth + 1, regions
    held = matepoint.pool_stats()["device_bytes_in_flight"]
    # two regions' worth: each region's input (if offloaded) and its two outputs
    per_region = INPUT_BYTES * (3 if inputs_offloaded else 2)
    assert held >= 2 * per_region - INPUT_BYTES, (held, per_region)
    (out.float() ** 2).mean().backward()
    assert_bitwise_equal([xg.grad] + [p.grad for p in model.parameters()], expected)


def selective_offload_kw(fn: Callable, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    context_fn = functools.partial(create_selective_checkpoint_contexts, offload_policy)
    return matepoint.checkpoint(fn, x, context_fn=context_fn, **kwargs)


def test_a_producer_stream_is_not_used_after_its_region(simulated) -> None:
    """Defect 6: the window retires a region's source later, when another
    stream is current and the region's own may be gone (an ExternalStream
    the caller destroyed). It must not use that stream's handle then: from
    the region's end to the end of the forward, no wait is queued on it
    (the copy-out stream marks the source used instead). The stream itself
    stays alive, as backward runs the region's nodes on it, so exact
    gradients can be compared."""
    matepoint.set_options(offload_window=1)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    region_stream, _ = sim.side_streams()
    calls = [0]

    def wrap(fn: Callable, h: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] != 2:
            return matepoint.checkpoint(fn, h)
        with sim.stream(0, region_stream):
            out = matepoint.checkpoint(fn, h)
        _C._sim_log_waits(True)     # from here on, its stream is as good as gone
        return out

    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_(True)
    try:
        loss = (model(leaf, wrap).float() ** 2).mean()
        waits = _C._sim_wait_log()
    finally:
        _C._sim_log_waits(False)
    assert calls[0] == DEPTH and waits, "the later regions queued no wait at all"
    assert [w for w in waits if w["waiter"] == region_stream] == []
    loss.backward()
    sim.assert_no_cuda_error()
    grads = [leaf.grad] + [p.grad for p in model.parameters()]
    assert_bitwise_equal(grads, expected[:len(grads)])


def test_a_prefetched_buffer_is_reused_only_past_its_copy_and_reader(simulated) -> None:
    """Defect 3: a span prefetched while stream `a` is current comes from
    a's allocator, is written by the copy-in stream and read on stream `b`.
    Dropped unread (an output the recompute never took), a's next
    allocation must not get its memory while the copy back still writes
    it: the buffer is marked used by the copy-in stream (and by `b`).
    Premise: the span is really prefetched (its source retired first, else
    backward uses it in place). The reader's own record is proven by data
    in tests/test_waits_needed.py ("read on another stream")."""
    a, b = sim.side_streams()
    source = torch.randn(64, 64)
    group, saved = _C._sac_offload([source])
    del source
    sim.finish()                                # the copy out ran ...
    matepoint.pool_stats()                      # ... and the window retired the source
    before = matepoint.pool_stats()
    with sim.stream(0, a):
        _C._sac_prefetch(group)                 # queued, not run: the GPU lags
    with sim.stream(0, b):
        (restored,) = _C._sac_restore(group, saved)
    after = matepoint.pool_stats()
    assert after["prefetched"] - before["prefetched"] == 1, "nothing was prefetched"
    assert after["used_in_place"] == before["used_in_place"], "the span was used in place"
    del restored, group, saved                  # never read
    with sim.stream(0, a):
        kept = torch.full((64, 64), 1.0)        # a's allocator hands out memory
    sim.finish()                                # the copy back runs now
    assert torch.equal(kept, torch.full((64, 64), 1.0))


def test_regions_on_streams_prefetch_exactly(simulated) -> None:
    """Defect 3: regions cycle through three streams in forward and
    backward (as torch's engine runs each node on its forward stream), so
    every prefetch allocates on one stream what another reads (with two
    streams, a prefetch depth of 2 fetched each span on the stream that
    reads it: the premise below failed); with a prefetch depth of 2,
    gradients match a run without checkpointing bit for bit (stronger once
    the simulated kernels lag in data)."""
    matepoint.set_options(pipeline=True, prefetch_depth=2)
    streams = sim.side_streams() + [None]
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    calls = [0]

    class OnStream(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, h: torch.Tensor, handle: int) -> torch.Tensor:
            ctx.handle = handle
            return h.view_as(h)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:
            _C._sim_set_stream(0, ctx.handle)   # the region's backward runs on its stream
            return grad, None

    def wrap(fn: Callable, h: torch.Tensor) -> torch.Tensor:
        handle = streams[calls[0] % len(streams)]
        calls[0] += 1
        with sim.stream(0, handle):
            return OnStream.apply(matepoint.checkpoint(fn, h), handle)

    before = matepoint.pool_stats()["prefetched"]
    _C._sim_drop_site(None)                     # counts each site's calls from here
    try:
        _, grads = train_step(model, x, wrap)
    finally:
        _C._sim_set_stream(0, None)
    assert_bitwise_equal(grads, expected)
    # premise: spans really prefetched, and read on another stream than
    # the one that allocated them
    assert matepoint.pool_stats()["prefetched"] > before
    assert _C._sim_site_counts()["fetched_on_reader"] > 0


def byte_buffers(nbytes: int) -> int:
    """uint8 tensors of `nbytes` alive: restored copies the engine made."""
    return sum(1 for obj in gc.get_objects()
               if isinstance(obj, torch.Tensor) and obj.dtype == torch.uint8
               and obj.numel() == nbytes)


def test_two_threads_fetching_one_span_keep_one_copy(simulated) -> None:
    """Defect 7: a copy back through pageable memory runs without the GIL;
    a second thread fetching the same span meanwhile starts its own. The
    first one back is kept, the other's buffer and event go: no restored
    buffer outlives its discard, and the span comes back exact."""
    matepoint.set_options(pool_limit_bytes=1)   # pageable memory only
    source = torch.randn(1024, 1024)      # a copy long enough for the other thread
    expected = source.clone()
    with pytest.warns(RuntimeWarning, match="pageable"):
        group, saved = _C._sac_offload([source])
    del source
    stop = threading.Event()
    errors: List[BaseException] = []

    def fetch_and_drop() -> None:
        try:
            while not stop.is_set():
                saved[0].unpack()               # fetched at need, through pageable memory
                _C._sac_discard(group)
        except BaseException as error:  # noqa: BLE001 (re-raised below)
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=fetch_and_drop) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        for _ in range(1000):
            saved[0].unpack()
            _C._sac_discard(group)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(interval)
    assert not errors, errors
    gc.collect()
    assert byte_buffers(expected.nbytes) == 0, "a copied-back buffer leaked"
    (restored,) = _C._sac_restore(group, saved)
    assert torch.equal(restored, expected)


def test_a_copy_back_beaten_by_another_thread_is_dropped(simulated) -> None:
    """Defect 7, the race made certain (the test above races only when the
    threads happen to meet, and often they do not): while this thread's
    copy back is inside torch's Python code (the torch.cuda stand-in's
    current-stream query), another thread copies the same span back and
    finishes first. Premise: exactly one fetch was beaten. Ours is dropped,
    both threads get the span exact, and no buffer outlives the discard."""
    matepoint.set_options(pool_limit_bytes=1)   # pageable memory, as in the race above
    source = torch.randn(1024, 1024)
    expected = source.clone()
    with fake_torch_cuda.installed() as standin:
        _C._simulate_torch_adapter(True)
        try:
            with pytest.warns(RuntimeWarning, match="pageable"):
                group, saved = _C._sac_offload([source])
            del source
            others: List[torch.Tensor] = []

            def inside(name: str) -> None:
                if name == "_cuda_getCurrentRawStream" and not standin.calls["beaten"]:
                    standin.calls["beaten"] += 1
                    run_in_thread(lambda: others.append(saved[0].unpack()))
            _C._sim_drop_site(None)                 # counts each site's calls from here
            standin.inside = inside
            try:
                mine = saved[0].unpack()
            finally:
                standin.inside = None
            assert _C._sim_site_counts()["beaten_after_copy_in"] == 1, "no fetch was beaten"
            assert torch.equal(mine, expected) and torch.equal(others[0], expected)
            del mine, others
            _C._sac_discard(group)
            gc.collect()
            assert byte_buffers(expected.nbytes) == 0, "a copied-back buffer leaked"
            (restored,) = _C._sac_restore(group, saved)
            assert torch.equal(restored, expected)
            del restored, group, saved
            gc.collect()
            sim.finish()
        finally:
            _C._simulate_torch_adapter(False)


def test_a_failed_wait_at_the_switch_leaves_no_cuda_error(simulated) -> None:
    """The drain's host wait failing (the device went bad) has nothing left
    to undo: its status is cleared from the thread's last error, where
    torch's next launch check would find it, and everything is given back."""
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    out = model(x.clone().requires_grad_(True), matepoint.checkpoint)
    del out
    gc.collect()
    _C._sim_fail("cudaEventSynchronize", 0, 1, 700)
    _C._simulate_cuda(False)
    try:
        sim.assert_no_cuda_error()
        stats = _C._sim_stats()
        assert stats["events_live"] == 0 and stats["host_bytes_live"] == 0, stats
    finally:
        _C._simulate_cuda(True)


# torch's own device exchange: in its CUDA builds only (torch 2.14.1 here)
TORCH_EXCHANGE = getattr(torch._C, "_cuda_maybeExchangeDevice", None)
needs_torch_exchange = pytest.mark.skipif(
    TORCH_EXCHANGE is None, reason="this torch (a CPU build) has no _cuda_maybeExchangeDevice")


def outcome(call: Callable[[], Any]) -> tuple:
    """What `call` answered: ("value", value) or ("raised", type, message)."""
    try:
        return ("value", call())
    except Exception as error:  # noqa: BLE001 (compared, not handled)
        return ("raised", type(error).__name__, str(error))


@needs_torch_exchange
@pytest.mark.parametrize("argument", [-1, -128, -129, 128, 1.0, True, None, "0"])
def test_the_stand_in_checks_arguments_as_torchs_device_exchange(argument: Any) -> None:
    """Where torch's own torch._C._cuda_maybeExchangeDevice answers without
    CUDA (its argument checks, and -1 for a negative index, before its lazy
    CUDA init), the stand-in the engine's tests run on answers the same."""
    standin = fake_torch_cuda.TorchCudaStandin()
    assert outcome(lambda: standin._cuda_maybeExchangeDevice(argument)) == \
        outcome(lambda: TORCH_EXCHANGE(argument))


@needs_torch_exchange
def test_leaving_a_device_reaches_torchs_own_device_exchange(simulated) -> None:
    """Defect 7(e)'s torch half on torch's own _cuda_maybeExchangeDevice (the
    rest of torch.cuda is the stand-in's: no GPU here). A thread that never
    used GPU 0 checkpoints a block on GPU 1: the engine leaves GPU 1 without
    making GPU 0 current (it has no context) and tells torch GPU 0 is its
    device, calling torch's function with index 0. Without a driver torch's
    lazy CUDA init then refuses, the one step that needs a GPU: the engine
    reports that as unraisable (a leave has no caller to raise to) and the
    checkpoint is exact. With a driver the call succeeds, reports nothing,
    and torch's current device stays 0."""
    torch.manual_seed(0)
    with sim.device(1):
        layer = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        x = torch.randn(BATCH, WIDTH).requires_grad_()
    expected = layer(x).detach().clone()
    reported: List[BaseException] = []
    seen: Dict[str, Any] = {}

    def checkpoint_on_gpu_1() -> None:
        out = matepoint.checkpoint(layer, x, preserve_rng_state=False)
        seen["cuda_device"] = _C._sim_get_device()
        seen["torch_device"] = torch.cuda.current_device() if torch.cuda.is_available() else None
        assert_bitwise_equal([out], [expected])
        out.float().sum().backward()

    hook = sys.unraisablehook
    sys.unraisablehook = lambda report: reported.append(report.exc_value)
    try:
        with fake_torch_cuda.installed(torchs_own=["_cuda_maybeExchangeDevice"]) as standin:
            assert _C._torch_cuda_entries({})["_cuda_maybeExchangeDevice"] is TORCH_EXCHANGE
            _C._simulate_torch_adapter(True)
            try:
                _C._sim_forget_contexts()
                run_in_thread(checkpoint_on_gpu_1)
            finally:
                _C._sim_set_device(0)           # the context every other test assumes
                _C._simulate_torch_adapter(False)
    finally:
        sys.unraisablehook = hook
    assert standin.calls["_cuda_hasPrimaryContext"] > 0      # premise: GPU 0 had no context
    assert seen["cuda_device"] == 1, seen                     # left on GPU 1, as torch's guards
    if torch.cuda.is_available():
        assert reported == [] and seen["torch_device"] == 0, (reported, seen)
    else:
        assert [type(error) for error in reported] == [RuntimeError], reported
        assert "NVIDIA driver" in str(reported[0]), reported[0]
