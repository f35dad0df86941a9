"""How fast the planner's C solver is on a deep chain.

The case the planner is built for: 200 transformer blocks whose latents are
200 MiB each, planned in 1 MiB units under an 80 GiB budget (target: under
100 ms a solve). Block costs are synthetic but shaped like a real stack
(activations about 8x the input, backward about 2x forward, PCIe at
25 GB/s), with some spread so the solver cannot take shortcuts.

    python benchmarks/planner_speed.py [--blocks 200] [--budget-gib 80] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics

from matepoint import _C
from matepoint._timing import time_call
from matepoint._planner import BlockProfile, _units, solve

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
    plan = solve(chain, budget, unit, True)
    solve_s = time_call(lambda: solve(chain, budget, unit, True), args.repeats)
    units = _units(chain, unit)
    frontier_s = time_call(lambda: _C._plan_frontier(units, True, 16), 1)
    counts = {choice: plan.choices.count(choice) for choice in ("keep", "recompute", "offload")}
    result = {
        "blocks": args.blocks, "budget_gib": args.budget_gib, "unit_mib": args.unit_mib,
        "solve_ms_median": statistics.median(solve_s) * 1e3, "solve_ms_min": min(solve_s) * 1e3,
        "frontier_16_points_ms": frontier_s[0] * 1e3, "choices": counts,
        "predicted_peak_gib": plan.predicted_peak_bytes / (1 << 30),
        "predicted_step_s": plan.predicted_time_s,
    }
    log.info("%d blocks, %.0f GiB budget, %.2f MiB units: solve %.1f ms median (min %.1f ms, "
             "%d runs); 16-point frontier %.0f ms", args.blocks, args.budget_gib, args.unit_mib,
             result["solve_ms_median"], result["solve_ms_min"], args.repeats,
             result["frontier_16_points_ms"])
    log.info("plan: %s, predicted peak %.1f GiB, step %.2f s", counts,
             result["predicted_peak_gib"], plan.predicted_time_s)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
