"""Runs one (case, mode, depth) in a process of its own and measures it:
first and steady step times, peak memory, pinned host memory, and the
gradients against a reference run of the same case."""
from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import statistics
import tempfile
from typing import Any, Dict, List, Optional, Sequence

import torch

from matepoint._timing import timed
from matepoint.bench import modes
from matepoint.bench.cases import CASES
from matepoint.bench.workload import Workload


def _device_used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _gradient_errors(parameters: List[torch.nn.Parameter], path: str) -> Dict[str, Any]:
    """Norm-wise relative error of each parameter's gradient against the
    reference's, the largest of them, and whether all are bit-identical."""
    reference = torch.load(path)
    if len(reference) != len(parameters):
        raise RuntimeError(f"reference has {len(reference)} gradients, this run {len(parameters)}")
    worst, exact = 0.0, True
    for p, ref in zip(parameters, reference):
        got = p.grad.detach().cpu()
        exact = exact and torch.equal(got, ref)
        diff = (got.double() - ref.double()).norm().item()
        worst = max(worst, diff / max(ref.double().norm().item(), 1e-30))
    return {"grad_rel_err": worst, "grads_exact": exact}


def _step(work: Workload, mode: str) -> torch.Tensor:
    with modes.step_context(mode):
        return work.run_step()


def _measure(work: Workload, mode: str, steps: int, cuda: bool) -> Dict[str, Any]:
    import matepoint
    from matepoint._meter import PeakMeter
    # gradients exist before each step, as the planner's budget assumes
    for p in work.parameters:
        p.grad = torch.zeros_like(p)
    times: List[float] = []
    losses: List[float] = []
    device_peak, allocations_after_first = 0, 0
    # the meter's peaks count the steps, not building or planning
    device = torch.device("cuda") if cuda else None
    meter = PeakMeter(device) if device is not None else None
    with meter if meter is not None else contextlib.nullcontext():
        for step in range(steps):
            for p in work.parameters:
                p.grad.zero_()
            seconds, loss = timed(functools.partial(_step, work, mode), device)
            times.append(seconds)
            losses.append(float(loss))
            if cuda:
                device_peak = max(device_peak, _device_used_bytes())
            if work.optimizer is not None:
                work.optimizer.step()
            if step == 0:
                allocations_after_first = matepoint.pool_stats()["host_allocations"]
    steady = times[1:] or times
    result: Dict[str, Any] = {
        "first_step_ms": times[0] * 1e3,
        "step_ms": statistics.median(steady) * 1e3,
        "step_ms_all": [t * 1e3 for t in steady],
        "losses": losses,
    }
    if modes.uses_matepoint(mode):
        stats = matepoint.pool_stats()
        result["pinned_host_bytes"] = stats["bytes_reserved"]
        result["host_allocations_after_first_step"] = (stats["host_allocations"]
                                                       - allocations_after_first)
        result["peak_device_bytes_in_flight"] = stats["peak_device_bytes_in_flight"]
    if cuda:
        result["device_used_bytes"] = device_peak
        result["activation_peak_bytes"] = meter.peak_bytes
        result["peak_allocated_bytes"] = meter.peak_allocated_bytes
    else:
        result.update(_cpu_peak(work, mode))
        host_stats = getattr(torch.cuda, "host_memory_stats", None)
        if mode == "torch+save_on_cpu" and host_stats is not None:
            result["pinned_host_bytes"] = host_stats().get("reserved_bytes.current")
    return result


def _cpu_peak(work: Workload, mode: str) -> Dict[str, Any]:
    """The C heap's peak above the start of one more step, sampled after
    every operation; a step of its own, since sampling slows the timed
    steps. Every mode runs it (no optimizer step after it), so the
    gradients compared afterwards are alike. Empty where the heap cannot be
    read (no glibc mallinfo2, or AddressSanitizer's allocator)."""
    from matepoint._meter import PeakMeter, host_meter_available
    if not host_meter_available():
        return {}
    for p in work.parameters:
        p.grad.zero_()
    with PeakMeter(torch.device("cpu")) as meter:
        with modes.step_context(mode):
            work.run_step()
    return {"peak_allocated_bytes": meter.peak_bytes, "activation_peak_bytes": meter.peak_bytes}


def run_child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One mode of one case at one depth, in this process."""
    import matepoint
    case, mode = CASES[spec["case"]], spec["mode"]
    cuda = torch.cuda.is_available()
    if not cuda:
        # one thread, as the parent's overhead probe: two OpenMP threads on a
        # busy 2-core machine stalled steps of a few ms to 2 s at random
        torch.set_num_threads(1)
    modes.prepare(mode)
    torch.manual_seed(0)
    work = case.build(spec, mode, torch.device("cuda" if cuda else "cpu"))
    result: Dict[str, Any] = {"case": spec["case"], "mode": mode, "depth": spec["depth"],
                              "round": spec["round"], "status": "ok", **work.extra}
    if modes.uses_matepoint(mode) and work.reserve is not None:
        seconds, _ = timed(functools.partial(matepoint.reserve_pool, *work.reserve))
        result["reserve_pool_ms"] = seconds * 1e3
    result.update(_measure(work, mode, spec["steps"], cuda))
    if spec.get("write_reference"):
        torch.save([p.grad.detach().cpu() for p in work.parameters], spec["reference"])
        result["grad_rel_err"], result["grads_exact"] = 0.0, True
    elif spec.get("reference"):
        result.update(_gradient_errors(work.parameters, spec["reference"]))
    return result


# What every run imports, loaded once into the fork server: each run forks
# from it instead of starting Python and importing torch again (about 2 s of
# CPU per run). torch._dynamo is among them because every run imports it
# too, at different places: torch's checkpoint on its first call (which made
# torch's first step seconds long), the heap meter's dispatch mode in the
# others (about 2 s of CPU). The server runs nothing else, no CUDA context
# and no thread pool, so a fork of it is a fresh process with the imports.
_PRELOAD = ["torch", "torch._dynamo", "matepoint", "matepoint.bench.runner"]
_context: Optional[Any] = None


def preload(modules: Sequence[str]) -> None:
    """Has the fork server import ``modules`` too (what every run of a case
    imports, such as transformers); takes effect only before the first run."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _fork_server() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _child(spec: Dict[str, Any], results: Any, output: str) -> None:
    """The run's process: its output goes to a file the parent reads only
    when the run fails (a traceback ends up there too)."""
    fd = os.open(output, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    results.send(run_child(spec))


def _read(path: str) -> str:
    with open(path, errors="replace") as handle:
        return handle.read()


def spawn(spec: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """run_child in a process of its own (forked from a server that has
    imported torch), so peaks are its own and an out-of-memory or a crash
    is recorded as such while the sweep goes on."""
    base = {"case": spec["case"], "mode": spec["mode"], "depth": spec["depth"],
            "round": spec["round"]}
    context = _fork_server()
    with tempfile.NamedTemporaryFile(prefix="matepoint-bench-run-", suffix=".log") as output:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_child, args=(spec, send, output.name), daemon=True)
        process.start()
        send.close()  # the child's death then ends the wait below
        try:
            if not receive.poll(timeout):
                process.kill()
                return {**base, "status": "timeout"}
            try:
                return receive.recv()
            except EOFError:  # the run failed before sending its result
                pass
        finally:
            process.join()
            receive.close()
        printed = _read(output.name)
    return {**base, "status": "OOM" if "out of memory" in printed.lower() else "error",
            "error": printed.strip().splitlines()[-3:]
            or [f"the run's process exited with status {process.exitcode}"]}
