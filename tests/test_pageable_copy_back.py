"""A copy back through pageable host memory (the pool at its limit) is
synchronous for the host only: cudaMemcpyAsync from pageable memory
returns once the driver staged the bytes, and "the DMA to final
destination may not have completed" (CUDA's API synchronization
behavior). Whatever reads the restored span must still wait for the copy's
stream. The simulated GPU used to run the whole stream at such a copy, so
a missing wait after a pageable copy back could not show; it now stages
the bytes at the call and lands them when the stream reaches the copy.

Proven by data as tests/test_waits_needed.py does: with every span in
pageable memory the step is exact, and dropping the compute stream's waits
for its copies back (site reader_after_copy_in) changes the gradients."""
from __future__ import annotations

import warnings

import matepoint
from matepoint import _C

from test_waits_needed import ADVERSARIES, Scenario, plain, run_check, training_case

READER_WAITS = "reader_after_copy_in"
PAGEABLE = training_case(Scenario("pageable, prefetch, window 1",
                                  dict(offload_window=1, prefetch_depth=1, pool_limit_bytes=1),
                                  lambda: plain))


def test_a_pageable_copy_back_is_awaited_by_data(simulated) -> None:
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # the pageable fallback's
        for adversary in ADVERSARIES:
            pageable_before = _C._sim_stats()["pageable_copies"]
            right, counts = run_check(PAGEABLE, adversary, None)
            assert _C._sim_stats()["pageable_copies"] > pageable_before, adversary
            assert matepoint.pool_stats()["fallbacks"] > 0, "no span went to pageable memory"
            assert right, f"{adversary}: the step itself is not exact"
            assert counts[READER_WAITS] > 0, "no copy back was awaited by the compute stream"
            right, _ = run_check(PAGEABLE, adversary, READER_WAITS)
            if not right:
                shown.append(adversary)
    assert shown, ("dropping the waits for pageable copies back changed the data under no "
                   "adversary: the simulated GPU lands such copies at the call")
