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
