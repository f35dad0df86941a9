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

import matepoint
from matepoint import _build_layout
from matepoint.__main__ import TESTED_TORCH

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = {"Plan", "PlanError", "PlannedBlock", "Options", "TorchCheckpointPatch", "AllocatorInfo"}


def pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return handle.read()


def plain_environment() -> dict:
    return {key: value for key, value in os.environ.items() if not key.startswith("MATEPOINT_")}


# ---- the sdist -----------------------------------------------------------------

def test_the_sdist_holds_every_file_the_build_needs(tmp_path) -> None:
    built = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path),
         "sdist", "--dist-dir", str(tmp_path)],
        cwd=ROOT, env=plain_environment(), capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (archive,) = glob.glob(str(tmp_path / "matepoint-*.tar.gz"))
    with tarfile.open(archive) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    needed = {"LICENSE", "README.md", "pyproject.toml", "setup.py", "matepoint/py.typed",
              "matepoint/_C.pyi"}
    for pattern in ("csrc/**/*.c", "csrc/**/*.h", "csrc/**/*.cpp", "matepoint/**/*.py"):
        needed |= {os.path.relpath(path, ROOT)
                   for path in glob.glob(os.path.join(ROOT, pattern), recursive=True)}
    assert not needed - names, f"the sdist lacks {sorted(needed - names)}"
    assert any(name.startswith("csrc/") and name.endswith(".h") for name in names)
    left_in = [name for name in names
               if name.endswith((".so", ".o", ".pyc")) or name.startswith(("build/", "tests/"))]
    assert not left_in, f"the sdist carries {left_in}"


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
    listed = "RUNTIME_UNIT_SOURCES = (OOM_UNIT_SOURCE, ADAPTER_UNIT_SOURCE) + ADAPTER_HEADER_SOURCES"
    assert listed in text
    layout_file.write_text(text.replace(listed, listed + ' + ("csrc/common/mp_assert.h",)'))
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib",
                            str(tmp_path / "lib")], cwd=checkout, env=plain_environment(),
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    for source, name in _build_layout.runtime_unit_files() + [("csrc/common/mp_assert.h", "_csrc/common/mp_assert.h")]:
        with open(tmp_path / "lib" / "matepoint" / name, encoding="utf-8") as shipped:
            assert shipped.read() == read(source)


# ---- release builds ------------------------------------------------------------

@pytest.mark.parametrize("switch", ["MATEPOINT_TESTING", "MATEPOINT_DEBUG"])
def test_a_release_build_refuses_test_and_debug_code(switch: str) -> None:
    with pytest.raises(ValueError, match=f"{switch}=1"):
        _build_layout.c_flags({"MATEPOINT_RELEASE": "1", switch: "1"})


def test_a_release_build_is_optimized_and_stripped() -> None:
    release = {"MATEPOINT_RELEASE": "1", "MATEPOINT_WERROR": "1"}
    flags = _build_layout.c_flags(release)
    assert "-g0" in flags and "-DMATEPOINT_TESTING=1" not in flags
    assert _build_layout.link_flags(release) == ["-s"]
    assert "-g0" not in _build_layout.c_flags({}) and _build_layout.link_flags({}) == []


# ---- the version ---------------------------------------------------------------

def test_the_version_is_written_once() -> None:
    config = pyproject()
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert (config["tool"]["setuptools"]["dynamic"]["version"]
            == {"attr": "matepoint.__version__"})
    assert re.fullmatch(r"\d+\.\d+\.\d+", matepoint.__version__)
    written = [path for path in glob.glob(os.path.join(ROOT, "matepoint", "**", "*.py"),
                                          recursive=True)
               if re.search(r"^__version__\s*=", read(path), flags=re.M)]
    assert [os.path.relpath(path, ROOT) for path in written] == ["matepoint/__init__.py"]


def test_python_m_matepoint_version() -> None:
    shown = subprocess.run([sys.executable, "-m", "matepoint", "--version"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"matepoint {matepoint.__version__} (torch ")
    assert all(version in shown.stdout for version in TESTED_TORCH)


def test_the_bench_report_names_the_version(tmp_path) -> None:
    import json

    from matepoint.bench import report

    path = report.write_json(str(tmp_path), {})
    with open(path, encoding="utf-8") as handle:
        assert json.load(handle)["matepoint"] == matepoint.__version__


def test_the_tested_torch_releases_are_the_ones_make_test_installs() -> None:
    makefile = read("Makefile")
    pins = [re.search(rf"^{name}\s*\?=\s*torch==(\S+)$", makefile, flags=re.M).group(1)
            for name in ("TORCH", "TORCH214")]
    assert tuple(pins) == TESTED_TORCH
    floor = re.fullmatch(r"torch>=(\S+)", pyproject()["project"]["dependencies"][0]).group(1)
    assert all(tuple(map(int, v.split(".")[:2])) >= tuple(map(int, floor.split(".")))
               for v in TESTED_TORCH)


# ---- the metadata --------------------------------------------------------------

def test_the_metadata_is_complete() -> None:
    config = pyproject()
    project = config["project"]
    assert set(project["optional-dependencies"]) >= {"bench", "hf", "test"}
    assert "matplotlib" in project["optional-dependencies"]["bench"]
    assert "transformers" in project["optional-dependencies"]["hf"]
    classifiers = set(project["classifiers"])
    low = int(re.fullmatch(r">=3\.(\d+)", project["requires-python"]).group(1))
    for minor in range(low, 14):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert {"Homepage", "Source", "Issues"} <= set(project["urls"])
    # wheel: setuptools builds wheels itself; the floor is the SPDX license's
    requires = config["build-system"]["requires"]
    assert not any(re.match(r"wheel\b", requirement) for requirement in requires)
    floor = re.search(r"^SETUPTOOLS_FLOOR = (\d+)$", read("setup.py"), flags=re.M).group(1)
    assert requires == [f"setuptools>={floor}"]


def test_an_old_setuptools_is_told_what_to_do(tmp_path) -> None:
    stub = tmp_path / "setuptools"
    stub.mkdir()
    (stub / "__init__.py").write_text('__version__ = "65.5.0"\n')
    result = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT,
                            env={**plain_environment(), "PYTHONPATH": str(tmp_path)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "needs setuptools>=77" in result.stderr and "found setuptools 65.5.0" in result.stderr


def test_the_cibuildwheel_configuration_builds_the_wheel_make_dist_builds() -> None:
    config = pyproject()["tool"]["cibuildwheel"]
    makefile = read("Makefile")
    plat = re.search(r"^DIST_PLAT\s*:=\s*(\S+)$", makefile, flags=re.M).group(1)
    assert plat.startswith(config["manylinux-x86_64-image"])
    assert config["environment"]["MATEPOINT_RELEASE"] == "1"
    assert "MATEPOINT_RELEASE=1" in makefile
    assert "test_dist_install.py" in config["test-command"]
    # one abi3 wheel, built once (with the oldest CPython it serves), as
    # setup.py tags it (tests/check_wheel.py checks the built wheel's tag)
    tag = _build_layout.PY_LIMITED_API_TAG
    assert config["build"] == [f"{tag}-*"]
    assert 'options={"bdist_wheel": {"py_limited_api": layout.PY_LIMITED_API_TAG}}' in read("setup.py")


# ---- dir(matepoint) ------------------------------------------------------------

def test_dir_shows_the_public_names_only() -> None:
    names = set(dir(matepoint))
    assert not names & {"sys", "types", "torch", "Dict", "Any", "List", "annotations"}
    assert names == set(matepoint.__all__) | CLASSES | {"__version__"}
    for name in names:
        getattr(matepoint, name)
