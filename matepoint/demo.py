"""Small demo: memory held for backward by a deep MLP, with and without matepoint.

Run with ``python -m matepoint.demo``. It counts the bytes of the tensors the
autograd graph keeps alive between forward and backward (measured with an
outer saved-tensor hook), and on a GPU also peak device memory.
"""
from __future__ import annotations

import argparse
import logging
from typing import Callable

import torch
import torch.nn as nn

import matepoint
from matepoint._meter import saved_tensor_bytes

log = logging.getLogger("matepoint.demo")


def make_model(depth: int, width: int) -> nn.ModuleList:
    return nn.ModuleList(
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        for _ in range(depth)
    )


def held_bytes(model: nn.ModuleList, x: torch.Tensor, wrap: Callable) -> int:
    """Bytes of distinct activation storages autograd keeps for backward."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def forward() -> torch.Tensor:
        out = x
        for block in model:
            out = wrap(block, out)
        return out

    out, held = saved_tensor_bytes(forward, weights)
    out.sum().backward()
    return held


def plain(fn: Callable, *args: torch.Tensor) -> torch.Tensor:
    return fn(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--depths", default="4,8,16,32")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log.info("bytes held for backward by a deep MLP (width %d, batch %d, %s)",
             args.width, args.batch, device)
    log.info("%6s %16s %16s %8s", "depth", "no checkpoint", "matepoint", "saved")
    for depth in (int(d) for d in args.depths.split(",")):
        model = make_model(depth, args.width).to(device)
        x = torch.randn(args.batch, args.width, device=device, requires_grad=True)
        before = held_bytes(model, x, plain)
        after = held_bytes(model, x, matepoint.checkpoint)
        log.info("%6d %13.2f MiB %13.2f MiB %7.1fx", depth, before / 2**20, after / 2**20,
                 before / max(after, 1))
    if device == "cpu":
        log.info("GPU memory numbers need a GPU: see `python -m matepoint.bench` there.")


if __name__ == "__main__":
    main()
