"""The planner's selective choice on a transformer block stack (CPU).

At a budget between "all recomputed" and "all kept", compares the plan with
the selective choice against the best whole-block plan (keep / recompute
only, from the same profiles) at the same budget: predicted step time of
each, and the measured time of each (median of interleaved rounds, so that
load on the machine falls on both alike).

    python benchmarks/planner_selective.py [--layers 6] [--rounds 9] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from typing import Any, Dict, List

import torch
import torch.nn as nn

import matepoint
from matepoint._planner import predict, solve

log = logging.getLogger("matepoint.planner_selective")
MIB = float(1 << 20)


def stack(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, activation="gelu",
                                   batch_first=True)
        for _ in range(layers)])


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x.detach().requires_grad_(True)).square().mean().backward()
    model.zero_grad(set_to_none=True)


def run(layers: int, rounds: int, repeats: int) -> Dict[str, Any]:
    model, x = stack(layers, 256), torch.randn(8, 256, 256)
    probe = matepoint.plan(model, x, budget_bytes=1 << 40, repeats=repeats)
    profiles, unit = probe.profiles, probe.unit_bytes
    whole = [dataclasses.replace(p, selective_s=None, selective_bytes=None) for p in profiles]
    kept = predict(profiles, ["keep"] * layers, unit, False)[0]
    recomputed = predict(profiles, ["recompute"] * layers, unit, False)[0]
    budget = (kept + recomputed) // 2
    selective = solve(profiles, budget, unit, False, offload=False)
    best_whole = solve(whole, budget, unit, False, offload=False)
    timings: Dict[str, List[float]] = {"selective": [], "whole": []}
    plans = {"selective": selective, "whole": best_whole}
    for _ in range(rounds):
        for name, plan in plans.items():
            plan.apply(model)
            step(model, x)  # warm-up after switching
            begun = time.perf_counter()
            step(model, x)
            timings[name].append(time.perf_counter() - begun)
    result = {"layers": layers, "budget_bytes": budget, "all_kept_bytes": kept,
              "all_recomputed_bytes": recomputed, "torch": torch.__version__}
    for name, plan in plans.items():
        measured = statistics.median(timings[name])
        result[name] = {"choices": plan.choices, "predicted_s": plan.predicted_time_s,
                        "predicted_peak_bytes": plan.predicted_peak_bytes,
                        "measured_s": measured,
                        "measured_over_predicted": measured / plan.predicted_time_s}
    result["predicted_gain"] = 1 - selective.predicted_time_s / best_whole.predicted_time_s
    result["measured_gain"] = 1 - result["selective"]["measured_s"] / result["whole"]["measured_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=3, help="plan()'s timing repeats")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = run(args.layers, args.rounds, args.repeats)
    log.info("budget %.1f MiB (all kept %.1f, all recomputed %.1f)", result["budget_bytes"] / MIB,
             result["all_kept_bytes"] / MIB, result["all_recomputed_bytes"] / MIB)
    for name in ("selective", "whole"):
        r = result[name]
        log.info("%-9s %s: predicted %.1f ms, measured %.1f ms (x%.3f), peak %.1f MiB", name,
                 r["choices"], r["predicted_s"] * 1e3, r["measured_s"] * 1e3,
                 r["measured_over_predicted"], r["predicted_peak_bytes"] / MIB)
    log.info("selective vs best whole-block plan: predicted %.1f%% faster, measured %.1f%%",
             result["predicted_gain"] * 100, result["measured_gain"] * 100)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
