"""matepoint benchmark: memory and step time of a deep transformer stack.

``python -m matepoint.bench`` (or ``matepoint-bench``) trains a stack of
transformer blocks for a few steps under each mode and prints a table; it
also writes JSON and, with matplotlib, a PNG plot. Modes:

  none                no checkpointing
  torch               torch.utils.checkpoint (non-reentrant)
  torch+save_on_cpu   torch checkpoint inside save_on_cpu(pin_memory=True)
  matepoint           matepoint.checkpoint (inputs offloaded, prefetched)
  matepoint+alloc     the same under matepoint's allocator
  matepoint-auto      matepoint.plan's choice per block (keep / recompute /
                      offload) under --budget-gib, by default the activation
                      memory that checkpointing every block needs

Every (mode, depth) runs in its own process, so peaks are clean and an
out-of-memory in one is recorded as OOM while the sweep goes on. Without a
GPU it runs a small CPU configuration and says so.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

log = logging.getLogger("matepoint.bench")
MODES = ["none", "torch", "torch+save_on_cpu", "matepoint", "matepoint+alloc", "matepoint-auto"]
MIB = float(1 << 20)


def build_stack(depth: int, hidden: int, heads: int, dtype: torch.dtype, device: str) -> nn.ModuleList:
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True,
                                   norm_first=True)
        for _ in range(depth))
    return blocks.to(device=device, dtype=dtype)


def wrapper_for(mode: str) -> Callable:
    import matepoint
    import torch.utils.checkpoint as tc

    if mode == "none":
        return lambda block, x: block(x)
    if mode.startswith("torch"):
        return lambda block, x: tc.checkpoint(block, x, use_reentrant=False)
    return matepoint.checkpoint


def grad_fingerprint(blocks: nn.ModuleList) -> List[float]:
    """Per-parameter sums of gradients, in float64, to compare runs cheaply."""
    return [float(p.grad.double().sum()) for p in blocks.parameters() if p.grad is not None]


def device_used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def planned_blocks(blocks: nn.ModuleList, x: torch.Tensor,
                   budget_gib: Optional[float]) -> tuple:
    """matepoint-auto: the blocks wrapped as planned, and the plan."""
    import matepoint
    from matepoint import _planner
    profiles = _planner.profile_blocks(list(blocks), (x,), _planner._copy_bandwidth(x.device),
                                       repeats=3)
    unit = 1 << 20 if x.is_cuda else 4096
    pipeline = matepoint.options.pipeline
    if budget_gib is None:  # what checkpointing every block needs
        budget, _ = _planner.predict(profiles, ["recompute"] * len(profiles), unit, pipeline)
    else:
        budget = int(budget_gib * (1 << 30))
    plan = _planner.solve(profiles, budget, unit, pipeline)
    log.info("%s", plan)
    return plan.apply(blocks), plan


def run_child(args: argparse.Namespace) -> Dict[str, Any]:
    """One mode at one depth, in this process; returns the measurements."""
    mode, depth = args.child_mode, args.child_depth
    import matepoint
    from matepoint._meter import PeakMeter
    if mode == "matepoint+alloc":
        matepoint.install_allocator()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype)
    blocks = build_stack(depth, args.hidden, args.heads, dtype, device)
    x = torch.randn(args.batch, args.seq, args.hidden, device=device, dtype=dtype)
    wrap, plan = wrapper_for(mode), None
    if mode == "matepoint-auto":
        run_blocks, plan = planned_blocks(blocks, x, args.budget_gib)
        wrap = lambda block, h: block(h)  # noqa: E731 (each block wraps itself)
    else:
        run_blocks = blocks
    # gradients exist before each step, as the planner's budget assumes
    for p in blocks.parameters():
        p.grad = torch.zeros_like(p)
    if mode == "torch+save_on_cpu":
        context = lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda)  # noqa: E731
    else:
        context = contextlib.nullcontext
    times, device_peak = [], 0
    # peaks count from here: matepoint-auto's profiling above is not a step
    meter = PeakMeter(torch.device("cuda")) if cuda else None
    with meter or contextlib.nullcontext():
        for step in range(args.steps):
            for p in blocks.parameters():
                p.grad.zero_()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            h = x.requires_grad_(True)
            with context():
                for block in run_blocks:
                    h = wrap(block, h)
            if cuda:
                torch.cuda.synchronize()
                device_peak = max(device_peak, device_used_bytes())
            h.float().pow(2).mean().backward()
            if cuda:
                torch.cuda.synchronize()
                device_peak = max(device_peak, device_used_bytes())
            times.append(time.perf_counter() - start)
            del h
    result: Dict[str, Any] = {
        "mode": mode, "depth": depth, "status": "ok",
        "step_ms": statistics.median(times[1:] or times) * 1e3,
        "grad_fingerprint": grad_fingerprint(blocks),
        "pinned_host_bytes": matepoint.pool_stats()["bytes_reserved"] if "matepoint" in mode else None,
    }
    if plan is not None:
        result["plan"] = {c: plan.choices.count(c) for c in ("keep", "recompute", "offload")}
        result["budget_bytes"] = plan.budget_bytes
        result["predicted_peak_bytes"] = plan.predicted_peak_bytes
    if cuda:
        result["device_used_bytes"] = device_peak
        result["activation_peak_bytes"] = meter.peak_bytes
        if mode == "matepoint+alloc":
            stats = matepoint.memory_stats()
            result["peak_allocated_bytes"] = stats["peak_allocated_bytes"]
            result["peak_reserved_bytes"] = stats["peak_reserved_bytes"]
        else:
            result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        host_stats = getattr(torch.cuda, "host_memory_stats", None)
        if mode == "torch+save_on_cpu" and host_stats is not None:
            result["pinned_host_bytes"] = host_stats().get("reserved_bytes.current")
    return result


def spawn(args: argparse.Namespace, mode: str, depth: int) -> Dict[str, Any]:
    command = [sys.executable, "-m", "matepoint.bench", "--child-mode", mode, "--child-depth",
               str(depth), "--hidden", str(args.hidden), "--heads", str(args.heads), "--seq",
               str(args.seq), "--batch", str(args.batch), "--dtype", args.dtype, "--steps",
               str(args.steps)]
    if args.budget_gib is not None:
        command += ["--budget-gib", str(args.budget_gib)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    oom = "out of memory" in proc.stderr.lower()
    return {"mode": mode, "depth": depth, "status": "OOM" if oom else "error",
            "error": proc.stderr.strip().splitlines()[-1:] if proc.stderr else []}


def pcie_probe(megabytes: int = 256) -> Dict[str, float]:
    """Pinned host<->device bandwidth, GB/s, median of five copies each way."""
    n = megabytes << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    result = {}
    for name, dst, src in (("h2d_GBps", dev, host), ("d2h_GBps", host, dev)):
        samples = []
        for _ in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            samples.append(n / (start.elapsed_time(end) / 1e3) / 1e9)
        result[name] = statistics.median(samples[1:])
    return result


def offload_throughput(probe: Dict[str, float], depth: int = 16, megabytes: int = 64) -> Dict[str, float]:
    """Transfer-bound case: checkpoints whose work is trivial, so the D2H copies
    of their inputs dominate; GB/s offloaded and the fraction of the probe."""
    import matepoint
    inputs = [torch.randn(megabytes << 18, device="cuda", requires_grad=True) for _ in range(depth)]
    outs = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x in inputs:
        outs.append(matepoint.checkpoint(lambda t: t * 2.0, x))
    torch.cuda.synchronize()
    matepoint.pool_stats()  # lets finished copies go
    seconds = time.perf_counter() - start
    gbps = depth * (megabytes << 20) / seconds / 1e9
    del outs
    return {"offload_GBps": gbps, "fraction_of_d2h": gbps / probe["d2h_GBps"]}


def print_table(rows: List[Dict[str, Any]], cuda: bool) -> None:
    header = f"{'mode':<18} {'depth':>5} {'status':>6} {'step ms':>9}"
    if cuda:
        header += (f" {'alloc MiB':>10} {'reserved MiB':>12} {'device MiB':>10} {'pinned MiB':>10}"
                   f" {'act MiB':>8} {'pred MiB':>8}")
    header += f" {'grads':>6}"
    log.info(header)
    for row in rows:
        line = f"{row['mode']:<18} {row['depth']:>5} {row['status']:>6}"
        if row["status"] != "ok":
            log.info(line)
            continue
        line += f" {row['step_ms']:>9.1f}"
        if cuda:
            pinned = row.get("pinned_host_bytes")
            line += (f" {row['peak_allocated_bytes'] / MIB:>10.0f} {row['peak_reserved_bytes'] / MIB:>12.0f}"
                     f" {row['device_used_bytes'] / MIB:>10.0f}"
                     f" {(pinned or 0) / MIB:>10.0f} {row['activation_peak_bytes'] / MIB:>8.0f}")
            predicted = row.get("predicted_peak_bytes")
            line += f" {predicted / MIB:>8.0f}" if predicted is not None else f" {'-':>8}"
        line += f" {row.get('grads_match', '-'):>6}"
        log.info(line)


def mark_gradients(rows: List[Dict[str, Any]], tolerance: float) -> None:
    reference = {r["depth"]: r["grad_fingerprint"] for r in rows
                 if r["mode"] == "none" and r["status"] == "ok"}
    for row in rows:
        ref = reference.get(row["depth"])
        if row["status"] != "ok" or ref is None:
            continue
        got = row["grad_fingerprint"]
        close = len(got) == len(ref) and all(
            abs(a - b) <= tolerance * (abs(b) + 1e-3) for a, b in zip(got, ref))
        row["grads_match"] = "yes" if close else "NO"


def plot(rows: List[Dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: no plot written")
        return
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        points = [r for r in rows if r["mode"] == mode and r["status"] == "ok"]
        if not points:
            continue
        depths = [r["depth"] for r in points]
        key = "device_used_bytes" if "device_used_bytes" in points[0] else None
        if key:
            memory.plot(depths, [r[key] / MIB for r in points], marker="o", label=mode)
        speed.plot(depths, [r["step_ms"] for r in points], marker="o", label=mode)
    memory.set(xlabel="depth (blocks)", ylabel="peak device memory (MiB)", xscale="log")
    speed.set(xlabel="depth (blocks)", ylabel="median step time (ms)", xscale="log")
    speed.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log.info("plot written to %s", path)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="8,16,32", help="comma-separated depths to sweep")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="matepoint-auto's activation budget (default: what checkpointing "
                             "every block needs)")
    parser.add_argument("--out", default="benchmarks/out", help="folder for JSON and PNG")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per (mode, depth)")
    parser.add_argument("--gpu-check", action="store_true",
                        help="the size `make gpu-check` runs (finishes in minutes)")
    parser.add_argument("--child-mode", help=argparse.SUPPRESS)
    parser.add_argument("--child-depth", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gpu_check:
        args.depths, args.hidden, args.seq, args.batch, args.steps = "16,64,128", 1024, 1024, 4, 4
    for name in ("hidden", "heads", "seq", "batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    return args


def measure_overhead(rounds: int, calls: int) -> Dict[str, float]:
    """Per-call time (us) of forward+backward of a checkpointed tiny function:
    no checkpoint, torch's, matepoint's; interleaved rounds, medians."""
    import matepoint
    import torch.utils.checkpoint as tc

    def tiny(t: torch.Tensor) -> torch.Tensor:
        return torch.sin(t) * t

    wrappers = {"plain": lambda fn, t: fn(t),
                "torch": lambda fn, t: tc.checkpoint(fn, t, use_reentrant=False),
                "matepoint": matepoint.checkpoint}
    x = torch.randn(16, requires_grad=True)
    samples: Dict[str, List[float]] = {name: [] for name in wrappers}

    def timed(wrap: Callable) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            wrap(tiny, x).sum().backward()
        return (time.perf_counter() - start) / calls * 1e6

    for wrap in wrappers.values():
        timed(wrap)  # warm-up
    for _ in range(rounds):
        for name, wrap in wrappers.items():
            samples[name].append(timed(wrap))
    result = {name: statistics.median(values) for name, values in samples.items()}
    result["ratio_total"] = result["matepoint"] / result["torch"]
    result["ratio_overhead"] = (result["matepoint"] - result["plain"]) / (result["torch"] - result["plain"])
    return result


def run_cpu(args: argparse.Namespace) -> None:
    log.info("No CUDA GPU here: running the small CPU configuration. GPU memory, step time and "
             "PCIe numbers need a GPU (run this command there).")
    torch.set_num_threads(1)
    overhead = measure_overhead(rounds=10, calls=100)
    log.info("per-call overhead: torch %.1f us, matepoint %.1f us (ratio %.2f; plain call %.1f us)",
             overhead["torch"], overhead["matepoint"], overhead["ratio_total"], overhead["plain"])
    from matepoint.demo import held_bytes, make_model, plain
    model = make_model(16, 256)
    x = torch.randn(64, 256, requires_grad=True)
    held = {"none": held_bytes(model, x, plain), "matepoint": held_bytes(model, x, wrapper_for("matepoint"))}
    log.info("CPU memory held for backward by a 16-block MLP: %.1f MiB without checkpoints, "
             "%.1f MiB with matepoint", held["none"] / MIB, held["matepoint"] / MIB)
    args.hidden, args.heads, args.seq, args.batch, args.steps, args.dtype = 64, 4, 32, 2, 3, "float32"
    depths = [4, 8]
    modes = ["none", "torch", "matepoint", "matepoint-auto"]
    rows = [spawn(args, mode, depth) for depth in depths for mode in modes]
    mark_gradients(rows, tolerance=0.0)
    print_table(rows, cuda=False)
    write_json(args, {"device": "cpu", "rows": rows, "overhead_us": overhead, "held_bytes": held})


def write_json(args: argparse.Namespace, payload: Dict[str, Any]) -> None:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench.json")
    payload.update(torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)
    log.info("results written to %s", path)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.child_mode:
        print(json.dumps(run_child(args)), flush=True)
        return
    if not torch.cuda.is_available():
        run_cpu(args)
        return
    depths = [int(d) for d in args.depths.split(",")]
    modes = args.modes.split(",")
    probe = pcie_probe()
    log.info("%s, torch %s: pinned H2D %.1f GB/s, D2H %.1f GB/s", torch.cuda.get_device_name(),
             torch.__version__, probe["h2d_GBps"], probe["d2h_GBps"])
    rows, total, begun = [], len(depths) * len(modes), time.time()
    for depth in depths:
        for mode in modes:
            log.info("[%d/%d] %s at depth %d (%.0f s so far)", len(rows) + 1, total, mode, depth,
                     time.time() - begun)
            rows.append(spawn(args, mode, depth))
    mark_gradients(rows, tolerance=1e-2 if args.dtype != "float32" else 1e-4)
    throughput = offload_throughput(probe)
    print_table(rows, cuda=True)
    log.info("offload throughput (transfer-bound): %.1f GB/s = %.2f of the D2H probe",
             throughput["offload_GBps"], throughput["fraction_of_d2h"])
    write_json(args, {"device": torch.cuda.get_device_name(), "probe": probe,
                      "offload": throughput, "rows": rows, "config": vars(args)})
    plot(rows, os.path.join(args.out, "bench.png"))


if __name__ == "__main__":
    main()
