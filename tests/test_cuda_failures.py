"""Any CUDA runtime call can fail: a sweep over every kind of call and every
position it takes in each phase of a two-region training step on the
simulated GPU (and in the engine letting go of its device). The failed
phase either raises a clear Python error (naming the call, or out of
memory) or takes its documented fallback with exact gradients; either way
the pool and the window end empty, no CUDA error is left for torch to find
(no kernel launch finds one), every event and stream is given back once the
engine lets go of the device, and the next step is exact."""
from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn

import matepoint
import sim
from matepoint import _C

from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step
from test_gpu_timeline import TwoDevices

WIDTH, BATCH, REGIONS = 64, 32, 2       # 8 KiB inputs
FAILURE = 1                             # cudaErrorInvalidValue: a failure, not an answer
# cudaGetLastError reads and clears; nothing can make it fail
NEVER_FAILS = {"cudaGetLastError"}
Outcome = Tuple[Optional[List[torch.Tensor]], Optional[str]]


def fresh_engine() -> None:
    """The engine lets go of its devices (streams, events, pool) and takes
    the simulated runtime again: the next step creates them anew."""
    _C._simulate_cuda(False)
    _C._simulate_cuda(True)


def step(model: nn.Module, x: torch.Tensor) -> Outcome:
    """The step's gradients, or what it raised (as text: the exception's
    frames would keep the step's graph, and its offloaded inputs, alive)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # the pageable fallback's
            _, grads = train_step(model, x, matepoint.checkpoint)
    except (RuntimeError, MemoryError) as error:   # torch.OutOfMemoryError is a RuntimeError
        return None, f"{type(error).__name__}: {error}"
    return [g.detach().clone() for g in grads], None


def let_go() -> Outcome:
    """The engine gives its device back: streams, events, pinned buffers."""
    try:
        fresh_engine()
    except RuntimeError as error:
        return None, f"{type(error).__name__}: {error}"
    return None, None


def fresh_memory_step(model: nn.Module, x: torch.Tensor) -> Outcome:
    """A segment of its own for a large tensor (cudaMalloc), returned by
    matepoint's allocator once the tensor died (cudaFree); then a step."""
    try:
        big = torch.empty(64 << 20, dtype=torch.uint8)
    except torch.OutOfMemoryError as error:    # its cudaMalloc failed
        return None, f"{type(error).__name__}: {error}"
    del big
    library, _, _ = sim._attach()
    library.matepoint_reset()
    return step(model, x)


def let_go_after_a_step(model: nn.Module, x: torch.Tensor) -> Outcome:
    return let_go()


def out_of_device_memory(model: nn.Module, x: torch.Tensor) -> Outcome:
    """A request larger than any cached segment (cudaMalloc) that finds no
    memory even after the cache was released (cudaFree, then the free and
    total bytes for the message: cudaMemGetInfo) raises
    torch.OutOfMemoryError; the next one gets memory again."""
    _C._sim_fail("cudaMalloc", 0, 1 << 40, 2)     # cudaErrorMemoryAllocation, every time
    try:
        torch.empty(64 << 20, dtype=torch.uint8)
    except torch.OutOfMemoryError:
        pass
    finally:
        _C._sim_fail("cudaMalloc", 0, 0, 0)
    big = torch.empty(64 << 20, dtype=torch.uint8)
    del big
    return step(model, x)


def completion_record_fails(model: nn.Module, x: torch.Tensor) -> Outcome:
    """The copy out is queued but its completion event cannot be recorded:
    the copy-out stream is synchronized instead (cudaStreamSynchronize)
    and the checkpoint raises."""
    hidden = x.detach().clone().requires_grad_(True) * 1.0
    _C._sim_fail("cudaEventRecord", 1, 1, FAILURE)    # the second: the copy's own
    try:
        matepoint.checkpoint(nn.Linear(WIDTH, WIDTH), hidden)
    except RuntimeError as error:
        if "cudaEventRecord" not in str(error):
            return None, f"{type(error).__name__}: {error}"
    finally:
        _C._sim_fail("cudaEventRecord", 0, 0, 0)
    del hidden
    return step(model, x)


@dataclass
class Phase:
    name: str
    model: Callable[[], nn.Module]
    action: Callable[[nn.Module, torch.Tensor], Outcome] = step    # what is swept
    options: dict = field(default_factory=dict)
    step_first: bool = False      # a step before the action (not swept) gives it work
    # the kinds of call swept (None: every one the action makes): a phase
    # that repeats another's step sweeps only the calls it adds
    kinds: Optional[frozenset] = None


PHASES = [
    Phase("one GPU", lambda: MLP(WIDTH, REGIONS)),
    Phase("two GPUs", lambda: TwoDevices(depth=REGIONS),
          kinds=frozenset({"cudaSetDevice", "cudaGetDevice"})),
    Phase("fresh device memory", lambda: MLP(WIDTH, REGIONS), action=fresh_memory_step,
          kinds=frozenset({"cudaMalloc", "cudaFree"})),
    Phase("pageable host memory", lambda: MLP(WIDTH, REGIONS),
          options=dict(pool_limit_bytes=BATCH * WIDTH * 4)),
    Phase("letting go", lambda: MLP(WIDTH, REGIONS), action=let_go_after_a_step,
          step_first=True),
    Phase("out of device memory", lambda: MLP(WIDTH, REGIONS), action=out_of_device_memory,
          kinds=frozenset({"cudaMalloc", "cudaFree", "cudaMemGetInfo"})),
    Phase("completion record fails", lambda: MLP(WIDTH, REGIONS),
          action=completion_record_fails, kinds=frozenset({"cudaStreamSynchronize"})),
]
# in the runtime table, but called by neither the engine nor the allocator
# since a block whose event cannot be recorded is deferred instead of the
# whole device waited for (csrc/alloc; tests/c/test_alloc.c)
SWEPT_IN_C = {"cudaDeviceSynchronize"}


def calls() -> Dict[str, int]:
    return dict(_C._sim_stats()["calls"])


def run(phase: Phase, model: nn.Module, x: torch.Tensor, failing: Optional[Tuple[str, int]]
        ) -> Tuple[Outcome, Dict[str, int]]:
    """The phase on a fresh engine, with call #position of `kind` failing:
    its outcome and the calls its action made."""
    fresh_engine()
    if phase.step_first:
        step(model, x)
        sim.finish()
        gc.collect()
    before = calls()
    if failing is not None:
        _C._sim_fail(failing[0], failing[1], 1, FAILURE)
    try:
        outcome = phase.action(model, x)
    finally:
        if failing is not None:
            _C._sim_fail(failing[0], 0, 0, 0)
    return outcome, {kind: count - before.get(kind, 0) for kind, count in calls().items()}


def settle(where: str, baseline: Dict[str, int]) -> List[str]:
    """What the failed phase left once the GPU caught up."""
    sim.finish()
    gc.collect()
    problems = []
    stats = matepoint.pool_stats()
    if stats["bytes_in_use"] or stats["device_bytes_in_flight"] or _C._offload_copies():
        problems.append(f"{where}: the pool or the window is not empty: {stats}")
    if _C._sim_peek_last_error() != 0:
        problems.append(f"{where}: CUDA error {_C._sim_peek_last_error()} left for torch")
        _C._sim_fail("cudaGetLastError", 0, 0, 0)
    _C._simulate_cuda(False)     # the engine gives its streams and events back
    # the device allocator keeps completed events for reuse, as many as were
    # ever pending at once: not the engine's to give back
    sim.empty_device_cache()
    counts = _C._sim_stats()
    for name in ("events_live", "streams_live"):
        extra = counts[name] - baseline[name]
        if extra != 0:
            problems.append(f"{where}: {extra} {name.split('_')[0]} not given back")
        baseline[name] = counts[name]
    _C._simulate_cuda(True)
    return problems


def clear_message(error: str, kind: str) -> bool:
    """The error names the call (cudaStreamCreate for
    cudaStreamCreateWithFlags) or says the device is out of memory."""
    return kind.replace("WithFlags", "") in error or "out of memory" in error.lower()


def sweep(phase: Phase, model: nn.Module, x: torch.Tensor, expected: List[torch.Tensor]
          ) -> Tuple[Dict[str, int], List[str]]:
    (grads, error), made = run(phase, model, x, None)
    assert error is None, f"{phase.name}: the phase itself raised {error}"
    swept = {kind: count for kind, count in made.items() if count > 0 and
             kind not in NEVER_FAILS and (phase.kinds is None or kind in phase.kinds)}
    sim.finish()
    gc.collect()
    _C._simulate_cuda(False)
    sim.empty_device_cache()
    baseline = dict(_C._sim_stats())     # with the engine holding no device
    _C._simulate_cuda(True)
    problems = []
    for kind, count in sorted(swept.items()):
        for position in range(count):
            where = f"{phase.name}: {kind} #{position} of {count} failing"
            launch_errors = _C._sim_stats()["launch_errors"]
            (grads, error), _ = run(phase, model, x, (kind, position))
            if error is not None and not clear_message(error, kind):
                problems.append(f"{where}: unclear error {error}")
            if grads is not None:
                try:
                    assert_bitwise_equal(grads, expected)
                except AssertionError:
                    problems.append(f"{where}: the fallback gave other gradients")
            if _C._sim_stats()["launch_errors"] != launch_errors:
                problems.append(f"{where}: a kernel launch found the CUDA error left behind "
                                "(torch would raise it from an unrelated kernel)")
            problems += settle(where, baseline)
            (grads, error), _ = run(Phase("next", phase.model), model, x, None)
            if error is not None or grads is None:
                problems.append(f"{where}: the next step raised {error}")
            else:
                try:
                    assert_bitwise_equal(grads, expected)
                except AssertionError:
                    problems.append(f"{where}: the next step gave other gradients")
            sim.finish()
            gc.collect()
    return swept, problems


@pytest.mark.parametrize("phase", PHASES, ids=[p.name for p in PHASES])
def test_every_cuda_call_can_fail_anywhere(simulated, phase: Phase) -> None:
    matepoint.set_options(**phase.options)
    torch.manual_seed(0)
    model, x = phase.model(), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    expected = [g.detach().clone() for g in expected]
    swept, problems = sweep(phase, model, x, expected)
    assert swept, f"{phase.name}: no CUDA call was made"
    assert problems == [], "\n".join(problems)


def test_every_kind_of_call_failed_somewhere(simulated) -> None:
    """The phases above reach every entry point of the runtime table."""
    kinds = set()
    for phase in PHASES:
        matepoint.set_options(**phase.options)
        model, x = phase.model(), torch.randn(BATCH, WIDTH)
        _, made = run(phase, model, x, None)
        sim.finish()
        gc.collect()
        kinds |= {kind for kind, count in made.items() if count > 0}
    every = {k for k in calls() if k not in NEVER_FAILS | SWEPT_IN_C}
    assert every - kinds == set()
