"""A deep checkpointed stack that offloads every block's input: the
device's peak over a training step against the planner's prediction for
it (matepoint.plan's model of the "offload" choice), the claim behind
"device memory stays flat as the model gets deeper"."""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.nn as nn

from matepoint.bench.selfcheck.outcome import CheckFailed, options_kept

# how far the measured peak may pass the prediction (the allocator's
# rounding, a gradient's transient copy)
PEAK_TOLERANCE = 0.15
# the planner's memory quantum for the predictions (its smallest default)
UNIT_BYTES = 1024


class Residual(nn.Module):
    """x + MLP(x): its input is all a checkpoint of it needs to keep."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def _step(blocks: nn.ModuleList, x: torch.Tensor) -> None:
    """Forward and backward through every block checkpointed with offload;
    gradients accumulate into those of the step before (already allocated)."""
    import matepoint
    h = x
    for block in blocks:
        h = matepoint.checkpoint(block, h)
    h.sum().backward()


def check_deep_stack_peak(target: Any) -> Dict[str, Any]:
    import matepoint
    from matepoint._planning.planner import predict
    with options_kept(offload=True, pipeline=True, prefetch_depth=1,
                      min_offload_bytes=target.min_offload_bytes):
        torch.manual_seed(0)
        blocks = nn.ModuleList(Residual(target.deep_width) for _ in range(target.deep_depth))
        blocks = blocks.to(target.device)
        x = torch.randn(target.deep_batch, target.deep_width, device=target.device,
                        requires_grad=True)
        profiles = matepoint.plan(blocks, x, budget_bytes=1 << 50).profiles  # each block once
        kept, _ = predict(profiles, ["keep"] * len(blocks), UNIT_BYTES, True)
        predicted, _ = predict(profiles, ["offload"] * len(blocks), UNIT_BYTES, True)
        _step(blocks, x)                     # warm: gradients and the pool
        target.synchronize()
        with target.peak_meter() as meter:
            _step(blocks, x)
            target.synchronize()
    measured = int(meter.peak_bytes)
    figures = {"depth": len(blocks), "input_bytes": x.nbytes, "predicted_peak_bytes": predicted,
               "measured_peak_bytes": measured, "ratio": measured / max(predicted, 1),
               "keep_all_predicted_peak_bytes": kept}
    if measured > predicted * (1 + PEAK_TOLERANCE):
        raise CheckFailed(f"the step peaked at {measured} bytes of device memory above its "
                          f"parameters and gradients, {figures['ratio']:.2f}x the planner's "
                          f"prediction of {predicted} for {len(blocks)} offloaded blocks")
    return figures
