"""How far a saved input goes through csrc/offload, as tests/test_layout.py's
call reader sees it, here and at earlier commits.

For each direction (save: checkpoint's forward; restore: backward's unpack)
it prints `stops`, the functions of csrc/offload the path reaches from the
direction's entry points following calls inside csrc/offload (each once);
`files`, the files they are in; and `climbs`, the calls among them from a
file into another that calls back into the first (directly or through
others): a climb back to a file already passed. The definitions are
test_layout.offload_paths's.

    python benchmarks/offload_paths.py                 # the working tree
    python benchmarks/offload_paths.py eece687 main    # commits, beside it
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from typing import Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import test_layout  # noqa: E402  (the call reader lives with its tests)

log = logging.getLogger("matepoint.bench.offload_paths")


def measure_commit(commit: str) -> Dict[str, Dict[str, int]]:
    """The figures of csrc/ as `commit` has it (git archive, no checkout)."""
    with tempfile.TemporaryDirectory() as folder:
        archive = os.path.join(folder, "csrc.tar")
        with open(archive, "wb") as handle:
            subprocess.run(["git", "archive", commit, "csrc"], cwd=ROOT, stdout=handle,
                           check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
        return test_layout.offload_paths(os.path.join(folder, "csrc"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commits", nargs="*", help="commits to measure beside the working tree")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = [(commit, measure_commit(commit)) for commit in args.commits]
    rows.append(("working tree", test_layout.offload_paths()))
    log.info("%-14s %-8s %6s %6s %7s", "tree", "path", "stops", "files", "climbs")
    for name, figures in rows:
        for path, figure in figures.items():
            log.info("%-14s %-8s %6d %6d %7d", name, path, figure["stops"], figure["files"],
                     figure["climbs"])


if __name__ == "__main__":
    main()
