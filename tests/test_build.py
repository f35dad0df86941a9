"""What a plain `pip install .` ships: no simulated GPU, no test controls.
Test builds (MATEPOINT_TESTING=1, as `make test` makes them) have both."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from matepoint import _C
from matepoint._build_layout import LIMITED_API, TEST_BUILD_SYMBOLS, c_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_ONLY = ("_simulate_cuda", "_sim_advance", "_offload_copies", "_fail_pool_acquires")


def test_every_build_uses_the_limited_api() -> None:
    """One abi3 wheel serves every CPython from 3.10: _C is compiled for
    the limited C API of 3.10 in every build (plain, test, debug, release,
    as ASan's reads the same flags) and named .abi3.so, which every CPython
    from 3.10 imports; this one imported it."""
    assert LIMITED_API == "0x030A0000"
    for environ in ({}, {"MATEPOINT_TESTING": "1", "MATEPOINT_WERROR": "1"},
                    {"MATEPOINT_DEBUG": "1"}, {"MATEPOINT_RELEASE": "1"}):
        assert f"-DPy_LIMITED_API={LIMITED_API}" in c_flags(environ), environ
    # a checkout built before abi3 keeps a _C.cpython-3XX-*.so that Python
    # prefers: `make clean` (or removing matepoint/*.so) once
    assert _C.__file__.endswith(".abi3.so"), f"{_C.__file__}: a stale pre-abi3 build?"


def test_this_build_says_what_it_is() -> None:
    present = [name for name in TEST_ONLY if hasattr(_C, name)]
    assert present == (list(TEST_ONLY) if _C.TEST_BUILD else [])


@pytest.mark.skipif(bool(os.environ.get("MATEPOINT_SANITIZED")), reason="checked in the plain run")
def test_a_plain_build_ships_no_test_double(tmp_path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "MATEPOINT_TESTING"}
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    libraries = [os.path.join(folder, name) for folder, _, names in os.walk(tmp_path / "lib")
                 for name in names if name.endswith(".so")]
    assert len(libraries) == 2, libraries
    assert all(library.endswith(".abi3.so") for library in libraries), libraries
    for library in libraries:
        with open(library, "rb") as handle:
            content = handle.read()
        found = [symbol for symbol in TEST_BUILD_SYMBOLS if symbol in content]
        assert not found, f"{os.path.basename(library)} carries {found}"
    probe = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import importlib.util as u; "
             "spec = u.spec_from_file_location('matepoint._C', sys.argv[2]); "
             "m = u.module_from_spec(spec); spec.loader.exec_module(m); "
             "print(m.TEST_BUILD, hasattr(m, '_simulate_cuda'))")
    module = next(path for path in libraries if os.path.basename(path).startswith("_C"))
    result = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "lib"), module],
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["0", "False"], result.stderr
