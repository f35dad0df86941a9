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
