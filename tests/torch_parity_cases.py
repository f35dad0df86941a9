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
import time
import warnings
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


def stand_for_cuda_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda's Python checks answer "CUDA is up" (they run before torch
    asks the allocator; lazy initialization would load the driver, absent
    here), and no capture is underway."""
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    for module in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(module, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


@pytest.fixture
def cuda_up(library, monkeypatch) -> Iterator[ctypes.CDLL]:
    stand_for_cuda_up(monkeypatch)
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


def read(address: int, nbytes: int) -> torch.Tensor:
    """A copy of `nbytes` of simulated device memory at `address`."""
    storage = torch._C._construct_storage_from_data_pointer(address, torch.device("cpu"), nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,)).clone()


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


# ---- 2. trace times, sizes and pools ------------------------------------------------

# torch converts its approximate clock into the wall clock's microseconds
# when it takes a snapshot; the conversion is an estimate, a second is ample
CLOCK_SLACK_US = 1_000_000


def test_trace_times_are_epoch_microseconds_and_sizes_requested(cuda_up) -> None:
    torch.cuda.memory._record_memory_history()
    try:
        before_us = time.time_ns() // 1000
        first = torch.empty(1000, dtype=torch.uint8, device="cuda:0")
        first_at = first.data_ptr()
        del first
        after_us = time.time_ns() // 1000
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(None)
    # torch records the bytes asked for (1000), not the block's (1024)
    assert block_actions_at(trace, first_at) == [("alloc", 1000), ("free_requested", 1000),
                                                 ("free_completed", 1000)], trace
    times = [entry["time_us"] for entry in trace]
    assert times == sorted(times) and len(times) >= 3
    assert all(before_us - CLOCK_SLACK_US <= t <= after_us + CLOCK_SLACK_US for t in times), (
        before_us, times, after_us)


def test_trace_names_the_pool_of_the_memory(cuda_up) -> None:
    pool = torch.cuda.MemPool()
    torch.cuda.memory._record_memory_history()
    try:
        with torch.cuda.use_mem_pool(pool):
            inside = torch.empty(1000, dtype=torch.uint8, device="cuda:0")
        outside = torch.empty(1000, dtype=torch.uint8, device="cuda:0")
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(None)
    pools = {entry["addr"]: tuple(entry["pool_id"]) for entry in trace
             if entry["action"] == "alloc"}
    assert pools[inside.data_ptr()] == pool.id and pool.id != (0, 0)
    assert pools[outside.data_ptr()] == (0, 0)
    del inside, outside, pool


# ---- 6. history calls that raised or answered nothing ---------------------------------


def test_is_history_enabled_answers(cuda_up) -> None:
    """torch._C._cuda_isHistoryEnabled(), which torch.compile's CUDA graph
    trees ask (cudagraph_trees_history_recording)."""
    assert torch._C._cuda_isHistoryEnabled() is False
    torch.cuda.memory._record_memory_history()
    try:
        assert torch._C._cuda_isHistoryEnabled() is True
    finally:
        torch.cuda.memory._record_memory_history(None)
    assert torch._C._cuda_isHistoryEnabled() is False


def allocate_here() -> torch.Tensor:
    return torch.empty(4096, dtype=torch.uint8, device="cuda:0")


def test_allocation_traceback_of_a_recorded_block(cuda_up) -> None:
    untraced = allocate_here()
    torch.cuda.memory._record_memory_history()
    try:
        traced = allocate_here()
    finally:
        torch.cuda.memory._record_memory_history(None)
    frames = torch.cuda.memory._allocation_traceback(traced.untyped_storage().data_ptr())
    assert frames is not None and any(f["name"] == "allocate_here" for f in frames), frames
    assert torch.cuda.memory._allocation_traceback(untraced.data_ptr()) is None
    del traced, untraced


def test_context_none_gathers_no_stack(cuda_up) -> None:
    """context=None: torch keeps no stack for a block; the block still
    names its checkpoint region and phase."""
    torch.cuda.memory._record_memory_history(context=None)
    try:
        held = allocate_here()
        snapshot = torch.cuda.memory._snapshot()
        assert torch.cuda.memory._allocation_traceback(held.data_ptr()) is None
    finally:
        torch.cuda.memory._record_memory_history(None)
    (block,) = [b for s in snapshot["segments"] for b in s["blocks"]
                if b["address"] == held.data_ptr() and b["state"] == "active_allocated"]
    assert block["frames"] == [], block["frames"]
    assert block["forward_frames"] == ["matepoint region 0 other"]
    del held


def free_here(holder: List[torch.Tensor]) -> None:
    holder.pop()    # the last reference: the tensor's memory is freed here


def test_a_frees_records_carry_torchs_stacks(cuda_up) -> None:
    """A free's trace entries carry the stack torch's would: with
    context="alloc" the block's from its allocation, with "all" (the
    default) the free's own, in free_requested and free_completed alike."""
    def frames(entry: Dict[str, Any]) -> List[str]:
        return [frame["name"] for frame in entry.get("frames", [])]
    for context, where in (("alloc", "allocate_here"), ("all", "free_here")):
        torch.cuda.memory._record_memory_history(context=context)
        try:
            held = [allocate_here()]
            at = held[0].data_ptr()
            free_here(held)
            trace = torch.cuda.memory._snapshot()["device_traces"][0]
        finally:
            torch.cuda.memory._record_memory_history(None)
        entries = {entry["action"]: entry for entry in trace if entry.get("addr") == at}
        assert "allocate_here" in frames(entries["alloc"]), context   # premise
        for action in ("free_requested", "free_completed"):
            assert where in frames(entries[action]), (context, action, frames(entries[action]))


def test_recording_off_drops_the_trace(cuda_up) -> None:
    """Turning recording off drops what was recorded (torch clears its
    ring): a later recording starts from nothing."""
    torch.cuda.memory._record_memory_history()
    before = allocate_here()
    torch.cuda.memory._record_memory_history(None)
    assert torch.cuda.memory._snapshot()["device_traces"][0] == []
    torch.cuda.memory._record_memory_history()
    try:
        after = allocate_here()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(None)
    assert block_actions_at(trace, after.data_ptr()) == [("alloc", 4096)]
    assert block_actions_at(trace, before.data_ptr()) == []
    del before, after


# ---- 8. zero-byte allocations ----------------------------------------------------------


def test_zero_bytes_are_a_null_pointer_and_count_nothing(cuda_up) -> None:
    """torch's allocator gives no memory for zero bytes: a null pointer,
    nothing counted (cudagraph trees filter storages by data_ptr() != 0)."""
    before = torch.cuda.memory_stats(0)
    empty = torch.empty(0, device="cuda:0")
    raw = torch.cuda.caching_allocator_alloc(0)
    after = torch.cuda.memory_stats(0)
    assert empty.data_ptr() == 0 and empty.untyped_storage().data_ptr() == 0
    assert raw == 0
    for key in ("allocation.all.allocated", "allocated_bytes.all.allocated",
                "requested_bytes.all.allocated", "segment.all.allocated"):
        assert after[key] == before[key], key
    torch.cuda.caching_allocator_delete(raw)
    del empty
    gc.collect()
    assert torch.cuda.memory_stats(0)["allocation.all.freed"] == before["allocation.all.freed"]
    # premise: a non-empty allocation is counted the same way
    held = torch.empty(1, device="cuda:0")
    assert torch.cuda.memory_stats(0)["allocation.all.allocated"] == (
        before["allocation.all.allocated"] + 1)
    del held


# ---- 7. memory fraction ---------------------------------------------------------------

# the simulated devices' memory (cudaMemGetInfo's total)
DEVICE_TOTAL = 16 << 30


def out_of_memory(nbytes: int) -> bool:
    try:
        held = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    except torch.OutOfMemoryError:
        return True
    del held
    return False


def test_memory_fraction_as_torchs(cuda_up) -> None:
    """A fraction caps what the allocator reserves; 0.0 caps at nothing; a
    NaN fraction is refused with an error naming matepoint's allocator and
    leaves the cap; a device that does not exist raises, as every memory
    function does."""
    torch.cuda.empty_cache()
    cap = 8 * MIB
    try:
        torch.cuda.set_per_process_memory_fraction(cap / DEVICE_TOTAL, 0)
        assert torch.cuda.get_per_process_memory_fraction(0) == cap / DEVICE_TOTAL
        assert out_of_memory(12 * MIB) and not out_of_memory(MIB)   # premise: the cap works
        with pytest.raises(RuntimeError, match="matepoint's allocator: invalid memory fraction"):
            torch.cuda.set_per_process_memory_fraction(float("nan"), 0)
        assert torch.cuda.get_per_process_memory_fraction(0) == cap / DEVICE_TOTAL
        assert out_of_memory(12 * MIB), "the NaN fraction removed the cap"
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(0.0, 0)
        assert torch.cuda.get_per_process_memory_fraction(0) == 0.0
        assert out_of_memory(MIB), "a fraction of 0 caps at nothing"
        with pytest.raises(RuntimeError, match="matepoint's allocator has no CUDA device 7"):
            torch.cuda.get_per_process_memory_fraction(7)
        with pytest.raises(RuntimeError, match="matepoint's allocator has no CUDA device 7"):
            torch.cuda.set_per_process_memory_fraction(0.5, 7)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert not out_of_memory(12 * MIB)


# ---- 5. out-of-memory observers ---------------------------------------------------------


def test_out_of_memory_observers_get_torchs_figures(cuda_up) -> None:
    """torch passes its observers the device allocation that failed (a
    segment's size) and the device's total, or with a fraction set the
    fraction's cap."""
    seen: List[Any] = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *figures: seen.append(figures))
    torch.cuda.empty_cache()
    held = torch.empty(MIB, dtype=torch.uint8, device="cuda:0")
    _C._sim_fail("cudaMalloc", 0, 1 << 40, 2)       # cudaErrorMemoryAllocation, every time
    try:
        for nbytes in (64 * MIB, 20 * MIB):
            assert out_of_memory(nbytes)
    finally:
        _C._sim_fail("cudaMalloc", 0, 0, 0)
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    try:
        assert out_of_memory(6 << 30)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert [figures[:3] for figures in seen] == [
        (0, 64 * MIB, DEVICE_TOTAL), (0, 20 * MIB, DEVICE_TOTAL), (0, 6 << 30, 4 << 30)], seen
    assert all(0 < figures[3] <= DEVICE_TOTAL for figures in seen)
    del held


# ---- 3. record_stream with a stream of another device -----------------------------------


def stream_of_device(handle: int, device: int) -> torch.cuda.Stream:
    """torch's Stream for a simulated stream of `device` (made current first:
    torch.cuda.device's exit would ask the driver, absent here, about the
    previous device's context)."""
    previous = torch.cuda.current_device()
    torch.cuda.set_device(device)
    try:
        stream = torch.cuda.ExternalStream(handle)
    finally:
        torch.cuda.set_device(previous)
    assert stream.device == torch.device("cuda", device)
    return stream


def test_record_stream_of_another_devices_stream(cuda_up) -> None:
    """t_on_cuda0.record_stream(stream_on_cuda1): the block is not handed
    out again until device 1's stream has done its work on it. A kernel of
    device 1 still writing the freed tensor's memory (peer access) must not
    land in the next tensor of device 0."""
    other = _C._sim_stream_create(1)
    try:
        tensor = torch.empty(1 << 16, dtype=torch.uint8, device="cuda:0")
        at, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
        view(tensor).fill_(3)                  # what device 1's kernel writes, once it runs
        _C._sim_kernel(1, other, [at, nbytes], [])
        tensor.record_stream(stream_of_device(other, 1))
        del tensor
        after = torch.empty(1 << 16, dtype=torch.uint8, device="cuda:0")
        view(after).fill_(7)
        sim.finish()                           # device 1's kernel lands
        assert torch.equal(view(after), torch.full((nbytes,), 7, dtype=torch.uint8)), (
            "device 1's kernel wrote into memory handed out again")
        assert torch.equal(read(at, nbytes), torch.full((nbytes,), 3, dtype=torch.uint8))
        del after
    finally:
        _C._sim_stream_destroy(other)
    assert _C._sim_peek_last_error() == 0


# ---- 4. capture marks: pools allocated to outside a capture ----------------------------


def test_use_mem_pool_is_no_capture(cuda_up) -> None:
    """torch 2.13+ marks real captures apart from pools allocated to outside
    one (use_mem_pool, NCCL registration, cudagraph trees' warmup). A capped
    device whose ordinary cache is full, a use_mem_pool scope, an
    allocation that needs a new segment: the cache is released and the
    allocation succeeds, as under torch 2.14's allocator."""
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(7 * MIB / DEVICE_TOTAL, 0)
    pool = torch.cuda.MemPool()
    try:
        # six 1 MiB tensors: three 2 MiB segments of the ordinary cache
        filling = [torch.empty(MIB, dtype=torch.uint8, device="cuda:0") for _ in range(6)]
        del filling
        assert torch.cuda.memory_reserved(0) == 6 * MIB
        assert torch.cuda.memory_allocated(0) == 0
        with torch.cuda.use_mem_pool(pool):
            inside = torch.empty(MIB, dtype=torch.uint8, device="cuda:0")
        (segment,) = pool.snapshot()
        assert segment["address"] <= inside.data_ptr() < segment["address"] + 2 * MIB
        assert torch.cuda.memory_reserved(0) == 2 * MIB       # the cache went
        del inside
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    del pool


# ---- 9. calls around captures -----------------------------------------------------------

CAPTURE_INVALIDATED = 901     # cudaErrorStreamCaptureInvalidated


def test_a_failed_event_record_never_synchronizes_the_device(cuda_up) -> None:
    """A block used on another stream whose free cannot record its event
    (here an injected cudaEventRecord failure) waits for a record that
    works; it is never returned after a device-wide synchronize, which
    would break a capture another thread runs on the device (one the
    allocator knows nothing of), nor handed out while the other stream
    still uses it."""
    reader, side = _C._sim_stream_create(0), _C._sim_stream_create(0)
    try:
        tensor = torch.empty(1 << 16, dtype=torch.uint8, device="cuda:0")
        at, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
        view(tensor).fill_(3)                  # what the reader's kernel writes, once it runs
        _C._sim_kernel(0, reader, [at, nbytes], [])
        tensor.record_stream(stream_of_device(reader, 0))
        _C._sim_capture(0, side, True)         # another thread's capture, in global mode
        try:
            _C._sim_fail("cudaEventRecord", 0, 1, 700)
            del tensor
        finally:
            status = _C._sim_capture(0, side, False)
            _C._sim_fail("cudaEventRecord", 0, 0, 0)
        assert status == 0 and status != CAPTURE_INVALIDATED
        assert _C._sim_take_last_error() == 0, "the failed record was left as the last error"
        after = torch.empty(1 << 16, dtype=torch.uint8, device="cuda:0")
        view(after).fill_(7)
        sim.finish()                           # the reader's kernel lands
        assert torch.equal(view(after), torch.full((nbytes,), 7, dtype=torch.uint8)), (
            "memory the reader still used was handed out again")
        del after
    finally:
        _C._sim_stream_destroy(reader)
        _C._sim_stream_destroy(side)


def test_a_record_failing_on_is_not_retried_at_every_allocation(cuda_up, capfd) -> None:
    """A block whose free cannot record its event, the record failing on (a
    stream destroyed since, or another GPU's without the adapter), is tried
    again after ever longer gaps: 200 allocations report a few failures,
    not one each (and make no event each). Once a record works, empty_cache
    takes the block back."""
    reader = _C._sim_stream_create(0)
    try:
        tensor = torch.empty(1 << 16, dtype=torch.uint8, device="cuda:0")
        _C._sim_kernel(0, reader, [tensor.data_ptr(), 1 << 16], [])
        tensor.record_stream(stream_of_device(reader, 0))
        _C._sim_fail("cudaEventRecord", 0, 1 << 40, 400)     # cudaErrorInvalidResourceHandle
        try:
            del tensor
            for _ in range(200):
                torch.empty(1024, dtype=torch.uint8, device="cuda:0")   # freed at once
        finally:
            _C._sim_fail("cudaEventRecord", 0, 0, 0)
        reports = capfd.readouterr().err.count("cudaEventRecord failed")
        assert 2 <= reports <= 10, reports
        assert _C._sim_take_last_error() == 0
        sim.finish()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved(0) == 0, "the block never came back"
    finally:
        _C._sim_stream_destroy(reader)


def test_out_of_memory_is_out_of_memory_whatever_failed_on_the_way(cuda_up) -> None:
    """A request out of memory raises torch.OutOfMemoryError, and its
    observers hear of it, even when another call failed and was reported
    on the way (an earlier free's event record, tried again at the retry):
    retry-smaller code must see an out of memory."""
    seen: List[Any] = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *figures: seen.append(figures))
    reader = _C._sim_stream_create(0)
    try:
        tensor = torch.empty(1 << 16, dtype=torch.uint8, device="cuda:0")
        _C._sim_kernel(0, reader, [tensor.data_ptr(), 1 << 16], [])
        tensor.record_stream(stream_of_device(reader, 0))
        _C._sim_fail("cudaEventRecord", 0, 1 << 40, 400)
        try:
            del tensor
            with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
                torch.empty(1 << 50, dtype=torch.uint8, device="cuda:0")
        finally:
            _C._sim_fail("cudaEventRecord", 0, 0, 0)
        assert [figures[:2] for figures in seen] == [(0, 1 << 50)], seen
        sim.finish()
        torch.cuda.empty_cache()
    finally:
        _C._sim_stream_destroy(reader)


def test_memory_stats_count_a_mem_pools_reserved_bytes(cuda_up) -> None:
    """torch 2.13+'s reserved_bytes_by_private_pools: a MemPool's segments,
    per pool kind, under the pool's id; kept (current 0) after it is gone."""
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        inside = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda:0")
    key = "reserved_bytes_by_private_pools." + "_".join(str(part) for part in pool.id)
    stats = torch.cuda.memory_stats(0)
    assert stats[key + ".all.current"] == 20 * MIB, sorted(k for k in stats if "private" in k)
    assert stats[key + ".large_pool.current"] == 20 * MIB
    assert stats[key + ".small_pool.current"] == 0
    del inside, pool
    gc.collect()
    stats = torch.cuda.memory_stats(0)
    assert stats[key + ".all.current"] == 0 and stats[key + ".all.peak"] == 20 * MIB


def test_num_sync_all_streams_counts_each_wait_for_every_stream(cuda_up) -> None:
    """torch counts num_sync_all_streams where its allocator waits for every
    stream's pending frees: each empty_cache (and out-of-memory retry)."""
    before = torch.cuda.memory_stats(0)["num_sync_all_streams"]
    torch.cuda.empty_cache()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_stats(0)["num_sync_all_streams"] == before + 2


def test_a_refused_capture_allocation_is_no_out_of_memory(cuda_up) -> None:
    """An allocation on a capturing stream no pool takes (a capture begun
    outside torch.cuda.graph) is refused with an error naming the capture:
    a RuntimeError, not a torch.OutOfMemoryError, which retry-smaller code
    (batch-size finders) would take for a request too large."""
    side = _C._sim_stream_create(0)
    torch.cuda.set_stream(stream_of_device(side, 0))
    _C._sim_capture(0, side, True)
    try:
        with pytest.raises(RuntimeError, match="cannot allocate during this CUDA graph capture") \
                as refused:
            torch.empty(1024, dtype=torch.uint8, device="cuda:0")
    finally:
        status = _C._sim_capture(0, side, False)
        torch.cuda.set_stream(torch.cuda.default_stream(0))
        _C._sim_stream_destroy(side)
    assert not isinstance(refused.value, torch.OutOfMemoryError)
    assert status == 0


def test_a_cuda_error_in_cudamalloc_is_no_out_of_memory(cuda_up) -> None:
    """A sticky CUDA error (a faulting kernel's 700) fails cudaMalloc:
    raised as torch's allocator raises it, a RuntimeError naming the error,
    not a torch.OutOfMemoryError; as torch's, it counts no out of memory
    (num_ooms) and the memory history records no "oom"."""
    torch.cuda.empty_cache()
    mallocs = _C._sim_stats()["calls"]["cudaMalloc"]
    ooms = torch.cuda.memory_stats(0)["num_ooms"]
    torch.cuda.memory._record_memory_history()
    _C._sim_fail("cudaMalloc", 0, 1, 700)
    try:
        with pytest.raises(RuntimeError, match="CUDA error 700") as raised:
            torch.empty(64 * MIB, dtype=torch.uint8, device="cuda:0")   # a segment of its own
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        _C._sim_fail("cudaMalloc", 0, 0, 0)
        torch.cuda.memory._record_memory_history(None)
    assert _C._sim_stats()["calls"]["cudaMalloc"] == mallocs + 1     # premise: it was asked
    assert not isinstance(raised.value, torch.OutOfMemoryError)
    assert _C._sim_take_last_error() == 0
    assert torch.cuda.memory_stats(0)["num_ooms"] == ooms
    assert [entry["action"] for entry in trace] == [], trace


def test_what_the_history_does_not_keep_is_said(cuda_up, capfd) -> None:
    """record_function annotations, torch.compile's context and user
    metadata are not recorded (docs/guides/allocator.md says why): each is
    said once, naming matepoint's allocator, where torch would record it.
    torch delivers a C++ warning on stderr or, where a Python call of its
    operators is on the way (record_function on torch 2.15), as a Python
    warning: either is said."""
    torch.cuda.memory._record_memory_history(global_record_annotations=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.profiler.record_function("a step"):
                held = torch.empty(1024, dtype=torch.uint8, device="cuda:0")
            torch.cuda.memory._set_memory_metadata("a note")
    finally:
        torch.cuda.memory._record_memory_history(None)
    said = capfd.readouterr().err + "".join(str(warning.message) for warning in caught)
    assert "matepoint's allocator does not record record_function annotations" in said, said
    assert "matepoint does not support user metadata" in said, said
    assert torch._C._cuda_memoryMetadataSupported() is False
    del held
