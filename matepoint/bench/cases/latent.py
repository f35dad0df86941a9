"""The deep-latent case matepoint exists for: a deep stack (200 blocks on an
80 GB GPU) of windowed attention + MLP blocks whose input is one large
latent (204,800 tokens x 512 = 200 MiB in bfloat16), where torch's
checkpoint keeps every block's input on the device."""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from matepoint.bench import modes
from matepoint.bench.workload import Workload, chain_step

MODES = ["torch", "torch+save_on_cpu", "matepoint", "matepoint+alloc", "matepoint+spill"]


class WindowBlock(nn.Module):
    """Pre-norm attention within fixed windows of tokens, then an MLP."""

    def __init__(self, width: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(tokens // self.window, self.window, 3, self.heads,
                                           width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3)
        x = x + self.proj(attended.reshape(tokens, width))
        return x + self.mlp(self.norm2(x))


def unavailable() -> Optional[str]:
    return None


def sizes(args: argparse.Namespace, cuda: bool) -> Dict[str, Any]:
    if not cuda:
        return {"tokens": 2048, "width": 32, "heads": 4, "window": 32, "dtype": "float32"}
    return {"tokens": args.latent_tokens, "width": 512, "heads": 8, "window": 512,
            "dtype": "bfloat16"}


def depths(args: argparse.Namespace, cuda: bool) -> List[int]:
    if not cuda:
        return [6]
    if args.latent_depth:
        return [args.latent_depth]
    # torch's checkpoint keeps every input: as deep as half the memory holds
    input_bytes = args.latent_tokens * 512 * 2
    total = torch.cuda.get_device_properties(0).total_memory
    return [max(8, min(200, int(0.5 * total / input_bytes)))]


def build(spec: Dict[str, Any], mode: str, device: torch.device) -> Workload:
    size, depth = spec["size"], spec["depth"]
    dtype = getattr(torch, size["dtype"])
    blocks = [WindowBlock(size["width"], size["heads"], size["window"]).to(device, dtype)
              for _ in range(depth)]
    x = torch.randn(size["tokens"], size["width"], device=device, dtype=dtype)
    parameters = [p for block in blocks for p in block.parameters()]
    if mode == "matepoint+spill":   # half of what a step offloads stays in pinned memory
        modes.use_spill(x.nbytes * depth // 2)
    step = chain_step(blocks, x, modes.checkpoint_function(mode))
    return Workload(parameters, step, reserve=(x.nbytes, depth),
                    extra={"input_bytes": x.nbytes})
