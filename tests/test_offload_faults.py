"""Faults of the offload engine found by a third reading of the CUDA path
(issue 43): in-place changes seen through the input's base, and the
engine's own calls beside a CUDA graph capture. On the simulated GPU
(tests/sim.py)."""
from __future__ import annotations

import gc

import pytest
import torch

import matepoint
from matepoint import _C


WIDTH = 64
SPAN = WIDTH * 2 * WIDTH * 4       # a view's span: its base's rows


def counters() -> dict:
    stats = matepoint.pool_stats()
    return {key: stats[key] for key in ("prefetched", "fetched_at_need", "used_in_place",
                                        "spill_writes")}


def region(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (t * weight).tanh()


@pytest.mark.parametrize("where", ["in_place", "copied", "spilled"])
def test_a_change_through_the_base_of_a_dead_view_is_caught(request, tmp_path, where):
    """checkpoint(f, base[:, :k]); the view dies; base.add_(): torch's
    checkpoint raises (its recompute keeps the view and the view shares the
    base's version counter); so must matepoint, wherever the input went."""
    request.getfixturevalue("simulated" if where == "in_place" else "offload")
    if where == "spilled":
        matepoint.set_options(spill_dir=str(tmp_path / "spill"), host_limit_bytes=2 * SPAN)
    try:
        matepoint.set_options(offload_window=4 if where == "in_place" else 1)
        bases = [torch.randn(WIDTH, 2 * WIDTH) for _ in range(3)]
        weight = torch.randn(WIDTH, requires_grad=True)
        before = counters()
        outs = []
        for base in bases:
            view = base[:, :WIDTH]
            outs.append(matepoint.checkpoint(region, view, weight))
            del view
        loss = sum(out.sum() for out in outs)
        if where == "spilled":
            _C._spill_settle()      # the writes run on the tier's threads: count them done
        spilled = counters()["spill_writes"] - before["spill_writes"]   # in the forward
        del outs
        gc.collect()
        bases[0].add_(1)
        with pytest.raises(RuntimeError, match="input tensor #0 .* modified in place"):
            loss.backward()
        made = {key: value - before[key] for key, value in counters().items()}
        del loss
        gc.collect()
    finally:
        matepoint.set_options(spill_dir=None, host_limit_bytes=None)
    made["spill_writes"] = spilled
    premise = {"in_place": "used_in_place", "copied": "fetched_at_need", "spilled": "spill_writes"}
    assert made[premise[where]] >= 1, made


def test_record_stream_on_memory_from_elsewhere_says_nothing(offload, capfd):
    """torch's caching allocator skips record_stream on memory it did not
    allocate (DLPack, IPC) without a word; so does matepoint's."""
    import ctypes
    import sim
    library = ctypes.CDLL(sim.allocator_path())
    library.matepoint_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    library.matepoint_record_stream.restype = None
    foreign = ctypes.create_string_buffer(64)
    capfd.readouterr()
    library.matepoint_record_stream(ctypes.addressof(foreign), None)
    assert capfd.readouterr().err == ""


CAPTURE_INVALIDATED = 901


@pytest.mark.parametrize("fixture", ["simulated", "offload"])
def test_offloading_beside_a_capture_does_not_invalidate_it(request, fixture):
    """A capture in CUDA's global mode (torch.cuda.graph's default) begun on
    a side stream while the legacy stream trains with offload: the engine's
    pinning, event queries and synchronizations run in relaxed mode (as the
    allocator's do), so the capture survives."""
    request.getfixturevalue(fixture)
    import sim
    from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step
    matepoint.empty_pool()
    model, x = MLP(WIDTH, 6), torch.randn(WIDTH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    side, _ = sim.side_streams()
    calls = dict(_C._sim_stats()["calls"])
    _C._sim_capture(0, side, True)
    try:
        _, grads = train_step(model, x, matepoint.checkpoint)
        sim.finish()                # the copies ran: their buffers can be unpinned
        matepoint.empty_pool()
    finally:
        status = _C._sim_capture(0, side, False)
    made = {name: count - calls.get(name, 0) for name, count in _C._sim_stats()["calls"].items()}
    assert made["cudaHostAlloc"] >= 1 and made["cudaFreeHost"] >= 1, made   # the premise
    assert made["cudaEventQuery"] + made.get("cudaEventSynchronize", 0) + \
        made.get("cudaStreamSynchronize", 0) >= 1, made
    assert status != CAPTURE_INVALIDATED, "the engine made a call CUDA forbids in a capture"
    assert status == 0
    assert_bitwise_equal(grads, expected)


def test_a_source_used_in_place_outlives_its_copy_out_under_expandable_segments(simulated):
    """Backward uses the window's last sources in place and drops them when
    the graph goes, while their copies out may still be queued (the GPU
    lags). torch's allocator with expandable_segments:True then unmaps the
    freed pages on empty_cache() after synchronizing only their own stream:
    the queued D2H would read unmapped memory (an illegal address on a GPU).
    The engine marks such a source used by the copy-out stream, so its
    memory goes back only after the D2H."""
    import sim
    from conftest import MLP, train_step
    matepoint.set_options(offload_window=2, prefetch_depth=1)
    width = 512                                     # 1 MiB inputs: segments of their own
    model, x = MLP(width, 4), torch.randn(width, width)
    before = matepoint.pool_stats()["used_in_place"]
    queued = _C._sim_stats()["calls"]["cudaMemcpyAsync"]
    _C._sim_expandable(True)      # the fixture's mode too: said here, this test's premise
    train_step(model, x, matepoint.checkpoint)
    gc.collect()
    pending = _C._sim_stats()["ops_queued"]
    faults = _C._sim_stats()["unmap_faults"]
    sim.empty_device_cache()                        # the allocator unmaps what is free
    made = _C._sim_stats()["unmap_faults"] - faults
    assert matepoint.pool_stats()["used_in_place"] - before == 2      # the premise
    assert _C._sim_stats()["calls"]["cudaMemcpyAsync"] > queued and pending > 0
    assert made == 0, "a copy out read memory unmapped under it"
