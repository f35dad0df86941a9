"""Plan files: what :meth:`Plan.save` writes loads back equal, and files an
earlier matepoint wrote (``matepoint-plan-1``: each policy's figures as
flat profile fields) load unchanged, upgraded once by :meth:`Plan.load`.

tests/data/plan-1-*.json were written by matepoint at commit 7d704a1: one
by ``matepoint.plan`` on a three-block attention chain (CPU), one solved
from hand-made profiles with every policy measured and offload chosen."""
from __future__ import annotations

import json
import os
from typing import Any, Dict

import pytest

from matepoint._planning.planner import BlockProfile, Plan, PolicyFigures, solve

DATA = os.path.join(os.path.dirname(__file__), "data")
MIB = 1 << 20
PLAN_1_FILES = ["plan-1-measured.json", "plan-1-synthetic.json"]


def plan_1(name: str) -> Dict[str, Any]:
    with open(os.path.join(DATA, name), encoding="utf-8") as file:
        return json.load(file)


@pytest.mark.parametrize("name", PLAN_1_FILES)
def test_a_plan_1_file_loads_with_every_figure_in_its_place(name: str) -> None:
    data = plan_1(name)
    plan = Plan.load(os.path.join(DATA, name))
    assert plan.choices == data["choices"] and plan.budget_bytes == data["budget_bytes"]
    for loaded, saved in zip(plan.profiles, data["profiles"]):
        for field in ("forward_s", "backward_s", "copy_s", "input_bytes", "activation_bytes",
                      "output_bytes", "forward_peak_bytes", "backward_peak_bytes",
                      "recompute_s", "offload_stay_bytes"):
            assert getattr(loaded, field) == saved[field], field
        for policy in ("selective", "attention"):
            figures = loaded.policies.get(policy)
            seconds, held, stay = (saved[f"{policy}{suffix}"]
                                   for suffix in ("_s", "_bytes", "_stay_bytes"))
            if seconds is None:
                assert figures is None
            else:
                # a null stay meant that nothing stays
                assert (figures.seconds, figures.held_bytes, figures.stay_bytes) == \
                    (seconds, held, 0 if stay is None else stay)


@pytest.mark.parametrize("name", PLAN_1_FILES)
def test_a_plan_1_file_plans_and_predicts_as_it_did(name: str) -> None:
    """Its profiles solve to its choices again, with the peak and the time
    it recorded, bit for bit."""
    plan = Plan.load(os.path.join(DATA, name))
    again = solve(plan.profiles, plan.budget_bytes, plan.unit_bytes, plan.pipeline, plan.offload)
    assert again.choices == plan.choices
    assert (again.predicted_peak_bytes, again.predicted_time_s) == \
        (plan.predicted_peak_bytes, plan.predicted_time_s)


@pytest.mark.parametrize("name", PLAN_1_FILES)
def test_an_upgraded_plan_saves_as_plan_2_and_loads_equal(tmp_path, name: str) -> None:
    plan = Plan.load(os.path.join(DATA, name))
    path = tmp_path / "plan.json"
    plan.save(str(path))
    data = json.loads(path.read_text())
    assert data["format"] == "matepoint-plan-2"
    assert not {"selective_s", "attention_bytes"} & set(data["profiles"][0])
    assert Plan.load(str(path)) == plan


def test_the_synthetic_file_holds_each_policy_where_it_was() -> None:
    """Blocks 0 and 2 measured both policies (stays given), 1 and 3 only
    selective (written null for attention)."""
    plan = Plan.load(os.path.join(DATA, "plan-1-synthetic.json"))
    both = BlockProfile(1e-3, 2e-3, 1e-4, MIB, 10 * MIB, MIB, 0, 0, 4e-3, MIB // 4, {
        "selective": PolicyFigures(3.4e-3, 4 * MIB, MIB // 2),
        "attention": PolicyFigures(3.5e-3, 2 * MIB, MIB // 4)})
    selective = BlockProfile(1e-3, 2e-3, 1e-4, MIB, 10 * MIB, MIB, 0, 0, 4e-3, None, {
        "selective": PolicyFigures(3.4e-3, 4 * MIB)})
    assert plan.profiles == [both, selective, both, selective]
    assert plan.choices == ["offload+attention", "offload+selective", "offload+attention", "keep"]


def test_a_plan_1_file_from_before_attention_loads(tmp_path) -> None:
    """Files older still had no attention fields at all: attention loads
    as not measured, and the plan solves to the same choices."""
    data = plan_1("plan-1-synthetic.json")
    for fields in data["profiles"]:
        del fields["attention_s"], fields["attention_bytes"], fields["attention_stay_bytes"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    loaded = Plan.load(str(path))
    assert all(set(p.policies) == {"selective"} for p in loaded.profiles)
    assert loaded.profiles[0].policies["selective"].held_bytes == 4 * MIB
    assert "attention" not in "".join(solve(loaded.profiles, loaded.budget_bytes,
                                            loaded.unit_bytes, True).choices)
