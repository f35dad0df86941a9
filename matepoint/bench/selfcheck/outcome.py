"""A check's outcome: PASS, FAIL (with the reason) or SKIP (with why it
could not run here), its figures and seconds; the time limit each check
runs under, and the options a check changes, put back after it."""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class CheckFailed(Exception):
    """The claim does not hold here: the message says how."""


class CheckSkipped(Exception):
    """The check cannot run here: the message says why."""


class _TimedOut(Exception):
    """A check ran past its time limit."""


@dataclasses.dataclass
class Result:
    """One check's outcome. ``figures`` are what it measured (plain values)."""
    name: str
    group: str
    claim: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    figures: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Check:
    """A claim and the function that checks it on a target: it returns its
    figures, or raises CheckFailed / CheckSkipped. ``needs_gpu``: skipped
    without one; ``quick``: part of ``--quick``; ``limit_s``: its time limit."""
    name: str
    group: str
    claim: str
    run: Callable[[Any], Dict[str, Any]]
    needs_gpu: bool = True
    quick: bool = True
    limit_s: int = 60


def _alarm(signum: int, frame: Any) -> None:
    raise _TimedOut()


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """SIGALRM after ``seconds`` (on the main thread only: elsewhere, and
    inside a C call that does not return, the limit cannot interrupt; the
    caller's process limit is the backstop)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_check(check: Check, target: Any, skip_reason: Optional[str] = None) -> Result:
    """Runs ``check`` on ``target`` (in its session) under its time limit;
    any error becomes a FAIL naming it, so one check never stops the rest."""
    result = Result(check.name, check.group, check.claim, PASS)
    if skip_reason is not None:
        result.status, result.reason = SKIP, skip_reason
        return result
    started = time.perf_counter()
    caught: List[warnings.WarningMessage] = []
    try:
        with _time_limit(check.limit_s), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session = target.session(check.name) if target is not None else \
                contextlib.nullcontext()
            with session:
                result.figures = check.run(target) or {}
    except CheckSkipped as skipped:
        result.status, result.reason = SKIP, str(skipped)
    except CheckFailed as failed:
        result.status, result.reason = FAIL, str(failed)
    except _TimedOut:
        result.status, result.reason = FAIL, f"ran past its time limit of {check.limit_s} s"
    except Exception as error:  # noqa: BLE001 (every error is a finding: reported, not raised)
        result.status, result.reason = FAIL, f"{type(error).__name__}: {error}"
        result.figures = {"traceback": traceback.format_exc(limit=8)}
    result.seconds = round(time.perf_counter() - started, 2)
    # what matepoint warned meanwhile (a fallback to pageable memory, a
    # failed write) belongs to the result, not to the terminal
    said = list(dict.fromkeys(str(w.message) for w in caught
                              if issubclass(w.category, RuntimeWarning)))
    if said:
        result.figures["warnings"] = said
    return result


@contextlib.contextmanager
def options_kept(**changes: Any) -> Iterator[None]:
    """matepoint's options changed for a check, and put back after it."""
    import matepoint
    saved = matepoint.options
    matepoint.set_options(**changes)
    try:
        yield
    finally:
        matepoint.set_options(**{name: getattr(saved, name)
                                 for name in saved.__dataclass_fields__})


def first_difference(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor],
                     names: Sequence[str]) -> Optional[str]:
    """Where two lists of tensors first differ bit for bit ('the gradient
    of 3.0.weight differs: 12 of 1024 elements, by up to 0.5'), or None."""
    if len(got) != len(expected):
        return f"{len(got)} gradients, torch's checkpoint gave {len(expected)}"
    for name, mine, theirs in zip(names, got, expected):
        if mine is None or theirs is None:
            if mine is not theirs:
                return f"the gradient of {name} is missing on one side"
            continue
        if torch.equal(mine, theirs):
            continue
        if mine.shape != theirs.shape:
            return (f"the gradient of {name} has shape {tuple(mine.shape)}, "
                    f"not {tuple(theirs.shape)}")
        differ = int(mine.ne(theirs).sum())
        gap = float((mine.double() - theirs.double()).abs().nan_to_num(float("inf")).max())
        return (f"the gradient of {name} differs from torch's checkpoint's: "
                f"{differ} of {mine.numel()} elements, by up to {gap:.3g}")
    return None


def counted(before: Dict[str, Any], after: Dict[str, Any], keys: List[str]) -> Dict[str, int]:
    """The change of each pool counter of ``keys`` between two pool_stats()."""
    return {key: int(after[key]) - int(before[key]) for key in keys}
