"""The offload engine's CPU cost per step, over the simulated GPU of a test
build (MATEPOINT_TESTING=1): no CUDA needed.

Each sample times forward + backward of a chain of checkpointed regions
whose inputs the engine offloads (a copy out per region into the pool, its
window, a prefetch and a copy back in backward), beside the same chain with
offloading off; both run in one process, interleaved, so machine noise hits
both alike. The simulated GPU keeps up with the CPU (every queued copy runs
at once), so what is timed is the engine's own work and the runtime calls
it makes. Prints medians in microseconds per step and per region, and the
offloaded chain's ratio to the plain one; `--json` writes them.

Compare two checkouts side by side by running it in each, alternately:

    PYTHONPATH=. python benchmarks/offload_sim_overhead.py --json a.json
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Dict, List

import torch

import matepoint
from matepoint import _C

log = logging.getLogger("matepoint.bench.offload_sim")

EVERYTHING = 1 << 62    # operations per runtime call: a GPU that keeps up


def _step(weights: List[torch.Tensor], x: torch.Tensor) -> None:
    for w in weights:
        x = matepoint.checkpoint(lambda t, w=w: torch.tanh(t @ w), x)
    x.sum().backward()


def _per_step_us(weights: List[torch.Tensor], x: torch.Tensor, steps: int,
                 offload: bool) -> float:
    matepoint.set_options(offload=offload)
    start = time.perf_counter()
    for _ in range(steps):
        _step(weights, x)
    return (time.perf_counter() - start) / steps * 1e6


def measure(rounds: int, steps: int, regions: int, width: int) -> Dict[str, float]:
    """Median per-step time (us) with and without offloading."""
    weights = [torch.randn(width, width, requires_grad=True) for _ in range(regions)]
    x = torch.randn(width, width, requires_grad=True)
    samples: Dict[str, List[float]] = {"plain": [], "offload": []}
    for offload in (False, True):
        _per_step_us(weights, x, steps, offload)      # warm-up: the pool fills
    for _ in range(rounds):
        samples["plain"].append(_per_step_us(weights, x, steps, False))
        samples["offload"].append(_per_step_us(weights, x, steps, True))
    stats = matepoint.pool_stats()
    assert stats["prefetched"] + stats["fetched_at_need"] > 0, "nothing was offloaded"
    assert stats["bytes_in_use"] == 0, stats
    result = {name: statistics.median(values) for name, values in samples.items()}
    result["ratio"] = result["offload"] / result["plain"]
    result["engine_us_per_region"] = (result["offload"] - result["plain"]) / regions
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--regions", type=int, default=8)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not getattr(_C, "TEST_BUILD", 0):
        parser.error("needs a test build: MATEPOINT_TESTING=1 pip install -e .")
    torch.set_num_threads(1)
    saved = matepoint.options
    matepoint.set_options(min_offload_bytes=0)
    _C._simulate_cuda(True)
    _C._sim_set_progress(EVERYTHING)
    try:
        result = measure(args.rounds, args.steps, args.regions, args.width)
    finally:
        _C._sim_set_progress(0)
        _C._simulate_cuda(False)
        matepoint.set_options(offload=saved.offload, min_offload_bytes=saved.min_offload_bytes)
    log.info("%s: per step of %d regions (median of %d interleaved rounds x %d steps): "
             "plain %.1f us, offload %.1f us, ratio %.3f, engine %.1f us per region",
             matepoint.__file__, args.regions, args.rounds, args.steps, result["plain"],
             result["offload"], result["ratio"], result["engine_us_per_region"])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
