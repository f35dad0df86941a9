"""Does torch keep working under matepoint's allocator on a real GPU?

Run by ``make gpu-check`` (benchmarks/gpu_check.sh). In one process, after
``matepoint.install_allocator()``, each probe runs in its own try block with
a time limit and reports PASS or FAIL, its error and its seconds:

  train        a few checkpointed training steps, torch.cuda.max_memory_allocated()
               logged per step and compared with matepoint's own peak
  cudnn        a conv net with torch.backends.cudnn.benchmark = True (cacheInfo)
  graph        torch.cuda.graph capture and replay (a private pool), a second
               graph sharing the pool, make_graphed_callables
  compile      torch.compile(mode="reduce-overhead") training steps (cudagraph
               trees switch between the forward and backward graphs' pool states)
  mempool      torch.cuda.MemPool and use_mem_pool
  snapshot     _record_memory_history, _snapshot, _dump_snapshot, rendered by
               torch.cuda._memory_viz to HTML
  ipc          an interior view of a CUDA tensor shared with spawned processes
               (one on torch's allocator, one on matepoint's), read back

Results go to OUT/allocator_probe.json (and the snapshot files beside it).
``--dry-run`` (no GPU needed) checks the script imports and parses, writes
the JSON with every probe skipped, and says why; it never writes a number.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

log = logging.getLogger("allocator_probe")
MIB = 1 << 20


class ProbeTimeout(Exception):
    """A probe ran past its time limit."""


def _alarm(signum: int, frame: Any) -> None:
    raise ProbeTimeout("ran past its time limit")


def run_probe(name: str, probe: Callable[[], Dict[str, Any]], limit_s: int) -> Dict[str, Any]:
    """One probe under a SIGALRM time limit: its result, PASS or FAIL."""
    started = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit_s)
    try:
        details = probe()
        result = {"status": "PASS", **details}
    except Exception as error:  # every failure is a finding: report it, go on
        result = {"status": "FAIL", "error": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc(limit=8)}
    finally:
        signal.alarm(0)
    result["seconds"] = round(time.perf_counter() - started, 2)
    log.info("%-9s %s (%.1f s)%s", name, result["status"], result["seconds"],
             f": {result['error']}" if "error" in result else "")
    return result


# ---- probes ------------------------------------------------------------------------------

def _block(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                               torch.nn.Linear(4 * width, width))


def probe_train() -> Dict[str, Any]:
    import matepoint
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_block(1024) for _ in range(8)).cuda()
    optimizer = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    x = torch.randn(16, 512, 1024, device="cuda")
    peaks: List[int] = []
    for _ in range(4):
        torch.cuda.reset_peak_memory_stats()
        h = x
        for block in blocks:
            h = matepoint.checkpoint(block, h)
        h.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    mine = matepoint.memory_stats()["peak_allocated_bytes"]
    if mine != peaks[-1]:
        raise AssertionError(f"torch's max_memory_allocated {peaks[-1]} != matepoint's {mine}")
    return {"max_memory_allocated_mib": [round(p / MIB, 1) for p in peaks],
            "memory_reserved_mib": round(torch.cuda.memory_reserved() / MIB, 1)}


def probe_cudnn() -> Dict[str, Any]:
    torch.backends.cudnn.benchmark = True
    try:
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(64, 128, 3, padding=1, stride=2), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(128, 10)).cuda()
        x = torch.randn(32, 3, 128, 128, device="cuda")
        for _ in range(3):
            net(x).logsumexp(1).mean().backward()
        torch.cuda.synchronize()
    finally:
        torch.backends.cudnn.benchmark = False
    return {"max_memory_allocated_mib": round(torch.cuda.max_memory_allocated() / MIB, 1)}


def probe_graph() -> Dict[str, Any]:
    torch.manual_seed(0)
    model = _block(256).cuda()
    static_in = torch.randn(64, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):                      # warm-up, as torch's docs ask
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_in)
    shared = torch.cuda.CUDAGraph()
    with torch.cuda.graph(shared, pool=graph.pool()):
        static_twice = model(static_out)
    errors = []
    for _ in range(3):
        static_in.copy_(torch.randn(64, 256, device="cuda"))
        graph.replay()
        shared.replay()
        with torch.no_grad():
            expected = model(static_in)
            errors.append(float((static_out - expected).abs().max()))
            errors.append(float((static_twice - model(expected)).abs().max()))
    if max(errors) > 1e-4:
        raise AssertionError(f"replay differs from eager by {max(errors)}")
    reserved_with_graphs = torch.cuda.memory_reserved()
    del graph, shared, static_out, static_twice
    torch.cuda.empty_cache()
    callable_ = torch.cuda.make_graphed_callables(_block(256).cuda(),
                                                  (torch.randn(8, 256, device="cuda",
                                                               requires_grad=True),))
    y = callable_(torch.randn(8, 256, device="cuda", requires_grad=True))
    y.sum().backward()
    torch.cuda.synchronize()
    return {"max_replay_error": max(errors),
            "reserved_with_graphs_mib": round(reserved_with_graphs / MIB, 1),
            "reserved_after_release_mib": round(torch.cuda.memory_reserved() / MIB, 1)}


def probe_compile() -> Dict[str, Any]:
    """Training steps: cudagraph trees record a forward and a backward graph
    into one pool and switch between them (getCheckpointState /
    setCheckpointPoolState), then inference with the same module."""
    torch.manual_seed(0)
    model = _block(512).cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    errors = []
    for _ in range(4):
        x = torch.randn(32, 512, device="cuda")
        model.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        errors += [float((a - p.grad).abs().max()) for a, p in zip(got, model.parameters())]
    for _ in range(2):
        x = torch.randn(32, 512, device="cuda")
        with torch.no_grad():
            errors.append(float((compiled(x).clone() - model(x)).abs().max()))
    torch.cuda.synchronize()
    if max(errors) > 1e-2:
        raise AssertionError(f"compiled results differ from eager by {max(errors)}")
    return {"max_error": max(errors)}


def probe_mempool() -> Dict[str, Any]:
    """torch.cuda.MemPool / use_mem_pool: the pool's allocations in its own
    segments, its memory back once it is gone."""
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        inside = torch.ones(1 << 20, device="cuda")
    outside = torch.ones(1 << 20, device="cuda")
    segments = pool.snapshot()
    if not any(s["address"] <= inside.data_ptr() < s["address"] + s["total_size"]
               for s in segments):
        raise AssertionError("an allocation inside use_mem_pool is not in the pool's segments")
    if any(s["address"] <= outside.data_ptr() < s["address"] + s["total_size"]
           for s in segments):
        raise AssertionError("an allocation outside use_mem_pool landed in the pool")
    reserved = torch.cuda.memory_reserved()
    del inside, pool, segments
    torch.cuda.synchronize()
    return {"reserved_mib": round(reserved / MIB, 1),
            "reserved_after_release_mib": round(torch.cuda.memory_reserved() / MIB, 1)}


def probe_snapshot(out: str) -> Dict[str, Any]:
    import matepoint
    from torch.cuda import _memory_viz
    torch.cuda.memory._record_memory_history(max_entries=100000)
    try:
        blocks = torch.nn.ModuleList(_block(512) for _ in range(4)).cuda()
        h = torch.randn(8, 256, 512, device="cuda", requires_grad=True)
        for block in blocks:
            h = matepoint.checkpoint(block, h)
        h.sum().backward()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._dump_snapshot(os.path.join(out, "snapshot.pickle"))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    html = _memory_viz.trace_plot(snapshot)
    with open(os.path.join(out, "snapshot.html"), "w") as file:
        file.write(html)
    actions: Dict[str, int] = {}
    for trace in snapshot.get("device_traces", []):
        for entry in trace:
            actions[entry["action"]] = actions.get(entry["action"], 0) + 1
    if not snapshot.get("segments") or not actions.get("alloc"):
        raise AssertionError(f"an empty snapshot: {len(snapshot.get('segments', []))} "
                             f"segments, actions {actions}")
    return {"segments": len(snapshot["segments"]), "actions": actions,
            "html_bytes": len(html)}


def _ipc_child(queue: Any, answers: Any, install: bool) -> None:
    """A spawned process: reads the shared view, answers its sum and head."""
    if install:
        import matepoint
        matepoint.install_allocator()
    view = queue.get()
    answers.put((float(view.sum()), view[:4].tolist()))
    del view


def probe_ipc() -> Dict[str, Any]:
    import torch.multiprocessing as mp
    import ctypes
    from matepoint import _C
    from matepoint._allocator import allocator_path
    pad = torch.empty(1000, device="cuda")               # the tensor below is not a segment's start
    data = torch.arange(4096, dtype=torch.float32, device="cuda")
    view = data[100:1100]
    base_of = getattr(ctypes.CDLL(allocator_path()), _C.ALLOCATOR_SYMBOLS["base_allocation"])
    base_of.restype = ctypes.c_void_p
    base_of.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    offset = data.data_ptr() - base_of(data.data_ptr(), ctypes.byref(ctypes.c_size_t()))
    if offset <= 0:
        raise AssertionError("premise: the shared block should sit inside its segment")
    context = mp.get_context("spawn")
    results = {}
    for install in (False, True):
        queue, answers = context.Queue(), context.Queue()
        child = context.Process(target=_ipc_child, args=(queue, answers, install))
        child.start()
        queue.put(view)
        got = answers.get(timeout=60)
        child.join(timeout=60)
        expected = (float(view.sum()), view[:4].tolist())
        if got != expected:
            raise AssertionError(f"the receiver read {got}, expected {expected}")
        results["receiver_" + ("matepoint" if install else "torch")] = "ok"
    del pad
    return {"offset_bytes": offset, **results}


PROBES = ("train", "cudnn", "graph", "compile", "mempool", "snapshot", "ipc")
LIMITS_S = {"train": 60, "cudnn": 60, "graph": 60, "compile": 150, "mempool": 30, "snapshot": 60,
            "ipc": 90}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join("build", "gpu-check")),
                        help="folder for allocator_probe.json and the snapshot ($OUT, default "
                             "build/gpu-check)")
    parser.add_argument("--probes", default=",".join(PROBES),
                        help=f"comma-separated, of {', '.join(PROBES)}")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the script without a GPU: every probe skipped")
    args = parser.parse_args(argv)
    unknown = set(args.probes.split(",")) - set(PROBES)
    if unknown:
        parser.error(f"unknown probes {sorted(unknown)}; choose from {', '.join(PROBES)}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    report: Dict[str, Any] = {"torch": torch.__version__, "probes": {}}
    names = args.probes.split(",")
    if args.dry_run or not torch.cuda.is_available():
        reason = "--dry-run" if args.dry_run else "no CUDA GPU in this process"
        log.info("allocator probe: every probe skipped (%s)", reason)
        report["probes"] = {name: {"status": "SKIPPED", "reason": reason} for name in names}
    else:
        import matepoint
        report["device"] = torch.cuda.get_device_name(0)
        report["oom_raises"] = matepoint.install_allocator()
        calls = {"train": probe_train, "cudnn": probe_cudnn, "graph": probe_graph,
                 "compile": probe_compile, "mempool": probe_mempool, "snapshot": lambda: probe_snapshot(args.out),
                 "ipc": probe_ipc}
        for name in names:
            report["probes"][name] = run_probe(name, calls[name], LIMITS_S[name])
    path = os.path.join(args.out, "allocator_probe.json")
    with open(path, "w") as file:
        json.dump(report, file, indent=2)
    log.info("allocator probe: %s", path)
    return 1 if any(p["status"] == "FAIL" for p in report["probes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
