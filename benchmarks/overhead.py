"""Per-call CPU overhead of matepoint.checkpoint vs torch.utils.checkpoint.

Each sample times forward + backward of a checkpointed tiny function, on two
workloads: `x * 2` over 4 elements (nothing but the fixed cost per call) and
`sin(x) * x` over 16. Every workload and implementation is interleaved in
one run, so machine noise hits all alike. Prints medians and the ratios
matepoint / torch (lower is better), and writes them as JSON (`--json`).

Two more ratios say what the whole-call ratio can mean. The floor, no
checkpoint / torch, is the lowest whole-call ratio any checkpoint could
reach: a call can't cost less than the region run without checkpointing.
The added ratio, (matepoint - no checkpoint) / (torch - no checkpoint),
compares only what each checkpoint adds to the call.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.utils.checkpoint as tc

import matepoint

log = logging.getLogger("matepoint.bench.overhead")

WORKLOADS: Dict[str, tuple] = {
    "x * 2, 4 elements": (lambda t: t * 2, 4),
    "sin(x) * x, 16 elements": (lambda t: torch.sin(t) * t, 16),
}
WRAPPERS: Dict[str, Callable] = {
    "plain": lambda fn, t: fn(t),
    "torch": lambda fn, t: tc.checkpoint(fn, t, use_reentrant=False),
    "matepoint": matepoint.checkpoint,
}


def _per_call_us(wrap: Callable, fn: Callable, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        wrap(fn, x).sum().backward()
    return (time.perf_counter() - start) / calls * 1e6


def measure(rounds: int, calls: int) -> Dict[str, Dict[str, float]]:
    """Median per-call time (us) of each workload under each wrapper, and
    matepoint's ratio to torch, from `rounds` interleaved rounds."""
    inputs = {name: torch.randn(n, requires_grad=True) for name, (_, n) in WORKLOADS.items()}
    samples: Dict[str, Dict[str, List[float]]] = {
        name: {wrap: [] for wrap in WRAPPERS} for name in WORKLOADS}
    for name, (fn, _) in WORKLOADS.items():
        for wrap in WRAPPERS.values():
            _per_call_us(wrap, fn, inputs[name], calls)   # warm-up
    for _ in range(rounds):
        for name, (fn, _) in WORKLOADS.items():
            for wrap_name, wrap in WRAPPERS.items():
                samples[name][wrap_name].append(_per_call_us(wrap, fn, inputs[name], calls))
    result = {}
    for name, per_wrap in samples.items():
        medians = {wrap: statistics.median(values) for wrap, values in per_wrap.items()}
        medians["ratio_total"] = medians["matepoint"] / medians["torch"]
        medians["floor"] = medians["plain"] / medians["torch"]
        medians["ratio_added"] = ((medians["matepoint"] - medians["plain"])
                                  / (medians["torch"] - medians["plain"]))
        result[name] = medians
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    result = measure(args.rounds, args.calls)
    log.info("per call, forward+backward (median of %d interleaved rounds x %d calls)",
             args.rounds, args.calls)
    for name, medians in result.items():
        log.info("%s: plain %.1f us, torch %.1f us, matepoint %.1f us, ratio %.3f "
                 "(floor %.3f, added %.3f)", name, medians["plain"], medians["torch"],
                 medians["matepoint"], medians["ratio_total"], medians["floor"],
                 medians["ratio_added"])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
