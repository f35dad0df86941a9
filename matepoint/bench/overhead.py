"""Per-call overhead of a checkpoint: the CPU cost of the machinery alone."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import torch


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

    def timed(wrap: Callable) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            wrap(tiny, x).sum().backward()
        return (time.perf_counter() - start) / calls * 1e6

    for wrap in wrappers.values():
        timed(wrap)  # warm-up
    for _ in range(rounds):
        for name, wrap in wrappers.items():
            samples[name].append(timed(wrap))
    result = {name: statistics.median(values) for name, values in samples.items()}
    result["ratio_total"] = result["matepoint"] / result["torch"]
    result["ratio_overhead"] = (result["matepoint"] - result["plain"]) / (result["torch"] - result["plain"])
    return result
