"""The C++ adapter that makes matepoint's allocator torch's CUDA allocator
past malloc and free, so torch's own memory API answers from it.

torch's CUDAPluggableAllocator throws for memory_stats, snapshots and
out-of-memory observers. csrc/torch_cxx/torch_adapter.cpp subclasses it and
answers them from the allocator library's table (csrc/alloc/torch_bridge.h);
it is compiled at run time against the running torch exactly as the OOM
unit is (matepoint/_oom.py: same cache, key, trust checks, timeout), and
needs torch's CUDA headers and the CUDA runtime's (found under $CUDA_HOME,
beside the nvcc on PATH, or in the nvidia-cuda-runtime wheel beside torch).

Where it cannot be built, install_allocator() installs the plain pluggable
allocator, warns once, and torch's memory functions raise an error naming
matepoint's allocator when called (fallback_functions()).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from matepoint import _build_layout, _C, _oom

_HERE = os.path.dirname(os.path.abspath(__file__))
_LIBRARIES = ("c10_cuda", "torch_cpu", "torch_cuda")
# torch 2.14's c10 headers use C++20 (operator<=>)
_FLAGS = ("-std=c++20",)
_ERROR_BYTES = 1024


def _unit_files() -> Optional[Tuple[str, List[str]]]:
    """(the folder playing csrc/, [source, headers...]) from the first
    such folder holding them all: the installed package's, else the
    checkout's."""
    relative = [os.path.relpath(path, "csrc") for path in
                (_build_layout.ADAPTER_UNIT_SOURCE,) + _build_layout.ADAPTER_HEADER_SOURCES]
    for root in _build_layout.unit_source_roots(_HERE):
        paths = [os.path.join(root, path) for path in relative]
        if all(os.path.exists(path) for path in paths):
            return root, paths
    return None


def _nvcc_include() -> Optional[str]:
    """The include folder of the nvcc on PATH, as nvcc itself says (it may
    be a wrapper script), like the Makefile's abi-check asks it."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        done = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in (done.stdout + done.stderr).splitlines():
        if 'INCLUDES="-I' in line:
            return line.split('INCLUDES="-I', 1)[1].split('"', 1)[0]
    return None


def cuda_include_dirs() -> List[str]:
    """Folders holding the CUDA runtime's headers, most specific first:
    $CUDA_HOME, the toolkit of the nvcc on PATH, the nvidia wheels beside
    torch, /usr/local/cuda."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "include"))
    nvcc = _nvcc_include()
    if nvcc is not None:
        candidates.append(nvcc)
    site = os.path.dirname(os.path.dirname(torch.__file__))
    candidates += sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "include")), reverse=True)
    candidates += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "include")))
    candidates.append("/usr/local/cuda/include")
    # the runtime wheel alone lacks crt/ (it comes with nvcc's wheel)
    return [path for path in candidates
            if os.path.exists(os.path.join(path, "cuda_runtime_api.h"))
            and os.path.exists(os.path.join(path, "crt", "host_defines.h"))]


def _unit() -> Tuple[str, _oom.UnitExtras]:
    """The adapter's source and how it builds here; raises _oom.BuildError
    saying why it cannot."""
    found = _unit_files()
    if found is None:
        raise _oom.BuildError("torch_adapter.cpp or its headers are not in the installed package")
    root, files = found
    if not os.path.exists(os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc",
                                       "cuda", "CUDAPluggableAllocator.h")):
        raise _oom.BuildError("this torch ships no CUDAPluggableAllocator.h")
    includes = cuda_include_dirs()
    if not includes:
        raise _oom.BuildError("no CUDA runtime headers (cuda_runtime_api.h) under $CUDA_HOME, "
                              "beside nvcc or in the nvidia-cuda-runtime wheel")
    extras = _oom.UnitExtras(flags=_FLAGS, include_dirs=(root, includes[0]),
                             libraries=_LIBRARIES, depends=tuple(files[1:]))
    return files[0], extras


def build() -> ctypes.CDLL:
    """Compiles (or reuses from the cache) and loads the adapter; raises
    _oom.BuildError saying why it cannot be had here."""
    source, extras = _unit()
    return _oom.load_library(source, "torch_adapter", extras)


# c10's CUDA headers include one that a CUDA build of torch generates (its
# build options); a CPU build ships the others without it
_GENERATED_HEADER = os.path.join("c10", "cuda", "impl", "cuda_cmake_macros.h")
_GENERATED_TEXT = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"


def check_compiles() -> None:
    """Compiles the adapter against the running torch's headers without
    linking it: a CPU build of torch ships the CUDA headers, not
    libtorch_cuda (nor the one header a CUDA build generates, which is
    written as a CUDA build of torch writes it). Raises _oom.BuildError with
    the compiler's output."""
    source, extras = _unit()
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    if os.path.exists(os.path.join(include, _GENERATED_HEADER)):
        _oom.check_compiles(source, extras)
        return
    with tempfile.TemporaryDirectory(prefix="matepoint-headers-") as folder:
        generated = os.path.join(folder, _GENERATED_HEADER)
        os.makedirs(os.path.dirname(generated))
        with open(generated, "w") as handle:
            handle.write(_GENERATED_TEXT)
        extras = dataclasses.replace(extras, include_dirs=extras.include_dirs + (folder,))
        _oom.check_compiles(source, extras)


def install(library: ctypes.CDLL) -> None:
    """Makes the adapter over ``library`` (the allocator's) torch's current
    CUDA allocator; raises _oom.BuildError or RuntimeError saying why not."""
    adapter = build()
    get_bridge = getattr(library, _C.ALLOCATOR_SYMBOLS["torch_bridge"])
    install_fn = adapter.matepoint_torch_adapter_install
    install_fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    install_fn.restype = ctypes.c_int
    error = ctypes.create_string_buffer(_ERROR_BYTES)
    if install_fn(ctypes.cast(get_bridge, ctypes.c_void_p), error, _ERROR_BYTES) != 0:
        raise RuntimeError(f"torch refused matepoint's allocator adapter: "
                           f"{error.value.decode(errors='replace')}")


# torch.cuda's memory functions that need the adapter (module-level names
# in torch.cuda.memory, re-exported by torch.cuda where public)
GUARDED_FUNCTIONS = (
    "memory_stats", "memory_stats_as_nested_dict", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
    "reset_accumulated_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
    "memory_summary", "get_per_process_memory_fraction", "memory_snapshot",
    "_record_memory_history", "_snapshot", "_dump_snapshot",
)


def _guarded(name: str, reason: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"torch.cuda.{name}() is not available under matepoint's allocator in this "
            f"process: the C++ adapter that answers torch's memory API could not be built "
            f"({reason}). Use matepoint.memory_stats() / matepoint.memory_report(), or fix the "
            f"build (a C++ compiler and the CUDA runtime headers) and restart.")
    refuse.__name__ = name
    refuse.__doc__ = f"Raises: matepoint's allocator is installed without its adapter ({reason})."
    return refuse


def guard_torch_memory_api(reason: str) -> None:
    """Replaces torch.cuda's memory functions (GUARDED_FUNCTIONS) by ones
    raising a RuntimeError that names matepoint's allocator and ``reason``,
    so the user meets the problem at their call, not deep inside torch."""
    for name in GUARDED_FUNCTIONS:
        if not hasattr(torch.cuda.memory, name):
            continue
        replacement = functools.wraps(getattr(torch.cuda.memory, name))(_guarded(name, reason))
        setattr(torch.cuda.memory, name, replacement)
        if hasattr(torch.cuda, name):
            setattr(torch.cuda, name, replacement)


def record_history(enabled: bool, stacks: bool = True, max_entries: int = 1 << 20,
                   clear: bool = False, skip_actions: Sequence[str] = ()) -> None:
    """What torch.cuda.memory._record_memory_history(context="all" or None,
    max_entries=..., clear_history=..., skip_actions=...) does once CUDA is
    up: the current allocator's recordHistory, through c10's C++ entry point
    and torch's stack gatherer. torch's Python entry initializes CUDA first,
    which a process without a GPU cannot do: the tests and
    benchmarks/memory_plot.py (the simulated GPU) record through this. Needs
    the adapter installed."""
    record = build().matepoint_torch_adapter_record_history
    record.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_int,
                       ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t, ctypes.c_char_p,
                       ctypes.c_size_t]
    record.restype = ctypes.c_int
    names = (ctypes.c_char_p * max(len(skip_actions), 1))(*[a.encode() for a in skip_actions])
    error = ctypes.create_string_buffer(_ERROR_BYTES)
    if record(int(enabled), int(stacks), max_entries, int(clear), names, len(skip_actions),
              error, _ERROR_BYTES) != 0:
        raise RuntimeError(f"recording memory history failed: "
                           f"{error.value.decode(errors='replace')}")
