"""The planner's fifth choice, offload+selective: a block checkpointed under
the selective policy, the outputs it saves (matmuls, convolutions,
attention) and its input sent to host memory through the offload engine."""
import pytest
import torch
import torch.nn as nn

import matepoint
from matepoint import _C
from matepoint._planning.planner import BlockProfile, Plan, PolicyFigures, planned_choice, predict, solve
import sim
from conftest import OpCounter, assert_bitwise_equal

MIB = 1 << 20
BATCH, WIDTH = 32, 64


def chain(depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        for _ in range(depth)])


def gradients(model: nn.Module, x: torch.Tensor):
    grads = [x.grad] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def buffers_taken() -> int:
    stats = matepoint.pool_stats()
    return stats["hits"] + stats["misses"]


def profile(selective_s: float = 3.2e-3, copy_s: float = 1e-4) -> BlockProfile:
    """A block whose matmul outputs are 3/8 of what it saves: 1 MiB in,
    8 MiB saved, selective keeps 3 MiB (its input included)."""
    return BlockProfile(1e-3, 2e-3, copy_s, MIB, 8 * MIB, MIB, 0, 0,
                        policies={"selective": PolicyFigures(selective_s, 3 * MIB)})


@pytest.mark.parametrize("gpu", ["offload", "simulated"])
def test_offload_selective_moves_saved_outputs_and_gives_exact_gradients(request,
                                                                          gpu: str) -> None:
    """On the simulated GPU (keeping up, or as far behind as CUDA allows):
    each offload+selective block sends its input and its two linears'
    outputs through the pool, lets the second's go when its forward ends
    (the recompute stops before it), brings the rest back as backward needs
    them, recomputes its GELU but no matmul, no input is prefetched across
    it (its output comes back when its recompute begins), and the gradients
    are bit-identical."""
    request.getfixturevalue(gpu)
    model, x = chain(4), torch.randn(BATCH, WIDTH)
    x_leaf = x.clone().requires_grad_(True)
    model(x_leaf).square().mean().backward()
    expected = gradients(model, x_leaf)

    choices = ["offload+selective", "offload", "offload+selective", "keep"]
    Plan(choices, [profile()] * 4, 64 * MIB, 1024, True, 0, 0.0).apply(model)
    assert [planned_choice(b) for b in model] == choices
    start, copies = buffers_taken(), _C._sim_stats()["copies_run"]
    prefetched, in_place = (matepoint.pool_stats()[key] for key in ("prefetched", "used_in_place"))
    x_leaf = x.clone().requires_grad_(True)
    loss = model(x_leaf).square().mean()
    taken = buffers_taken() - start
    # an input per offloading block, and two linear outputs per offload+selective one
    assert taken == 3 + 2 * 2
    input_bytes, first_output_bytes = BATCH * WIDTH * 4, BATCH * 4 * WIDTH * 4
    if gpu == "offload":    # all but the second linears' outputs held until backward
        assert matepoint.pool_stats()["bytes_in_use"] == 3 * input_bytes + 2 * first_output_bytes
    with OpCounter() as backward:
        loss.backward()
    # the offload block recomputes its first linear (nothing saves the second's output)
    assert backward.counts["gelu"] == 3 and backward.counts.get("addmm", 0) == 1
    # all out (a GPU far behind runs them only now), and all but the second
    # linears' outputs back; far behind, backward finds the window's spans
    # still on the device and uses the four it needs there, copying none
    # (the let-go outputs, never needed, are not counted as used)
    sim.finish()
    in_place = matepoint.pool_stats()["used_in_place"] - in_place
    assert in_place == (0 if gpu == "offload" else 4)
    back = taken - 2 - in_place
    assert _C._sim_stats()["copies_run"] - copies == taken + back
    # no input fetched ahead across blocks: only each block's first linear
    # output, when its recompute begins (far behind: used in place, or fetched at need)
    assert matepoint.pool_stats()["prefetched"] - prefetched == (2 if gpu == "offload" else 0)
    assert matepoint.pool_stats()["bytes_in_use"] == 0
    assert_bitwise_equal(expected, gradients(model, x_leaf))


def test_offload_selective_is_planned_at_its_modelled_cost() -> None:
    """Where little may be held, offloading the selective saves is the
    fastest plan; its copy is the input's scaled by the bytes it moves, and
    it holds nothing after its forward."""
    profiles = [profile()] * 4
    plan = solve(profiles, 10 * MIB, 1024, True)
    assert "offload+selective" in plan.choices, plan.choices
    copy_s = 1e-4 * 3   # 3 MiB where the input's 1 MiB takes 0.1 ms
    peak, seconds = predict(profiles[:1], ["offload+selective"], 1024, True)
    assert seconds == pytest.approx(3.2e-3 + max(0.0, copy_s - 1e-3) + copy_s, rel=1e-12)
    assert peak == profiles[0].checkpoint_work_bytes()
    rows = plan.table().splitlines()[2:]
    for row, choice in zip(rows, plan.choices):
        assert row.split()[1] == choice
        if choice == "offload+selective":
            assert row.split()[2] == "0.00"     # held
    # a copy slower than the recompute it saves: whole-block offload again
    slow = solve([profile(copy_s=2e-3)] * 4, 11 * MIB, 1024, True)
    assert "offload+selective" not in slow.choices and "offload" in slow.choices


def test_offload_selective_is_never_planned_without_offload() -> None:
    """offload=False (a CPU batch, or the offload option off) leaves it out
    of the plan, the smallest budget and the frontier, exactly as offload."""
    profiles = [profile()] * 4
    assert "offload+selective" in solve(profiles, 10 * MIB, 1024, True).choices
    without = solve(profiles, 12 * MIB, 1024, True, offload=False)
    assert not {"offload", "offload+selective"} & set(without.choices)
    with pytest.raises(matepoint.PlanError) as caught:
        solve(profiles, 10 * MIB, 1024, True, offload=False)
    least = caught.value.smallest_budget_bytes
    assert least > 10 * MIB
    assert not {"offload", "offload+selective"} & set(
        solve(profiles, least, 1024, True, offload=False).choices)
    assert all(seconds < 1 for _, seconds in without.frontier())
    assert min(peak for peak, _ in without.frontier()) == least


def test_cpu_plan_never_offloads_the_selective_saves() -> None:
    """matepoint.plan on CPU tensors (no simulated GPU): no offload at all."""
    model, x = chain(4), torch.randn(BATCH, WIDTH)
    plan = matepoint.plan(model, x, budget_bytes=64 * MIB, repeats=1, unit_bytes=1024)
    assert not plan.offload
    with pytest.raises(matepoint.PlanError) as caught:
        solve(plan.profiles, 1024, 1024, True, offload=False)
    tight = solve(plan.profiles, caught.value.smallest_budget_bytes, 1024, True, offload=False)
    assert not {"offload", "offload+selective"} & set(tight.choices)


def test_save_and_load_keep_the_choice(tmp_path) -> None:
    plan = solve([profile()] * 4, 10 * MIB, 1024, True)
    assert "offload+selective" in plan.choices
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = Plan.load(str(path))
    assert loaded == plan and loaded.rows() == plan.rows()
    model = chain(4)
    loaded.apply(model)
    assert [planned_choice(b) for b in model] == plan.choices
