"""Build script: the C extension matepoint._C (no torch headers, no CUDA needed)."""
import os
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


# MATEPOINT_TESTING=1 builds the test controls and the simulated GPU into
# both libraries (csrc/testing, csrc/cuda/cudart_sim*.c); a plain build ships
# neither.
TESTING = os.environ.get("MATEPOINT_TESTING") == "1"


def c_flags() -> list[str]:
    flags = ["-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden"]
    if TESTING:
        flags.append("-DMATEPOINT_TESTING=1")
    if os.environ.get("MATEPOINT_WERROR") == "1":
        flags.append("-Werror")
    if os.environ.get("MATEPOINT_DEBUG") == "1":
        flags += ["-O0", "-g", "-DMATEPOINT_DEBUG=1"]
    return flags


# csrc/cuda: the runtime loader and its helpers; the simulated GPU's files
# (cudart_sim*.c) go into test builds only.
CUDA_SIM = sorted(glob("csrc/cuda/cudart_sim*.c"))
CUDA = [c for c in sorted(glob("csrc/cuda/*.c")) if c not in CUDA_SIM]
# csrc/common: helpers every layer may use (both libraries link them)
COMMON = sorted(glob("csrc/common/*.c"))

extension = Extension(
    "matepoint._C",
    sources=[c for folder in ("base", "offload", "checkpoint", "module", "pool", "planner")
             for c in sorted(glob(f"csrc/{folder}/*.c"))] + CUDA + COMMON
    + (sorted(glob("csrc/testing/*.c")) + CUDA_SIM if TESTING else []),
    include_dirs=["csrc"],
    extra_compile_args=c_flags(),
    libraries=["dl", "pthread"],
)

# The CUDA caching allocator: a plain shared library (no Python module) that
# torch loads by path. It reaches the CUDA runtime through dlopen, so it
# builds on machines without CUDA too.
allocator = Extension(
    "matepoint._alloc",
    sources=sorted(glob("csrc/alloc/*.c")) + CUDA + COMMON,
    include_dirs=["csrc"],
    # torch.OutOfMemoryError is thrown (oom_raise.cpp) through these frames.
    # Link-time optimization: malloc and free cross the allocator's files
    # (csrc/alloc/alloc_internal.h), and only LTO inlines those calls as it
    # did when they were one file's static functions (alloc_bench --host).
    extra_compile_args=c_flags() + ["-fexceptions", "-flto"],
    extra_link_args=["-flto"],
    libraries=["dl", "pthread"],
)

class build_py_with_oom_unit(build_py):
    """Ships the C++ unit that raises torch.OutOfMemoryError inside the
    package: it is compiled at run time against the torch in use
    (matepoint/_oom.py), since pip's isolated build has no torch."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install finds it in csrc/ (matepoint/_oom.py)
        target = os.path.join(self.build_lib, "matepoint")
        self.mkpath(target)
        self.copy_file("csrc/alloc/oom_raise.cpp", os.path.join(target, "oom_raise.cpp"))


setup(ext_modules=[extension, allocator], cmdclass={"build_py": build_py_with_oom_unit})
