"""torch's own memory API answered by matepoint's allocator, through the
C++ adapter (csrc/torch_cxx/torch_adapter.cpp) installed over the allocator
that serves the simulated GPU's memory (tests/sim.py device_memory()).

Run by tests/test_torch_memory_api.py in a subprocess: installing the
adapter makes it torch's CUDA allocator and links matepoint._C to the
library for the rest of the process. Needs torch's CUDA libraries (a CUDA
build of torch; it runs on the CPU here).

torch.cuda's Python functions first check torch.cuda.is_initialized(); no
GPU is here, so the `cuda_up` fixture makes it (and is_available()) answer
True, standing for "CUDA is up", and torch.cuda.current_device() answer
the simulated GPU's current device (device=None). Everything under them is torch's real C++ path:
torch._C._cuda_memoryStats and the rest call the current allocator.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch

import matepoint
from matepoint import _adapter, _C
import sim

MIB = 1 << 20


@pytest.fixture(scope="module")
def library() -> ctypes.CDLL:
    return sim.install_adapter()


@pytest.fixture
def cuda_up(library, monkeypatch) -> Iterator[ctypes.CDLL]:
    # stands for "CUDA is up": torch.cuda's functions check it before asking
    # the allocator, and there is no GPU here
    for module in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(module, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", _C._sim_get_device)
    with sim.device_memory():
        yield library
    sim.empty_device_cache()


def mine(device: int) -> Dict[str, Any]:
    return matepoint.memory_stats(device)


# torch's function, how it is asked, and matepoint's own figure it must equal
def _torch_keys(device: int) -> Dict[str, Any]:
    return {key: value for key, value in mine(device).items()
            if "." in key or key.startswith("num_") or key == "max_split_size"}


FUNCTIONS: List[Tuple[str, Callable[[Any], Any], Callable[[int], Any]]] = [
    ("memory_stats", torch.cuda.memory_stats, _torch_keys),
    ("memory_stats_as_nested_dict",
     lambda d: torch.cuda.memory_stats_as_nested_dict(d)["active_bytes"]["large_pool"],
     lambda d: {f: mine(d)[f"active_bytes.large_pool.{f}"]
                for f in ("current", "peak", "allocated", "freed")}),
    ("memory_allocated", torch.cuda.memory_allocated, lambda d: mine(d)["allocated_bytes"]),
    ("max_memory_allocated", torch.cuda.max_memory_allocated,
     lambda d: mine(d)["peak_allocated_bytes"]),
    ("memory_reserved", torch.cuda.memory_reserved, lambda d: mine(d)["reserved_bytes"]),
    ("max_memory_reserved", torch.cuda.max_memory_reserved,
     lambda d: mine(d)["peak_reserved_bytes"]),
    ("get_per_process_memory_fraction", torch.cuda.get_per_process_memory_fraction,
     lambda d: 1.0),
]


def device_forms(index: int) -> List[Any]:
    """Every way torch accepts a device; None is the current one."""
    return [index, f"cuda:{index}", torch.device("cuda", index), None]


def check_all(index: int) -> List[str]:
    """Each function, each device form: torch's answer against matepoint's."""
    wrong = []
    for name, ask, expected in FUNCTIONS:
        for form in device_forms(index):
            with sim.device(index):
                got, want = ask(form), expected(index)
            if name == "memory_stats":
                got = {k: v for k, v in got.items() if k in want}
                assert len(got) == len(want), sorted(set(want) - set(got))
            if got != want:
                wrong.append(f"{name}({form!r}): torch {got!r} != matepoint {want!r}")
    return wrong


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(512, 512)



def checkpointed_step(index: int, during: List[List[str]]) -> None:
    """Forward and backward of two checkpointed blocks on device `index`;
    the comparison also runs inside each region (forward and recompute)."""
    with sim.device(index):
        torch.manual_seed(0)
        blocks = [Block(), Block()]

        def region(block: Block, x: torch.Tensor) -> torch.Tensor:
            # compared before tanh, whose saved output recompute still needs
            # (it stops once the last saved tensor is back)
            h = block.linear(x)
            during.append(check_all(index))
            return torch.tanh(h) * 2

        x = torch.randn(64, 512, requires_grad=True)
        for block in blocks:
            x = matepoint.checkpoint(region, block, x)
        x.square().mean().backward()


@pytest.mark.parametrize("index", [0, 1])
def test_every_memory_function_answers_matepoint_figures(cuda_up, index: int) -> None:
    during: List[List[str]] = []
    checkpointed_step(index, during)
    # premise: compared inside both regions, forward and recompute
    assert len(during) == 4, during
    assert [w for w in during if w] == []
    phases = {(row["region"] > 0, row["phase"]) for row in mine(index)["tags"]}
    assert {(True, "forward"), (True, "recompute")} <= phases, phases
    assert check_all(index) == []
    # premise: the step allocated, so every figure below is not trivially 0
    assert torch.cuda.max_memory_allocated(index) > 4 * MIB
    assert mine(index)["allocated_bytes.all.allocated"] > 0


@pytest.mark.parametrize("form", [1, "cuda:1", torch.device("cuda", 1), None])
def test_peak_reset_through_torch(cuda_up, form: Any) -> None:
    checkpointed_step(1, [])
    before_other = mine(0)["peak_allocated_bytes"]
    with sim.device(1):
        held = torch.empty(3 * MIB, dtype=torch.uint8)
        assert torch.cuda.max_memory_allocated(1) > torch.cuda.memory_allocated(1)
        torch.cuda.reset_peak_memory_stats(form)
    assert torch.cuda.max_memory_allocated(1) == torch.cuda.memory_allocated(1) >= 3 * MIB
    assert mine(1)["peak_allocated_bytes"] == mine(1)["allocated_bytes"]
    assert mine(1)["active_bytes.all.peak"] == mine(1)["active_bytes.all.current"]
    assert mine(0)["peak_allocated_bytes"] == before_other   # another device's stays
    assert check_all(1) == []
    del held


def test_accumulated_reset_through_torch(cuda_up) -> None:
    checkpointed_step(1, [])
    assert mine(1)["allocation.all.allocated"] > 0 and mine(1)["num_device_alloc"] > 0
    current = mine(1)["allocated_bytes.all.current"]
    torch.cuda.reset_accumulated_memory_stats("cuda:1")
    stats = torch.cuda.memory_stats(1)
    assert stats["allocation.all.allocated"] == stats["allocation.all.freed"] == 0
    assert stats["num_device_alloc"] == 0 and stats["allocated_bytes.all.current"] == current
    assert check_all(1) == []


def test_memory_summary_reads_the_figures(cuda_up) -> None:
    with sim.device(0):
        held = torch.empty(5 * MIB, dtype=torch.uint8)
        summary = torch.cuda.memory_summary(0)
    assert "PyTorch CUDA memory summary, device ID 0" in summary
    allocated = [line for line in summary.splitlines() if line.startswith("| Allocated memory ")]
    assert mine(0)["allocated_bytes"] == 5 * MIB     # premise: the one tensor held
    assert allocated and allocated[0].split("|")[2].strip() == "5120 KiB", summary
    del held


OBSERVER = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_size_t, ctypes.c_size_t,
                            ctypes.c_size_t)


def attach_observer(function: Callable[..., None]) -> Any:
    """torch._C._cuda_attach_out_of_memory_observer without its CUDA
    initialization (impossible without a GPU): the same C++ entry point,
    c10::cuda::CUDACachingAllocator::attachOutOfMemoryObserver, reached
    through the adapter's C export."""
    adapter = _adapter.build()
    callback = OBSERVER(function)
    error = ctypes.create_string_buffer(512)
    attach = adapter.matepoint_torch_adapter_attach_oom_observer
    attach.argtypes = [OBSERVER, ctypes.c_char_p, ctypes.c_size_t]
    assert attach(callback, error, 512) == 0, error.value
    _observers.append(callback)   # torch keeps calling it: alive for the process
    return callback


_observers: List[Any] = []


def test_out_of_memory_observers_fire(cuda_up) -> None:
    seen: List[Tuple[int, int, int, int]] = []
    order: List[str] = []
    attach_observer(lambda *args: (seen.append(args), order.append("first")))
    attach_observer(lambda *args: order.append("second"))
    with sim.device(1):
        held = torch.empty(MIB, dtype=torch.uint8)
        _C._sim_fail("cudaMalloc", 0, 1 << 40, 2)    # cudaErrorMemoryAllocation, every time
        try:
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(64 * MIB, dtype=torch.uint8)
        finally:
            _C._sim_fail("cudaMalloc", 0, 0, 0)
    assert order == ["first", "second"]
    # torch's figures: the device allocation that failed, the device's total
    ((device, alloc_size, total, free),) = seen
    assert device == 1 and alloc_size == 64 * MIB
    assert total > 0 and free <= total
    assert mine(1)["num_ooms"] == 1
    del held


def record_history(enabled: bool, stacks: bool = True) -> None:
    """torch.cuda.memory._record_memory_history without its CUDA
    initialization (impossible without a GPU): _adapter.record_history, the
    same C++ call. Cleared at each start: each test starts from nothing."""
    _adapter.record_history(enabled, stacks, 100000, clear=enabled)


def rendered_snapshot(html: str) -> Dict[str, Any]:
    """The snapshot a _memory_viz page carries (base64 of its pickle)."""
    import base64
    import json
    import pickle
    payload = html.split("const local_files = ", 1)[1].split("\n", 1)[0]
    return pickle.loads(base64.b64decode(json.loads(payload)[0]["base64"]))


def test_snapshot_renders_with_region_and_phase_tags(cuda_up, tmp_path) -> None:
    from torch.cuda import _memory_viz
    record_history(True)
    try:
        checkpointed_step(0, [])
        with sim.device(0):
            held = torch.empty(MIB, dtype=torch.uint8)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._dump_snapshot(str(tmp_path / "snapshot.pickle"))
    finally:
        record_history(False)
    trace = snapshot["device_traces"][0]
    actions = [entry["action"] for entry in trace]
    # balanced: each block freed in the trace was allocated in it, and
    # every requested free completed (no other stream used them)
    allocated = {entry["addr"] for entry in trace if entry["action"] == "alloc"}
    assert actions.count("alloc") > actions.count("free_requested") > 10
    assert actions.count("free_requested") == actions.count("free_completed")
    assert {e["addr"] for e in trace if e["action"] == "free_requested"} <= allocated
    assert "segment_alloc" in actions
    tags = {entry["user_metadata"] for entry in trace if entry["action"] == "alloc"}
    assert {"matepoint region 0 other"} < tags, tags
    assert any(t.endswith(" forward") for t in tags) and any(t.endswith(" recompute") for t in tags)
    # the blocks live now carry their tag and the Python stack of their allocation
    live = [block for segment in snapshot["segments"] for block in segment["blocks"]
            if block["state"] == "active_allocated"]
    mine_now = [b for b in live if b["size"] == MIB]
    assert mine_now and mine_now[0]["forward_frames"] == ["matepoint region 0 other"]
    assert any(frame["name"] == "test_snapshot_renders_with_region_and_phase_tags"
               for frame in mine_now[0]["frames"]), mine_now[0]["frames"]
    # torch's own viewer pages, and the dumped file, carry the same
    for page in (_memory_viz.trace_plot(snapshot), _memory_viz.segment_plot(snapshot)):
        assert page.startswith("\n<!DOCTYPE html>") and "MemoryViz.js" in page
        shown = rendered_snapshot(page)
        assert {e.get("user_metadata") for e in shown["device_traces"][0]} >= tags
    import pickle
    with open(tmp_path / "snapshot.pickle", "rb") as handle:
        dumped = pickle.load(handle)
    assert len(dumped["device_traces"][0]) >= len(trace)
    del held


def test_history_off_records_nothing_and_keeps_stacks_out(cuda_up) -> None:
    record_history(True, stacks=False)
    try:
        with sim.device(0):
            held = torch.empty(MIB, dtype=torch.uint8)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        record_history(False)
    (block,) = [b for s in snapshot["segments"] for b in s["blocks"]
                if b["state"] == "active_allocated" and b["size"] == MIB]
    assert block["frames"] == [] and block["forward_frames"] == ["matepoint region 0 other"]
    assert [e["action"] for e in snapshot["device_traces"][0]][-1] == "alloc"
    with sim.device(0):
        torch.empty(MIB, dtype=torch.uint8)
    # off: nothing more recorded, and what was recorded went (torch clears
    # its ring when recording stops)
    assert torch.cuda.memory._snapshot()["device_traces"][0] == []
    del held


def test_history_skips_the_actions_named(cuda_up) -> None:
    """torch's _record_memory_history(skip_actions=[...]): those actions are
    not recorded, the others are; an unknown name is refused."""
    sim.empty_device_cache()
    segments_before = mine(0)["num_device_alloc"]
    _adapter.record_history(True, False, 100000, clear=True,
                            skip_actions=["free_requested", "segment_alloc"])
    try:
        with sim.device(0):
            held = torch.empty(MIB, dtype=torch.uint8)
        del held
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        record_history(False)
    assert mine(0)["num_device_alloc"] > segments_before     # a segment was allocated
    actions = [entry["action"] for entry in trace]
    assert "alloc" in actions and "free_completed" in actions
    assert "free_requested" not in actions and "segment_alloc" not in actions
    with pytest.raises(RuntimeError, match="matepoint's allocator: unknown memory history "
                                           "action 'free' in skip_actions"):
        _adapter.record_history(True, skip_actions=["free"])
