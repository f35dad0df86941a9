"""The pinned pool making room for a span whose size it has not cached:
at pool_limit_bytes, or when the host refuses to pin more (cudaHostAlloc
out of memory), cached buffers of other sizes that no span uses are
unpinned, as few and as small as make room, and the pin tried once more,
so the span still lands in pinned memory; only when that fails too does
it fall back to pageable memory. On the simulated GPU (tests/sim.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import matepoint
from matepoint import _C

from conftest import run_in_thread
from package_under_test import PACKAGE_PARENT

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


def test_pinning_in_another_devices_context_leaves_torchs_device_as_it_was(offload) -> None:
    """reserve_pool() on a thread whose current device (GPU 1) has no
    context yet pins in GPU 0's context, which exists, rather than create
    one; afterwards torch.cuda.current_device() still answers 1, as torch's
    own guards leave it (GPU 0 stays CUDA's current device: setting GPU 1
    would create its context)."""
    seen = {}

    def on_a_thread_of_gpu_1() -> None:
        _C._sim_set_device(1)                 # torch.cuda.set_device(1)
        _C._sim_forget_contexts()             # no context anywhere yet...
        run_in_thread(lambda: _C._sim_set_device(0))    # ...but GPU 0's, made elsewhere
        assert _C._sim_stats()["contexts"] == [True, False]
        before = matepoint.pool_stats()["host_allocations"]
        seen["reserved"] = matepoint.reserve_pool(64 * KIB, 2)
        seen["pinned"] = matepoint.pool_stats()["host_allocations"] - before
        seen["contexts"] = _C._sim_stats()["contexts"]
        seen["devices"] = (_C._sim_get_device(), _C._sim_torch_device())

    try:
        run_in_thread(on_a_thread_of_gpu_1)
    finally:
        _C._sim_set_device(0)
    matepoint.empty_pool()
    assert (seen["reserved"], seen["pinned"]) == (2, 2)
    assert seen["contexts"] == [True, False], "pinning created GPU 1's context"
    assert seen["devices"] == (0, 1), "torch.cuda.current_device() no longer answers 1"


# reserve_pool() in a process with no CUDA runtime to load: its buffers,
# and whether a libcudart got loaded all the same
NO_CUDA_RUNTIME = """
import matepoint
reserved = matepoint.reserve_pool(64 * 1024, 2)
stats = matepoint.pool_stats()
loaded = any("libcudart" in line for line in open("/proc/self/maps"))
print(reserved, stats["backend"], stats["host_allocations"], loaded)
"""


def test_without_a_cuda_runtime_reserve_pool_reserves_host_memory() -> None:
    """On a CPU-only install (no CUDA runtime library to load, so no
    device), reserve_pool() still reserves its buffers, in plain host
    memory, entering no device. Run in a process whose dynamic loader
    ignores /etc/ld.so.cache, where a machine lists its CUDA toolkit's
    libcudart."""
    loader = next((line.split()[-1] for line in open("/proc/self/maps")
                   if os.path.basename(line.split()[-1]).startswith("ld-linux")), None)
    if loader is None:
        pytest.skip("no glibc dynamic loader to run Python under")
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT))
    done = subprocess.run([loader, "--inhibit-cache", sys.executable, "-c", NO_CUDA_RUNTIME],
                          env=env, cwd=PACKAGE_PARENT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    reserved, backend, allocations, loaded = done.stdout.split()
    if loaded == "True":
        pytest.skip("a CUDA runtime library is in the loader's default folders")
    assert (reserved, backend, allocations) == ("2", "host", "2")
