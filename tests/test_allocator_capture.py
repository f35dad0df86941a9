"""matepoint's allocator under CUDA graph capture (torch.cuda.graph,
make_graphed_callables), on the simulated GPU, which now enforces CUDA's
global capture mode (the one torch.cuda.graph uses by default):
cudaMalloc, cudaFree, event queries and synchronizations made while a
capture is underway fail and invalidate it.

torch gives a graph's memory a private pool through hooks a pluggable
allocator can only set in C++ (std::function), and calls them as no-ops
otherwise: memory matepoint handed out during a capture would go to other
tensors once freed while the graph, replayed, still writes it. So the
allocator refuses to allocate on a capturing stream, with a message that
says why, and makes none of the calls that would invalidate the capture
(torch's own allocator skips its event queries during a capture for the
same reason)."""
from __future__ import annotations

import contextlib
import ctypes
import gc
from typing import Iterator, Tuple

import pytest
import torch

import matepoint
import sim
from matepoint import _C

from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step

ELEMENTS = 1 << 14
CAPTURE_INVALIDATED = 901


def test_allocation_on_a_capturing_stream_is_refused_and_the_capture_survives(offload):
    side, other = sim.side_streams()
    with sim.stream(0, side):
        cached = torch.ones(ELEMENTS)       # its block stays cached for `side`
        shared = torch.ones(ELEMENTS)
    sim.record_stream(shared, 0, other)     # its free leaves an event to query
    del cached, shared
    queries = _C._sim_stats()["calls"]["cudaEventQuery"]
    _C._sim_capture(0, side, True)
    try:
        with sim.stream(0, side):
            for elements in (ELEMENTS, 64 * ELEMENTS):      # a cache hit, a new segment
                with pytest.raises(RuntimeError, match="CUDA graph capture") as raised:
                    torch.empty(elements)
                assert "install_allocator" in str(raised.value)
    finally:
        status = _C._sim_capture(0, side, False)
    assert status != CAPTURE_INVALIDATED, "the allocator made a call CUDA forbids in a capture"
    assert status == 0
    assert _C._sim_stats()["calls"]["cudaEventQuery"] == queries
    with sim.stream(0, side):               # after the capture: served as before
        assert float(torch.ones(ELEMENTS).sum()) == ELEMENTS




def test_allocations_beside_a_capture_do_not_invalidate_it(offload):
    """While a stream captures, the allocator serves other streams (the
    legacy one here) without the calls global mode forbids: it makes its
    event queries and cudaMalloc in relaxed mode, as torch's allocator does
    for cudaMalloc, so another stream's capture survives."""
    side, other = sim.side_streams()
    shared = torch.ones(ELEMENTS)           # on the legacy stream
    sim.record_stream(shared, 0, other)     # its free leaves an event to query
    del shared
    _C._sim_capture(0, side, True)
    try:
        served = [torch.ones(ELEMENTS), torch.ones(64 * ELEMENTS)]   # a query, a cudaMalloc
    finally:
        status = _C._sim_capture(0, side, False)
    assert status != CAPTURE_INVALIDATED, "the allocator made a call CUDA forbids in a capture"
    assert status == 0
    assert [float(t.sum()) for t in served] == [ELEMENTS, 64 * ELEMENTS]
    assert _C._sim_take_last_error() == 0

def test_checkpoint_on_a_capturing_stream_keeps_its_inputs_and_the_capture(offload_heap_memory):
    """A checkpointed region captured into a CUDA graph (make_graphed_callables
    over checkpointed blocks): a copy out would become part of the graph,
    and the engine's event query at the next region invalidated the capture
    (RuntimeError: cudaEventQuery failed ... CUDA error 900). Its inputs
    stay on the device instead (start_d2h asks before any runtime call a
    capture forbids); offload goes on once the capture ended."""
    side, _ = sim.side_streams()
    torch.manual_seed(0)
    model, x = MLP(32, 4), torch.randn(16, 32)
    _, expected = train_step(model, x, no_checkpoint)
    _C._sim_capture(0, side, True)
    try:
        with sim.stream(0, side):
            _, grads = train_step(model, x, matepoint.checkpoint)
    finally:
        status = _C._sim_capture(0, side, False)
    assert status == 0, "the capture was invalidated"
    assert_bitwise_equal(grads, expected)
    with sim.stream(0, side):
        _, grads = train_step(model, x, matepoint.checkpoint)
    assert_bitwise_equal(grads, expected)


class GraphPool:
    """A CUDA graph's private pool as torch begins it for a capture on
    `stream` (torch.cuda.graph: beginAllocateToPool before the capture,
    endAllocateToPool after, releasePool when the graph goes), through the
    allocator library's entry points the C++ adapter calls, with the test
    build's filter that takes one stream (as
    torch._C._cuda_beginAllocateCurrentStreamToPool)."""

    def __init__(self, pool_id: Tuple[int, int], stream: int, device: int = 0) -> None:
        self.library = sim.allocator_library()
        self.args = (device, *pool_id)
        for name in ("begin_pool", "end_pool", "release_pool", "pool_use_count"):
            function = getattr(self.library, "matepoint_test_" + name)
            function.restype = ctypes.c_int
            function.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64] + (
                [ctypes.c_void_p, ctypes.c_void_p] if name == "begin_pool" else [])
        self.stream = stream

    def begin(self) -> None:
        use_pool = ctypes.cast(self.library.matepoint_test_stream_filter, ctypes.c_void_p)
        assert self.library.matepoint_test_begin_pool(*self.args, use_pool, self.stream) == 0

    def end(self) -> None:
        assert self.library.matepoint_test_end_pool(*self.args) == 0

    def release(self) -> None:
        assert self.library.matepoint_test_release_pool(*self.args) == 0

    def use_count(self) -> int:
        return self.library.matepoint_test_pool_use_count(*self.args)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Allocations on the pool's stream meanwhile come from the pool;
        the capture must survive."""
        self.begin()
        _C._sim_capture(0, self.stream, True)
        try:
            with sim.stream(0, self.stream):
                yield
        finally:
            status = _C._sim_capture(0, self.stream, False)
            self.end()
        assert status == 0, "the capture was invalidated"


def device_bytes() -> int:
    """Bytes the allocator holds from simulated device 0 (cudaMalloc'ed)."""
    return _C._sim_stats()["device_bytes_live"][0]


def test_a_capture_allocates_from_its_graphs_pool(offload):
    """torch.cuda.graph under matepoint's allocator: a capture on a side
    stream is served from the graph's private pool (no refusal, the capture
    survives); memory freed during the capture is reused inside it; the
    ordinary cache never hands the pool's memory out, the pool never the
    cache's; the pool's memory stays until the graph is released, and goes
    back at the next empty_cache, as torch's."""
    side, _ = sim.side_streams()
    with sim.stream(0, side):
        cached = torch.ones(ELEMENTS)
    cached_at = cached.data_ptr()
    del cached                                  # a free block of side's ordinary cache
    held_before = device_bytes()
    graph = GraphPool((1, 0), side)
    with graph.capture():
        scratch = torch.ones(ELEMENTS)
        scratch_at = scratch.data_ptr()
        output = torch.ones(64 * ELEMENTS)      # a segment of its own, in the pool
        del scratch
        reused = torch.full((ELEMENTS,), 2.0)   # freed in the capture: reused in it
    pool_bytes = device_bytes() - held_before
    assert pool_bytes > 0
    assert scratch_at != cached_at and reused.data_ptr() == scratch_at
    assert float(output.sum()) == 64 * ELEMENTS and float(reused.sum()) == 2 * ELEMENTS
    with sim.stream(0, side):                   # after the capture: the ordinary cache
        after = torch.ones(ELEMENTS)
        assert after.data_ptr() == cached_at
        del reused, output
        again = torch.ones(ELEMENTS)            # not the pool's freed block
        assert again.data_ptr() not in (scratch_at, cached_at)
    del after, again
    sim.empty_device_cache()                    # the graph lives: its pool stays
    assert device_bytes() >= pool_bytes
    kept = device_bytes()
    graph.release()
    sim.empty_device_cache()
    assert graph.use_count() == -1, "a released pool with nothing live is forgotten"
    assert kept - device_bytes() == pool_bytes, "the pool's memory went back at release"


def test_pools_of_two_graphs_share_nothing_and_outputs_outlive_release(offload):
    """Two graphs captured one after the other on the same stream get
    distinct memory; a graph sharing a pool (torch.cuda.graph(pool=...))
    reuses it. A graph's output still held keeps its segment past the
    graph's release; once freed, the next empty_cache gives the segment back
    (as torch's: no cudaFree at a tensor's free)."""
    side, _ = sim.side_streams()
    first, second = GraphPool((2, 0), side), GraphPool((0, 3), side)
    with first.capture():
        freed_at = torch.ones(ELEMENTS).data_ptr()     # freed at once, inside the pool
        output = torch.ones(64 * ELEMENTS)
    with second.capture():
        other = torch.ones(ELEMENTS)
    assert other.data_ptr() != freed_at
    with first.capture():                       # shares the first graph's pool
        shared = torch.ones(ELEMENTS)
    assert shared.data_ptr() == freed_at and first.use_count() == 2
    del other, shared
    held = device_bytes()
    second.release()
    sim.empty_device_cache()
    assert device_bytes() < held and second.use_count() == -1
    first.release()
    first.release()                             # both graphs of the first pool are gone
    assert first.use_count() == 0, "its output is still live"
    held = device_bytes()
    del output
    assert device_bytes() == held, "a cudaFree at a tensor's free"
    sim.empty_device_cache()
    assert device_bytes() < held and first.use_count() == -1


def test_capture_without_a_pool_for_its_stream_is_still_refused(offload):
    """A pool that takes another stream does not make a capture on this
    one safe: still refused, the capture intact."""
    side, other = sim.side_streams()
    graph = GraphPool((4, 0), other)
    graph.begin()
    _C._sim_capture(0, side, True)
    try:
        with sim.stream(0, side):
            with pytest.raises(RuntimeError, match="CUDA graph capture"):
                torch.empty(ELEMENTS)
    finally:
        status = _C._sim_capture(0, side, False)
        graph.end()
        graph.release()
    assert status == 0


def test_a_checkpointed_step_captured_into_a_pool_keeps_its_inputs(offload):
    """make_graphed_callables over checkpointed blocks under matepoint's
    allocator: the capture's allocations (forward, and backward on its
    worker thread, same stream) come from the graph's pool; the regions'
    inputs stay on the device (no copy would replay correctly); gradients
    are bit-for-bit those without checkpointing; the pool goes once the
    graph and its outputs do."""
    side, _ = sim.side_streams()
    torch.manual_seed(0)
    model, x = MLP(32, 4), torch.randn(16, 32)
    _, expected = train_step(model, x, no_checkpoint)
    graph = GraphPool((6, 0), side)
    held = device_bytes()
    with graph.capture():
        out, grads = train_step(model, x, matepoint.checkpoint)
        assert _C._offload_copies() == [], "an input was copied out during the capture"
    assert device_bytes() > held, "premise: the capture allocated from its pool"
    assert_bitwise_equal(grads, expected)
    graph.release()
    assert graph.use_count() == 0, "the output and gradients, still held, keep their segments"
    del out, grads
    model.zero_grad(set_to_none=True)
    gc.collect()
    sim.empty_device_cache()
    assert graph.use_count() == -1
