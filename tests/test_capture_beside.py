"""The engine's own runtime calls beside a CUDA graph capture on another
stream, one test per kind of call, each proven by its own effect.

In CUDA's global capture mode (torch.cuda.graph's default), while any
stream captures, a thread not in relaxed mode may make no "potentially
unsafe" call: cudaHostAlloc, cudaFreeHost, cudaMalloc, cudaFree, event
queries and synchronizations fail with cudaErrorStreamCaptureUnsupported
and invalidate the capture, whose cudaStreamEndCapture then returns
cudaErrorStreamCaptureInvalidated (the simulated GPU does the same:
csrc/testing/cudart_sim.c). The engine makes those calls in relaxed mode
(cudart_relax_capture), as torch's allocator does its cudaMalloc, so a
capture beside training survives. Each test below makes one kind of call
happen while a side stream captures, asserts it did (its premise), and
fails by the capture's status when that call's relaxed mode is undone."""
from __future__ import annotations

import pytest
import torch

import matepoint
from matepoint import _C

import sim
from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step

CAPTURE_INVALIDATED = 901      # cudaErrorStreamCaptureInvalidated
WIDTH, BATCH, DEPTH = 64, 64, 12
INPUT_BYTES = WIDTH * BATCH * 4


def calls() -> dict:
    return dict(_C._sim_stats()["calls"])


def made_since(before: dict) -> dict:
    return {name: count - before.get(name, 0) for name, count in calls().items()}


class Capture:
    """A capture in global mode on side stream `stream` of device 0 for the
    block; `status` is cudaStreamEndCapture's, `made` the runtime calls of
    the block by name."""

    def __init__(self, stream: int) -> None:
        self.stream = stream
        self.status = None
        self.made: dict = {}

    def __enter__(self) -> "Capture":
        self.before = calls()
        _C._sim_capture(0, self.stream, True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.status = _C._sim_capture(0, self.stream, False)
        self.made = made_since(self.before)

    def assert_survived(self) -> None:
        assert self.status != CAPTURE_INVALIDATED, \
            "the engine made a call CUDA forbids beside a capture in global mode"
        assert self.status == 0


def test_pinning_beside_a_capture_pins_and_keeps_the_capture(offload):
    """The pool's first buffers are pinned (cudaHostAlloc) while a side
    stream captures: the pins succeed (no pageable fallback) and the
    capture survives."""
    matepoint.empty_pool()
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    fallbacks = matepoint.pool_stats()["fallbacks"]
    with Capture(sim.side_streams()[0]) as capture:
        _, grads = train_step(model, x, matepoint.checkpoint)
    assert capture.made["cudaHostAlloc"] >= 1, capture.made       # the premise
    capture.assert_survived()
    assert matepoint.pool_stats()["fallbacks"] == fallbacks, "a pin was refused"
    assert_bitwise_equal(grads, expected)


def test_unpinning_beside_a_capture_keeps_the_capture(offload):
    """Buffers pinned before the capture go back (cudaFreeHost, by
    empty_pool) while a side stream captures: the capture survives."""
    matepoint.empty_pool()
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    train_step(model, x, matepoint.checkpoint)
    assert matepoint.pool_stats()["bytes_reserved"] > 0
    with Capture(sim.side_streams()[0]) as capture:
        matepoint.empty_pool()
    assert capture.made["cudaFreeHost"] >= 1, capture.made        # the premise
    capture.assert_survived()
    assert matepoint.pool_stats()["bytes_reserved"] == 0


@pytest.fixture
def spill_dir(tmp_path):
    yield str(tmp_path / "spill")
    matepoint.set_options(spill_dir=None, host_limit_bytes=None)


def test_waiting_for_copies_out_beside_a_capture_keeps_it(simulated, spill_dir):
    """Pinned memory at host_limit_bytes, the forward makes room by
    spilling its oldest spans, whose copies out the lagging GPU has not
    run yet: the host waits for the copy-out stream (a quiet
    cudaStreamSynchronize, streams_wait_stream_quietly) while a side stream
    captures. The wait is made and the capture survives; the gradients are
    exact. Undone, the wait is refused (the capture invalidated) and the
    spill writes buffers no copy filled."""
    torch.manual_seed(0)
    model, x = MLP(WIDTH, 2 * DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=4 * INPUT_BYTES)
    writes = matepoint.pool_stats()["spill_writes"]
    with Capture(sim.side_streams()[0]) as capture:
        _, grads = train_step(model, x, matepoint.checkpoint)
    assert capture.made["cudaStreamSynchronize"] >= 1, capture.made    # the premise
    assert matepoint.pool_stats()["spill_writes"] > writes
    capture.assert_survived()
    assert_bitwise_equal(grads, expected)


def test_a_discard_waiting_for_its_copy_back_beside_a_capture_keeps_it(simulated):
    """A prefetched span discarded unread while a side stream captures, the
    stream wait that orders its memory after the copy back failing: the
    host waits for the copy back instead (a quiet cudaEventSynchronize,
    streams_wait_event_quietly). The wait is made and the capture survives."""
    source = torch.randn(WIDTH, WIDTH)
    group, saved = _C._sac_offload([source])
    del source
    sim.finish()                                  # the copy out ran ...
    matepoint.pool_stats()                        # ... and the window retired the source
    prefetched = matepoint.pool_stats()["prefetched"]
    _C._sac_prefetch(group)                       # the copy back is queued, not run
    assert matepoint.pool_stats()["prefetched"] == prefetched + 1     # not used in place
    with Capture(sim.side_streams()[0]) as capture:
        _C._sim_fail("cudaStreamWaitEvent", 0, 1, 1)     # cudaErrorInvalidValue, once
        try:
            _C._sac_discard(group)
        finally:
            _C._sim_fail("cudaStreamWaitEvent", 0, 0, 0)
    assert capture.made["cudaEventSynchronize"] >= 1, capture.made    # the premise
    assert _C._sim_take_last_error() == 0
    capture.assert_survived()
    del group, saved
