"""``python -m matepoint check``: runs the checks of registry.py on this
machine's GPU (about a minute; ``--quick`` about ten seconds) and prints
each one's PASS, FAIL or SKIP with its reason; ``--json FILE`` writes every
figure with the GPU's name, the driver, the versions and the date. The
exit status is 0 only when nothing failed.

The allocator's checks run in a process of their own, started here (the
same command with ``--allocator-process``): install_allocator() must come
before CUDA is used, and a crash there must not take the other checks'
results with it. That process writes one JSON line per result as it goes.
Without a GPU, the checks that need none run and each of the others says
that it needs one."""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional

import torch

from matepoint import __version__, _C
from matepoint.bench.selfcheck.outcome import FAIL, PASS, SKIP, Result, run_check
from matepoint.bench.selfcheck.registry import ALLOCATOR, BY_NAME, CHECKS, GROUPS, HOST, Check
from matepoint.bench.selfcheck.target import Target, default_target, load_target

log = logging.getLogger("matepoint.check")
SCHEMA = 1
# time for the allocator's process to start (torch's import) beyond its checks' limits
_START_S = 120


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m matepoint check",
        description="matepoint's claims checked on this machine's GPU, each PASS, FAIL or "
                    "SKIP with its reason. Exit status 0 only when nothing failed.")
    parser.add_argument("--quick", action="store_true",
                        help="the short set (about 10 s on a GPU)")
    parser.add_argument("--json", metavar="FILE",
                        help="write every result and figure, with the GPU, driver, versions "
                             "and date, to FILE")
    parser.add_argument("--only", metavar="NAMES",
                        help="comma-separated checks or groups ("
                             + ", ".join(GROUPS) + ")")
    # for matepoint's own tests: the checks on another Target (module:name)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--allocator-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    known = {check.name for check in CHECKS} | set(GROUPS)
    wanted = args.only.split(",") if args.only else []
    unknown = sorted(set(wanted) - known)
    if unknown:
        parser.error(f"unknown checks or groups {unknown}; choose from {', '.join(sorted(known))}")
    return args


def selected(args: argparse.Namespace) -> List[Check]:
    """The checks to run, in order; allocator_install with any allocator check."""
    wanted = set(args.only.split(",")) if args.only else None
    chosen = [check for check in CHECKS
              if (wanted is None or check.name in wanted or check.group in wanted)
              and (check.quick or not args.quick)]
    if any(check.group == ALLOCATOR for check in chosen):
        first = BY_NAME["allocator_install"]
        chosen = [check for check in CHECKS if check in chosen or check is first]
    return chosen


def _lines(result: Result) -> List[str]:
    """The result in one line; a failure's warnings below it."""
    said = result.claim if result.status == PASS else result.reason
    lines = [f"{result.status:<4}  {result.name:<24} {said} ({result.seconds:.1f} s)"]
    if result.status == FAIL:
        lines += [f"      warned: {text}" for text in result.figures.get("warnings", [])]
    return lines


def _allocator_process(checks: List[Check], args: argparse.Namespace) -> List[Result]:
    """The allocator's checks in a new process: its results, and a FAIL
    for each check it never reported (with how the process ended)."""
    with tempfile.TemporaryDirectory(prefix="matepoint-check-") as folder:
        lines = os.path.join(folder, "results.jsonl")
        command = [sys.executable, "-m", "matepoint", "check", "--allocator-process",
                   "--only", ",".join(check.name for check in checks), "--json", lines]
        if args.target:
            command += ["--target", args.target]
        limit = _START_S + sum(check.limit_s for check in checks)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
            ended = f"exit {done.returncode}: {(done.stderr or done.stdout)[-1500:].strip()}"
        except subprocess.TimeoutExpired:
            ended = f"killed after {limit} s"
        reported = {}
        if os.path.exists(lines):
            with open(lines) as handle:
                for text in handle:
                    row = json.loads(text)
                    reported[row["name"]] = Result(**row)
    results = []
    for check in checks:
        result = reported.get(check.name)
        if result is None:
            result = Result(check.name, check.group, check.claim, FAIL,
                            f"the allocator's process ended before this check reported ({ended})")
        results.append(result)
    return results


def _run_here(checks: List[Check], target: Optional[Target], no_gpu: str,
              done: Callable[[Result], None]) -> List[Result]:
    """``checks`` in this process, in order, ``done`` told of each result
    as it comes."""
    results = []
    for check in checks:
        if check.group == HOST:
            result = run_check(check, None)
        else:
            result = run_check(check, target, None if target is not None else no_gpu)
        done(result)
        results.append(result)
    return results


def _appender(path: str) -> Callable[[Result], None]:
    """Appends each result to ``path`` as a JSON line, at once: what the
    allocator's process reported survives its crash."""
    def append(result: Result) -> None:
        with open(path, "a") as handle:
            handle.write(json.dumps(result.as_dict()) + "\n")
    return append


def _print(result: Result) -> None:
    for line in _lines(result):
        log.info("%s", line)


def _describe(target: Optional[Target]) -> Optional[Dict[str, Any]]:
    if target is None:
        return None
    try:
        return target.describe()
    except Exception as error:  # noqa: BLE001 (the results stand without it)
        return {"name": None, "error": f"{type(error).__name__}: {error}"}


def write_json(path: str, results: List[Result], target: Optional[Target],
               args: argparse.Namespace) -> None:
    """Every result and figure, the GPU, driver, versions, date and report."""
    from matepoint.bench.machine import report as machine_report
    report = machine_report.gather()
    payload = {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m matepoint check" + (" --quick" if args.quick else ""),
        "versions": {"matepoint": __version__, "build": "test" if _C.TEST_BUILD else "release",
                     "torch": torch.__version__, "cuda": torch.version.cuda,
                     "python": report["python"]["version"]},
        "target": target.name if target is not None else None,
        "gpu": _describe(target), "driver": report["gpus"]["driver"],
        "summary": {status: sum(r.status == status for r in results)
                    for status in (PASS, FAIL, SKIP)},
        "checks": [result.as_dict() for result in results],
        "report": report,
    }
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.target:
        target: Optional[Target] = load_target(args.target)
        no_gpu = ""
    else:
        target, no_gpu = default_target()
    checks = selected(args)
    if args.allocator_process:      # its --json is the file of JSON lines the parent reads
        _run_here(checks, target, no_gpu, _appender(args.json))
        return 0
    log.info("matepoint %s, torch %s: %d checks on %s", __version__, torch.__version__,
             len(checks), target.name if target is not None else f"no GPU ({no_gpu})")
    results: List[Result] = []
    for group in GROUPS:
        batch = [check for check in checks if check.group == group]
        if group == ALLOCATOR and batch and target is not None:
            log.info("(the allocator's checks, in a process of their own: up to a minute)")
            done = _allocator_process(batch, args)
            for result in done:
                _print(result)
        else:
            done = _run_here(batch, target, no_gpu, _print)
        results += done
    counts = {status: sum(r.status == status for r in results) for status in (PASS, FAIL, SKIP)}
    log.info("%d passed, %d failed, %d skipped", counts[PASS], counts[FAIL], counts[SKIP])
    if args.json:
        write_json(args.json, results, target, args)
        log.info("results: %s", args.json)
    return 1 if counts[FAIL] else 0
