"""csrc/ shows the architecture: folders in layers, each including only
headers of its own folder or of a folder below it, no file over 600 lines."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
MAX_LINES = 600

# Bottom first. A folder may include headers of its own folder and of the
# folders listed before it; testing (test builds only) sits above the
# engine it drives and below the module that registers it.
LAYERS = ("common", "cuda", "pool", "spill", "alloc", "planner", "base", "offload", "checkpoint",
          "testing", "module")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _sources() -> list[str]:
    found = []
    for folder, _, names in os.walk(CSRC):
        found += [os.path.join(folder, name) for name in names
                  if name.endswith((".c", ".h", ".cpp"))]
    return sorted(found)


def _folder_of_include(source: str, included: str) -> str:
    if "/" in included:
        return included.split("/")[0]
    return os.path.basename(os.path.dirname(source))


def test_every_folder_is_a_known_layer() -> None:
    folders = sorted(name for name in os.listdir(CSRC) if os.path.isdir(os.path.join(CSRC, name)))
    assert folders == sorted(LAYERS)


def test_no_folder_includes_a_header_from_above_it() -> None:
    upward = []
    for source in _sources():
        own = os.path.basename(os.path.dirname(source))
        with open(source, encoding="utf-8") as handle:
            text = handle.read()
        for included in INCLUDE.findall(text):
            target = _folder_of_include(source, included)
            path = os.path.join(CSRC, target, os.path.basename(included))
            assert os.path.exists(path), f"{source} includes {included}, which is not in csrc/"
            if LAYERS.index(target) > LAYERS.index(own):
                upward.append(f"{os.path.relpath(source, CSRC)} -> {included}")
    assert not upward, "includes pointing up the layers:\n" + "\n".join(upward)


def test_no_source_file_runs_over_the_limit() -> None:
    long = []
    for source in _sources():
        with open(source, encoding="utf-8") as handle:
            count = sum(1 for _ in handle)
        if count > MAX_LINES:
            long.append(f"{os.path.relpath(source, CSRC)}: {count} lines")
    assert not long, f"over {MAX_LINES} lines:\n" + "\n".join(long)
