"""tests/check_wheel.py, the release gate, on wheels made to fail it: a
prebuilt C++ unit missing for a torch PREBUILT_TORCH names, a listed unit
absent, a unit needing a newer libstdc++ than torch's own."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

import check_wheel
from matepoint import _build_layout, _units


def _unpacked(tmp_path: Path, drop: Sequence[str] = (),
              replace: Optional[Dict[str, Path]] = None) -> List[str]:
    """The prebuilt units of this build laid out as in a wheel under
    ``tmp_path``, less those whose key is in ``drop``, with the files named
    in ``replace`` replaced; the wheel's member names."""
    if not _units.carried():
        pytest.fail(f"no prebuilt units in {_units.FOLDER}: run `make units`")
    folder = tmp_path / "matepoint" / _build_layout.PREBUILT_FOLDER
    folder.mkdir(parents=True)
    listed = []
    for entry in _units.carried():
        if entry["key"] in drop:
            continue
        listed.append(entry)
        shutil.copy(os.path.join(_units.FOLDER, entry["file"]), folder / entry["file"])
    for name, source in (replace or {}).items():
        shutil.copy(source, folder / name)
    (folder / _build_layout.PREBUILT_MANIFEST).write_text(json.dumps({"units": listed}))
    return [str(path.relative_to(tmp_path)) for path in (tmp_path / "matepoint").rglob("*")
            if path.is_file()]


def test_every_unit_for_every_named_torch_passes(tmp_path: Path) -> None:
    problems, carried = check_wheel.prebuilt_problems(_unpacked(tmp_path), str(tmp_path))
    assert problems == []
    assert carried == check_wheel.expected_units()
    assert len(carried) == len(_build_layout.PREBUILT_TORCH) * len(_build_layout.CXX_UNITS)


def test_a_unit_missing_for_a_named_torch_fails(tmp_path: Path) -> None:
    key = _build_layout.unit_key(_build_layout.CXX_UNITS["torch_adapter"], "2.15.0",
                                 _build_layout.PREBUILT_CUDA_MAJOR, True)
    problems, _ = check_wheel.prebuilt_problems(_unpacked(tmp_path, [key]), str(tmp_path))
    assert problems == [f"no prebuilt torch_adapter for {key} (PREBUILT_TORCH names it)"]


def test_a_listed_unit_absent_from_the_wheel_fails(tmp_path: Path) -> None:
    names = _unpacked(tmp_path)
    gone = next(name for name in names if "oom_raise-torch2.11" in name)
    names.remove(gone)
    problems, _ = check_wheel.prebuilt_problems(names, str(tmp_path))
    assert f"{gone}, listed in" in problems[0] and "is missing" in problems[0]


def test_no_list_of_units_fails(tmp_path: Path) -> None:
    problems, carried = check_wheel.prebuilt_problems([], str(tmp_path))
    assert carried == [] and "units.json is missing" in problems[0]


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_a_unit_needing_a_newer_libstdcxx_than_torch_fails(tmp_path: Path) -> None:
    """A unit built the plain way calls libstdc++'s newer functions (torch's
    headers make std::vector call this 3.4.29 one; the prebuild takes them
    from the static library): the gate names them."""
    source = tmp_path / "newer.cpp"
    source.write_text("#include <string>\n"
                      'extern "C" void newer() { std::__throw_bad_array_new_length(); }\n')
    library = tmp_path / "newer.so"
    subprocess.run(["c++", "-std=c++17", "-O2", "-shared", "-fPIC", str(source), "-o",
                    str(library)], check=True, capture_output=True, timeout=120)
    entry = next(e for e in _units.carried() if e["unit"] == "oom_raise")
    unpacked = tmp_path / "wheel"
    names = _unpacked(unpacked, replace={entry["file"]: library})
    problems, _ = check_wheel.prebuilt_problems(names, str(unpacked))
    assert any("GLIBCXX_3.4.29" in problem and entry["file"] in problem
               for problem in problems), problems


def test_the_wheel_check_reads_a_zip_as_built(tmp_path: Path) -> None:
    """wheel_problems() on a zip: the units' lines are printed, and a wheel
    without them is refused (beside what else such a wheel lacks)."""
    wheel = tmp_path / "matepoint-0.1.0-cp310-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("matepoint/__init__.py", "")
    problems = check_wheel.wheel_problems(str(wheel))
    assert any("units.json is missing" in problem for problem in problems), problems
