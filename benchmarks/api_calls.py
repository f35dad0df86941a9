"""CUDA runtime calls per offloaded span, counted on the simulated GPU.

Needs a test build (MATEPOINT_TESTING=1 pip install -e .). Trains an MLP of
`--depth` checkpointed blocks for `--steps` steps with the GPU lagging
(`--progress` operations per call) and prints the calls of each runtime
entry point divided by the spans offloaded (one per block and step), as a
table and as JSON (`--json`)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))

import matepoint  # noqa: E402
import sim  # noqa: E402
from conftest import MLP, train_step  # noqa: E402
from matepoint import _C  # noqa: E402


def count_calls(depth: int, steps: int, progress: int) -> dict:
    matepoint.set_options(min_offload_bytes=0)
    _C._simulate_cuda(True)
    _C._sim_set_progress(progress)
    with sim.device_memory():
        model, x = MLP(64, depth), torch.randn(32, 64)
        train_step(model, x, matepoint.checkpoint)       # warm: streams, pool, events
        before = _C._sim_stats()["calls"]
        spans = matepoint.pool_stats()["hits"] + matepoint.pool_stats()["misses"]
        for _ in range(steps):
            train_step(model, x, matepoint.checkpoint)
        import gc
        gc.collect()
        spans = matepoint.pool_stats()["hits"] + matepoint.pool_stats()["misses"] - spans
        after = _C._sim_stats()["calls"]
        sim.finish()
    _C._sim_set_progress(0)
    _C._simulate_cuda(False)
    return {name: (after[name] - before[name]) / spans for name in after
            if after[name] != before[name]} | {"spans": spans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--progress", type=int, default=0)
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args()
    sim.require_test_build()
    counts = count_calls(args.depth, args.steps, args.progress)
    spans = counts.pop("spans")
    total = sum(counts.values())
    lookups = counts.get("cudaGetDevice", 0) + counts.get("cudaGetLastError", 0)
    print(f"{spans} spans offloaded; runtime calls per span:")
    for name, value in sorted(counts.items()):
        print(f"  {name:28s} {value:6.2f}")
    print(f"  {'total':28s} {total:6.2f}")
    print(f"  {'total without lookups':28s} {total - lookups:6.2f}  (cudaGetDevice, cudaGetLastError)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"per_span": counts, "total": total, "spans": spans,
                       "total_without_lookups": total - lookups, "args": vars(args)}, handle,
                      indent=2)


if __name__ == "__main__":
    main()
