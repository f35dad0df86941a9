"""What a benchmark case hands the runner: one model ready to train."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn


@dataclasses.dataclass
class Workload:
    """parameters: in a fixed order, for the gradient comparison.
    run_step: one forward and backward; returns the loss.
    optimizer: stepped after each step when the case trains (None: the
        parameters stay put and every step computes the same gradients).
    reserve: (buffer_bytes, count) of the inputs a step offloads, for
        matepoint.reserve_pool; None when unknown.
    extra: case-specific figures for the results (a plan, sizes)."""

    parameters: List[nn.Parameter]
    run_step: Callable[[], torch.Tensor]
    optimizer: Optional[torch.optim.Optimizer] = None
    reserve: Optional[Tuple[int, int]] = None
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)


def chain_step(blocks: List[nn.Module], x: torch.Tensor,
               checkpoint: Optional[Callable]) -> Callable[[], torch.Tensor]:
    """Forward through `blocks` in order, each checkpointed when asked."""
    def run_step() -> torch.Tensor:
        h = x.detach().requires_grad_(True)
        for block in blocks:
            h = checkpoint(block, h) if checkpoint is not None else block(h)
        loss = h.float().pow(2).mean()
        loss.backward()
        return loss.detach()
    return run_step
