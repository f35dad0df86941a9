"""The offload window and backward from several threads (issue 43, item
7): autograd graphs are per thread, so one thread's backward reaching a
region says nothing of when another thread's backward reaches its inputs
of the same region count (regions count per device, across threads)."""
from __future__ import annotations

from typing import List

import torch

import matepoint
from matepoint import _C
from conftest import run_in_thread


def test_a_threads_backward_leaves_another_threads_inputs_offloaded(simulated) -> None:
    """This thread's backward begins while another thread's input of the
    same region is still held (the GPU lags): only this thread's input is
    used in place; the other thread's source is retired (in stream order)
    and its own backward copies it back, exact. Before, the other thread's
    source was kept on the device until its copy died, its offload undone."""
    mine_source, their_source = torch.randn(64, 64), torch.randn(64, 64)
    mine_expected, their_expected = mine_source.clone(), their_source.clone()
    mine_group, mine_saved = _C._sac_offload([mine_source])
    theirs: List[object] = []
    run_in_thread(lambda: theirs.append(_C._sac_offload([their_source])))
    their_group, their_saved = theirs.pop()
    del mine_source, their_source
    rows = _C._offload_copies()
    assert len({row[0] for row in rows}) == 1, rows   # premise: one region, both held
    before = matepoint.pool_stats()
    assert before["device_bytes_in_flight"] == 2 * mine_expected.nbytes, before
    (mine,) = _C._sac_restore(mine_group, mine_saved)  # this thread's backward
    middle = matepoint.pool_stats()
    assert middle["used_in_place"] - before["used_in_place"] == 1
    assert middle["device_bytes_in_flight"] == 0, middle
    (their,) = _C._sac_restore(their_group, their_saved)
    after = matepoint.pool_stats()
    assert after["used_in_place"] == middle["used_in_place"], "the other input stayed in place"
    assert after["fetched_at_need"] - middle["fetched_at_need"] == 1
    assert torch.equal(mine, mine_expected) and torch.equal(their, their_expected)
