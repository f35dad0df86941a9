"""What a release carries: the sdist holds every file the build needs, the
version is written once, the metadata is complete, `dir(matepoint)` is the
public names, and release builds refuse test code. (The wheel itself is
built, repaired, installed and run by `make dist-test`:
tests/test_dist_install.py and tests/check_wheel.py.)"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from matepoint import _build_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return handle.read()


def plain_environment() -> dict:
    return {key: value for key, value in os.environ.items() if not key.startswith("MATEPOINT_")}


# ---- the sdist and wheel contents ----------------------------------------------

def test_every_unit_compiled_at_run_time_ships_inside_the_package(tmp_path) -> None:
    # a copy of the checkout whose list names one more file: it ships too
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), checkout / name)
    for folder in ("matepoint", "csrc"):
        shutil.copytree(os.path.join(ROOT, folder), checkout / folder,
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    layout_file = checkout / "matepoint" / "_build_layout.py"
    text = layout_file.read_text()
    assert "    OOM_UNIT_SOURCE,\n)" in text
    layout_file.write_text(text.replace("    OOM_UNIT_SOURCE,\n)",
                                        '    OOM_UNIT_SOURCE,\n    "csrc/alloc/alloc.h",\n)'))
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib",
                            str(tmp_path / "lib")], cwd=checkout, env=plain_environment(),
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    for source, name in _build_layout.runtime_unit_files() + [("csrc/alloc/alloc.h", "alloc.h")]:
        with open(tmp_path / "lib" / "matepoint" / name, encoding="utf-8") as shipped:
            assert shipped.read() == read(source)
