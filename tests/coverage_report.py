"""Line coverage of matepoint's C sources from gcc --coverage builds (`make
coverage`): every object's notes (.gcno) under the given folders, read by
gcov as JSON and merged per source file (a file compiled into several
binaries counts a line as run if any of them ran it).

    python tests/coverage_report.py [--prefix csrc/offload ...]
        [--require-functions FILE ...] FOLDER...

Prints one row per source file under the prefixes; exits 1 if a function of
a --require-functions file never ran (or the file was not instrumented).
Run from the checkout's root (the sources' paths are relative to it)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Dict, Iterator, List, Set, Tuple

Coverage = Dict[str, Tuple[Dict[int, int], Dict[str, int]]]   # file -> (line counts, function counts)


def notes_files(folders: List[str]) -> Iterator[str]:
    for folder in folders:
        for root, _, files in os.walk(folder):
            for name in sorted(files):
                if name.endswith(".gcno"):
                    yield os.path.join(root, name)


def gcov_json(notes: str) -> dict:
    """gcov's JSON for one object (no data file: nothing of it ran)."""
    done = subprocess.run(["gcov", "--json-format", "--stdout", notes], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.splitlines()[0])


def merge(coverage: Coverage, report: dict) -> None:
    for entry in report["files"]:
        path = os.path.normpath(entry["file"])
        lines, functions = coverage.setdefault(path, ({}, {}))
        for line in entry["lines"]:
            number = line["line_number"]
            lines[number] = lines.get(number, 0) + line["count"]
        for function in entry["functions"]:
            name = function["name"]
            functions[name] = functions.get(name, 0) + function["execution_count"]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--prefix", action="append", default=[])
    parser.add_argument("--require-functions", action="append", default=[])
    args = parser.parse_args(argv)
    coverage: Coverage = {}
    for notes in notes_files(args.folders):
        merge(coverage, gcov_json(notes))
    prefixes = tuple(os.path.normpath(p) + os.sep for p in args.prefix) or ("",)
    total_run = total_lines = 0
    print(f"{'file':<44} {'lines':>6} {'run':>6} {'cover':>7}  functions never run")
    for path in sorted(p for p in coverage if p.startswith(prefixes)):
        lines, functions = coverage[path]
        run = sum(1 for count in lines.values() if count > 0)
        total_run, total_lines = total_run + run, total_lines + len(lines)
        never = sorted(name for name, count in functions.items() if count == 0)
        percent = 100.0 * run / len(lines) if lines else 100.0
        print(f"{path:<44} {len(lines):>6} {run:>6} {percent:>6.1f}%  {', '.join(never)}")
    if total_lines:
        print(f"{'total':<44} {total_lines:>6} {total_run:>6} {100.0 * total_run / total_lines:>6.1f}%")
    failed = False
    for path in map(os.path.normpath, args.require_functions):
        if path not in coverage:
            print(f"coverage: {path} was not instrumented", file=sys.stderr)
            failed = True
            continue
        missed: Set[str] = {name for name, count in coverage[path][1].items() if count == 0}
        if missed:
            print(f"coverage: functions of {path} never called: {', '.join(sorted(missed))}",
                  file=sys.stderr)
            failed = True
        else:
            print(f"coverage: every function of {path} ran "
                  f"({len(coverage[path][1])} functions)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
