"""torch's CUDA graph pool hooks, cacheInfo and getBaseAllocation answered by
matepoint's allocator through the C++ adapter (csrc/torch_cxx/torch_adapter.cpp),
over the allocator serving the simulated GPU's memory (tests/sim.py).

Run by tests/test_torch_graph_pools.py in a subprocess (the adapter becomes
torch's CUDA allocator for the rest of the process); needs a CUDA build of
torch (it runs on the CPU here). torch._C._cuda_beginAllocateToPool,
_cuda_endAllocateToPool and _cuda_releasePool are torch's own bindings: they
call the current allocator's beginAllocateToPool / endAllocateToPool /
releasePool, as torch.cuda.graph's capture_begin, capture_end and reset do
(the binding's filter takes every stream; a graph's takes its capture's).
cacheInfo and getBaseAllocation have no Python binding: the adapter's test
entries call torch's c10::cuda::CUDACachingAllocator functions.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
from typing import Iterator, List, Tuple

import pytest
import torch

import matepoint
from matepoint import _adapter, _C
import sim

ELEMENTS = 1 << 14
CAPTURE_INVALIDATED = 901


@pytest.fixture(scope="module")
def adapter() -> ctypes.CDLL:
    sim.install_adapter()
    return _adapter.build()


@pytest.fixture
def memory(adapter) -> Iterator[ctypes.CDLL]:
    with sim.device_memory():
        yield adapter
    gc.collect()
    sim.empty_device_cache()


def device_bytes() -> int:
    return _C._sim_stats()["device_bytes_live"][0]


def mark_capture(adapter: ctypes.CDLL, device: int, begin: bool) -> None:
    """torch 2.13+'s markCaptureBegin/End (CUDAGraph's capture_begin and
    capture_end mark a capture; torch exposes them to no Python caller)."""
    function = adapter.matepoint_torch_adapter_mark_capture
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    error = ctypes.create_string_buffer(512)
    assert function(device, int(begin), error, 512) == 0, error.value


@contextlib.contextmanager
def captured(adapter: ctypes.CDLL, pool: Tuple[int, int], stream: int) -> Iterator[List[int]]:
    """A CUDA graph capture on `stream` of device 0 as torch.cuda.graph
    makes it: beginAllocateToPool, the stream's capture (simulated), marked
    begun; then its end, marked ended, endAllocateToPool. Yields a list
    that holds the capture's end status (0: it stayed valid) after."""
    status: List[int] = []
    torch._C._cuda_beginAllocateToPool(0, pool)
    _C._sim_capture(0, stream, True)
    mark_capture(adapter, 0, True)
    try:
        with sim.stream(0, stream):
            yield status
    finally:
        status.append(_C._sim_capture(0, stream, False))
        mark_capture(adapter, 0, False)
        torch._C._cuda_endAllocateToPool(0, pool)


def test_a_pool_begun_through_torch_serves_a_capture_and_goes_at_release(memory) -> None:
    side, _ = sim.side_streams()
    with sim.stream(0, side):
        cached_at = torch.ones(ELEMENTS).data_ptr()     # freed: side's ordinary cache
    pool: Tuple[int, int] = (0, 4242)
    held = device_bytes()
    with captured(memory, pool, side) as ended:
        scratch = torch.ones(ELEMENTS)
        scratch_at = scratch.data_ptr()
        del scratch
        output = torch.full((ELEMENTS,), 3.0)
    (status,) = ended
    assert status == 0 and status != CAPTURE_INVALIDATED
    assert scratch_at != cached_at and output.data_ptr() == scratch_at
    pool_bytes = device_bytes() - held
    assert pool_bytes > 0
    with sim.stream(0, side):
        assert torch.ones(ELEMENTS).data_ptr() == cached_at     # the cache, not the pool
    assert float(output.sum()) == 3 * ELEMENTS
    del output
    sim.empty_device_cache()
    assert device_bytes() == pool_bytes, "the pool, still in use, kept its memory"
    torch._C._cuda_releasePool(0, pool)
    # freeable now: it goes at the next empty_cache (or out-of-memory
    # retry), as torch's, not at the release
    assert device_bytes() == pool_bytes
    sim.empty_device_cache()
    assert device_bytes() == 0


def test_a_second_begin_of_a_pool_being_recorded_to_raises(memory) -> None:
    pool = (0, 4343)
    torch._C._cuda_beginAllocateToPool(1, pool)
    try:
        with pytest.raises(RuntimeError, match="already recording to mempool_id"):
            torch._C._cuda_beginAllocateToPool(1, pool)
    finally:
        torch._C._cuda_endAllocateToPool(1, pool)
        torch._C._cuda_releasePool(1, pool)


def cache_info(adapter: ctypes.CDLL, device: int, start: int) -> int:
    function = adapter.matepoint_torch_adapter_cache_info
    function.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p,
                         ctypes.c_size_t]
    largest, error = ctypes.c_size_t(start), ctypes.create_string_buffer(512)
    assert function(device, ctypes.byref(largest), error, 512) == 0, error.value
    return largest.value


def test_cache_info_is_the_largest_free_block(memory) -> None:
    """torch's cacheInfo (cudnn.benchmark): the largest cached free block
    when larger than the caller's guess. (A zero guess first becomes the
    device's free memory, from cudaMemGetInfo: on a GPU only.)"""
    sim.empty_device_cache()
    assert cache_info(memory, 0, 1) == 1
    with sim.device(0):
        held = torch.empty(3 << 18)                     # 3 MiB of a 20 MiB segment
    assert cache_info(memory, 0, 1) == 17 << 20
    assert cache_info(memory, 0, 64 << 20) == 64 << 20
    del held
    assert cache_info(memory, 0, 1) == 20 << 20


def test_base_allocation_through_torch(memory) -> None:
    function = memory.matepoint_torch_adapter_base_allocation
    function.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                         ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p, ctypes.c_size_t]
    with sim.device(0):
        first, second = torch.ones(ELEMENTS), torch.ones(ELEMENTS)
    base, size = ctypes.c_void_p(), ctypes.c_size_t()
    error = ctypes.create_string_buffer(512)
    assert function(second[10:].data_ptr(), ctypes.byref(base), ctypes.byref(size), error, 512) == 0
    assert base.value <= first.data_ptr() < second.data_ptr() and size.value == 2 << 20
    assert function(1 << 40, ctypes.byref(base), ctypes.byref(size), error, 512) == -1
    assert b"invalid device pointer" in error.value


def replayed(ptr: int, elements: int) -> torch.UntypedStorage:
    """What a CUDA graph tree makes of a replayed output: a storage over the
    recorded address, with no deleter (torch._C's own constructor)."""
    return torch._C._construct_storage_from_data_pointer(ptr, torch.device("cpu"), elements * 4)


def read(ptr: int, elements: int = ELEMENTS) -> torch.Tensor:
    """The floats at `ptr` (a view with no deleter: it frees nothing)."""
    return torch.empty(0).set_(replayed(ptr, elements), 0, (elements,), (1,)).clone()


def replay(storage: torch.UntypedStorage, value: float) -> None:
    """A graph replay writing its output into the recorded address."""
    torch.empty(0).set_(storage, 0, (ELEMENTS,), (1,)).fill_(value)


def record(pool: Tuple[int, int], stream: int, *values: float) -> List[torch.Tensor]:
    """A recording into `pool`: a scratch tensor freed, then the outputs."""
    torch._C._cuda_beginAllocateToPool(0, pool)
    try:
        with sim.stream(0, stream):
            scratch = torch.ones(ELEMENTS)
            outputs = [torch.full((ELEMENTS,), value) for value in values]
            del scratch
    finally:
        torch._C._cuda_endAllocateToPool(0, pool)
    return outputs


def allocated_bytes() -> int:
    return int(matepoint.memory_stats(0)["allocated_bytes"])


def test_graph_trees_switch_between_two_recordings_of_one_pool(memory) -> None:
    """torch.compile's CUDA graph trees (cudagraph_trees.py): graphs A and B
    recorded into one pool; then A replays and C is recorded from A's
    state; then B's path replays and D is recorded from B's state. Each
    switch is torch's _cuda_setCheckpointPoolState, with the replayed
    outputs given deleters and the dead ones freed through torch's
    raw_delete: a recording never lands on a live replayed output."""
    side, _ = sim.side_streams()
    pool = (0, 4545)
    a1, a2 = record(pool, side, 1.0, 2.0)
    a1_at, a2_at = a1.data_ptr(), a2.data_ptr()
    after_a = torch._C._cuda_getCheckpointState(0, pool)
    (b1,) = record(pool, side, 3.0)
    b1_at = b1.data_ptr()
    after_b = torch._C._cuda_getCheckpointState(0, pool)
    assert len({a1_at, a2_at, b1_at}) == 3
    held = device_bytes()
    # the recorded tensors die: the allocator's books say the pool is free
    del a1, a2, b1
    assert allocated_bytes() == 0
    # A replays (a2 dies at once), then C records from A's state
    replay_a1 = replayed(a1_at, ELEMENTS)
    replay(replay_a1, 1.0)
    torch._C._cuda_setCheckpointPoolState(0, after_a, [], [replay_a1._cdata])
    assert allocated_bytes() == 2 * ELEMENTS * 4        # A's two outputs, live again
    assert torch._C._cuda_checkPoolLiveAllocations(0, pool, {a1_at, a2_at})
    assert not torch._C._cuda_checkPoolLiveAllocations(0, pool, {a1_at})
    torch._C._cuda_cudaCachingAllocator_raw_delete(a2_at)
    assert torch._C._cuda_checkPoolLiveAllocations(0, pool, {a1_at})
    assert not torch._C._cuda_checkPoolLiveAllocations(0, pool, {a1_at, a2_at})
    (c1,) = record(pool, side, 4.0)
    assert c1.data_ptr() == a2_at, "the dead output's block is reused"
    assert torch.equal(read(a1_at), torch.full((ELEMENTS,), 1.0)), "A's output was overwritten"
    del c1
    # B's path replays (A's outputs, then B's), then D records from B's state
    replay_a1_again, replay_b1 = replayed(a1_at, ELEMENTS), replayed(b1_at, ELEMENTS)
    replay(replay_a1_again, 1.0)
    replay(replay_b1, 3.0)
    torch._C._cuda_setCheckpointPoolState(0, after_b, [replay_a1._cdata],
                                          [replay_a1_again._cdata, replay_b1._cdata])
    assert allocated_bytes() == 3 * ELEMENTS * 4
    torch._C._cuda_cudaCachingAllocator_raw_delete(a2_at)
    (d1,) = record(pool, side, 5.0)
    assert d1.data_ptr() not in (a1_at, b1_at)
    assert torch.equal(read(a1_at), torch.full((ELEMENTS,), 1.0))
    assert torch.equal(read(b1_at), torch.full((ELEMENTS,), 3.0))
    assert float(d1.sum()) == 5.0 * ELEMENTS
    sim.empty_device_cache()                            # read()'s copies' segment
    assert device_bytes() == held, "the pool took no new segment"
    # the replayed outputs die through the allocator's deleter, the stale one frees nothing
    del d1, replay_a1_again, replay_b1, replay_a1
    assert allocated_bytes() == 0
    for _ in range(4):                                  # A, B, C, D recorded into it
        torch._C._cuda_releasePool(0, pool)
    sim.empty_device_cache()
    assert device_bytes() == 0
    assert matepoint.memory_stats(0)["active_bytes.all.current"] == 0


def test_a_restore_of_a_released_pool_is_refused_clearly(memory) -> None:
    side, _ = sim.side_streams()
    pool = (0, 4646)
    (out,) = record(pool, side, 1.0)
    state = torch._C._cuda_getCheckpointState(0, pool)
    del out
    torch._C._cuda_releasePool(0, pool)
    with pytest.raises(RuntimeError, match="matepoint's allocator cannot restore CUDA graph "
                                           "pool .* the pool does not exist or was released"):
        torch._C._cuda_setCheckpointPoolState(0, state, [], [])
    with pytest.raises(RuntimeError, match="matepoint's allocator cannot checkpoint"):
        torch._C._cuda_getCheckpointState(0, pool)
    sim.empty_device_cache()
    assert device_bytes() == 0
