"""Per-call CPU overhead of matepoint.checkpoint vs torch.utils.checkpoint.

Each sample times forward + backward of a checkpointed tiny function; the
implementations are interleaved in one run so machine noise hits both alike.
Prints medians and the ratio matepoint / torch (lower is better).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Callable

import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint

log = logging.getLogger("matepoint.bench.overhead")


def tiny(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * x


def make_step(wrapper: Callable, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        out = wrapper(tiny, x)
        out.sum().backward()

    return step


def plain(fn: Callable, *args: torch.Tensor) -> torch.Tensor:
    return fn(*args)


def torch_cp(fn: Callable, *args: torch.Tensor) -> torch.Tensor:
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False)


def median_us(step: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) / calls * 1e6


def measure(rounds: int, calls: int) -> dict:
    torch.set_num_threads(1)
    x = torch.randn(16, requires_grad=True)
    steps = {
        "plain": make_step(plain, x),
        "torch": make_step(torch_cp, x),
        "matepoint": make_step(matepoint.checkpoint, x),
    }
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        median_us(step, calls)  # warm-up
    for _ in range(rounds):
        for name, step in steps.items():
            samples[name].append(median_us(step, calls))
    result = {name: statistics.median(values) for name, values in samples.items()}
    result["overhead_torch_us"] = result["torch"] - result["plain"]
    result["overhead_matepoint_us"] = result["matepoint"] - result["plain"]
    result["ratio_total"] = result["matepoint"] / result["torch"]
    result["ratio_overhead"] = result["overhead_matepoint_us"] / result["overhead_torch_us"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = measure(args.rounds, args.calls)
    log.info("per call, forward+backward of a tiny function (median of %d rounds x %d calls)",
             args.rounds, args.calls)
    log.info("%-28s %10.2f us", "no checkpoint", result["plain"])
    log.info("%-28s %10.2f us", "torch.utils.checkpoint", result["torch"])
    log.info("%-28s %10.2f us", "matepoint.checkpoint", result["matepoint"])
    log.info("ratio matepoint/torch, whole call:     %.3f", result["ratio_total"])
    log.info("ratio matepoint/torch, added overhead: %.3f", result["ratio_overhead"])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
