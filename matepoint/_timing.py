"""One way to time a piece of work, for the benchmark, the planner and the
scripts in benchmarks/: the wall clock around each call, with the device's
queued work waited for on both sides (a CUDA call returns before the GPU has
run it), or CUDA events where only the GPU's own time counts.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple, TypeVar, Union

import torch

T = TypeVar("T")
DeviceLike = Union[torch.device, str, None]


def _cuda(device: DeviceLike) -> Optional[torch.device]:
    """``device`` as a CUDA device, or None where there is nothing to wait for."""
    if device is None:
        return None
    device = torch.device(device)
    return device if device.type == "cuda" else None


def timed(fn: Callable[[], T], device: DeviceLike = None) -> Tuple[float, T]:
    """Calls ``fn()`` once; returns the seconds it took and its result.

    On a CUDA ``device`` the device is synchronized before the clock starts
    (earlier work is not counted) and before it stops (the call's work is)."""
    cuda = _cuda(device)
    if cuda is not None:
        torch.cuda.synchronize(cuda)
    begun = time.perf_counter()
    result = fn()
    if cuda is not None:
        torch.cuda.synchronize(cuda)
    return time.perf_counter() - begun, result


def _event_timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds between CUDA events recorded around ``fn()`` on the current stream."""
    with torch.cuda.device(device):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_call(fn: Callable[[], object], repeats: int, warmup: int = 0,
              device: DeviceLike = None, events: bool = False) -> List[float]:
    """Seconds of each of ``repeats`` calls of ``fn()``, after ``warmup``
    calls that are not timed.

    device: a CUDA device's work is waited for around each call (see
        `timed`); None or a CPU device times the wall clock alone.
    events: on a CUDA device, time the GPU's work between two CUDA events on
        the current stream instead of the wall clock (a copy's own time,
        without the launch). Ignored elsewhere.
    Raises ValueError when ``repeats`` is below 1 or ``warmup`` below 0."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer of at least 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer of at least 0, got {warmup!r}")
    cuda = _cuda(device)
    for _ in range(warmup):
        fn()
    if events and cuda is not None:
        return [_event_timed(fn, cuda) for _ in range(repeats)]
    return [timed(fn, cuda)[0] for _ in range(repeats)]
