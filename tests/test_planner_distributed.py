"""One plan per job: on 2 gloo ranks (spawned CPU processes) whose blocks run
at different speeds, matepoint.plan and matepoint.apply give every rank the
same plan at every budget."""
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import matepoint
from matepoint._planning.planner import BlockProfile, PolicyFigures, predict, reduce_profiles

WORLD = 2
DEPTH = 6


class Slow(nn.Module):
    """A block that is slow on one rank only: timings differ per process."""

    def __init__(self, width: int, slow_on_rank: int) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                   nn.Linear(4 * width, width))
        self.slow_on_rank = slow_on_rank

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == self.slow_on_rank:
            time.sleep(0.05)
        return self.inner(x)


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    # rank 0 finds the even blocks slow, rank 1 the odd ones
    return nn.Sequential(*[Slow(64, i % WORLD) for i in range(DEPTH)])


def rank_profiles(rank: int):
    """Figures that differ per rank; the attention policy measured on rank 0 only."""
    policies = {"selective": PolicyFigures(3.4e-3, 4 << 20, rank << 20)}
    if rank == 0:
        policies["attention"] = PolicyFigures(3e-3, 1 << 21)
    return [BlockProfile(1e-3 * (1 + rank), 2e-3 * (2 - rank), 1e-4, 1 << 20, (10 + rank) << 20,
                         1 << 20, 5 << 20, (6 - rank) << 20, 4e-3, policies=policies)]


def worker(rank: int, store: str, budgets, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    try:
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
        model = chain()
        plans = [matepoint.plan(model, x, budget_bytes=b, unit_bytes=1024, repeats=1).choices
                 for b in budgets]
        matepoint.apply(model, budget_bytes=budgets[len(budgets) // 2], unit_bytes=1024)
        for _ in range(2):
            model(x.requires_grad_()).sum().backward()
        plans.append(matepoint.planned(model).choices)
        results[rank] = plans, reduce_profiles(rank_profiles(rank))
    finally:
        dist.destroy_process_group()
    os._exit(0)     # no interpreter finalization after gloo: see tests/test_recipes.py


def test_every_rank_gets_the_same_plan_at_every_budget(tmp_path) -> None:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    profiles = matepoint.plan(chain(), x, budget_bytes=1 << 30, unit_bytes=1024,
                              repeats=1).profiles
    kept, _ = predict(profiles, ["keep"] * DEPTH, 1024, True)
    recomputed, _ = predict(profiles, ["recompute"] * DEPTH, 1024, True)
    # from all kept down to near all recomputed
    budgets = [recomputed + (kept - recomputed) * k // 5 + 8192 for k in range(5, -1, -1)]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(str(tmp_path / "store"), budgets, results), nprocs=WORLD)
        plans = {rank: result[0] for rank, result in results.items()}
        reduced = {rank: result[1] for rank, result in results.items()}
    assert plans[0] == plans[1], plans
    # each figure its max; the one rank 1 did not measure unmeasured on both
    assert reduced[0] == reduced[1] == [BlockProfile(
        2e-3, 4e-3, 1e-4, 1 << 20, 11 << 20, 1 << 20, 5 << 20, 6 << 20, 4e-3,
        policies={"selective": PolicyFigures(3.4e-3, 4 << 20, 1 << 20)})]
    # the budgets really trade: the plans differ from one another
    assert len({tuple(p) for p in plans[0]}) >= 3, plans[0]


def lone_worker(rank: int, store: str, results) -> None:
    """Both ranks plan on a subgroup; then rank 0 alone calls plan()."""
    import datetime
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=4))
    try:
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
        # a new group's timeout is its own (torch's default: 30 minutes)
        group = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=4))
        together = matepoint.plan(chain(), x, budget_bytes=1 << 30, unit_bytes=1024, repeats=1,
                                  group=group).choices
        if rank == 0:
            try:
                matepoint.plan(chain(), x, budget_bytes=1 << 30, unit_bytes=1024, repeats=1,
                               group=group)
                results[rank] = together, "no error"
            except RuntimeError as error:
                results[rank] = together, str(error)
        else:
            results[rank] = together, None
            # stay in the group until rank 0 has its answer
            deadline = time.monotonic() + 60
            while 0 not in results and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        dist.destroy_process_group()
    os._exit(0)     # no interpreter finalization after gloo: see tests/test_recipes.py


def test_a_rank_that_does_not_call_is_named_within_the_timeout(tmp_path) -> None:
    """plan() is a collective over its group: called on one rank only (plan
    on rank 0, broadcast), it raises naming the cause instead of hanging."""
    started = time.monotonic()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(lone_worker, args=(str(tmp_path / "store"), results), nprocs=WORLD)
        results = dict(results)
    assert results[0][0] == results[1][0]   # with group=, one plan for both
    message = results[0][1]
    assert "matepoint.plan is a collective over the process group: every rank of the group " \
           "must call it" in message, message
    assert "Rank 1 failed to pass monitoredBarrier" in message, message    # gloo names it
    assert time.monotonic() - started < 120


def test_group_must_be_a_process_group() -> None:
    with pytest.raises(TypeError, match="matepoint.plan: group must be a torch.distributed "
                                        "process group or None"):
        matepoint.plan(chain(), torch.randn(4, 64), budget_bytes=1 << 30, group="all")
    with pytest.raises(TypeError, match="matepoint.enable: group must be"), \
            pytest.warns(FutureWarning, match="matepoint.apply"):
        matepoint.enable(nn.Linear(2, 2), budget_bytes=1 << 30, group=0)
    with pytest.raises(TypeError, match="matepoint.apply: group must be"):
        matepoint.apply(nn.Sequential(nn.Linear(2, 2)), 1 << 30, group=0)
