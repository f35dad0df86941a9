"""Out of memory under matepoint's allocator as torch.OutOfMemoryError.

torch takes an allocator's failure only as a thrown c10::OutOfMemoryError,
a C++ type. The throw lives in one small C++ file (oom_raise.cpp) that is
compiled the first time install_allocator() runs, against the torch that
is running (its headers, C++ ABI and libc10), and cached in
MATEPOINT_CACHE_DIR (default ~/.cache/matepoint) under a name that changes
with torch's version and the source. Compiling at run time keeps
``pip install .`` free of torch (pip's isolated build has none, and asking
for it there fetches a multi-GB CUDA build) and rebuilds after a torch
upgrade. It needs a C++ compiler (``c++``, or $CXX); without one, out of
memory stops the process with the same message, as before.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
from typing import List, Optional

import torch

log = logging.getLogger("matepoint")
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, "oom_raise.cpp"),
            os.path.join(_HERE, os.pardir, "csrc", "alloc", "oom_raise.cpp")]
_loaded: List[ctypes.CDLL] = []   # keeps built libraries loaded for the process


def cache_dir() -> str:
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                           "matepoint")
    return os.environ.get("MATEPOINT_CACHE_DIR", default)


def _torch_dirs() -> List[str]:
    root = os.path.dirname(torch.__file__)
    return [os.path.join(root, "include"), os.path.join(root, "lib")]


def build_library(source: str, name: str) -> str:
    """Compiles `source` (C++ using c10) into a shared library linked to the
    running torch's libc10; returns its path, reusing a cached build."""
    with open(source, "rb") as handle:
        text = handle.read()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(text + f"{torch.__version__}|{abi}".encode()).hexdigest()[:16]
    folder = cache_dir()
    target = os.path.join(folder, f"{name}-{key}.so")
    if os.path.exists(target):
        return target
    os.makedirs(folder, exist_ok=True)
    include, lib = _torch_dirs()
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    # build beside the target, then rename: ranks of one job may race here
    handle, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(handle)
    command = compiler + ["-std=c++17", "-O2", "-shared", "-fPIC",
                          f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", include, source,
                          "-L", lib, "-lc10", f"-Wl,-rpath,{lib}", "-o", partial]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(
                f"compiling {os.path.basename(source)} failed:\n{done.stderr[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _source() -> Optional[str]:
    return next((path for path in _SOURCES if os.path.exists(path)), None)


def attach_oom_handler(allocator: ctypes.CDLL) -> bool:
    """Makes the allocator raise torch.OutOfMemoryError; False (with a
    warning in the log) when the C++ unit cannot be built here."""
    source = _source()
    try:
        if source is None:
            raise RuntimeError("oom_raise.cpp is not in the installed package")
        library = ctypes.CDLL(build_library(source, "oom_raise"))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("matepoint: out of memory under its allocator will stop the process instead "
                    "of raising torch.OutOfMemoryError: %s", error)
        return False
    _loaded.append(library)
    handler = ctypes.cast(library.matepoint_raise_oom, ctypes.c_void_p)
    allocator.matepoint_alloc_set_oom_handler.argtypes = [ctypes.c_void_p]
    allocator.matepoint_alloc_set_oom_handler(handler)
    return True
