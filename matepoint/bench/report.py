"""From measured runs to what a user reads: each mode's step time and peak
memory as ratios to torch's checkpoint in the same round, the spread of
those ratios over rounds (the noise figure, with a flag where the rounds
disagree on whether a mode is faster or slower than torch), and gradients
judged against torch's own error."""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from matepoint import __version__

log = logging.getLogger("matepoint.bench")
MIB = float(1 << 20)
Key = Tuple[str, int, str]


def _ok(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [r for r in rows if r["status"] == "ok"]


def _per_round(rows: List[Dict[str, Any]], case: str, depth: int, mode: str) -> Dict[int, Dict]:
    return {r["round"]: r for r in _ok(rows)
            if (r["case"], r["depth"], r["mode"]) == (case, depth, mode)}


def _ratios(mine: Dict[int, Dict], torch_runs: Dict[int, Dict], field: str) -> List[float]:
    """mine / torch's per round, each round against its own."""
    return [mine[k][field] / torch_runs[k][field] for k in sorted(mine)
            if k in torch_runs and mine[k].get(field) and torch_runs[k].get(field)]


def _ratio(mine: Dict[int, Dict], torch_runs: Dict[int, Dict], field: str) -> Optional[float]:
    """Median over rounds of mine / torch's, each round against its own."""
    ratios = _ratios(mine, torch_runs, field)
    return statistics.median(ratios) if ratios else None


def _noise(ratios: List[float]) -> Dict[str, Any]:
    """The spread of per-round ratios, and whether it hides the answer.

    ``noisy`` when the rounds disagree on which side of 1 (torch) the mode
    lies, or spread over more than half the median: one more round could
    then change the conclusion."""
    if len(ratios) < 2:
        return {"step_ratio_min": ratios[0] if ratios else None,
                "step_ratio_max": ratios[0] if ratios else None, "noisy": None}
    low, high, middle = min(ratios), max(ratios), statistics.median(ratios)
    straddles = low < 1.0 < high
    return {"step_ratio_min": low, "step_ratio_max": high,
            "noisy": straddles or (high - low) > 0.5 * middle}


def _gradients(first: Dict[str, Any], torch_first: Optional[Dict[str, Any]]) -> str:
    """'exact', 'ok' (no worse than ten times torch's checkpoint's own error
    against the same reference), 'DIFFERS', or '-' when not compared."""
    if "grad_rel_err" not in first:
        return "-"
    if first["grads_exact"]:
        return "exact"
    torch_err = torch_first.get("grad_rel_err") if torch_first else None
    if torch_err is not None and first["grad_rel_err"] <= 10 * max(torch_err, 1e-7):
        return "ok"
    return "DIFFERS"


def _loss_max_diff(first: Dict[str, Any], rows: List[Dict[str, Any]]) -> Optional[float]:
    """Largest difference of this run's loss curve from the reference run's."""
    for r in _ok(rows):
        if r.get("is_reference") and (r["case"], r["depth"]) == (first["case"], first["depth"]):
            return max(abs(a - b) for a, b in zip(first["losses"], r["losses"]))
    return None


def summarize(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One entry per (case, depth, mode), in the order first run."""
    keys: List[Key] = []
    for r in rows:
        key = (r["case"], r["depth"], r["mode"])
        if key not in keys:
            keys.append(key)
    summary = []
    for case, depth, mode in keys:
        runs = _per_round(rows, case, depth, mode)
        entry: Dict[str, Any] = {"case": case, "depth": depth, "mode": mode}
        if not runs:
            failed = [r for r in rows if (r["case"], r["depth"], r["mode"]) == (case, depth, mode)]
            entry["status"] = failed[0]["status"]
            summary.append(entry)
            continue
        torch_runs = _per_round(rows, case, depth, "torch")
        medians = [r["step_ms"] for r in runs.values()]
        first = runs[min(runs)]
        step_ratios = _ratios(runs, torch_runs, "step_ms")
        entry.update(status="ok", rounds=len(runs), step_ms=statistics.median(medians),
                     step_ms_min=min(medians), step_ms_max=max(medians),
                     first_step_ms=statistics.median(r["first_step_ms"] for r in runs.values()),
                     step_ratios=step_ratios, **_noise(step_ratios),
                     step_ratio=_ratio(runs, torch_runs, "step_ms"),
                     memory_ratio=_ratio(runs, torch_runs, "peak_allocated_bytes"),
                     grads=_gradients(first, torch_runs.get(min(runs))),
                     grad_rel_err=first.get("grad_rel_err"),
                     loss_max_diff=_loss_max_diff(first, rows),
                     reference=next((r["mode"] for r in _ok(rows) if r.get("is_reference")
                                     and (r["case"], r["depth"]) == (case, depth)), None))
        for field in ("peak_allocated_bytes", "device_used_bytes", "pinned_host_bytes",
                      "activation_peak_bytes", "predicted_peak_bytes", "budget_bytes",
                      "host_allocations_after_first_step", "reserve_pool_ms"):
            values = [r[field] for r in runs.values() if r.get(field) is not None]
            if values:
                entry[field] = max(values)
        summary.append(entry)
    return summary


def _cell(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def _spread(e: Dict[str, Any]) -> str:
    """The per-round ratios' range, '?' appended where it hides the answer."""
    if e.get("step_ratio_min") is None or e.get("noisy") is None:
        return "1 round"
    return (f"{e['step_ratio_min']:.2f}-{e['step_ratio_max']:.2f}"
            + ("?" if e["noisy"] else ""))


def print_table(summary: List[Dict[str, Any]], cuda: bool) -> None:
    """Logs one row per (case, depth, mode), then what the columns mean."""
    header = (f"{'case':<7} {'depth':>5} {'mode':<18} {'status':>7} {'step/torch':>10} "
              f"{'rounds':>12} {'mem/torch':>9} {'step ms':>9} {'first ms':>9}")
    if cuda:
        header += f" {'alloc MiB':>10} {'device MiB':>10} {'pinned MiB':>10}"
    else:
        header += f" {'heap MiB':>9}"
    header += f" {'grads':>7} {'rel err':>8}"
    log.info(header)
    for e in summary:
        line = f"{e['case']:<7} {e['depth']:>5} {e['mode']:<18} {e['status']:>7}"
        if e["status"] == "ok":
            line += (f" {_cell(e['step_ratio'], '.3f'):>10} {_spread(e):>12}"
                     f" {_cell(e['memory_ratio'], '.3f'):>9}"
                     f" {e['step_ms']:>9.1f} {e['first_step_ms']:>9.1f}")
            if cuda:
                line += (f" {_cell(e.get('peak_allocated_bytes'), '.0f', MIB):>10}"
                         f" {_cell(e.get('device_used_bytes'), '.0f', MIB):>10}"
                         f" {_cell(e.get('pinned_host_bytes'), '.0f', MIB):>10}")
            else:
                line += f" {_cell(e.get('peak_allocated_bytes'), '.2f', MIB):>9}"
            line += f" {e['grads']:>7} {_cell(e['grad_rel_err'], '.1e'):>8}"
        log.info(line)
    for note in LEGEND if not cuda else LEGEND[:2]:
        log.info(note)
    noisy = [e for e in summary if e.get("noisy")]
    if noisy:
        log.warning("%d row(s) marked '?': their rounds disagree by more than the ratio can "
                    "resolve; run with more --repeats, on an idle machine", len(noisy))


LEGEND = (
    "step/torch, mem/torch: median over rounds of each round's ratio to torch's checkpoint "
    "(run in the same round); rounds: the lowest-highest per-round step ratio, '?' where the "
    "rounds disagree on which side of torch the mode lies or spread over half the median.",
    "first ms: the first step, reported apart and left out of 'step ms': in every process it "
    "includes one-time lazy initialisation (torch's kernels and autograd, allocator caches, "
    "pinned buffers), far slower than later steps. Not in it: importing torch._dynamo, which "
    "torch's checkpoint does on its first call (seconds), done once for all runs.",
    "mem/torch and heap MiB on the CPU: the C heap's peak during one extra step, sampled "
    "after every operation (matepoint._meter.PeakMeter), above what was in use before it.",
)


def write_json(folder: str, payload: Dict[str, Any]) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "bench.json")
    payload.update(matepoint=__version__, torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)
    log.info("results written to %s", os.path.abspath(path))
    return path


def plot(summary: List[Dict[str, Any]], case: str, path: str) -> None:
    """Peak memory and step time, as ratios to torch's checkpoint, against depth."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: no plot written")
        return
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in dict.fromkeys(e["mode"] for e in summary if e["case"] == case):
        points = [e for e in summary if e["case"] == case and e["mode"] == mode
                  and e["status"] == "ok" and e.get("step_ratio") is not None]
        depths = [e["depth"] for e in points]
        if any(e.get("memory_ratio") is not None for e in points):
            memory.plot(depths, [e.get("memory_ratio") for e in points], marker="o", label=mode)
        speed.plot(depths, [e["step_ratio"] for e in points], marker="o", label=mode)
    memory.set(xlabel="depth (blocks)", ylabel="peak allocated / torch checkpoint", xscale="log")
    speed.set(xlabel="depth (blocks)", ylabel="median step time / torch checkpoint", xscale="log")
    speed.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log.info("plot written to %s", path)
