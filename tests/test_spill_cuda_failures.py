"""The disk tier's CUDA calls can fail too (tests/test_cuda_failures.py's
sweep, over a step that spills): before it writes a span out, the tier asks
whether the span's copy out completed (cudaEventQuery), and with none
ready it waits for the copy-out streams (cudaStreamSynchronize). A query
that fails counts as "not completed": the span stays in its pinned buffer
for now, and neither the Python error nor CUDA's per-thread last error of
that query may outlive it (torch would raise the latter from its next,
unrelated kernel launch; the former would surface as an error in whatever
Python code ran next). Every failure position: a clear error or exact
gradients, the pool and window empty, the next step exact."""
from __future__ import annotations

import matepoint
import torch
import torch.nn as nn

from conftest import MLP, no_checkpoint, train_step
from test_cuda_failures import Phase, sweep

WIDTH, BATCH, DEPTH = 64, 32, 4
INPUT_BYTES = WIDTH * BATCH * 4          # one region's offloaded input (a pool class size)
TIER_KINDS = frozenset({"cudaEventQuery", "cudaStreamSynchronize"})


def spilled_step(model: nn.Module, x: torch.Tensor) -> int:
    """Spans the disk tier wrote during one step."""
    before = matepoint.pool_stats()["spill_writes"]
    train_step(model, x, matepoint.checkpoint)
    return matepoint.pool_stats()["spill_writes"] - before


def test_every_disk_tier_query_can_fail(simulated, tmp_path) -> None:
    options = dict(spill_dir=str(tmp_path / "spill"), host_limit_bytes=2 * INPUT_BYTES)
    phase = Phase("disk tier", lambda: MLP(WIDTH, DEPTH), options=options, kinds=TIER_KINDS)
    try:
        matepoint.set_options(**options)
        torch.manual_seed(0)
        model, x = phase.model(), torch.randn(BATCH, WIDTH)
        _, expected = train_step(model, x, no_checkpoint)
        expected = [g.detach().clone() for g in expected]
        assert spilled_step(model, x) > 0, "the premise: the step goes to disk"
        swept, problems = sweep(phase, model, x, expected)
    finally:
        matepoint.set_options(spill_dir=None, host_limit_bytes=None)
    assert swept.get("cudaEventQuery", 0) > 0, swept
    assert problems == [], "\n".join(problems)
