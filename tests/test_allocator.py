"""The allocator library seen from Python.

Without a GPU the library runs on its host backend (MATEPOINT_ALLOC_BACKEND=
host) in a subprocess, where the test plays torch's part and calls its entry
points, so tags from checkpoint() and the statistics are checked for real.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import matepoint

HOST_SCRIPT = textwrap.dedent("""
    import ctypes, torch, matepoint
    from matepoint import _C
    from matepoint._allocator import allocator_path
    lib = ctypes.CDLL(allocator_path())
    lib.matepoint_malloc.restype = ctypes.c_void_p
    lib.matepoint_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.matepoint_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    _C._attach_allocator(allocator_path())
    held = []

    def region(x):
        # stands in for the device tensors torch would allocate in the region
        ptr = lib.matepoint_malloc(3 << 20 if matepoint.is_recomputing() else 1 << 20, 0, None)
        held.append(ptr)
        return x.sin().exp()

    outside = lib.matepoint_malloc(4096, 0, None)
    x = torch.randn(4, requires_grad=True)
    matepoint.checkpoint(region, x).sum().backward()
    stats = matepoint.memory_stats()
    rows = {(r["region"] > 0, r["phase"]): r for r in stats["tags"]}
    assert rows[(True, "forward")]["peak_bytes"] == 1 << 20, rows
    assert rows[(True, "recompute")]["peak_bytes"] == 3 << 20, rows
    assert rows[(False, "other")]["live_bytes"] == 4096, rows
    assert stats["allocated_bytes"] == (1 << 20) + (3 << 20) + 4096
    assert stats["mallocs"] == 3 and stats["frees"] == 0
    for ptr in held:
        lib.matepoint_free(ptr, 0, 0, None)
    lib.matepoint_free(outside, 0, 0, None)
    stats = matepoint.memory_stats()
    assert stats["allocated_bytes"] == 0 and stats["frees"] == 3
    assert all(r["live_bytes"] == 0 for r in stats["tags"])
    report = matepoint.memory_report()
    assert "recompute" in report and "outside" in report
    matepoint.reset_peak_memory_stats()
    assert matepoint.memory_stats()["peak_allocated_bytes"] == 0
    matepoint.empty_cache()
    assert matepoint.memory_stats()["reserved_bytes"] == 0
    print("host allocator ok")
""")


def test_tags_and_stats_through_the_library_on_the_host_backend() -> None:
    env = dict(os.environ, MATEPOINT_ALLOC_BACKEND="host")
    result = subprocess.run([sys.executable, "-c", HOST_SCRIPT], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "host allocator ok" in result.stdout


def test_library_exports_torch_entry_points() -> None:
    import ctypes
    lib = ctypes.CDLL(matepoint._allocator.allocator_path())
    for name in ["matepoint_malloc", "matepoint_free", "matepoint_init", "matepoint_reset",
                 "matepoint_record_stream", "matepoint_set_memory_fraction",
                 "matepoint_alloc_set_tag", "matepoint_alloc_get_stats"]:
        assert getattr(lib, name) is not None


def test_stats_before_install_say_how_to_install() -> None:
    with pytest.raises(RuntimeError, match="install_allocator"):
        matepoint.memory_stats()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_install_without_cuda_is_refused() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        matepoint.install_allocator()


CUDA_SCRIPT = textwrap.dedent("""
    import torch, matepoint
    matepoint.install_allocator()
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 512, device="cuda")
    for step in range(3):
        h = x
        for layer in model:
            h = matepoint.checkpoint(layer, h)
        h.pow(2).mean().backward()
        opt.step(); opt.zero_grad()
    torch.cuda.synchronize()
    stats = matepoint.memory_stats()
    assert stats["mallocs"] > 0 and stats["cache_hits"] > 0
    assert any(r["phase"] == "recompute" for r in stats["tags"])
    torch.cuda.empty_cache()
    print(matepoint.memory_report())
    print("cuda allocator ok")
""")


@pytest.mark.cuda
def test_training_steps_under_the_allocator_on_a_gpu() -> None:
    result = subprocess.run([sys.executable, "-c", CUDA_SCRIPT], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "cuda allocator ok" in result.stdout
