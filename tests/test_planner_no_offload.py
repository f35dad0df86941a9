"""matepoint.plan never chooses an offload that cannot run: inputs not on a
GPU (CPU tensors, no simulated GPU) or the offload option off. It keeps or recomputes
every block and says so."""
import dataclasses

import pytest
import torch
import torch.nn as nn

import matepoint
from matepoint._planning.planner import solve

MIB = 1 << 20


def chain(depth: int = 6, width: int = 128) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        for _ in range(depth)])


def profiled(model, x, budget_bytes: int = 64 * MIB):
    return matepoint.plan(model, x, budget_bytes=budget_bytes, repeats=1, unit_bytes=1024,
                          bandwidth_bytes_per_s=1e9)


def smallest(profiles, offload: bool) -> int:
    with pytest.raises(matepoint.PlanError) as caught:
        solve(profiles, 1024, 1024, True, offload=offload)
    return caught.value.smallest_budget_bytes


def test_plan_on_the_cpu_keeps_or_recomputes_and_says_why(every_tensor_moves) -> None:
    from matepoint import _C
    assert _C._offload_device_type() == "cuda"
    # 32 KiB inputs; off the GPU the engine would move none of them, and the
    # profiles say so
    model, x = chain(), torch.randn(64, 128)
    plan = profiled(model, x)
    assert not plan.offload and "not on a GPU" in plan.note
    assert plan.note in str(plan).splitlines()[0]
    assert all(p.offload_stay_bytes == p.input_bytes for p in plan.profiles)
    # the same profiles as a GPU run would give them, every input movable: an
    # offload would lower the floor
    plan.profiles = [dataclasses.replace(p, offload_stay_bytes=0, policies={
        name: dataclasses.replace(figures, stay_bytes=0) for name, figures in p.policies.items()})
        for p in plan.profiles]
    # the smallest budget without offload, and one a smaller budget needs offload for
    least, least_with_offload = smallest(plan.profiles, False), smallest(plan.profiles, True)
    assert least_with_offload < least
    fitted = solve(plan.profiles, least, 1024, True, offload=False, note=plan.note)
    assert "offload" not in fitted.choices and fitted.predicted_peak_bytes <= least
    assert {"keep", "recompute"} <= set(fitted.choices)
    assert all(seconds < 1e3 for _, seconds in fitted.frontier())
    with pytest.raises(matepoint.PlanError):
        solve(plan.profiles, least - 1024, 1024, True, offload=False)
    # plan() itself, at a budget only an offload could meet: no offload chosen
    budget = (least + least_with_offload) // 2
    try:
        tight = profiled(model, x, budget)
    except matepoint.PlanError as error:
        assert error.smallest_budget_bytes > budget
    else:
        assert "offload" not in tight.choices, tight


def test_plan_with_the_offload_option_off_never_offloads(offload) -> None:
    matepoint.set_options(offload=False)
    plan = profiled(chain(), torch.randn(64, 128))
    assert not plan.offload and "offload option is off" in plan.note


def test_plan_offloads_where_it_can_run(offload_heap_memory) -> None:
    model, x = chain(), torch.randn(64, 128)
    plan = profiled(model, x)
    assert plan.offload and plan.note == ""
    budget = smallest(plan.profiles, True)
    choices = solve(plan.profiles, budget, 1024, True).choices
    assert {"offload", "offload+selective"} & set(choices), choices
