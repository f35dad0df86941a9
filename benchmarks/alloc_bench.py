"""Allocator benchmark (GPU): replay one training step's allocation trace.

Records the device allocations of a forward+backward of the deep transformer
stack with torch's memory history, then replays the same sequence of
malloc/free (sizes and streams) through torch's native caching allocator and
through matepoint's, each in a fresh process. Reports the median latency of
malloc+free and peak reserved / peak allocated for both, side by side.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--replay", choices=["torch", "matepoint"], help=argparse.SUPPRESS)
    parser.add_argument("--trace", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
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
