"""The checks that need no GPU: matepoint's checkpoint against torch's on
the CPU, and whether install_allocator() would get its C++ units for the
torch installed here (the report's outlook, judged)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
import torch.nn as nn

from matepoint.bench.machine import units as machine_units
from matepoint.bench.selfcheck.outcome import CheckFailed, CheckSkipped
from matepoint.bench.selfcheck.training_checks import assert_exact, torch_checkpoint


def check_checkpoint_cpu(target: Any) -> Dict[str, Any]:
    """A few checkpointed blocks with dropout (its masks replayed in the
    recompute), fp32 on the CPU: gradients bit for bit torch's."""
    import matepoint
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1))
                           for _ in range(4))
    x = torch.randn(32, 64)

    def step(wrap: Callable) -> List[torch.Tensor]:
        blocks.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_(True)
        torch.manual_seed(1)
        h = leaf
        for block in blocks:
            h = wrap(block, h)
        h.square().mean().backward()
        return [leaf.grad] + [p.grad.clone() for p in blocks.parameters()]

    expected = step(torch_checkpoint)
    assert_exact(blocks, step(matepoint.checkpoint), expected)
    return {"blocks": len(blocks), "tensors_compared": len(expected)}


def check_allocator_units(target: Any) -> Dict[str, Any]:
    """Whether install_allocator() would give torch's memory API (the
    adapter) and raise torch.OutOfMemoryError (the OOM unit) here."""
    outlook = machine_units.allocator_outlook()
    figures = {"adapter": outlook["adapter"]["state"], "oom_unit": outlook["oom_unit"]["state"],
               "adapter_path": outlook["adapter"]["path"]}
    if outlook["state"] == machine_units.NO_CUDA:
        raise CheckSkipped(outlook["reason"])
    for role in ("adapter", "oom_unit"):
        unit = outlook[role]
        if unit["state"] == "missing":
            fix = f" To fix: {unit['fix']}" if unit["fix"] else ""
            raise CheckFailed(f"install_allocator() would run without its {unit['unit']}: "
                              f"{unit['reason']}.{fix}")
    return figures
