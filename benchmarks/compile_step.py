"""CPU step time of a stack of per-block compiled blocks: matepoint vs torch's checkpoint.

The torchtitan shape: each block is compiled on its own (``torch.compile(block)``)
and checkpointed around (``matepoint.checkpoint(block, x)`` or
``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``). A step is
forward + backward of the stack (no optimizer). The variants (plus the same
compiled blocks without checkpointing) alternate within every round, so machine
noise hits all alike; the result is the median step time over the rounds and the
ratio matepoint / torch (lower is better). Every variant's gradients are checked
equal to the unchecked run's before timing.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

import matepoint

log = logging.getLogger("matepoint.bench.compile_step")


class Block(nn.Module):
    """A transformer-like MLP block with a residual (a user-defined module)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


WRAPPERS: Dict[str, Callable] = {
    "no checkpoint": lambda block, x: block(x),
    "torch checkpoint": lambda block, x: torch_checkpoint.checkpoint(block, x,
                                                                     use_reentrant=False),
    "matepoint": matepoint.checkpoint,
}


def _step(blocks: List[Callable], wrap: Callable, x: torch.Tensor) -> None:
    for block in blocks:
        x = wrap(block, x)
    x.square().mean().backward()


def _gradients(modules: List[nn.Module], blocks: List[Callable], wrap: Callable,
               x: torch.Tensor) -> List[torch.Tensor]:
    for module in modules:
        module.zero_grad(set_to_none=True)
    _step(blocks, wrap, x)
    return [p.grad.clone() for module in modules for p in module.parameters()]


def measure(depth: int, width: int, batch: int, backend: str, rounds: int,
            steps: int) -> Dict[str, float]:
    """Median seconds per step of each variant over ``rounds`` alternating rounds."""
    torch.manual_seed(0)
    modules = [Block(width) for _ in range(depth)]
    blocks = [torch.compile(module, backend=backend) for module in modules]
    x = torch.randn(batch, width, requires_grad=True)
    expected = _gradients(modules, blocks, WRAPPERS["no checkpoint"], x)   # compiles
    for name, wrap in WRAPPERS.items():
        got = _gradients(modules, blocks, wrap, x)
        if not all(torch.equal(a, b) for a, b in zip(expected, got)):
            raise RuntimeError(f"{name}: gradients differ from the unchecked run")
    samples: Dict[str, List[float]] = {name: [] for name in WRAPPERS}
    for _ in range(rounds):
        for name, wrap in WRAPPERS.items():
            start = time.perf_counter()
            for _ in range(steps):
                _step(blocks, wrap, x)
            samples[name].append((time.perf_counter() - start) / steps)
    result = {name: statistics.median(values) for name, values in samples.items()}
    result["matepoint / torch"] = result["matepoint"] / result["torch checkpoint"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    result = measure(args.depth, args.width, args.batch, args.backend, args.rounds, args.steps)
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"Python {platform.python_version()}, {args.threads} torch thread(s)",
        "load average before / after": [load_before[0], os.getloadavg()[0]],
        "torch": torch.__version__,
        "settings": vars(args),
        "seconds per step (median)": result,
    }
    for name, value in result.items():
        unit = "" if "/" in name else " ms"
        shown = value if "/" in name else value * 1e3
        log.info("%-18s %8.3f%s", name, shown, unit)
    log.info("load average %.2f before, %.2f after", load_before[0], os.getloadavg()[0])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
