"""The C++ adapter that makes matepoint's allocator torch's CUDA allocator
past malloc and free, so torch's own memory API answers from it.

torch's CUDAPluggableAllocator throws for memory_stats, snapshots and
out-of-memory observers. csrc/torch_cxx/torch_adapter.cpp subclasses it and
answers them from the allocator library's table (csrc/alloc/torch_bridge.h).
A release wheel carries it prebuilt for every torch it names
(matepoint/_units.py); for another torch it is compiled here exactly as the
OOM unit is (matepoint/_oom.py: same cache, key, trust checks, timeout),
which needs a C++ compiler and CUDA's runtime headers (under $CUDA_HOME,
beside the nvcc on PATH, or the nvidia-cuda-runtime and nvidia-cuda-crt
wheels beside torch).

Where it cannot be had, install_allocator() installs the plain pluggable
allocator, warns once with what is missing and what supplies it, and
torch's memory functions raise an error naming matepoint's allocator when
called (guard_torch_memory_api()).
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

from matepoint import _C, _oom

_ERROR_BYTES = 1024
# where a CUDA toolkit is looked for when $CUDA_HOME and PATH name none (a
# module attribute: a test hides the toolkit as a user's machine lacks it)
DEFAULT_CUDA_HOMES = ("/usr/local/cuda",)


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


def _cuda_include_candidates() -> List[str]:
    """Folders that may hold the CUDA runtime's headers, most specific
    first: $CUDA_HOME, the toolkit of the nvcc on PATH, the nvidia wheels
    beside torch, DEFAULT_CUDA_HOMES."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "include"))
    nvcc = _nvcc_include()
    if nvcc is not None:
        candidates.append(nvcc)
    site = os.path.dirname(os.path.dirname(torch.__file__))
    candidates += sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "include")), reverse=True)
    candidates += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "include")))
    candidates += [os.path.join(home, "include") for home in DEFAULT_CUDA_HOMES]
    return [path for path in candidates
            if os.path.exists(os.path.join(path, "cuda_runtime_api.h"))]


def cuda_include_dirs() -> List[str]:
    """Folders holding the CUDA runtime's headers whole, most specific
    first (see _cuda_include_candidates): the runtime's wheel
    (nvidia-cuda-runtime) lacks crt/, which nvidia-cuda-crt adds."""
    return [path for path in _cuda_include_candidates()
            if os.path.exists(os.path.join(path, "crt", "host_defines.h"))]


def _cuda_headers_fix() -> str:
    release = ".".join((torch.version.cuda or "13.0").split(".")[:2])
    return (f"pip install \"nvidia-cuda-runtime=={release}.*\" \"nvidia-cuda-crt=={release}.*\" "
            f"(CUDA's runtime headers for torch's CUDA {torch.version.cuda}), or set CUDA_HOME "
            f"to a CUDA toolkit")


def _compile_extras() -> _oom.UnitExtras:
    """What compiling the adapter here needs beyond torch's own headers;
    raises _oom.BuildError naming what is missing and what supplies it."""
    if not os.path.exists(os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc",
                                       "cuda", "CUDAPluggableAllocator.h")):
        raise _oom.BuildError(f"torch {torch.__version__} ships no CUDAPluggableAllocator.h",
                              "install a CUDA build of torch")
    includes = cuda_include_dirs()
    if not includes:
        partial = _cuda_include_candidates()
        missing = (f"CUDA's headers in {partial[0]} lack crt/host_defines.h (the nvidia-cuda-crt "
                   f"wheel's)" if partial else
                   "no CUDA runtime headers (cuda_runtime_api.h) under $CUDA_HOME, beside nvcc, "
                   "in the nvidia wheels beside torch or in /usr/local/cuda")
        raise _oom.BuildError(missing, _cuda_headers_fix())
    return _oom.UnitExtras(include_dirs=(includes[0],))


def build() -> ctypes.CDLL:
    """The adapter for the running torch: the wheel's prebuilt one, else
    compiled here (or reused from the cache); raises _oom.BuildError saying
    why it cannot be had, with what fixes it."""
    return _oom.load_unit("torch_adapter", _compile_extras)


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
    found = _oom.unit_source("torch_adapter")
    if found is None:
        raise _oom.BuildError("torch_adapter.cpp or its headers are not in the installed package")
    root, source = found
    needed = _compile_extras()
    extras = dataclasses.replace(needed, include_dirs=(root,) + needed.include_dirs)
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
