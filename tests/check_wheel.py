"""Checks a release wheel before it ships (``make dist`` runs it):

    python tests/check_wheel.py build/dist/matepoint-*.whl

- its shared libraries carry no debug information (no .debug_* section) and
  no symbol table beyond the dynamic one, no RPATH/RUNPATH, no path of the
  machine that built them (the build folder, the home, /tmp), and none of the
  test build's code (matepoint/_build_layout.py's TEST_BUILD_SYMBOLS);
- it is the one abi3 wheel (tagged cp310-abi3, its libraries named
  .abi3.so) that serves every CPython from 3.10;
- it holds the C++ units' sources (RUNTIME_UNIT_SOURCES, compiled at run time
  for a torch it has no prebuilt unit for) and the license;
- it carries every C++ unit prebuilt for every torch of PREBUILT_TORCH (its
  matepoint/_prebuilt/units.json lists each with its key), each within
  torch's own symbol ceilings (tools/prebuild_units.py), and prints them.

Needs only the standard library and binutils' readelf (no torch).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from typing import List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layout = _load("_build_layout", "matepoint/_build_layout.py")
prebuild = _load("prebuild_units", "tools/prebuild_units.py")

# byte strings that would betray where or by whom the wheel was built
BUILD_PATHS = (ROOT.encode(), b"/tmp/", b"/root/", b"/home/", b"build/dist-src",
               b"/work/", os.path.expanduser("~").encode())


def _readelf(args: List[str], path: str) -> str:
    return subprocess.run(["readelf", "-W", *args, path], capture_output=True, text=True,
                          check=True).stdout


def library_problems(path: str) -> List[str]:
    """What is wrong with one shared library of the wheel (empty: nothing)."""
    name = os.path.basename(path)
    problems = []
    sections = re.findall(r"\]\s+(\.\S+)", _readelf(["-S"], path))
    unstripped = [section for section in sections
                  if section.startswith((".debug", ".zdebug")) or section == ".symtab"]
    if unstripped:
        problems.append(f"{name}: not stripped ({', '.join(unstripped)})")
    dynamic = _readelf(["-d"], path)
    if "RPATH" in dynamic or "RUNPATH" in dynamic:
        problems.append(f"{name}: has an RPATH/RUNPATH")
    with open(path, "rb") as handle:
        content = handle.read()
    for marker in BUILD_PATHS:
        if marker and marker in content:
            problems.append(f"{name}: holds the build path {marker.decode()!r}")
    for symbol in layout.TEST_BUILD_SYMBOLS:
        if symbol in content:
            problems.append(f"{name}: holds test-build code ({symbol.decode()})")
    return problems


def abi3_problems(wheel: str, archive: zipfile.ZipFile, libraries: List[str]) -> List[str]:
    """The wheel is tagged for the limited API of 3.10 (file name and the
    WHEEL metadata agree) and its libraries are named for it."""
    problems = []
    python_tag = f"{layout.PY_LIMITED_API_TAG}-abi3"
    if f"-{python_tag}-" not in os.path.basename(wheel):
        problems.append(f"not tagged {python_tag}")
    metadata = [name for name in archive.namelist() if name.endswith(".dist-info/WHEEL")]
    tags = re.findall(r"^Tag: (\S+)$", archive.read(metadata[0]).decode(), re.M) if metadata else []
    if not tags or not all(tag.startswith(python_tag + "-") for tag in tags):
        problems.append(f"WHEEL's tags {tags} are not all {python_tag}")
    problems += [f"{name}: not named .abi3.so" for name in libraries if not name.endswith(".abi3.so")]
    return problems


def expected_units() -> List[str]:
    """The key of every unit the wheel must carry prebuilt, by unit."""
    keys = [(unit.name, layout.unit_key(unit, release, layout.PREBUILT_CUDA_MAJOR,
                                        layout.PREBUILT_CXX11_ABI))
            for release in layout.PREBUILT_TORCH.values() for unit in layout.CXX_UNITS.values()]
    return sorted(f"{name}:{key}" for name, key in keys)


def prebuilt_problems(names: List[str], folder: str) -> Tuple[List[str], List[str]]:
    """(what is wrong with the prebuilt units of a wheel unpacked in
    ``folder`` whose members are ``names``, the units it carries as lines)."""
    listing = f"matepoint/{layout.PREBUILT_FOLDER}/{layout.PREBUILT_MANIFEST}"
    if listing not in names:
        return [f"{listing} is missing: no prebuilt C++ units"], []
    with open(os.path.join(folder, listing)) as handle:
        entries = json.load(handle)["units"]
    problems, carried = [], []
    for entry in entries:
        member = f"matepoint/{layout.PREBUILT_FOLDER}/{entry['file']}"
        if member not in names:
            problems.append(f"{member}, listed in {listing}, is missing")
            continue
        problems += prebuild.symbol_problems(os.path.join(folder, member))
        carried.append(f"{entry['unit']}:{entry['key']}")
    missing = sorted(set(expected_units()) - set(carried))
    problems += [f"no prebuilt {name.replace(':', ' for ')} (PREBUILT_TORCH names it)"
                 for name in missing]
    return problems, sorted(carried)


def wheel_problems(wheel: str) -> List[str]:
    """Everything wrong with ``wheel`` (empty: it may ship)."""
    problems = []
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as folder:
        names = archive.namelist()
        archive.extractall(folder)
        libraries = [name for name in names if name.endswith(".so")]
        # the prebuilt C++ units are torch's, not Python's: named by their key
        prebuilt = f"matepoint/{layout.PREBUILT_FOLDER}/"
        problems += abi3_problems(wheel, archive, [name for name in libraries
                                                   if not name.startswith(prebuilt)])
        if not any(os.path.basename(name).startswith("_C.") for name in libraries):
            problems.append("no matepoint._C in the wheel")
        if not any(os.path.basename(name).startswith("_alloc.") for name in libraries):
            problems.append("no allocator library in the wheel")
        for name in libraries:
            problems += library_problems(os.path.join(folder, name))
        unit_problems, carried = prebuilt_problems(names, folder)
        problems += unit_problems
        for line in carried:
            print(f"{os.path.basename(wheel)}: carries {line}")
    for _, shipped in layout.runtime_unit_files():
        if f"matepoint/{shipped}" not in names:
            problems.append(f"matepoint/{shipped} (compiled at run time) is missing")
    if not any(re.search(r"\.dist-info/licenses/LICENSE$", name) for name in names):
        problems.append("the license is missing from .dist-info")
    return problems


def main(wheels: List[str]) -> int:
    if not wheels:
        print(__doc__)
        return 2
    failed = False
    for wheel in wheels:
        problems = wheel_problems(wheel)
        for problem in problems:
            print(f"{os.path.basename(wheel)}: {problem}")
        failed = failed or bool(problems)
        if not problems:
            print(f"{os.path.basename(wheel)}: stripped, no build paths, no test-build code")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
