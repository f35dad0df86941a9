"""Step time of the `latent` case with the disk tier (issue 37): the host
limit at half the offloaded bytes against no limit, on a CPU machine.

On the CPU matepoint offloads nothing (inputs must live on a GPU), so this
runs the case's blocks on the simulated GPU of a test build
(MATEPOINT_TESTING=1; device memory is host memory, copies are memcpy, a
GPU that keeps up), where offloaded inputs do go through the pinned pool
and, past the limit, the disk tier. One thread; rounds alternate the two
runs; gradients checked equal. Usage (from the checkout, after a test build):

    PYTHONPATH=. python benchmarks/spill_latent.py --spill-dir /tmp/spill
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import matepoint  # noqa: E402
import sim  # noqa: E402  (tests/sim.py: the simulated GPU)
from matepoint import _C  # noqa: E402
from matepoint.bench.cases.latent import WindowBlock  # noqa: E402


def step(blocks, x) -> list:
    for block in blocks:
        block.zero_grad(set_to_none=True)
    h = x.detach().requires_grad_(True)
    for block in blocks:
        h = matepoint.checkpoint(block, h)
    h.float().pow(2).mean().backward()
    return [p.grad.clone() for block in blocks for p in block.parameters()]


def timed(blocks, x, steps: int) -> tuple:
    times, grads = [], None
    for _ in range(steps):
        start = time.perf_counter()
        grads = step(blocks, x)
        times.append(time.perf_counter() - start)
    return times, grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spill-dir", required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sim.require_test_build()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    matepoint.set_options(min_offload_bytes=0)
    _C._simulate_cuda(True)
    _C._sim_set_progress(sim.EVERYTHING)
    with sim.device_memory(False), sim.as_on_cuda(lag=False):
        blocks = [WindowBlock(args.width, 4, 64) for _ in range(args.depth)]
        x = torch.randn(args.tokens, args.width)
        offloaded = x.nbytes * args.depth
        runs = {"no limit": {}, "limit = offloaded / 2": {"spill_dir": args.spill_dir,
                                                          "host_limit_bytes": offloaded // 2}}
        results = {name: [] for name in runs}
        grads = {}
        for round_index in range(args.rounds):
            order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
            for name in order:
                matepoint.set_options(spill_dir=None, host_limit_bytes=None)
                matepoint.set_options(**runs[name])
                step(blocks, x)      # warm: the pool's buffers, the tier's threads
                times, grads[name] = timed(blocks, x, args.steps)
                results[name] += times
                stats = matepoint.pool_stats()
        exact = all(torch.equal(a, b) for a, b in zip(*grads.values()))
        print(f"latent on the simulated GPU: {args.depth} blocks x {x.nbytes / 2**20:.1f} MiB "
              f"inputs = {offloaded / 2**20:.0f} MiB offloaded; {args.rounds} rounds x "
              f"{args.steps} steps; grads equal: {exact}")
        base = statistics.median(results["no limit"])
        for name, times in results.items():
            median = statistics.median(times)
            print(f"  {name:24s} step {median * 1e3:7.1f} ms (min {min(times) * 1e3:.1f}, "
                  f"max {max(times) * 1e3:.1f})  ratio {median / base:.2f}")
        print(f"  last run's pool_stats: bytes_reserved {stats['bytes_reserved']} (limit "
              f"{offloaded // 2} when limited), peak_spilled_bytes {stats['peak_spilled_bytes']}, spill_writes "
              f"{stats['spill_writes']}, spill_reads {stats['spill_reads']}, "
              f"spill_read_stalls {stats['spill_read_stalls']}, fallbacks {stats['fallbacks']}")
        matepoint.set_options(spill_dir=None, host_limit_bytes=None)
    _C._simulate_cuda(False)


if __name__ == "__main__":
    main()
