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
from typing import List, Mapping, NamedTuple, Optional, Tuple

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
                          "csrc/torch_cxx/torch_entries.h", "csrc/torch_cxx/single_threaded.h")
OOM_HEADER_SOURCES = ("csrc/torch_cxx/single_threaded.h",)
# Every C++ unit compiled against torch and every header one includes: a
# new unit is one more entry here.
RUNTIME_UNIT_SOURCES = (OOM_UNIT_SOURCE, ADAPTER_UNIT_SOURCE) + ADAPTER_HEADER_SOURCES
# where they are inside the installed package: the package's csrc/
PACKAGE_SOURCES = "_csrc"


class CxxUnit(NamedTuple):
    """One C++ unit compiled against torch: its checkout source and the
    local headers it includes, whether it needs CUDA's headers and torch's
    CUDA libraries, and the torch libraries it links."""
    name: str
    source: str
    headers: Tuple[str, ...]
    needs_cuda: bool
    libraries: Tuple[str, ...]


CXX_UNITS = {
    "oom_raise": CxxUnit("oom_raise", OOM_UNIT_SOURCE, OOM_HEADER_SOURCES, False, ("c10",)),
    "torch_adapter": CxxUnit("torch_adapter", ADAPTER_UNIT_SOURCE, ADAPTER_HEADER_SOURCES, True,
                             ("c10", "c10_cuda", "torch_cpu", "torch_cuda")),
}

# The torch releases the wheel carries every unit prebuilt for, by minor
# release: each is built against the headers of the release named (a patch
# release keeps its minor's C++ ABI). Those are torch's PyPI wheels, CUDA 13
# builds (2.11 to 2.14: CUDA 13.0, 2.15: 13.2) with the C++11 ABI; the units
# compile against the CUDA 13.0 runtime's headers (the nvidia-cuda-runtime
# and nvidia-cuda-crt wheels of PREBUILT_CUDA_HEADERS).
PREBUILT_TORCH = {"2.11": "2.11.0", "2.12": "2.12.1", "2.13": "2.13.0", "2.14": "2.14.1",
                  "2.15": "2.15.0"}
PREBUILT_CUDA_MAJOR = "13"
PREBUILT_CUDA_HEADERS = "13.0"
PREBUILT_CXX11_ABI = True
# Prebuilt units are C++20 whatever the torch (the run-time build follows
# torch's own standard, cxx_standard()): in C++17 mode libstdc++ 12 calls
# two functions newer than torch's own libstdc++ floor (GLIBCXX_3.4.26 and
# 3.4.29), and its types have one layout in both modes. Every torch of
# PREBUILT_TORCH compiles under it.
PREBUILT_CXX_STANDARD = "c++20"
# inside the installed package: the units and their list (one JSON object)
PREBUILT_FOLDER = "_prebuilt"
PREBUILT_MANIFEST = "units.json"


def torch_minor(version: str) -> str:
    """'2.14' of '2.14.1+cu130' (or of '2.16.0a0+git1234')."""
    return ".".join(version.split("+")[0].split(".")[:2])


def cxx_standard(torch_version: str) -> str:
    """The C++ standard torch's own extensions build with for this torch
    (torch.utils.cpp_extension): C++17 up to 2.11, C++20 from 2.12 (whose
    c10 headers need it from 2.14 on)."""
    major, minor = (int("".join(ch for ch in part if ch.isdigit()) or 0)
                    for part in torch_minor(torch_version).split("."))
    return "c++17" if (major, minor) <= (2, 11) else "c++20"


def unit_key(unit: CxxUnit, torch_version: str, cuda_version: Optional[str],
             cxx11_abi: bool) -> str:
    """What a built unit is for: torch's minor release, CUDA's major release
    (units that need CUDA), torch's C++ ABI, e.g. 'torch2.14-cu13-cxx11abi1'."""
    parts = [f"torch{torch_minor(torch_version)}"]
    if unit.needs_cuda:
        parts.append(f"cu{(cuda_version or 'none').split('.')[0]}")
    parts.append(f"cxx11abi{int(cxx11_abi)}")
    return "-".join(parts)


def cxx_command(compiler: List[str], source: str, standard: str, cxx11_abi: bool,
                include_dirs: List[str], library_dir: str, libraries: Tuple[str, ...],
                output: Optional[str], flags: Tuple[str, ...] = (),
                link_inputs: Tuple[str, ...] = ()) -> List[str]:
    """The command that compiles ``source`` (or links an object) in the C++
    ``standard`` with ``flags`` against torch's headers (``include_dirs``:
    torch's include folder first) into the library ``output``, linked to
    torch's ``libraries`` in ``library_dir`` and then to ``link_inputs``
    (archives and linker options, which follow what they serve); with
    output None, one that only checks that it compiles."""
    command = list(compiler) + [f"-std={standard}"] + CXX_FLAGS + [
        f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}"] + list(flags)
    for folder in include_dirs:
        command += ["-I", folder]
    if output is None:
        return command + ["-fsyntax-only", source]
    # --no-as-needed: each torch library is named in the unit (DT_NEEDED),
    # whatever this linker's default, so the loader binds the unit to the
    # torch the process runs
    command += [source, "-L", library_dir, "-Wl,--no-as-needed"]
    command += [f"-l{name}" for name in libraries]
    return command + list(link_inputs) + ["-o", output]


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
CXX_FLAGS = ["-O2", "-shared", "-fPIC"]


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
