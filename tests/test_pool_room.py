"""The pinned pool making room for a span whose size it has not cached:
at pool_limit_bytes, or when the host refuses to pin more (cudaHostAlloc
out of memory), cached buffers of other sizes that no span uses are
unpinned, as few and as small as make room, and the pin tried once more,
so the span still lands in pinned memory; only when that fails too does
it fall back to pageable memory. On the simulated GPU (tests/sim.py)."""
from __future__ import annotations

import pytest
import torch

import matepoint
from matepoint import _C

MEMORY_ALLOCATION = 2       # cudaErrorMemoryAllocation
KIB = 1024


def offload_round_trip(nbytes: int = 256 * KIB) -> bool:
    """A span of `nbytes` offloaded and restored: whether it came back exact."""
    source = torch.randn(nbytes // 4)
    expected = source.clone()
    group, saved = _C._sac_offload([source])
    del source
    (restored,) = _C._sac_restore(group, saved)
    return torch.equal(restored, expected)


def refused(times: int):
    """The next `times` pins fail as out of memory, for the block."""
    class Refused:
        def __enter__(self) -> None:
            _C._sim_fail("cudaHostAlloc", 0, times, MEMORY_ALLOCATION)

        def __exit__(self, *exc: object) -> None:
            _C._sim_fail("cudaHostAlloc", 0, 0, 0)
    return Refused()


def test_a_refused_pin_unpins_cached_buffers_and_pins_again(offload) -> None:
    matepoint.empty_pool()
    assert matepoint.reserve_pool(64 * KIB, 4) == 4       # cached, of another size
    before = matepoint.pool_stats()
    with refused(1):
        assert offload_round_trip()
    after = matepoint.pool_stats()
    assert after["fallbacks"] == before["fallbacks"], "the span went to pageable memory"
    assert after["host_frees"] > before["host_frees"], "no cached buffer was unpinned"
    assert after["host_allocations"] == before["host_allocations"] + 1
    assert _C._sim_take_last_error() == 0


def test_a_pin_refused_twice_falls_back_to_pageable_memory(offload) -> None:
    matepoint.empty_pool()
    before = matepoint.pool_stats()
    with refused(2), pytest.warns(RuntimeWarning, match="pageable"):
        assert offload_round_trip()
    after = matepoint.pool_stats()
    assert after["fallbacks"] == before["fallbacks"] + 1
    assert after["host_allocations"] == before["host_allocations"]
    assert _C._sim_take_last_error() == 0


@pytest.mark.parametrize("limit_over", [256, 1])
def test_at_the_limit_the_smallest_cached_buffers_make_room(offload, limit_over: int) -> None:
    """Four buffers of the smallest class (256 bytes) fill the limit but
    `limit_over` bytes; a 512-byte span needs room: cached 256-byte buffers
    are unpinned (the search goes down to the smallest class, and on until
    even one byte short is made up), and the span lands pinned."""
    matepoint.empty_pool()
    matepoint.set_options(pool_limit_bytes=4 * 256 + 512 - limit_over)
    try:
        assert matepoint.reserve_pool(1, 4) == 4
        before = matepoint.pool_stats()
        assert offload_round_trip(512)
        after = matepoint.pool_stats()
    finally:
        matepoint.set_options(pool_limit_bytes=None)
    assert after["fallbacks"] == before["fallbacks"], "the span went to pageable memory"
    assert after["host_frees"] - before["host_frees"] == 1      # one 256-byte buffer does
    assert after["bytes_reserved"] <= 4 * 256 + 512 - limit_over
