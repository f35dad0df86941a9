"""The solver's plans do not change when it gets faster.

tests/data/planner_golden.json holds block profiles and, for a set of
budgets, the choices, peak and time the solver gave (recorded by the solver
of commit 16c7d5d, before the speed work of issue 36), with each chain's
frontier and, for a budget too small, the smallest budget named. The solver
must give the same back, bit for bit: the same choices where several plans
tie (chains of identical blocks tie everywhere), the same floats. The
profiles are recorded as plan-1 files held them (each policy's figures as
flat fields) and read through Plan.load's upgrade of those.

    python tests/test_planner_golden.py --record   # rewrites the JSON (only
                                                   # when the model changes)
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
from typing import Any, Dict, List

import pytest

from matepoint._planning.planner import BlockProfile, PlanError, PolicyFigures, solve
from matepoint._planning.plan_record import (_PLAN_1_POLICY_FIELDS, _upgraded_profile,
                                             profile_from_dict)

DATA = os.path.join(os.path.dirname(__file__), "data", "planner_golden.json")
MIB = 1 << 20
# the benchmark's frontier as planner_speed.py asks it; the others whole
FRONTIER_POINTS = {"benchmark": 16}
ALL_POINTS = 1 << 20


def _random_profile(rng: random.Random, stays: bool) -> BlockProfile:
    """Every figure measured, sizes and times spread so ties are rare."""
    input_bytes = rng.randint(1, 64) * MIB + rng.randint(0, MIB)
    activations = int(input_bytes * rng.uniform(2, 10))
    forward_s = rng.uniform(1e-3, 5e-3)
    selective = input_bytes + int((activations - input_bytes) * rng.uniform(0.2, 0.6))
    attention = input_bytes + int((selective - input_bytes) * rng.uniform(0.1, 0.8))

    def stay(nbytes: int) -> int:
        return rng.randint(0, nbytes // 4) if stays else 0
    profile = BlockProfile(
        forward_s=forward_s, backward_s=2 * forward_s * rng.uniform(0.8, 1.2),
        copy_s=input_bytes / rng.uniform(5e9, 25e9), input_bytes=input_bytes,
        activation_bytes=activations, output_bytes=input_bytes,
        forward_peak_bytes=activations + rng.randint(0, input_bytes),
        backward_peak_bytes=activations // rng.randint(1, 3),
        # drawn in the order the recording drew them
        policies={"selective": PolicyFigures(3 * forward_s * rng.uniform(1.0, 1.2), selective)},
        recompute_s=3 * forward_s * rng.uniform(1.2, 1.33))
    profile.policies["attention"] = PolicyFigures(3 * forward_s * rng.uniform(1.05, 1.3),
                                                  attention)
    profile.offload_stay_bytes = stay(input_bytes)
    for name, figures in profile.policies.items():
        profile.policies[name] = dataclasses.replace(figures, stay_bytes=stay(figures.held_bytes))
    return profile


def _identical_profiles(count: int) -> List[BlockProfile]:
    """A transformer-like stack: every block alike, so plans tie everywhere
    and only the solver's order of preference tells them apart."""
    block = BlockProfile(
        forward_s=4e-3, backward_s=8e-3, copy_s=3e-3, input_bytes=16 * MIB,
        activation_bytes=128 * MIB, output_bytes=16 * MIB, forward_peak_bytes=136 * MIB,
        backward_peak_bytes=64 * MIB, recompute_s=15e-3, offload_stay_bytes=MIB,
        policies={"selective": PolicyFigures(13e-3, 56 * MIB, 2 * MIB),
                  "attention": PolicyFigures(14e-3, 28 * MIB, MIB)})
    return [dataclasses.replace(block, policies=dict(block.policies)) for _ in range(count)]


def _benchmark_profiles() -> List[BlockProfile]:
    """benchmarks/planner_speed.py's chain (keep, recompute, offload only)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        from planner_speed import synthetic_chain
    finally:
        sys.path.pop(0)
    return synthetic_chain(200)


def _chains() -> List[Dict[str, Any]]:
    rng = random.Random(36)
    chains = [
        {"name": "benchmark", "unit_bytes": MIB, "profiles": _benchmark_profiles(),
         "budgets_gib": [40, 80, 120]},
        {"name": "identical", "unit_bytes": MIB, "profiles": _identical_profiles(24)},
        {"name": "identical-coarse", "unit_bytes": 8 * MIB, "profiles": _identical_profiles(9)},
    ]
    for i, stays in enumerate((False, True, True)):
        chains.append({"name": f"random-{i}", "unit_bytes": MIB // 4,
                       "profiles": [_random_profile(rng, stays) for _ in range(30)]})
    # blocks whose only expensive operation is attention: both policies
    # save the same, and ties between them go to selective
    twins = [_random_profile(rng, True) for _ in range(16)]
    for p in twins:
        p.policies["attention"] = p.policies["selective"]
    chains.append({"name": "twin-policies", "unit_bytes": MIB // 4, "profiles": twins})
    for chain in chains:
        # some selective and attention figures unmeasured, as for blocks
        # without attention or profiled before those choices existed
        if chain["name"] == "random-2":
            for p in chain["profiles"][::3]:
                p.policies.pop("attention", None)
            for p in chain["profiles"][::5]:
                p.policies.pop("selective", None)
    return chains


def _budgets(profiles: List[BlockProfile], chain: Dict[str, Any]) -> List[int]:
    """From below the smallest budget to above keeping everything."""
    if "budgets_gib" in chain:
        return [int(g * (1 << 30)) for g in chain["budgets_gib"]]
    everything = sum(p.activation_bytes for p in profiles) + \
        max(p.keep_work_bytes() for p in profiles)
    return [int(everything * f) for f in (0.005, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3,
                                          0.4, 0.5, 0.7, 1.0, 1.2)]


def _outcome(profiles: List[BlockProfile], budget: int, unit: int, pipeline: bool,
             offload: bool) -> Dict[str, Any]:
    try:
        plan = solve(profiles, budget, unit, pipeline, offload)
    except PlanError as error:
        return {"budget_bytes": budget, "smallest_budget_bytes": error.smallest_budget_bytes}
    return {"budget_bytes": budget, "choices": plan.choices,
            "peak_bytes": plan.predicted_peak_bytes, "time_s": plan.predicted_time_s}


def _record() -> Dict[str, Any]:
    cases = []
    for chain in _chains():
        profiles, unit = chain["profiles"], chain["unit_bytes"]
        for pipeline, offload in ((True, True), (False, True), (True, False)):
            solves = [_outcome(profiles, b, unit, pipeline, offload)
                      for b in _budgets(profiles, chain)]
            frontier = None
            planned = [s for s in solves if "choices" in s]
            if planned and (chain["name"] != "benchmark" or (pipeline and offload)):
                plan = solve(profiles, planned[-1]["budget_bytes"], unit, pipeline, offload)
                points = FRONTIER_POINTS.get(chain["name"], ALL_POINTS)
                frontier = [list(point) for point in plan.frontier(points)]
            cases.append({"name": chain["name"], "unit_bytes": unit, "pipeline": pipeline,
                          "offload": offload, "solves": solves, "frontier": frontier})
    chains = {c["name"]: [_plan_1_profile(p) for p in c["profiles"]] for c in _chains()}
    return {"recorded_by": "16c7d5d", "profiles": chains, "cases": cases}


def _plan_1_profile(profile: BlockProfile) -> Dict[str, Any]:
    """``profile`` as a plan-1 file holds it: each policy's figures flat."""
    fields = dataclasses.asdict(profile)
    policies = fields.pop("policies")
    for policy, names in _PLAN_1_POLICY_FIELDS.items():
        figures = policies.get(policy, {"seconds": None, "held_bytes": None, "stay_bytes": None})
        fields.update(zip(names, (figures["seconds"], figures["held_bytes"],
                                  figures["stay_bytes"])))
    return fields


def _load() -> Dict[str, Any]:
    with open(DATA, encoding="utf-8") as file:
        return json.load(file)


GOLDEN = _load() if os.path.exists(DATA) else {"cases": [], "profiles": {}}


def _case_id(case: Dict[str, Any]) -> str:
    return f"{case['name']}-{'pipelined' if case['pipeline'] else 'unpipelined'}" \
           f"{'' if case['offload'] else '-no-offload'}"


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=_case_id)
def test_same_plans_as_recorded(case: Dict[str, Any]) -> None:
    profiles = [profile_from_dict(_upgraded_profile(p)) for p in GOLDEN["profiles"][case["name"]]]
    for recorded in case["solves"]:
        got = _outcome(profiles, recorded["budget_bytes"], case["unit_bytes"], case["pipeline"],
                       case["offload"])
        # bit for bit: floats compare equal, not approximately
        assert got == recorded, recorded["budget_bytes"]
    if case["frontier"] is not None:
        budget = [s for s in case["solves"] if "choices" in s][-1]["budget_bytes"]
        plan = solve(profiles, budget, case["unit_bytes"], case["pipeline"], case["offload"])
        points = FRONTIER_POINTS.get(case["name"], ALL_POINTS)
        assert [list(point) for point in plan.frontier(points)] == case["frontier"]


def test_recorded_cases_cover_what_they_should() -> None:
    """The data holds ties, plans of every choice, refusals and frontiers."""
    assert len(GOLDEN["cases"]) == 21
    chosen = {c for case in GOLDEN["cases"] for s in case["solves"] for c in s.get("choices", ())}
    assert chosen == {"keep", "recompute", "offload", "selective", "offload+selective",
                      "attention", "offload+attention"}
    assert any("smallest_budget_bytes" in s for case in GOLDEN["cases"] for s in case["solves"])
    assert all(math.isfinite(s.get("time_s", 0)) for case in GOLDEN["cases"]
               for s in case["solves"])
    assert sum(case["frontier"] is not None for case in GOLDEN["cases"]) >= 15


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    os.makedirs(os.path.dirname(DATA), exist_ok=True)
    with open(DATA, "w", encoding="utf-8") as out:
        json.dump(_record(), out, separators=(",", ":"))
        out.write("\n")
