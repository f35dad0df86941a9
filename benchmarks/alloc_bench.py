"""Allocator benchmarks: replay one training step's allocation trace.

GPU (default): records the device allocations of a forward+backward of the
deep transformer stack with torch's memory history, then replays the same
sequence of malloc/free (sizes and streams) through torch's native caching
allocator and through matepoint's, each in a fresh process. Reports the
median latency of malloc+free and peak reserved / peak allocated for both.

Host (``--host``, no GPU needed): replays a synthetic multi-stream step (a
compute stream plus side streams that allocate gathered parameters and
reduce buffers used on the compute stream, as FSDP's all-gather and NCCL
streams do) through matepoint's allocator on its host backend, with 1 and
with 4 streams: the same sizes in the same order, only the streams (and the
record_stream calls that come with them) differ. A small C driver
(benchmarks/alloc_replay.c), compiled here against csrc/alloc, times the
replay in thread CPU time (time descheduled on a shared machine is not
counted), so no Python call is timed. Reports ns per malloc+free pair and
the ratio 4-stream / 1-stream; ``--baseline REV`` builds the allocator of a git
revision too and reports it beside.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

import torch

log = logging.getLogger("matepoint.alloc_bench")
Op = Tuple[str, int, int]   # ("alloc" | "free", allocation id, size)


def record_trace(depth: int, hidden: int, seq: int, batch: int) -> List[Op]:
    import matepoint
    from matepoint.bench.cases.stack import build_blocks
    size = {"hidden": hidden, "heads": max(1, hidden // 64), "dtype": "bfloat16"}
    blocks = build_blocks(depth, size, torch.device("cuda"))
    x = torch.randn(batch, seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    h = x
    for block in blocks:
        h = matepoint.checkpoint(block, h)
    h.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    ops, live = [], {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = len(live) + len(ops)
            ops.append(("alloc", live[event["addr"]], event["size"]))
        elif event["action"] == "free_completed" and event["addr"] in live:
            ops.append(("free", live.pop(event["addr"]), event["size"]))
    return ops


def replay(ops: List[Op], backend: str) -> Dict[str, float]:
    stream = torch.cuda.current_stream()
    pointers: Dict[int, int] = {}
    latencies: List[float] = []
    if backend == "matepoint":
        import matepoint
        from matepoint import _C
        from matepoint._allocator import allocator_path
        lib = ctypes.CDLL(allocator_path())
        lib.matepoint_malloc.restype = ctypes.c_void_p
        lib.matepoint_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.matepoint_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        _C._attach_allocator(allocator_path())
        raw = ctypes.c_void_p(stream.cuda_stream)
        alloc = lambda size: lib.matepoint_malloc(size, 0, raw)  # noqa: E731
        free = lambda ptr, size: lib.matepoint_free(ptr, size, 0, raw)  # noqa: E731
    else:
        alloc = lambda size: torch.cuda.caching_allocator_alloc(size, 0, stream)  # noqa: E731
        free = lambda ptr, size: torch.cuda.caching_allocator_delete(ptr)  # noqa: E731
    for _ in range(3):  # the first pass fills the cache; the later ones are steady state
        for kind, ident, size in ops:
            start = time.perf_counter_ns()
            if kind == "alloc":
                pointers[ident] = alloc(size)
            else:
                free(pointers.pop(ident), size)
            latencies.append(time.perf_counter_ns() - start)
        for ident in list(pointers):
            free(pointers.pop(ident), 0)
    if backend == "matepoint":
        stats = matepoint.memory_stats()
        peaks = stats["peak_reserved_bytes"], stats["peak_allocated_bytes"]
    else:
        peaks = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    steady = latencies[len(latencies) // 3:]
    return {"median_op_ns": statistics.median(steady), "reserved_over_allocated": peaks[0] / peaks[1]}


# ---- host backend: synthetic multi-stream trace -------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the replay needs: the allocator and its host backend, and the helpers
# of csrc/common they use; not the library's entry points or the CUDA backend.
REPLAY_FOLDERS = ("alloc", "common")
REPLAY_SKIPPED = ("entry.c", "entry_pools.c", "entry.h", "alloc_cuda.c", "alloc_cuda.h")


def synthetic_step(depth: int, streams: int, seed: int = 0) -> List[str]:
    """One forward+backward of a `depth`-layer stack as trace lines.

    Per layer the compute stream (0) allocates temporaries and two saved
    activations; a side stream allocates the gathered parameters (forward and
    backward) and a gradient reduce buffer, used on the compute stream
    (record_stream) and freed after the layer. The GPU catches up once per
    layer ("c"). With one stream every allocation is on stream 0 and no
    record_stream happens; the sizes and their order are the same.
    """
    rng = random.Random(seed)
    lines: List[str] = []
    next_id = 0

    def alloc(size: int, stream: int) -> int:
        nonlocal next_id
        lines.append(f"a {next_id} {size} {stream}")
        next_id += 1
        return next_id - 1

    def side(layer: int) -> int:
        return 1 + layer % (streams - 1) if streams > 1 else 0

    def used_on_compute(ident: int, stream: int) -> None:
        if stream != 0:
            lines.append(f"r {ident} 0")

    def temporaries(count: int) -> None:
        held = []
        for _ in range(count):
            size = rng.choice((512, 4096, 65536, 1 << 20, 3 << 20)) + rng.randrange(4096)
            held.append(alloc(size, 0))
            if len(held) > 2:
                lines.append(f"f {held.pop(rng.randrange(len(held)))}")
        lines.extend(f"f {ident}" for ident in held)

    saved: List[List[int]] = []
    param_bytes, act_bytes = 6 << 20, 2 << 20
    for layer in range(depth):
        stream = side(layer)
        gathered = alloc(param_bytes, stream)
        used_on_compute(gathered, stream)
        temporaries(6)
        saved.append([alloc(act_bytes, 0), alloc(act_bytes // 4 + rng.randrange(4096), 0)])
        lines.append(f"f {gathered}")
        lines.append("c")
    for layer in reversed(range(depth)):
        stream = side(layer)
        gathered = alloc(param_bytes, stream)
        used_on_compute(gathered, stream)
        temporaries(8)
        grad = alloc(param_bytes, 0)
        reduced = alloc(param_bytes // 4, stream)
        used_on_compute(reduced, stream)
        lines.extend(f"f {ident}" for ident in saved.pop())
        lines.append(f"f {gathered}")
        lines.append(f"f {grad}")
        lines.append(f"f {reduced}")
        lines.append("c")
    return lines


def _replay_files(revision: str) -> List[str]:
    """The C files of the replay's folders, as paths under csrc/."""
    if revision:
        listing = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", revision]
                                 + [f"csrc/{folder}/" for folder in REPLAY_FOLDERS],
                                 capture_output=True, text=True, check=True).stdout.split()
        paths = [path[len("csrc/"):] for path in listing]
    else:
        paths = [f"{folder}/{name}" for folder in REPLAY_FOLDERS
                 for name in os.listdir(os.path.join(ROOT, "csrc", folder))]
    return sorted(path for path in paths if path.endswith((".c", ".h"))
                  and os.path.basename(path) not in REPLAY_SKIPPED)


def build_replay(workdir: str, revision: str = "") -> str:
    """Compiles benchmarks/alloc_replay.c against csrc/alloc (of `revision`
    when given, else the working tree); returns the executable's path."""
    source_root = os.path.join(workdir, revision or "tree")
    sources = []
    for path in _replay_files(revision):
        target = os.path.join(source_root, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if revision:
            text = subprocess.run(["git", "-C", ROOT, "show", f"{revision}:csrc/{path}"],
                                  capture_output=True, text=True, check=True).stdout
            with open(target, "w") as handle:
                handle.write(text)
        else:
            shutil.copy(os.path.join(ROOT, "csrc", path), target)
        if path.endswith(".c"):
            sources.append(target)
    binary = os.path.join(workdir, f"alloc_replay_{revision or 'tree'}")
    cc = os.environ.get("CC", "cc")
    # -flto, as setup.py builds the allocator's library
    subprocess.run([cc, "-std=c11", "-O2", "-flto", "-DNDEBUG", "-I", source_root, "-o", binary,
                    os.path.join(ROOT, "benchmarks", "alloc_replay.c")] + sources + ["-lpthread"],
                   check=True)
    return binary


def run_replay(binary: str, trace: str, repeats: int) -> Dict[str, float]:
    proc = subprocess.run([binary, trace, str(repeats)], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def host_benchmark(depth: int, repeats: int, rounds: int, baseline: str) -> Dict[str, object]:
    """Replays the synthetic step with 1 and 4 streams, interleaved over
    `rounds`; the figure per configuration is the median over rounds of the
    best pass (ns per malloc+free pair)."""
    results: Dict[str, object] = {
        "cpu": platform.processor() or platform.machine(), "machine": platform.node(),
        "date": time.strftime("%Y-%m-%d"), "depth": depth, "repeats": repeats, "rounds": rounds,
        "load_average_before": os.getloadavg()[0],
    }
    with open("/proc/cpuinfo") as handle:
        names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
    if names:
        results["cpu"] = f"{names[0]} ({len(names)} logical CPUs)"
    with tempfile.TemporaryDirectory() as workdir:
        builds = {"tree": build_replay(workdir)}
        if baseline:
            builds[baseline] = build_replay(workdir, baseline)
        traces = {}
        for streams in (1, 4):
            traces[streams] = os.path.join(workdir, f"trace_{streams}.txt")
            lines = synthetic_step(depth, streams)
            with open(traces[streams], "w") as handle:
                handle.write("\n".join(lines) + "\n")
        samples: Dict[Tuple[str, int], List[Dict[str, float]]] = {}
        for _ in range(rounds):
            for name, binary in builds.items():
                for streams, trace in traces.items():
                    samples.setdefault((name, streams), []).append(
                        run_replay(binary, trace, repeats))
    for (name, streams), runs in samples.items():
        entry = results.setdefault(name, {})
        entry[f"{streams}_streams"] = {
            "pair_ns": statistics.median(r["best_pair_ns"] for r in runs),
            "pairs": runs[0]["pairs"], "segments": runs[0]["segments"],
            "peak_reserved_over_allocated": runs[0]["peak_reserved_bytes"]
            / runs[0]["peak_allocated_bytes"],
        }
        if streams == 4:
            entry["ratio_4_over_1"] = entry["4_streams"]["pair_ns"] / entry["1_streams"]["pair_ns"]
    return results


def log_host(results: Dict[str, object]) -> None:
    log.info("host backend, synthetic step (depth %d), %s, %s, load average %.1f before",
             results["depth"], results["cpu"], results["date"], results["load_average_before"])
    log.info("%-12s %8s %14s %10s %20s", "allocator", "streams", "ns per pair", "segments",
             "reserved/allocated")
    for name, entry in results.items():
        if not isinstance(entry, dict):
            continue
        for streams in (1, 4):
            r = entry[f"{streams}_streams"]
            log.info("%-12s %8d %14.1f %10d %20.3f", name, streams, r["pair_ns"], r["segments"],
                     r["peak_reserved_over_allocated"])
        log.info("%-12s ratio 4-stream / 1-stream: %.3f", name, entry["ratio_4_over_1"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--host", action="store_true",
                        help="replay a synthetic 1- and 4-stream trace on the host backend (no GPU)")
    parser.add_argument("--host-depth", type=int, default=48, help="layers of the synthetic step")
    parser.add_argument("--repeats", type=int, default=30, help="host: timed passes per run")
    parser.add_argument("--rounds", type=int, default=7, help="host: interleaved runs per case")
    parser.add_argument("--baseline", default="", help="host: also build csrc/alloc of this git revision")
    parser.add_argument("--json", help="host: write the results to this file")
    parser.add_argument("--replay", choices=["torch", "matepoint"], help=argparse.SUPPRESS)
    parser.add_argument("--trace", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.host:
        for name in ("host_depth", "repeats", "rounds"):
            if getattr(args, name) <= 0:
                parser.error(f"--{name.replace('_', '-')} must be a positive integer")
        results = host_benchmark(args.host_depth, args.repeats, args.rounds, args.baseline)
        log_host(results)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=2)
        return
    if not torch.cuda.is_available():
        log.info("alloc_bench needs a CUDA GPU")
        return
    if args.replay:
        with open(args.trace) as handle:
            ops = [tuple(op) for op in json.load(handle)]
        print(json.dumps(replay(ops, args.replay)), flush=True)
        return
    ops = record_trace(args.depth, args.hidden, args.seq, args.batch)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(ops, handle)
    results = {}
    for backend in ("torch", "matepoint"):
        proc = subprocess.run([sys.executable, __file__, "--replay", backend, "--trace", handle.name],
                              capture_output=True, text=True, check=True)
        results[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
    log.info("trace: %d operations from one training step (depth %d, hidden %d)", len(ops),
             args.depth, args.hidden)
    log.info("%-10s %16s %26s", "allocator", "median op (ns)", "peak reserved / allocated")
    for backend, r in results.items():
        log.info("%-10s %16.0f %26.3f", backend, r["median_op_ns"], r["reserved_over_allocated"])
    log.info("latency ratio matepoint/torch: %.2f",
             results["matepoint"]["median_op_ns"] / results["torch"]["median_op_ns"])


if __name__ == "__main__":
    main()
