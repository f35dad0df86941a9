"""The README's memory picture: device memory over one training step, per
checkpointed region and phase, read from torch's own memory snapshot.

It runs on the CPU, on the test build's simulated GPU (tests/sim.py), with
matepoint's allocator installed as torch's CUDA allocator through the C++
adapter: torch's snapshot of it carries each allocation's region and phase
(the trace's ``user_metadata``). Needs a test build (MATEPOINT_TESTING=1)
and a CUDA build of torch (its libraries; no GPU). The figure is an SVG
written without plotting libraries; --html also writes torch's own viewer
page (torch.cuda._memory_viz.trace_plot) for the same snapshot.

    MATEPOINT_TESTING=1 python setup.py build_ext --inplace
    python benchmarks/memory_plot.py --out docs/images/memory_regions.svg
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Dict, List, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import matepoint  # noqa: E402
from matepoint import _adapter, _C  # noqa: E402
from matepoint._allocator import allocator_path  # noqa: E402

log = logging.getLogger("memory_plot")
MIB = 1 << 20
WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 880, 380, 70, 50, 40
PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3"]


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def one_step(blocks: int, width: int, batch: int) -> None:
    """Forward and backward of `blocks` checkpointed MLP blocks."""
    torch.manual_seed(0)
    model = [Block(width) for _ in range(blocks)]
    x = torch.randn(batch, width, requires_grad=True)
    for block in model:
        x = matepoint.checkpoint(block, x)
    x.square().mean().backward()


def take_snapshot(blocks: int, width: int, batch: int) -> Dict[str, Any]:
    import sim
    sim.require_test_build()
    library, _, _ = sim._attach()
    _adapter.install(library)
    _C._attach_allocator(allocator_path())
    with sim.device_memory():
        _adapter.record_history(True, stacks=False, clear=True)
        one_step(blocks, width, batch)
        snapshot = torch.cuda.memory._snapshot()
        _adapter.record_history(False)
    return snapshot


def live_series(trace: List[Dict[str, Any]]) -> Tuple[List[str], List[Dict[str, int]]]:
    """(tags in order of first use, live bytes per tag after each event)."""
    tag_of: Dict[int, str] = {}
    live: Dict[str, int] = {}
    order: List[str] = []
    series = []
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            tag = entry["user_metadata"].replace("matepoint ", "")
            tag_of[entry["addr"]] = tag
            if tag not in live:
                live[tag] = 0
                order.append(tag)
            live[tag] += entry["size"]
        elif action == "free_completed" and entry["addr"] in tag_of:
            live[tag_of.pop(entry["addr"])] -= entry["size"]
        else:
            continue
        series.append(dict(live))
    return order, series


def _color(tag: str, regions: List[str]) -> Tuple[str, float]:
    parts = tag.split()          # "region 3 forward"
    if parts[1] == "0":
        return "#9a9a9a", 0.8    # outside any checkpoint
    color = PALETTE[regions.index(parts[1]) % len(PALETTE)]
    return color, 0.95 if parts[2] == "forward" else 0.45


def svg(order: List[str], series: List[Dict[str, int]], title: str) -> str:
    """A stacked area chart of live bytes per tag, events on the x axis."""
    regions = sorted({t.split()[1] for t in order if t.split()[1] != "0"}, key=int)
    # outside first, then each region's forward below its recompute
    stack = sorted(order, key=lambda t: (int(t.split()[1]), t.split()[2] != "forward"))
    peak = max(sum(point.values()) for point in series) or 1
    plot_w, plot_h = WIDTH - LEFT - 200, HEIGHT - BOTTOM - TOP
    n = max(len(series) - 1, 1)
    x = [LEFT + plot_w * i / n for i in range(len(series))]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="14">{title}</text>']
    below = [0] * len(series)
    for tag in stack:
        above = [below[i] + series[i].get(tag, 0) for i in range(len(series))]
        y = lambda v: TOP + plot_h * (1 - v / peak)  # noqa: E731
        points = [f"{x[i]:.1f},{y(above[i]):.1f}" for i in range(len(series))]
        points += [f"{x[i]:.1f},{y(below[i]):.1f}" for i in reversed(range(len(series)))]
        color, opacity = _color(tag, regions)
        out.append(f'<polygon points="{" ".join(points)}" fill="{color}" '
                   f'fill-opacity="{opacity}" stroke="none"><title>{tag}</title></polygon>')
        below = above
    for k in range(5):
        value = peak * k / 4
        ty = TOP + plot_h * (1 - k / 4)
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{ty:.1f}" y2="{ty:.1f}" '
                   f'stroke="#ddd"/><text x="{LEFT - 6}" y="{ty + 4:.1f}" text-anchor="end">'
                   f'{value / MIB:.0f} MiB</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 14}" text-anchor="middle">'
               f'allocator events (alloc / free) through one forward and backward</text>')
    for i, tag in enumerate(stack):
        color, opacity = _color(tag, regions)
        ly = TOP + 16 * i
        label = "outside checkpoints" if tag.split()[1] == "0" else tag
        out.append(f'<rect x="{WIDTH - 190}" y="{ly}" width="12" height="12" fill="{color}" '
                   f'fill-opacity="{opacity}"/><text x="{WIDTH - 172}" y="{ly + 10}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "images",
                                                      "memory_regions.svg"))
    parser.add_argument("--html", help="also write torch's memory_viz page here")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    snapshot = take_snapshot(args.blocks, args.width, args.batch)
    order, series = live_series(snapshot["device_traces"][0])
    title = (f"Device memory per checkpointed region and phase: {args.blocks} blocks, "
             f"torch.cuda.memory._snapshot() under matepoint")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write(svg(order, series, title))
    log.info("wrote %s (%d events, tags: %s)", args.out, len(series), ", ".join(order))
    if args.html:
        from torch.cuda import _memory_viz
        with open(args.html, "w") as handle:
            handle.write(_memory_viz.trace_plot(snapshot))
        log.info("wrote %s", args.html)


if __name__ == "__main__":
    main()
