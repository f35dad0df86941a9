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


HOST_PHASES_SCRIPT = textwrap.dedent("""
    import ctypes, threading, torch, matepoint
    from matepoint import _C
    from matepoint._allocator import allocator_path
    lib = ctypes.CDLL(allocator_path())
    lib.matepoint_malloc.restype = ctypes.c_void_p
    lib.matepoint_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    _C._attach_allocator(allocator_path())

    def region(x):
        y = x.sin()                             # the region's only saved tensor: x
        lib.matepoint_malloc(1 << 20, 0, None)  # after it: early stop never gets here
        return y * 2

    def recompute_bytes(early_stop, on_thread):
        matepoint.reset_peak_memory_stats()
        before = {r["region"]: r for r in matepoint.memory_stats()["tags"]
                  if r["phase"] == "recompute"}
        x = torch.randn(4, requires_grad=True)
        loss = matepoint.checkpoint(region, x, early_stop=early_stop).sum()
        if on_thread:
            thread = threading.Thread(target=loss.backward)
            thread.start(); thread.join()
        else:
            loss.backward()
        assert torch.equal(x.grad, 2 * x.cos())
        return sum(r["live_bytes"] for r in matepoint.memory_stats()["tags"]
                   if r["phase"] == "recompute" and r["region"] not in before)

    assert recompute_bytes(early_stop=True, on_thread=False) == 0
    assert recompute_bytes(early_stop=False, on_thread=False) == 1 << 20
    # autograd's device threads run CUDA backward: the tag follows the thread
    assert recompute_bytes(early_stop=False, on_thread=True) == 1 << 20
    print("phases ok")
""")


def test_early_stop_saves_recompute_allocations_and_tags_follow_threads() -> None:
    env = dict(os.environ, MATEPOINT_ALLOC_BACKEND="host")
    result = subprocess.run([sys.executable, "-c", HOST_PHASES_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "phases ok" in result.stdout


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
    from torch import nn
    matepoint.install_allocator()

    def recompute_tags(blocks, **kwargs):
        # recompute-tagged rows of the regions these steps create
        seen = {r["region"] for r in matepoint.memory_stats()["tags"]}
        x = torch.randn(64, 512, device="cuda")
        for step in range(2):
            h = x
            for block in blocks:
                h = matepoint.checkpoint(block, h, **kwargs)
            h.pow(2).mean().backward()
        torch.cuda.synchronize()
        return [r for r in matepoint.memory_stats()["tags"]
                if r["phase"] == "recompute" and r["region"] not in seen]

    # Linear saves only its input and weight: early stop ends the recompute
    # before it allocates anything
    linears = [nn.Linear(512, 512).cuda() for _ in range(4)]
    assert recompute_tags(linears) == []
    assert recompute_tags(linears, early_stop=False) != []
    # Linear-GELU-Linear must recompute the GELU input and output
    mlps = [nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).cuda()
            for _ in range(4)]
    assert recompute_tags(mlps) != []
    stats = matepoint.memory_stats()
    assert stats["mallocs"] > 0 and stats["cache_hits"] > 0
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
