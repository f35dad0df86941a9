"""How fast the planner's C solver is on a deep chain.

The case the planner is built for: 200 transformer blocks whose latents are
200 MiB each, planned in 1 MiB units under an 80 GiB budget (targets, issue
36: a solve in at most 50 ms, the 16-point frontier in at most 0.5 s on a
2-core machine). Block costs are synthetic but shaped like a real stack
(activations about 8x the input, backward about 2x forward, PCIe at
25 GB/s), with some spread so the solver cannot take shortcuts.

Wall time and the process's CPU time are both reported, with the machine's
load average: on a shared machine the wall clock counts other jobs' turns,
the CPU time much less so.

    python benchmarks/planner_speed.py [--blocks 200] [--budget-gib 80] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import time
from typing import Callable, List, Tuple

from matepoint import _C
from matepoint._timing import time_call
from matepoint._planning.block_profile import _records
from matepoint._planning.planner import CHOICES, BlockProfile, solve

log = logging.getLogger("matepoint.planner_speed")
MIB = 1 << 20


def synthetic_chain(blocks: int, seed: int = 0) -> list[BlockProfile]:
    rng = random.Random(seed)
    chain = []
    for _ in range(blocks):
        input_bytes = int(rng.uniform(150, 250) * MIB)
        activations = int(input_bytes * rng.uniform(6, 10))
        forward_s = rng.uniform(8e-3, 12e-3)
        chain.append(BlockProfile(
            forward_s=forward_s, backward_s=2 * forward_s, copy_s=input_bytes / 25e9,
            input_bytes=input_bytes, activation_bytes=activations, output_bytes=input_bytes,
            forward_peak_bytes=activations + input_bytes, backward_peak_bytes=activations // 2))
    return chain


def wall_and_cpu(fn: Callable[[], object], repeats: int) -> Tuple[List[float], List[float]]:
    """Seconds of each of ``repeats`` calls: on the wall clock, and of this
    process's CPU time."""
    wall, cpu = [], []
    for _ in range(repeats):
        begun, begun_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - begun)
        cpu.append(time.process_time() - begun_cpu)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--budget-gib", type=float, default=80.0)
    parser.add_argument("--unit-mib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    chain = synthetic_chain(args.blocks)
    unit = int(args.unit_mib * MIB)
    budget = int(args.budget_gib * (1 << 30))
    load_before = os.getloadavg()[0]
    plan = solve(chain, budget, unit, True)
    solve_s = time_call(lambda: solve(chain, budget, unit, True), args.repeats)
    _, solve_cpu_s = wall_and_cpu(lambda: solve(chain, budget, unit, True), args.repeats)
    units = _records(chain, unit)
    frontier_s, frontier_cpu_s = wall_and_cpu(lambda: _C._plan_frontier(units, True, 16), 1)
    counts = {choice: plan.choices.count(choice) for choice in CHOICES
              if choice in plan.choices}
    result = {
        "blocks": args.blocks, "budget_gib": args.budget_gib, "unit_mib": args.unit_mib,
        "solve_ms_median": statistics.median(solve_s) * 1e3, "solve_ms_min": min(solve_s) * 1e3,
        "solve_cpu_ms_median": statistics.median(solve_cpu_s) * 1e3,
        "solve_cpu_ms_min": min(solve_cpu_s) * 1e3,
        "frontier_16_points_ms": frontier_s[0] * 1e3,
        "frontier_16_points_cpu_ms": frontier_cpu_s[0] * 1e3, "choices": counts,
        "predicted_peak_gib": plan.predicted_peak_bytes / (1 << 30),
        "predicted_step_s": plan.predicted_time_s,
        "load_average": [load_before, os.getloadavg()[0]], "cpus": os.cpu_count(),
    }
    log.info("%d blocks, %.0f GiB budget, %.2f MiB units: solve %.1f ms median (min %.1f ms, "
             "%d runs; CPU %.1f ms median, min %.1f ms); 16-point frontier %.0f ms (CPU %.0f "
             "ms); load average %.2f -> %.2f on %d CPUs", args.blocks, args.budget_gib,
             args.unit_mib, result["solve_ms_median"], result["solve_ms_min"], args.repeats,
             result["solve_cpu_ms_median"], result["solve_cpu_ms_min"],
             result["frontier_16_points_ms"], result["frontier_16_points_cpu_ms"],
             load_before, os.getloadavg()[0], os.cpu_count() or 0)
    log.info("plan: %s, predicted peak %.1f GiB, step %.2f s", counts,
             result["predicted_peak_gib"], plan.predicted_time_s)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
