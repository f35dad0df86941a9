"""Two questions torch asks its CUDA allocator about the cache, answered by
matepoint's on the simulated GPU (tests/sim.py):

- getBaseAllocation (CUDA IPC, issue 42 item 5): a tensor's block is
  carved from a larger segment, and another process can only map whole
  segments (cudaIpcGetMemHandle of the segment's base), then adds the
  block's offset. Reporting the block itself as the base would map the
  wrong bytes.
- cacheInfo (cudnn.benchmark, item 3): the largest free block cached, which
  bounds the workspace cudnn tries."""
from __future__ import annotations

import ctypes

import torch

import sim

ELEMENTS = 1 << 14                      # 64 KiB of float32: the small pool's 2 MiB segments
SMALL_SEGMENT = 2 << 20


def base_allocation(pointer: int):
    """matepoint_base_allocation, the library's base_alloc_fn: (base, size)."""
    function = sim.allocator_library().matepoint_base_allocation
    function.restype = ctypes.c_void_p
    function.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    size = ctypes.c_size_t(0)
    return function(pointer, ctypes.byref(size)), size.value


def largest_free_block() -> int:
    function = sim.allocator_library().matepoint_test_largest_free_block
    function.restype = ctypes.c_uint64
    function.argtypes = [ctypes.c_int]
    return function(0)


def test_a_views_base_allocation_is_its_segment_and_maps_its_bytes(offload):
    side, _ = sim.side_streams()
    with sim.stream(0, side):
        first = torch.arange(ELEMENTS, dtype=torch.float32)
        second = torch.arange(ELEMENTS, dtype=torch.float32) + ELEMENTS
    view = second[100:]                 # an interior view of the second block
    base, size = base_allocation(view.data_ptr())
    assert (base, size) == base_allocation(first.data_ptr()), "one segment holds both"
    assert size == SMALL_SEGMENT and base <= first.data_ptr()
    offset = view.data_ptr() - base
    assert offset == second.data_ptr() - base + 100 * 4 and offset > 0
    # what a receiving process does (once the producer's stream ran): map
    # the segment, add the offset
    sim.finish()
    mapped = (ctypes.c_float * 8).from_address(base + offset)
    assert list(mapped) == [float(ELEMENTS + 100 + i) for i in range(8)]
    # a pointer the allocator did not hand out is its own base (torch's default)
    outside = torch.empty(0).data_ptr() + (1 << 40)
    assert base_allocation(outside) == (outside, 0)


def test_largest_free_block_is_what_the_cache_holds(offload):
    side, _ = sim.side_streams()
    sim.empty_device_cache()
    assert largest_free_block() == 0
    with sim.stream(0, side):
        small = torch.empty(ELEMENTS)               # a 2 MiB segment, its rest free
        assert largest_free_block() == SMALL_SEGMENT - ELEMENTS * 4
        large = torch.empty(3 << 18)                # 3 MiB: a 20 MiB segment
        assert largest_free_block() == (20 << 20) - (3 << 20)
        del large
        assert largest_free_block() == 20 << 20
        del small
    sim.empty_device_cache()
    assert largest_free_block() == 0
