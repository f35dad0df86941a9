"""The pinned pool when the host refuses to pin more (cudaHostAlloc out of
memory), with no pool_limit_bytes: cached buffers of other sizes that no
span uses are unpinned to make room and the pin tried once more, so the
span still lands in pinned memory; only when that fails too does it fall
back to pageable memory. On the simulated GPU (tests/sim.py)."""
from __future__ import annotations

import pytest
import torch

import matepoint
from matepoint import _C

MEMORY_ALLOCATION = 2       # cudaErrorMemoryAllocation
KIB = 1024


def offload_round_trip() -> tuple:
    """A 256 KiB span offloaded and restored: whether it came back exact."""
    source = torch.randn(256 * KIB // 4)
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
