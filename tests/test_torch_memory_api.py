"""torch's memory API under matepoint's allocator (issue 42).

The C figures (torch's names, in matepoint.memory_stats()) are checked on
every torch, on the allocator's host backend. torch's own functions are
checked through the C++ adapter in tests/torch_api_cases.py, run in a
subprocess (the adapter becomes torch's CUDA allocator for the rest of the
process): that needs torch's CUDA libraries, so a CPU build of torch skips
it, saying so.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Optional

import pytest
import torch

from matepoint import _C

HERE = os.path.dirname(os.path.abspath(__file__))


def _has_cuda_libraries() -> bool:
    include = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "cuda",
                           "CUDAPluggableAllocator.h")
    return torch.version.cuda is not None and os.path.exists(include)


needs_cuda_libraries = pytest.mark.skipif(
    not _has_cuda_libraries(),
    reason=f"torch {torch.__version__} is a CPU build: no CUDA libraries or headers to build "
           f"the adapter against (torch's memory API is checked on a CUDA build of torch)")


def _run_cases(path: str, *selection: str, preload: Optional[str] = None) -> None:
    """Runs the cases of `path` in a subprocess, with library `preload`
    preloaded after any already (AddressSanitizer's runtime stays first)."""
    if not getattr(_C, "TEST_BUILD", 0):
        pytest.skip("needs a test build (the simulated GPU)")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               os.path.join(HERE, path), *selection]
    env = dict(os.environ)
    if preload is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, [env.get("LD_PRELOAD"), preload]))
    result = subprocess.run(command, cwd=os.path.dirname(HERE), capture_output=True, text=True,
                            timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def device_shim(folder: str) -> str:
    """The runtime calls torch makes before it allocates, answered as the
    simulated GPU would (tests/c/cuda_device_shim.c), built into `folder`:
    no GPU (nor driver) is here."""
    shim = os.path.join(folder, "libcuda_device_shim.so")
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", shim,
                    os.path.join(HERE, "c", "cuda_device_shim.c")], check=True, timeout=120)
    return shim


@needs_cuda_libraries
def test_torch_memory_functions_answer_from_matepoint() -> None:
    _run_cases("torch_api_cases.py")


@needs_cuda_libraries
def test_torch_memory_api_answers_as_torchs_allocator(tmp_path) -> None:
    """tests/torch_parity_cases.py: CUDA tensors over the simulated GPU,
    torch's memory API called as users call it (issue 53)."""
    _run_cases("torch_parity_cases.py", preload=device_shim(str(tmp_path)))


HOST_FIGURES = textwrap.dedent("""
    import ctypes, matepoint
    from matepoint import _C
    from matepoint._allocator import allocator_path
    lib = ctypes.CDLL(allocator_path())
    lib.matepoint_malloc.restype = ctypes.c_void_p
    lib.matepoint_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.matepoint_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    _C._attach_allocator(allocator_path())
    MIB = 1 << 20
    # zero bytes: a null pointer and nothing counted, as torch's allocator
    assert lib.matepoint_malloc(0, 1, None) is None
    lib.matepoint_free(None, 0, 1, None)
    assert matepoint.memory_stats(1)["allocation.all.allocated"] == 0
    small = [lib.matepoint_malloc(1000, 1, None) for _ in range(3)]   # 1024 bytes each
    large = lib.matepoint_malloc(3 * MIB + 5, 1, None)
    s = matepoint.memory_stats(1)
    assert s["allocation.all.current"] == 4 and s["allocation.small_pool.current"] == 3
    assert s["allocated_bytes.small_pool.current"] == 3 * 1024
    assert s["allocated_bytes.large_pool.current"] == 3 * MIB + 512
    assert s["requested_bytes.all.current"] == 3 * 1000 + 3 * MIB + 5
    assert s["reserved_bytes.small_pool.current"] == 2 * MIB
    assert s["reserved_bytes.large_pool.current"] == 20 * MIB
    assert s["segment.all.current"] == 2 and s["num_device_alloc"] == 2
    # the free rest of each segment is an inactive split block
    assert s["inactive_split.all.current"] == 2
    assert s["inactive_split_bytes.all.current"] == (2 * MIB - 3 * 1024) + (17 * MIB - 512)
    lib.matepoint_free(small[1], 0, 1, None)    # a hole between two live blocks
    s = matepoint.memory_stats(1)
    assert s["inactive_split.small_pool.current"] == 2 and s["allocation.all.freed"] == 1
    assert s["active_bytes.all.current"] == s["allocated_bytes.all.current"]
    assert s["allocated_bytes.all.current"] == s["allocated_bytes"]    # one figure, two names
    assert s["num_device_alloc"] == s["device_allocs"] and s["num_ooms"] == s["ooms"] == 0
    assert s["max_split_size"] == -1 and s["oversize_allocations.current"] == 0
    for ptr in small[:1] + small[2:] + [large]:
        lib.matepoint_free(ptr, 0, 1, None)
    s = matepoint.memory_stats(1)
    assert s["allocated_bytes.all.current"] == s["inactive_split.all.current"] == 0
    assert s["allocated_bytes.all.peak"] == 3 * 1024 + 3 * MIB + 512
    assert s["allocated_bytes.all.freed"] == s["allocated_bytes.all.allocated"]
    assert matepoint.memory_stats(0)["allocation.all.allocated"] == 0   # device 0 untouched
    matepoint.reset_peak_memory_stats()
    assert matepoint.memory_stats(1)["allocated_bytes.all.peak"] == 0
    matepoint.empty_cache()
    s = matepoint.memory_stats(1)
    assert s["reserved_bytes.all.current"] == 0 and s["num_device_free"] == 2
    assert s["segment.all.freed"] == 2
    print("figures ok")
""")


def test_torch_figures_in_matepoint_memory_stats_on_the_host_backend() -> None:
    """torch's names and figures, made in C, read through matepoint.memory_stats()."""
    env = dict(os.environ, MATEPOINT_ALLOC_BACKEND="host")
    result = subprocess.run([sys.executable, "-c", HOST_FIGURES], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "figures ok" in result.stdout and "did not allocate" not in result.stderr


@needs_cuda_libraries
def test_the_readme_memory_plot_is_made_from_torch_snapshot(tmp_path) -> None:
    """benchmarks/memory_plot.py: one area per region and phase."""
    import xml.etree.ElementTree as ElementTree
    if not getattr(_C, "TEST_BUILD", 0):
        pytest.skip("needs a test build (the simulated GPU)")
    out, page = tmp_path / "plot.svg", tmp_path / "viz.html"
    script = os.path.join(os.path.dirname(HERE), "benchmarks", "memory_plot.py")
    result = subprocess.run([sys.executable, script, "--out", str(out), "--html", str(page),
                             "--blocks", "3", "--width", "128", "--batch", "64"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    areas = [node.findtext("{http://www.w3.org/2000/svg}title")
             for node in ElementTree.parse(out).getroot()
             if node.tag.endswith("polygon")]
    assert sorted(areas) == sorted(["region 0 other"] + [f"region {r} {phase}" for r in (1, 2, 3)
                                                         for phase in ("forward", "recompute")])
    assert "MemoryViz.js" in page.read_text()
