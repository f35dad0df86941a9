"""Every wait and record_stream the offload engine issues is needed, proven
on the simulated GPU: each scenario is run once as is, counting the engine's
cudaStreamWaitEvent and record_stream calls, then once per call with that
one call dropped (it succeeds and does nothing). Each dropped call must show
up BY DATA: gradients that differ from the run without offload (poison read
by a copy or kernel that ran too early), or poison the harness reports.

A call whose removal changes nothing is either redundant (remove it from the
engine, saying why) or a blind spot of the simulator (close it): the test
names it by scenario, kind and position."""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, List, Tuple

import pytest
import torch
import torch.nn as nn

import matepoint
import sim
from matepoint import _C

from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step

WIDTH, BATCH, DEPTH = 32, 16, 5
WAIT = "cudaStreamWaitEvent"
RECORD = "record_stream"


def plain(fn, x):
    return matepoint.checkpoint(fn, x)


def on_alternate_streams() -> Callable:
    """Regions alternate between two side streams: each input was made on
    the other stream, so its memory returns to a pool that never waited
    for the copy out unless the engine records it there."""
    streams = sim.side_streams()
    calls = [0]

    def wrap(fn, x):
        stream = streams[calls[0] % 2]
        calls[0] += 1
        with sim.stream(0, stream):
            return matepoint.checkpoint(fn, x)
    return wrap


@dataclass
class Scenario:
    name: str
    options: dict
    wrap: Callable[[], Callable]
    backwards: int = 1          # backward passes over one graph (retain_graph)


SCENARIOS = [
    Scenario("prefetch", dict(offload_window=2, prefetch_depth=1), lambda: plain),
    Scenario("deep prefetch, window 1", dict(offload_window=1, prefetch_depth=2), lambda: plain),
    Scenario("no pipeline", dict(offload_window=2, pipeline=False), lambda: plain),
    Scenario("side streams", dict(offload_window=1), on_alternate_streams),
    Scenario("two backwards", dict(offload_window=2), lambda: plain, backwards=2),
]


def step(model: nn.Module, x: torch.Tensor, wrap: Callable, backwards: int
         ) -> List[torch.Tensor]:
    """train_step with `backwards` backward passes over one graph: the
    gradients of the last one."""
    if backwards == 1:
        return train_step(model, x, wrap)[1]
    torch.manual_seed(0)
    leaf = x.detach().clone().requires_grad_(True)
    loss = (model(leaf, wrap).float() ** 2).mean()
    for index in range(backwards):
        model.zero_grad(set_to_none=True)
        leaf.grad = None
        loss.backward(retain_graph=index + 1 < backwards)
    return [leaf.grad] + [p.grad for p in model.parameters()]


def counts() -> Tuple[int, int]:
    return _C._sim_stats()["calls"][WAIT], _C._sim_records_made()


def run(scenario: Scenario, model: nn.Module, x: torch.Tensor) -> Tuple[List, int, int]:
    """One offloaded step: its gradients (None when it raised) and the
    engine's waits and records it made."""
    waits, records = counts()
    try:
        grads = step(model, x, scenario.wrap(), scenario.backwards)
        grads = [g.detach().clone() if g is not None else None for g in grads]
    except RuntimeError:
        grads = None
    sim.finish()
    gc.collect()
    after = counts()
    return grads, after[0] - waits, after[1] - records


def same(grads, expected) -> bool:
    if grads is None:
        return False
    try:
        assert_bitwise_equal(grads, expected)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_every_wait_and_record_is_needed(simulated, scenario: Scenario) -> None:
    matepoint.set_options(**scenario.options)
    torch.manual_seed(0)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    expected = step(model, x, no_checkpoint, scenario.backwards)
    expected = [g.detach().clone() for g in expected]
    grads, waits, records = run(scenario, model, x)
    assert same(grads, expected), "the step itself is not exact"
    assert waits > 0
    harmless = []
    for kind, total in ((WAIT, waits), (RECORD, records)):
        for index in range(total):
            _C._sim_drop(kind, index, 1)
            try:
                dropped, _, _ = run(scenario, model, x)
            finally:
                _C._sim_drop(kind, 0, 0)
            if same(dropped, expected):
                harmless.append(f"{kind} #{index} of {total}")
    assert harmless == [], (
        f"{scenario.name}: dropping these changes no data (redundant, or a blind spot of "
        f"the simulator): {harmless}")
