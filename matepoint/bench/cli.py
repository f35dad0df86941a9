"""matepoint benchmark: what matepoint buys against torch's checkpoint.

``python -m matepoint.bench`` (or ``matepoint-bench``) runs each case under
each mode, every (case, depth, mode) in its own process, repeated over
--repeats rounds (3) in alternating order, and prints a table that leads with
each mode's step time and peak memory as ratios to torch's checkpoint in
the same round, the range of the per-round ratios (marked '?' where the
rounds disagree more than the ratio can resolve) and the first step apart;
bench.json (with the configuration that ran) and bench.png go to --out
(default: benchmarks/out under the current directory). Cases:

  stack    transformer encoder blocks, swept over --depths (matepoint-auto:
           the planner's choice within --budget-gib)
  latent   the deep-latent case: 200 windowed-attention blocks on a 200 MiB
           latent (as deep as half the GPU memory holds), first step apart
  gpt2     Hugging Face GPT-2 (24 x 1024) from a config, a few SGD steps
  llama    Hugging Face Llama (16 x 1024), likewise

Modes: none, torch, torch+save_on_cpu, matepoint, matepoint+alloc,
matepoint+spill (latent, GPU only: the disk tier with the host limit at
half the offloaded bytes), matepoint-auto. Gradients are compared with the no-checkpoint run (or
torch's checkpoint where that ran out of memory) by the largest norm-wise
relative error over parameters, judged against torch's own error. On a GPU
it also probes the host-device link and the offload throughput on a warm
pool. Without a GPU it runs small CPU configurations and says so; peak
memory there is the C heap's, sampled during one extra step.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

from matepoint import __version__
from matepoint.bench import link, report, runner
from matepoint.bench.cases import CASES

# The CPU run's default: the Hugging Face cases would take about as long
# again as these two (40 s against 37 s for one round on the 2-core VM) and
# need transformers; `--cases gpt2,llama` runs them.
CPU_CASES = ("stack", "latent")
from matepoint.bench.modes import MODES
from matepoint.bench.overhead import measure_overhead

log = logging.getLogger("matepoint.bench")
REFERENCE_MODES = ("none", "torch")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=None,
                        help="comma-separated cases (default: all on a GPU; on the CPU "
                             f"{','.join(CPU_CASES)}, the Hugging Face ones only when named)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--depths", default="8,16,32", help="the stack case's depths")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--latent-tokens", type=int, default=204800,
                        help="tokens of the latent case's input (x 512 wide)")
    parser.add_argument("--latent-depth", type=int, default=0,
                        help="the latent case's depth (default: sized to the GPU)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run, the first apart")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds over all runs; the spread of their ratios is the noise "
                             "figure (default 3)")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="matepoint-auto's activation budget (default: what checkpointing "
                             "every block needs)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "out"),
                        help="folder for bench.json and bench.png, created if missing "
                             "(default: benchmarks/out under the current directory)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--gpu-check", action="store_true",
                        help="the size `make gpu-check` runs (finishes in minutes)")
    args = parser.parse_args(argv)
    if args.gpu_check:  # one round of every case: fits a 10-minute GPU session
        args.depths, args.steps, args.repeats = "16,128", 4, 1
    for name in ("hidden", "heads", "seq", "batch", "steps", "latent_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is reported apart)")
    for option, known in (("modes", MODES), ("cases", list(CASES))):
        unknown = set((getattr(args, option) or known[0]).split(",")) - set(known)
        if unknown:
            parser.error(f"unknown {option} {sorted(unknown)}; choose from {known}")
    return args


def configuration(args: argparse.Namespace, cuda: bool) -> Dict[str, Any]:
    """What will run on this machine: rounds, steps, and per case its sizes,
    depths and modes (on the CPU, its small sizes, not the GPU defaults)."""
    wanted = args.modes.split(",")
    if not cuda:  # the allocator is CUDA's; save_on_cpu and the disk tier move nothing off a CPU
        wanted = [m for m in wanted
                  if m not in ("matepoint+alloc", "torch+save_on_cpu", "matepoint+spill")]
    cases: Dict[str, Any] = {}
    names = args.cases.split(",") if args.cases else list(CASES) if cuda else list(CPU_CASES)
    for name in names:
        case = CASES[name]
        reason = case.unavailable()
        if reason:
            log.info("case %s skipped: %s", name, reason)
            cases[name] = {"skipped": reason}
            continue
        cases[name] = {"sizes": case.sizes(args, cuda), "depths": case.depths(args, cuda),
                       "modes": [m for m in case.MODES if m in wanted]}
    return {"device": "cuda" if cuda else "cpu", "cpu_threads": None if cuda else 1,
            "rounds": args.repeats, "steps": args.steps,
            "budget_gib": args.budget_gib, "out": os.path.abspath(args.out), "cases": cases}


def run_cases(config: Dict[str, Any], timeout: float, folder: str) -> List[Dict[str, Any]]:
    """Every (case, depth, mode) of ``config`` once per round. Round 0 runs
    the modes in order and gives each depth its reference gradients (the
    first of none/torch that completes); later rounds alternate the order."""
    rows: List[Dict[str, Any]] = []
    rounds = config["rounds"]
    plan = [(name, depth, case["sizes"], case["modes"])
            for name, case in config["cases"].items() if "skipped" not in case
            for depth in case["depths"]]
    runner.preload([module for name in config["cases"]
                    for module in getattr(CASES[name], "IMPORTS", ())])
    total, begun = rounds * sum(len(m) for *_, m in plan), time.time()
    for round_index in range(rounds):
        for name, depth, size, modes in plan:
            order = modes if round_index % 2 == 0 else list(reversed(modes))
            reference = os.path.join(folder, f"{name}-{depth}.pt")
            have_reference = False
            for mode in order:
                spec = {"case": name, "mode": mode, "depth": depth, "size": size,
                        "round": round_index, "steps": config["steps"],
                        "budget_gib": config["budget_gib"]}
                writes = round_index == 0 and not have_reference and mode in REFERENCE_MODES
                if round_index == 0:
                    spec.update(reference=reference, write_reference=writes)
                log.info("[%d/%d] round %d: %s at depth %d, %s (%.0f s so far)", len(rows) + 1,
                         total, round_index, name, depth, mode, time.time() - begun)
                row = runner.spawn(spec, timeout)
                if writes and row["status"] == "ok":
                    have_reference, row["is_reference"] = True, True
                rows.append(row)
    return rows


def held_for_backward() -> Dict[str, int]:
    """Bytes autograd keeps between forward and backward, with and without."""
    import matepoint
    from matepoint.demo import held_bytes, make_model, plain
    model = make_model(16, 256)
    x = torch.randn(64, 256, requires_grad=True)
    return {"none": held_bytes(model, x, plain),
            "matepoint": held_bytes(model, x, matepoint.checkpoint)}


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = torch.cuda.is_available()
    log.info("matepoint %s, torch %s", __version__, torch.__version__)
    payload: Dict[str, Any] = {"arguments": vars(args)}
    if cuda:
        payload["device"] = torch.cuda.get_device_name()
        payload["probe"] = link.probe()
        log.info("%s, torch %s: pinned H2D %.1f GB/s, D2H %.1f GB/s", payload["device"],
                 torch.__version__, payload["probe"]["h2d_GBps"], payload["probe"]["d2h_GBps"])
    else:
        payload["device"] = "cpu"
        log.info("No CUDA GPU here: running the small CPU configuration. GPU memory, step time "
                 "and PCIe numbers need a GPU (run this command there).")
        torch.set_num_threads(1)
        payload["overhead_us"] = overhead = measure_overhead(rounds=10, calls=100)
        log.info("per-call overhead: torch %.1f us, matepoint %.1f us (ratio %.2f; plain call "
                 "%.1f us)", overhead["torch"], overhead["matepoint"], overhead["ratio_total"],
                 overhead["plain"])
        payload["held_bytes"] = held = held_for_backward()
        log.info("CPU memory held for backward by a 16-block MLP: %.1f MiB without checkpoints, "
                 "%.1f MiB with matepoint", held["none"] / report.MIB,
                 held["matepoint"] / report.MIB)
    payload["config"] = config = configuration(args, cuda)
    with tempfile.TemporaryDirectory(prefix="matepoint-bench-") as folder:
        payload["rows"] = run_cases(config, args.timeout, folder)
    payload["summary"] = summary = report.summarize(payload["rows"])
    if cuda and "matepoint" in args.modes.split(","):
        payload["offload"] = offload = link.offload_throughput(payload["probe"]["d2h_GBps"])
    report.print_table(summary, cuda)
    if cuda and "offload" in payload:
        log.info("offload throughput (transfer-bound, warm pool): %.1f GB/s = %.2f of the D2H "
                 "probe", offload["offload_GBps"], offload["fraction_of_d2h"])
    report.write_json(args.out, payload)
    report.plot(summary, "stack", os.path.join(args.out, "bench.png"))
