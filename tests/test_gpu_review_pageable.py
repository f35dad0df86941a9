"""A copy back through pageable host memory (the pool at its limit) is
synchronous for the host only: cudaMemcpyAsync from pageable memory
returns once the driver staged the bytes, and "the DMA to final
destination may not have completed" (CUDA's API synchronization
behavior). Whatever reads the restored span must still wait for the copy's
stream. The simulated GPU used to run the whole stream at such a copy, so
a missing wait after a pageable copy back could not show; it now stages
the bytes at the call and lands them when the stream reaches the copy.

Proven by data as tests/test_waits_needed.py does: with every span in
pageable memory the step is exact, and dropping a wait of the compute
stream for the copy-in stream (one at a time) changes the gradients."""
from __future__ import annotations

import warnings

import torch

import matepoint
from matepoint import _C

from conftest import MLP
from test_waits_needed import (ADVERSARIES, BATCH, DEPTH, WAIT, WIDTH, Scenario,
                               logged_calls, plain, run, run_dropped, same, step)

COMPUTE_WAITS_FOR_COPY_IN = "compute waits for copy in"


def test_a_pageable_copy_back_is_awaited_by_data(simulated) -> None:
    scenario = Scenario("pageable, prefetch, window 1",
                        dict(offload_window=1, prefetch_depth=1, pool_limit_bytes=1),
                        lambda: plain)
    matepoint.set_options(**scenario.options)
    torch.manual_seed(0)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    expected = [g.detach().clone() for g in step(model, x, scenario.reference(), 1)]
    shown, dropped_count = [], 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)     # the pageable fallback's
            for adversary, progress in ADVERSARIES.items():
                _C._sim_set_progress(progress)
                _C._sim_log_waits(True)
                pageable_before = _C._sim_stats()["pageable_copies"]
                grads = run(scenario, model, x)
                calls = logged_calls()
                _C._sim_log_waits(False)
                assert _C._sim_stats()["pageable_copies"] > pageable_before, adversary
                assert same(grads, expected), f"{adversary}: the step itself is not exact"
                for call, index, kind in calls:
                    if call != WAIT or kind != COMPUTE_WAITS_FOR_COPY_IN:
                        continue
                    dropped_count += 1
                    if not same(run_dropped(scenario, model, x, call, index), expected):
                        shown.append((adversary, index))
    finally:
        _C._sim_log_waits(False)
        _C._sim_set_progress(0)
    assert dropped_count > 0, "no copy back was awaited by the compute stream"
    assert shown, (f"none of {dropped_count} dropped waits for a pageable copy back changed "
                   f"the data: the simulated GPU lands such copies at the call")
