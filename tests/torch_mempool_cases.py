"""torch.cuda.MemPool and torch.cuda.use_mem_pool (torch's own Python API)
under matepoint's allocator, through the C++ adapter
(csrc/torch_cxx/torch_adapter.cpp), over the allocator serving the simulated
GPU's memory (tests/sim.py).

Run by tests/test_torch_graph_pools.py in a subprocess (the adapter becomes
torch's CUDA allocator for the rest of the process), with a cudaGetDevice
preloaded that answers device 0 (tests/c/cuda_device_shim.c): a MemPool asks
the runtime for its device when made, and no GPU is here. As in
torch_api_cases.py, the `cuda_up` fixture makes torch.cuda's Python checks
answer "CUDA is up" (lazy initialization, the current device, no capture
underway); MemPool, use_mem_pool, MemPool.snapshot and their C++ calls
(createOrIncrefPool, beginAllocateToPool with the thread's filter,
getPoolUseCount, releasePool, emptyCache(mempool_id), snapshot(mempool_id))
are torch's own.
"""
from __future__ import annotations

import ctypes
import gc
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

import matepoint
from matepoint import _C
from matepoint._allocator import allocator_path
import sim
from torch_parity_cases import library, stand_for_cuda_up  # noqa: F401 (a fixture)

ELEMENTS = 1 << 14
MIB = 1 << 20


@pytest.fixture
def cuda_up(library, monkeypatch) -> Iterator[ctypes.CDLL]:
    stand_for_cuda_up(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_device", _C._sim_get_device)
    with sim.device_memory():
        yield library
    gc.collect()
    sim.empty_device_cache()


def device_bytes() -> int:
    return _C._sim_stats()["device_bytes_live"][0]


def allocated_bytes() -> int:
    return int(matepoint.memory_stats(0)["allocated_bytes"])


def use_count_in_c(library: ctypes.CDLL, pool: Tuple[int, int]) -> int:
    """The library's own count of a pool's uses on device 0 (-1: none)."""
    count = library.matepoint_test_pool_use_count
    count.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]
    count.restype = ctypes.c_int
    return count(0, pool[0], pool[1])


def holder(segments: List[Dict[str, Any]], ptr: int) -> Dict[str, Any]:
    """The segment of a snapshot holding `ptr`."""
    found = [s for s in segments if s["address"] <= ptr < s["address"] + s["total_size"]]
    assert len(found) == 1, (hex(ptr), [hex(s["address"]) for s in segments])
    return found[0]


def test_use_mem_pool_allocates_from_the_pool_until_it_ends(cuda_up) -> None:
    sim.empty_device_cache()
    outside = torch.ones(ELEMENTS)
    cached_at = outside.data_ptr()
    del outside                                  # a free block of the ordinary cache
    pool = torch.cuda.MemPool()
    assert pool.use_count() == 1
    with torch.cuda.use_mem_pool(pool):
        assert pool.use_count() == 2
        scratch = torch.ones(ELEMENTS)
        scratch_at = scratch.data_ptr()
        del scratch                              # stays in the pool
        kept = torch.full((ELEMENTS,), 2.0)
    assert pool.use_count() == 1
    assert kept.data_ptr() == scratch_at, "the pool reuses its own free block"
    assert scratch_at != cached_at, "the ordinary cache's free block was not used"
    mine = pool.snapshot()
    segment = holder(mine, kept.data_ptr())
    assert tuple(segment["segment_pool_id"]) == pool.id
    assert all(tuple(s["segment_pool_id"]) == pool.id for s in mine)
    assert not any(s["address"] <= cached_at < s["address"] + s["total_size"] for s in mine)
    everything = torch.cuda.memory_snapshot()
    assert tuple(holder(everything, cached_at)["segment_pool_id"]) == (0, 0)
    # outside the context: the ordinary cache again, never the pool
    after = torch.ones(ELEMENTS)
    assert after.data_ptr() == cached_at
    pool_bytes = segment["total_size"]
    del kept, after
    sim.empty_device_cache()
    assert device_bytes() == pool_bytes, "the pool keeps its memory while it lives"
    del pool
    gc.collect()
    assert device_bytes() == 0 and allocated_bytes() == 0


def test_two_pools_share_nothing_and_a_pool_reuses_its_blocks(cuda_up) -> None:
    first, second = torch.cuda.MemPool(), torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(first):
        freed_at = torch.ones(ELEMENTS).data_ptr()
    with torch.cuda.use_mem_pool(second):
        other = torch.ones(ELEMENTS)
    assert other.data_ptr() != freed_at, "a pool's free block went to another pool"
    with torch.cuda.use_mem_pool(first):
        again = torch.ones(ELEMENTS)
    assert again.data_ptr() == freed_at
    assert [tuple(s["segment_pool_id"]) for s in second.snapshot()] == [second.id]
    assert first.use_count() == 1 and second.use_count() == 1
    torch.ones(ELEMENTS)                         # a free block of the ordinary cache
    held = device_bytes()
    del first                                    # its block is live: its segment stays
    gc.collect()
    assert device_bytes() == held, "a MemPool's end emptied more than its own pool"
    assert float(again.sum()) == ELEMENTS
    del again
    # a released pool's memory is freeable, and goes at the next empty_cache,
    # as torch's: never at a tensor's free, where cudaFree would synchronize
    assert device_bytes() == held, "a cudaFree at a tensor's free"
    sim.empty_device_cache()
    assert device_bytes() == held - 2 * MIB - 2 * MIB     # the first pool's and the cache's
    del other, second
    gc.collect()
    assert device_bytes() == 0 and allocated_bytes() == 0
    assert matepoint.memory_stats(0)["segment.all.current"] == 0


def test_a_pool_matepoint_cannot_begin_is_refused_and_nothing_kept(cuda_up) -> None:
    """A begin the allocator refuses (here: a device it does not serve)
    raises at use_mem_pool, before its body, naming matepoint's allocator
    and why; the adapter keeps no filter (a second try is refused alike,
    not as "already recording") and the pool keeps its one use."""
    pool = torch.cuda.MemPool()
    ran = 0
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"matepoint's allocator cannot allocate to memory "
                                               r"pool \(\d+, \d+\) on device 7: no such device"):
            with torch.cuda.use_mem_pool(pool, device=7):
                ran += 1
    assert ran == 0
    assert use_count_in_c(cuda_up, pool.id) == 1
    with torch.cuda.use_mem_pool(pool):
        inside = torch.ones(ELEMENTS)
    assert tuple(holder(pool.snapshot(), inside.data_ptr())["segment_pool_id"]) == pool.id
    del inside, pool
    gc.collect()
    assert device_bytes() == 0


def test_mem_pools_matepoint_cannot_serve_are_refused_clearly(cuda_up) -> None:
    foreign = torch.cuda.memory.CUDAPluggableAllocator(allocator_path(), "matepoint_malloc",
                                                       "matepoint_free")
    with pytest.raises(RuntimeError, match="matepoint's allocator cannot serve a "
                                           "torch.cuda.MemPool whose memory comes from another"):
        torch.cuda.MemPool(allocator=foreign.allocator())
    for refused in ({"use_on_oom": True}, {"no_split": True}):
        before = torch.cuda.MemPool()
        with pytest.raises(RuntimeError, match="matepoint's allocator .*" + next(iter(refused))):
            torch.cuda.MemPool(**refused)
        after = torch.cuda.MemPool()
        # torch numbered the refused MemPool between the two (asserted, so
        # that the check of its id below cannot pass for another id)
        assert after.id == (before.id[0], before.id[1] + 2)
        refused_id = (before.id[0], before.id[1] + 1)
        assert use_count_in_c(cuda_up, refused_id) == -1      # not left behind
        assert use_count_in_c(cuda_up, before.id) == 1 and use_count_in_c(cuda_up, after.id) == 1
        del before, after
    own = torch.cuda.MemPool(allocator=torch.cuda.memory._get_current_allocator().allocator())
    with torch.cuda.use_mem_pool(own):
        inside = torch.ones(ELEMENTS)
    assert tuple(holder(own.snapshot(), inside.data_ptr())["segment_pool_id"]) == own.id
    del inside, own
    gc.collect()
    assert device_bytes() == 0
