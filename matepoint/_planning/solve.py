"""Solving: the fastest plan for measured profiles within a budget, by the
exact dynamic program in C (csrc/planner), and the model's prediction for
given choices."""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Tuple

from matepoint import _C
from matepoint._planning.block_profile import BlockProfile, _records
from matepoint._planning.choices import CHOICES, _OFFLOADING
from matepoint._planning.plan_record import Plan, PlanError

log = logging.getLogger("matepoint.planner")
def solve(profiles: List[BlockProfile], budget_bytes: int, unit_bytes: int,
          pipeline: bool, offload: bool = True, note: str = "") -> Plan:
    """The fastest plan for measured ``profiles`` within ``budget_bytes``.

    Args:
        profiles: one :class:`BlockProfile` per block, in order.
        budget_bytes: the activation budget.
        unit_bytes: the solver's memory quantum.
        pipeline: whether backward prefetches offloaded inputs.
        offload: False leaves the choices that offload out.
        note: why offload was left out, for the plan's table.

    Raises:
        PlanError: no plan fits; it names the smallest feasible budget.
    """
    units = _records(profiles, unit_bytes, offload)
    budget_units = budget_bytes // unit_bytes
    solved = _C._plan_solve(units, budget_units, pipeline)
    if solved is None or (not offload and _OFFLOADING.intersection(solved[0])):
        raise PlanError(budget_bytes, _smallest_budget(units, pipeline, offload) * unit_bytes)
    choices, seconds, peak_units = solved
    result = Plan([CHOICES[c] for c in choices], profiles, budget_bytes, unit_bytes, pipeline,
                  peak_units * unit_bytes, seconds, offload, note)
    log.debug("%s", result)
    return result


def predict(profiles: List[BlockProfile], choices: List[str], unit_bytes: int,
            pipeline: bool) -> Tuple[int, float]:
    """(peak bytes, step seconds) the planner's model gives ``choices``."""
    if len(choices) != len(profiles) or set(choices) - set(CHOICES):
        raise ValueError(f"need one of {CHOICES} per block, got {choices}")
    codes = bytes(CHOICES.index(c) for c in choices)
    seconds, peak_units = _C._plan_evaluate(_records(profiles, unit_bytes), codes, pipeline)
    return peak_units * unit_bytes, seconds


def default_unit(budget_bytes: int) -> int:
    """A power of two that keeps the solver's tables near 100k units."""
    return max(1024, 1 << max(0, math.ceil(math.log2(max(1, budget_bytes // 100_000)))))


def _smallest_budget(units: List[Dict[str, Any]], pipeline: bool, offload: bool) -> int:
    """The smallest budget in units any plan meets; without offload, found
    by bisection between the smallest with offload (a lower bound) and the
    peak of recomputing every block (always a plan without offload)."""
    low = _C._plan_min_budget(units, pipeline)
    if offload:
        return low
    recompute = bytes([CHOICES.index("recompute")] * len(units))
    high = _C._plan_evaluate(units, recompute, pipeline)[1]

    def fits(budget: int) -> bool:
        solved = _C._plan_solve(units, budget, pipeline)
        return solved is not None and not _OFFLOADING.intersection(solved[0])

    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return high
