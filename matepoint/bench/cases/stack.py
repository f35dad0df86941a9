"""A deep stack of transformer encoder blocks: memory and step time
against depth, and matepoint-auto (the planner) within a budget."""
from __future__ import annotations

import argparse
import logging
import math
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from matepoint.bench import modes
from matepoint.bench.workload import Workload, chain_step

log = logging.getLogger("matepoint.bench")
MODES = ["none", "torch", "torch+save_on_cpu", "matepoint", "matepoint+alloc", "matepoint-auto"]


def unavailable() -> Optional[str]:
    return None


def sizes(args: argparse.Namespace, cuda: bool) -> Dict[str, Any]:
    if not cuda:
        return {"hidden": 64, "heads": 4, "seq": 32, "batch": 2, "dtype": "float32"}
    return {"hidden": args.hidden, "heads": args.heads, "seq": args.seq, "batch": args.batch,
            "dtype": args.dtype}


def depths(args: argparse.Namespace, cuda: bool) -> List[int]:
    return [int(d) for d in args.depths.split(",")] if cuda else [4, 8]


def build_blocks(depth: int, size: Dict[str, Any], device: torch.device) -> List[nn.Module]:
    blocks = nn.ModuleList(
        nn.TransformerEncoderLayer(size["hidden"], size["heads"], 4 * size["hidden"], dropout=0.0,
                                   batch_first=True, norm_first=True)
        for _ in range(depth))
    return list(blocks.to(device=device, dtype=getattr(torch, size["dtype"])))


def planned(blocks: List[nn.Module], x: torch.Tensor, budget_gib: Optional[float]):
    """matepoint-auto: the blocks wrapped as planned, and the plan."""
    import matepoint
    from matepoint._planning import planner as _planner
    from matepoint._meter import copy_bandwidth
    note = _planner.no_offload_reason((x,))
    bandwidth = copy_bandwidth(x.device).d2h if note is None else math.inf
    profiles = _planner.profile_blocks(blocks, (x,), bandwidth, repeats=3)
    unit = 1 << 20 if x.is_cuda else 4096
    pipeline = matepoint.options.pipeline
    if budget_gib is None:  # what checkpointing every block needs
        budget, _ = _planner.predict(profiles, ["recompute"] * len(profiles), unit, pipeline)
    else:
        budget = int(budget_gib * (1 << 30))
    plan = _planner.solve(profiles, budget, unit, pipeline, offload=note is None,
                          note=note or "")
    log.info("%s", plan)
    return plan.apply(blocks), plan


def build(spec: Dict[str, Any], mode: str, device: torch.device) -> Workload:
    size = spec["size"]
    blocks = build_blocks(spec["depth"], size, device)
    x = torch.randn(size["batch"], size["seq"], size["hidden"], device=device,
                    dtype=getattr(torch, size["dtype"]))
    parameters = [p for block in blocks for p in block.parameters()]
    extra: Dict[str, Any] = {}
    if mode == "matepoint-auto":
        from matepoint._planning.planner import CHOICES
        run_blocks, plan = planned(blocks, x, spec.get("budget_gib"))
        extra = {"plan": {c: plan.choices.count(c) for c in CHOICES},
                 "budget_bytes": plan.budget_bytes,
                 "predicted_peak_bytes": plan.predicted_peak_bytes}
        step = chain_step(list(run_blocks), x, None)
    else:
        step = chain_step(blocks, x, modes.checkpoint_function(mode))
    return Workload(parameters, step, reserve=(x.nbytes, spec["depth"]), extra=extra)
