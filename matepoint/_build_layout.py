"""Where matepoint's compiled parts come from, and how they are compiled:
the one list that setup.py, the Makefile and matepoint/_oom.py read.

setup.py loads this file by its path (the package cannot be imported before
it is built, and pip's isolated build has no torch), so it imports nothing
outside the standard library. ``python matepoint/_build_layout.py cflags``
prints the C flags for the Makefile's C unit tests.
"""
from __future__ import annotations

import os
import sys
from glob import glob
from typing import List, Mapping, Tuple

# csrc/ folders compiled into matepoint._C; csrc/cuda's runtime loader and
# helpers and csrc/common go into both libraries; test builds
# (MATEPOINT_TESTING=1) add csrc/testing: the simulated GPU (cudart_sim*.c)
# and the test controls
EXTENSION_FOLDERS = ("base", "offload", "checkpoint", "module", "pool", "spill", "planner",
                     "common", "cuda")
TEST_FOLDERS = ("testing",)
# the allocator, its own shared library (matepoint._alloc) torch loads by path
ALLOCATOR_FOLDERS = ("alloc", "common", "cuda")
# its host backend ("device" memory in host memory, streams as counters) is
# a test seam: only test builds select it (MATEPOINT_ALLOC_BACKEND=host); the
# C unit tests and benchmarks/alloc_replay.c compile it themselves
ALLOCATOR_TEST_SOURCES = ("csrc/alloc/alloc_host.c",)
# symbols only a test build's libraries carry (the simulated GPU, the test
# controls, the allocator's host backend): tests/test_build.py and the
# release check (tests/check_wheel.py) look for them in built libraries
TEST_BUILD_SYMBOLS = (b"cudart_sim", b"testing_add_functions", b"matepoint_alloc_use_runtime",
                      b"alloc_host_init")
# The C++ units compiled against torch (csrc/torch_cxx: the unit that raises
# torch.OutOfMemoryError, and the adapter that makes the allocator torch's
# CUDA allocator past malloc and free, with the headers it includes). They
# include local headers by their path under csrc/ ("alloc/torch_bridge.h"),
# so an installed package ships them under matepoint/_csrc/ with the same
# paths, and a build of either tree passes its root as the include folder.
OOM_UNIT_SOURCE = "csrc/torch_cxx/oom_raise.cpp"
ADAPTER_UNIT_SOURCE = "csrc/torch_cxx/torch_adapter.cpp"
ADAPTER_HEADER_SOURCES = ("csrc/alloc/torch_bridge.h", "csrc/alloc/alloc.h",
                          "csrc/alloc/alloc_history.h", "csrc/torch_cxx/torch_snapshot.h",
                          "csrc/torch_cxx/torch_entries.h")
# Every C++ unit compiled against torch and every header one includes: a
# new unit is one more entry here.
RUNTIME_UNIT_SOURCES = (OOM_UNIT_SOURCE, ADAPTER_UNIT_SOURCE) + ADAPTER_HEADER_SOURCES
# where they are inside the installed package: the package's csrc/
PACKAGE_SOURCES = "_csrc"


def runtime_unit_files() -> List[Tuple[str, str]]:
    """(path in the checkout, path inside the installed package) of each
    C++ unit and header compiled against torch."""
    return [(path, os.path.join(PACKAGE_SOURCES, os.path.relpath(path, "csrc")))
            for path in RUNTIME_UNIT_SOURCES]


def unit_source_roots(package_dir: str) -> List[str]:
    """The folders that play csrc/ for the C++ units, most specific first:
    the installed package's copy, then the checkout's csrc/ (an editable
    install or a source tree), given the package folder ``package_dir``."""
    return [os.path.join(package_dir, PACKAGE_SOURCES),
            os.path.normpath(os.path.join(package_dir, os.pardir, "csrc"))]


C_FLAGS = ["-std=c11", "-Wall", "-Wextra"]
# the limited C API of Python 3.10 (0x030A0000), in every build: one abi3
# wheel (cp310-abi3) serves every CPython from 3.10; measured to add no
# per-call overhead (benchmarks/RESULTS.md, "abi3"). setup.py tags the
# extension and the wheel to match (PY_LIMITED_API_TAG).
LIMITED_API = "0x030A0000"
PY_LIMITED_API_TAG = "cp310"
CXX_FLAGS = ["-std=c++17", "-O2", "-shared", "-fPIC"]


def _glob(root: str, folder: str, pattern: str = "*.c") -> List[str]:
    found = sorted(glob(os.path.join(root, "csrc", folder, pattern)))
    return [os.path.relpath(path, root) for path in found]


def header_files(root: str) -> List[str]:
    """Every header under csrc: each extension depends on all of them
    (setuptools compares only the sources with a built library)."""
    return [path for folder in sorted(os.listdir(os.path.join(root, "csrc")))
            for path in _glob(root, folder, "*.h")]


def extension_sources(root: str, testing: bool) -> List[str]:
    """The C files of matepoint._C, relative to the checkout ``root``."""
    folders = EXTENSION_FOLDERS + (TEST_FOLDERS if testing else ())
    return [path for folder in folders for path in _glob(root, folder)]


def allocator_sources(root: str, testing: bool) -> List[str]:
    """The C files of the allocator library, relative to ``root``."""
    found = [path for folder in ALLOCATOR_FOLDERS for path in _glob(root, folder)]
    if not testing:
        found = [path for path in found if path not in ALLOCATOR_TEST_SOURCES]
    return found


# a release build (MATEPOINT_RELEASE=1, as `make dist` and cibuildwheel make
# the wheels): optimized whatever the interpreter recorded, no debug
# information, no symbol table but the dynamic one (-s), so no build path
RELEASE_C_FLAGS = ["-O3", "-DNDEBUG", "-g0"]
RELEASE_LINK_FLAGS = ["-s"]


def _release(environ: Mapping[str, str]) -> bool:
    if environ.get("MATEPOINT_RELEASE") != "1":
        return False
    for switch in ("MATEPOINT_TESTING", "MATEPOINT_DEBUG"):
        if environ.get(switch) == "1":
            raise ValueError(f"MATEPOINT_RELEASE=1 with {switch}=1: a release build ships no "
                             f"test or debug code; unset {switch}")
    return True


def c_flags(environ: Mapping[str, str]) -> List[str]:
    """Flags of a C build: MATEPOINT_TESTING=1 adds the test doubles,
    MATEPOINT_WERROR=1 -Werror, MATEPOINT_DEBUG=1 an unoptimized debug
    build with its asserts, MATEPOINT_RELEASE=1 a stripped release build
    (refused together with either of the first and the third)."""
    flags = C_FLAGS + ["-fvisibility=hidden", f"-DPy_LIMITED_API={LIMITED_API}"]
    if environ.get("MATEPOINT_TESTING") == "1":
        flags.append("-DMATEPOINT_TESTING=1")
    if environ.get("MATEPOINT_WERROR") == "1":
        flags.append("-Werror")
    if environ.get("MATEPOINT_DEBUG") == "1":
        flags += ["-O0", "-g", "-DMATEPOINT_DEBUG=1"]
    if _release(environ):
        flags += RELEASE_C_FLAGS
    return flags


def link_flags(environ: Mapping[str, str]) -> List[str]:
    """Linker flags of a C build: a release build is stripped."""
    return list(RELEASE_LINK_FLAGS) if _release(environ) else []


if __name__ == "__main__":
    if sys.argv[1:] != ["cflags"]:
        sys.exit("usage: python matepoint/_build_layout.py cflags")
    print(" ".join(C_FLAGS))
