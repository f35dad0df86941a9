"""Build script: the C extension matepoint._C (no torch headers, no CUDA needed)."""
import importlib.util
import json
import os

import setuptools

# pyproject.toml's license is an SPDX string, which setuptools reads from 77
# on; an older one (as `--no-build-isolation` may use) fails with a message
# that names neither, so say it here first.
SETUPTOOLS_FLOOR = 77
if int(setuptools.__version__.split(".")[0]) < SETUPTOOLS_FLOOR:
    raise SystemExit(f"matepoint needs setuptools>={SETUPTOOLS_FLOOR} to build (its license is "
                     f"an SPDX string), found setuptools {setuptools.__version__}: run "
                     f"`pip install 'setuptools>={SETUPTOOLS_FLOOR}'`, or build without "
                     f"--no-build-isolation")

from setuptools import Extension, setup  # noqa: E402
from setuptools.command.build_py import build_py  # noqa: E402

# the source lists and flags, shared with the Makefile and matepoint/_oom.py
# (loaded by path: the package itself cannot be imported before it is built)
_spec = importlib.util.spec_from_file_location("_build_layout", "matepoint/_build_layout.py")
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)

# MATEPOINT_TESTING=1 builds csrc/testing (the test controls and the
# simulated GPU) into _C, and the allocator's host backend (csrc/alloc/alloc_host.c); a plain build ships none of them.
TESTING = os.environ.get("MATEPOINT_TESTING") == "1"
# a change to a header alone rebuilds too
HEADERS = layout.header_files(".")

extension = Extension(
    "matepoint._C",
    sources=layout.extension_sources(".", TESTING),
    include_dirs=["csrc"],
    depends=HEADERS,
    extra_compile_args=layout.c_flags(os.environ),
    extra_link_args=layout.link_flags(os.environ),
    libraries=["dl", "pthread"],
    # the limited C API (c_flags defines Py_LIMITED_API): named _C.abi3.so
    py_limited_api=True,
)

# The CUDA caching allocator: a plain shared library (no Python module) that
# torch loads by path. It reaches the CUDA runtime through dlopen, so it
# builds on machines without CUDA too.
allocator = Extension(
    "matepoint._alloc",
    sources=layout.allocator_sources(".", TESTING),
    include_dirs=["csrc"],
    depends=HEADERS,
    # torch.OutOfMemoryError is thrown (oom_raise.cpp) through these frames.
    # Link-time optimization: malloc and free cross the allocator's files
    # (csrc/alloc/alloc_internal.h), and only LTO inlines those calls as it
    # did when they were one file's static functions (alloc_bench --host).
    extra_compile_args=layout.c_flags(os.environ) + ["-fexceptions", "-flto"],
    extra_link_args=["-flto"] + layout.link_flags(os.environ),
    libraries=["dl", "pthread"],
    # no Python API at all: named _alloc.abi3.so like _C, as the abi3 wheel
    # that carries both serves every CPython from 3.10
    py_limited_api=True,
)

class build_py_with_runtime_units(build_py):
    """Ships the C++ units compiled against torch inside the package: their
    sources (matepoint/_build_layout.py's RUNTIME_UNIT_SOURCES), compiled
    at run time for a torch the wheel has no prebuilt unit for, and the
    prebuilt units of MATEPOINT_PREBUILT_UNITS, a folder made by
    tools/prebuild_units.py (``make dist`` names it; pip's isolated build
    has no torch to build them against)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install finds them in csrc/ and matepoint/_prebuilt
        target = os.path.join(self.build_lib, "matepoint")
        for source, name in layout.runtime_unit_files():
            self.mkpath(os.path.dirname(os.path.join(target, name)))
            self.copy_file(source, os.path.join(target, name))
        prebuilt = os.environ.get("MATEPOINT_PREBUILT_UNITS")
        if prebuilt:
            self.copy_prebuilt(prebuilt, os.path.join(target, layout.PREBUILT_FOLDER))

    def copy_prebuilt(self, folder: str, target: str) -> None:
        with open(os.path.join(folder, layout.PREBUILT_MANIFEST)) as handle:
            listed = [entry["file"] for entry in json.load(handle)["units"]]
        self.mkpath(target)
        for name in listed + [layout.PREBUILT_MANIFEST]:
            self.copy_file(os.path.join(folder, name), os.path.join(target, name))


# one wheel for every CPython from 3.10: tagged cp310-abi3
setup(ext_modules=[extension, allocator], cmdclass={"build_py": build_py_with_runtime_units},
      options={"bdist_wheel": {"py_limited_api": layout.PY_LIMITED_API_TAG}})
