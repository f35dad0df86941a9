"""torch keeps working under matepoint's allocator: after
``install_allocator()`` (the first check; the rest need it), torch's memory
API answers from it during checkpointed training, cudnn.benchmark runs, a
CUDA graph captures and replays (and a second one shares its pool),
torch.compile(mode="reduce-overhead") trains, MemPool keeps its own
segments, a memory snapshot renders in torch's viewer, and a CUDA tensor
is read by spawned processes.

install_allocator() must run before CUDA is first used, so these checks
run in a process of their own (``python -m matepoint check`` starts it;
benchmarks/allocator_probe.py is one too)."""
from __future__ import annotations

import ctypes
from typing import Any, Dict, List

import torch
import torch.nn as nn

from matepoint import _units
from matepoint.bench.selfcheck.outcome import CheckFailed, CheckSkipped

MIB = 1 << 20


def _block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def _needs(target: Any, feature: str = "") -> None:
    """Skips unless the target can run ``feature`` and the allocator is
    installed with its adapter."""
    why = target.unavailable(feature) if feature else None
    if why is not None:
        raise CheckSkipped(why)
    if not getattr(target, "allocator_ready", False):
        raise CheckSkipped("matepoint's allocator is not installed with its adapter "
                           "(see allocator_install)")


def check_install(target: Any) -> Dict[str, Any]:
    import matepoint
    raises = target.install_allocator()
    info = matepoint.allocator_info()
    figures = {"adapter": info.adapter.origin, "adapter_path": info.adapter.path,
               "oom_unit": info.oom_unit.origin, "oom_raises": raises}
    for unit in (info.adapter, info.oom_unit):
        if unit.origin == _units.MISSING:
            fix = f" To fix: {unit.fix}" if unit.fix else ""
            raise CheckFailed(f"installed without its {unit.unit}: {unit.reason}.{fix}")
    target.allocator_ready = True
    return figures


def check_memory_api(target: Any) -> Dict[str, Any]:
    """Checkpointed training steps: torch.cuda.max_memory_allocated() and
    memory_allocated() are matepoint's own figures."""
    import matepoint
    _needs(target)
    torch.manual_seed(0)
    blocks = nn.ModuleList(_block(target.width) for _ in range(target.depth)).to(target.device)
    optimizer = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    x = torch.randn(target.batch, target.width, device=target.device)
    peaks: List[int] = []
    for _ in range(3):
        torch.cuda.reset_peak_memory_stats(target.index)
        h = x
        for block in blocks:
            h = matepoint.checkpoint(block, h)
        h.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        target.synchronize()
        peaks.append(torch.cuda.max_memory_allocated(target.index))
    mine = matepoint.memory_stats(target.index)
    if peaks[-1] != mine["peak_allocated_bytes"] or peaks[-1] == 0:
        raise CheckFailed(f"torch.cuda.max_memory_allocated() says {peaks[-1]} bytes, "
                          f"matepoint's allocator {mine['peak_allocated_bytes']}")
    allocated = torch.cuda.memory_allocated(target.index)
    if allocated != mine["allocated_bytes"]:
        raise CheckFailed(f"torch.cuda.memory_allocated() says {allocated} bytes, matepoint's "
                          f"allocator {mine['allocated_bytes']}")
    return {"max_memory_allocated_mib": [round(p / MIB, 2) for p in peaks],
            "memory_reserved_mib": round(torch.cuda.memory_reserved(target.index) / MIB, 2)}


def check_cudnn(target: Any) -> Dict[str, Any]:
    _needs(target, "cudnn")
    torch.backends.cudnn.benchmark = True
    try:
        net = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 128, 3, padding=1, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)).to(target.device)
        x = torch.randn(32, 3, 128, 128, device=target.device)
        for _ in range(3):
            net(x).logsumexp(1).mean().backward()
        target.synchronize()
    finally:
        torch.backends.cudnn.benchmark = False
    return {"max_memory_allocated_mib": round(torch.cuda.max_memory_allocated() / MIB, 1)}


def check_cuda_graph(target: Any) -> Dict[str, Any]:
    """A capture and its replays (its private pool), a second graph sharing
    the pool, and make_graphed_callables."""
    _needs(target, "cuda_graph")
    torch.manual_seed(0)
    model = _block(256).to(target.device)
    static_in = torch.randn(64, 256, device=target.device)
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
        static_in.copy_(torch.randn(64, 256, device=target.device))
        graph.replay()
        shared.replay()
        with torch.no_grad():
            expected = model(static_in)
            errors.append(float((static_out - expected).abs().max()))
            errors.append(float((static_twice - model(expected)).abs().max()))
    if max(errors) > 1e-4:
        raise CheckFailed(f"a replay differs from eager by {max(errors)}")
    reserved_with_graphs = torch.cuda.memory_reserved()
    del graph, shared, static_out, static_twice
    torch.cuda.empty_cache()
    graphed = torch.cuda.make_graphed_callables(
        _block(256).to(target.device),
        (torch.randn(8, 256, device=target.device, requires_grad=True),))
    graphed(torch.randn(8, 256, device=target.device, requires_grad=True)).sum().backward()
    target.synchronize()
    return {"max_replay_error": max(errors),
            "reserved_with_graphs_mib": round(reserved_with_graphs / MIB, 1),
            "reserved_after_release_mib": round(torch.cuda.memory_reserved() / MIB, 1)}


def check_compile(target: Any) -> Dict[str, Any]:
    """Training steps: cudagraph trees record a forward and a backward graph
    into one pool and switch between them (getCheckpointState /
    setCheckpointPoolState), then inference with the same module."""
    _needs(target, "compile")
    torch.manual_seed(0)
    model = _block(512).to(target.device)
    compiled = torch.compile(model, mode="reduce-overhead")
    errors = []
    for _ in range(4):
        x = torch.randn(32, 512, device=target.device)
        model.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        errors += [float((a - p.grad).abs().max()) for a, p in zip(got, model.parameters())]
    for _ in range(2):
        x = torch.randn(32, 512, device=target.device)
        with torch.no_grad():
            errors.append(float((compiled(x).clone() - model(x)).abs().max()))
    target.synchronize()
    if max(errors) > 1e-2:
        raise CheckFailed(f"compiled results differ from eager by {max(errors)}")
    return {"max_error": max(errors)}


def check_mempool(target: Any) -> Dict[str, Any]:
    """The pool's allocations in its own segments, its memory back once it
    is gone."""
    _needs(target, "mempool")
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        inside = torch.ones(1 << 20, device=target.device)
    outside = torch.ones(1 << 20, device=target.device)
    segments = pool.snapshot()

    def in_pool(tensor: torch.Tensor) -> bool:
        return any(s["address"] <= tensor.data_ptr() < s["address"] + s["total_size"]
                   for s in segments)

    if not in_pool(inside):
        raise CheckFailed("an allocation inside use_mem_pool is not in the pool's segments")
    if in_pool(outside):
        raise CheckFailed("an allocation outside use_mem_pool landed in the pool")
    reserved = torch.cuda.memory_reserved()
    del inside, pool, segments
    target.synchronize()
    return {"reserved_mib": round(reserved / MIB, 1),
            "reserved_after_release_mib": round(torch.cuda.memory_reserved() / MIB, 1)}


def check_snapshot(target: Any) -> Dict[str, Any]:
    """A snapshot of checkpointed training, every block tagged with its
    region and phase, rendered to HTML by torch.cuda._memory_viz."""
    import matepoint
    from torch.cuda import _memory_viz
    _needs(target)
    target.record_history(True)
    try:
        torch.manual_seed(0)
        blocks = nn.ModuleList(_block(target.width) for _ in range(4)).to(target.device)
        h = torch.randn(target.batch, target.width, device=target.device, requires_grad=True)
        for block in blocks:
            h = matepoint.checkpoint(block, h)
        h.sum().backward()
        target.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        target.record_history(False)
    html = _memory_viz.trace_plot(snapshot)
    actions: Dict[str, int] = {}
    tags = set()
    for trace in snapshot.get("device_traces", []):
        for entry in trace:
            actions[entry["action"]] = actions.get(entry["action"], 0) + 1
            if entry.get("user_metadata"):
                tags.add(entry["user_metadata"])
    if not snapshot.get("segments") or not actions.get("alloc"):
        raise CheckFailed(f"an empty snapshot: {len(snapshot.get('segments', []))} segments, "
                          f"actions {actions}")
    if not tags:
        raise CheckFailed("no allocation of the snapshot names its checkpoint region")
    return {"segments": len(snapshot["segments"]), "actions": actions,
            "region_tags": len(tags), "html_bytes": len(html)}


def _ipc_child(queue: Any, answers: Any, install: bool) -> None:
    """A spawned process: reads the shared view, answers its sum and head."""
    if install:
        import matepoint
        matepoint.install_allocator()
    view = queue.get()
    answers.put((float(view.sum()), view[:4].tolist()))
    del view


def check_ipc(target: Any) -> Dict[str, Any]:
    """An interior view of a CUDA tensor, sent to a spawned process on
    torch's allocator and to one on matepoint's: both read it right."""
    import torch.multiprocessing as mp
    from matepoint import _C
    from matepoint._allocator import allocator_path
    _needs(target, "ipc")
    pad = torch.empty(1000, device=target.device)      # the tensor is not a segment's start
    data = torch.arange(4096, dtype=torch.float32, device=target.device)
    view = data[100:1100]
    base_of = getattr(ctypes.CDLL(allocator_path()), _C.ALLOCATOR_SYMBOLS["base_allocation"])
    base_of.restype = ctypes.c_void_p
    base_of.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    offset = data.data_ptr() - base_of(data.data_ptr(), ctypes.byref(ctypes.c_size_t()))
    if offset <= 0:
        raise CheckFailed("premise: the shared block should sit inside its segment")
    context = mp.get_context("spawn")
    receivers = {}
    for install in (False, True):
        queue, answers = context.Queue(), context.Queue()
        child = context.Process(target=_ipc_child, args=(queue, answers, install))
        child.start()
        queue.put(view)
        got = answers.get(timeout=60)
        child.join(timeout=60)
        expected = (float(view.sum()), view[:4].tolist())
        if got != expected:
            raise CheckFailed(f"the receiver read {got}, expected {expected}")
        receivers["matepoint" if install else "torch"] = "read it right"
    del pad
    return {"offset_bytes": offset, "receivers": receivers}
