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

import sim
from matepoint import _C

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

