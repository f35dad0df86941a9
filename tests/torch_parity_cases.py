"""torch's memory API answered by matepoint's allocator as torch's own
CUDACachingAllocator answers it (issue 53): memory history with torch's
defaults, trace times and sizes, record_stream across devices, capture
marks, out-of-memory observers' figures, memory fractions, zero-byte
allocations and calls around captures. Through the C++ adapter
(csrc/torch_cxx/torch_adapter.cpp) over the allocator serving the
simulated GPU (tests/sim.py), each case called as users call it.

Run by tests/test_torch_memory_api.py in a subprocess (the adapter becomes
torch's CUDA allocator for the rest of the process), with the runtime
calls torch makes before it allocates preloaded (tests/c/cuda_device_shim.c:
the current device, the device count, stream priorities): so
torch.empty(..., device="cuda:0") is a CUDA tensor whose memory comes from
the simulated GPU, and torch's Python entries that ask the runtime for the
device work. The `cuda_up` fixture makes torch.cuda's Python checks answer
"CUDA is up" (lazy initialization would load the driver, which is not
here). No kernel runs on such a tensor: its bytes are read and written
through a CPU view of the same memory (`view`).
"""
from __future__ import annotations

import ctypes
import gc
import sys
from typing import Any, Dict, Iterator, List

import pytest
import torch

import matepoint
from matepoint import _C
import sim

MIB = 1 << 20
BLOCK_ACTIONS = ("alloc", "free_requested", "free_completed")

# torch's device guard asks the driver (absent here) whether a context
# exists, and warns that it could not: the answer does not matter here
pytestmark = pytest.mark.filterwarnings("ignore:uncheckedSetDevice")


@pytest.fixture(scope="module")
def library() -> ctypes.CDLL:
    return sim.install_adapter()


@pytest.fixture
def cuda_up(library, monkeypatch) -> Iterator[ctypes.CDLL]:
    # stands for "CUDA is up": torch.cuda's functions check it before asking
    # the allocator, and there is no GPU (nor driver) here
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    for module in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(module, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield library
    gc.collect()
    sim.empty_device_cache()


def view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a CUDA tensor of the simulated GPU, as a CPU tensor over
    the same memory (no deleter: it frees nothing)."""
    nbytes = tensor.untyped_storage().nbytes()
    storage = torch._C._construct_storage_from_data_pointer(
        tensor.untyped_storage().data_ptr(), torch.device("cpu"), nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))


def block_actions_at(trace: List[Dict[str, Any]], address: int) -> List[Any]:
    """(action, size) of the trace's records of the block at `address`."""
    return [(entry["action"], entry["size"]) for entry in trace
            if entry.get("addr") == address and entry["action"] in BLOCK_ACTIONS]


# ---- 1. memory history with torch's defaults ------------------------------------


def test_history_with_torchs_defaults_records(cuda_up) -> None:
    """_record_memory_history() with no arguments: max_entries=sys.maxsize.
    Every action is recorded (the ring grows as entries come), and
    memory_viz's timeline has them."""
    from torch.cuda import _memory_viz
    torch.cuda.memory._record_memory_history()
    try:
        held = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda:0")
        address = held.data_ptr()
        del held
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(None)
    trace = snapshot["device_traces"][0]
    assert block_actions_at(trace, address) == [("alloc", 2 * MIB), ("free_requested", 2 * MIB),
                                          ("free_completed", 2 * MIB)], trace
    # memory_viz's text timeline of the same trace: the tensor's life in it
    timeline = _memory_viz.trace(snapshot)
    assert "Device 0" in timeline and "del " in timeline, timeline


def test_history_keeps_at_least_one_entry(cuda_up) -> None:
    """max_entries=0 keeps one entry, the newest, as torch's ring does."""
    torch.cuda.memory._record_memory_history(max_entries=0)
    try:
        held = torch.empty(1000, dtype=torch.uint8, device="cuda:0")
        del held
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(None)
    assert [entry["action"] for entry in trace] == ["free_completed"]
