"""The offload engine's stream ordering where several streams meet one span
(issue 43, item 7), on the simulated GPU whose kernels lag in data
(tests/sim.py): a read not ordered after the copy writing what it reads
gets poison (NaN), so each test fails by data without its fix."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

import matepoint
import sim
from matepoint import _C
from conftest import run_in_thread


def on_raw_stream(handle: Optional[int]) -> Optional[int]:
    """Makes `handle` current with no ordering around it (unlike
    sim.stream, whose waits would order a later stream after an earlier
    one's); returns the stream that was current."""
    previous = _C._sim_current_stream(0)
    _C._sim_set_stream(0, handle)
    return previous


@pytest.mark.parametrize("prefetched", [True, False], ids=["prefetched", "fetched-at-need"])
def test_a_span_read_on_two_streams_is_awaited_on_each(simulated, prefetched: bool) -> None:
    """A span copied back once and read on two streams, neither ordered
    after the other: each reading stream waits for the copy back (the
    engine kept one flag per copy, so the second reader read the span
    before it arrived). Premise: the span really was copied back (not used
    in place), and both readers waited."""
    a, b = sim.side_streams()
    source = torch.randn(64, 64)
    expected = source.clone()
    group, saved = _C._sac_offload([source])
    del source
    sim.finish()                                # the copy out ran ...
    matepoint.pool_stats()                      # ... and the window retired the source
    before = matepoint.pool_stats()
    _C._sim_drop_site(None)                     # counts each site's calls from here
    if prefetched:
        _C._sac_prefetch(group)                 # on the legacy stream's memory; lags
    previous = on_raw_stream(a)
    try:
        on_a = saved[0].unpack()                # a waits (or copies back at need)
        _C._sim_set_stream(0, b)
        # read on b before anything on a runs (a kernel on a would run the
        # copy back it waits for, and b would find the span there by luck)
        results = [saved[0].unpack() * 1]
        _C._sim_set_stream(0, a)
        results.append(on_a * 1)
    finally:
        _C._sim_set_stream(0, previous)
    for handle in (a, b):                       # the legacy stream takes the results
        _C._sim_order_streams(0, previous, 0, handle)
    after = matepoint.pool_stats()
    assert after["used_in_place"] == before["used_in_place"], "the span was used in place"
    assert after["prefetched"] - before["prefetched"] == int(prefetched)
    assert after["fetched_at_need"] - before["fetched_at_need"] == int(not prefetched)
    _C._sac_discard(group)
    sim.finish()
    sim.assert_no_cuda_error()
    for result in results:
        assert torch.equal(result, expected)
    # b and the legacy stream (the discard's) wait; so does a when the
    # copy back was not queued on it
    assert _C._sim_site_counts()["reader_after_copy_in"] == 2 + int(prefetched)


PER_THREAD = 0x2    # cudaStreamPerThread: each thread's own default stream


def test_the_per_thread_stream_handle_is_no_key_across_threads(simulated) -> None:
    """cudaStreamPerThread is one handle naming another stream on each
    thread. A span offloaded on thread A's, its source retired by the
    window while the copy out was queued, is copied back on thread B's:
    the copy back must wait for the copy out. Taking equal handles for one
    stream, the engine made A's stream wait when it retired the source and
    then took B's for that stream ("the compute stream is the producer
    that waited"): B copied the host buffer before the copy out wrote it.
    Premise: retired with the copy out queued, and copied back at need
    (not used in place)."""
    matepoint.set_options(offload_window=1)
    matepoint.empty_pool()                      # fresh pinned buffers: no old bytes
    torch.manual_seed(0)
    source = torch.randn(64, 64)
    expected = source * 2
    previous = on_raw_stream(PER_THREAD)        # thread A: its own default stream
    try:
        made = source * 1                       # the producer's kernel
        group, saved = _C._sac_offload([made], True)
        # two regions more: with window 1 the second retires `made` (its
        # copy out still queued: A's stream waits for it)
        later = [_C._sac_offload([torch.randn(64, 64) * 1], True)]
        _C._sim_drop_site(None)                 # counts each site's calls from here
        later.append(_C._sac_offload([torch.randn(64, 64) * 1], True))
    finally:
        _C._sim_set_stream(0, previous)
    del made
    retired = _C._sim_site_counts()
    # retired with its copy out queued: A's stream waited for it (as the
    # engine took equal handles for one stream), or the copy-out stream
    # holds the source's memory (as it takes cudaStreamPerThread for none)
    assert retired["producer_after_copy_out"] + retired["source_on_copy_out"] == 1, retired
    before = matepoint.pool_stats()
    results = []

    def on_thread_b() -> None:
        _C._sim_set_stream(0, PER_THREAD)       # B's own default stream
        restored = saved[0].unpack()            # copied back at need, on B's stream
        results.append(restored * 2)            # B's kernel: lands what it depends on
        _C._sim_set_stream(0, None)
        _C._sim_order_streams(0, None, 0, PER_THREAD)

    run_in_thread(on_thread_b)
    after = matepoint.pool_stats()
    assert after["fetched_at_need"] - before["fetched_at_need"] == 1, "not copied back"
    assert after["used_in_place"] == before["used_in_place"], "the span was used in place"
    _C._sac_discard(group)
    for other, _ in later:
        _C._sac_discard(other)
    del later
    sim.finish()
    sim.assert_no_cuda_error()
    assert torch.equal(results[0], expected)
    assert _C._sim_site_counts()["copy_in_after_copy_out"] == 1
