"""Per-call overhead of a checkpoint: the CPU cost of the machinery alone."""
from __future__ import annotations

import functools
import statistics
from typing import Callable, Dict, List

import torch

from matepoint._timing import time_call


def measure_overhead(rounds: int, calls: int) -> Dict[str, float]:
    """Per-call time (us) of forward+backward of a checkpointed tiny function:
    no checkpoint, torch's, matepoint's; interleaved rounds, medians."""
    import matepoint
    import torch.utils.checkpoint as tc

    def tiny(t: torch.Tensor) -> torch.Tensor:
        return torch.sin(t) * t

    wrappers = {"plain": lambda fn, t: fn(t),
                "torch": lambda fn, t: tc.checkpoint(fn, t, use_reentrant=False),
                "matepoint": matepoint.checkpoint}
    x = torch.randn(16, requires_grad=True)
    samples: Dict[str, List[float]] = {name: [] for name in wrappers}

    def run_calls(wrap: Callable) -> None:
        for _ in range(calls):
            wrap(tiny, x).sum().backward()

    for wrap in wrappers.values():
        run_calls(wrap)  # warm-up
    for _ in range(rounds):  # interleaved, so machine noise hits all alike
        for name, wrap in wrappers.items():
            seconds, = time_call(functools.partial(run_calls, wrap), repeats=1)
            samples[name].append(seconds / calls * 1e6)
    result = {name: statistics.median(values) for name, values in samples.items()}
    result["ratio_total"] = result["matepoint"] / result["torch"]
    result["ratio_overhead"] = (result["matepoint"] - result["plain"]) / (result["torch"] - result["plain"])
    return result
