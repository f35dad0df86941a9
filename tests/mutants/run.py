"""`make mutants`: mutation testing of matepoint's C core.

Each mutant (operators.py) of the C files under the folders given is
built into a copy of the checkout (build.py: one object recompiled, the
libraries and unit tests relinked) and judged by the fast tests that
cover its file (targets.py), cheapest first; the first failure, a crash
or a timeout kills it. Mutants that do not compile are not counted.
Several mutants run at once (--jobs), a sample of them (--sample) within
a time budget (--budget-minutes); the report (build/mutants/report.md,
and report.json) gives per file the mutants killed, survived and
equivalent (targets.EQUIVALENT, with the reason), the score (killed over
killed plus survived) and every survivor.

    python tests/mutants/run.py --folders csrc/pool csrc/spill --sample 100 \\
        --ctest test_pool='csrc/pool/pool.c ...' --ctest-flags '...'
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build  # noqa: E402
import operators  # noqa: E402
import report  # noqa: E402
import targets  # noqa: E402

log = logging.getLogger("mutants")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENVIRONMENT = {"MATEPOINT_TESTING": "1", "PYTHONDONTWRITEBYTECODE": "1",
               "ASAN_OPTIONS": "allocator_may_return_null=1:detect_leaks=1",
               "TSAN_OPTIONS": "allocator_may_return_null=1"}


# the process groups of the tests running now: killed with this process
# (each runs in a session of its own, so a signal to this one misses them)
_running: Dict[int, subprocess.Popen] = {}
_running_lock = threading.Lock()


def run_command(command: List[str], cwd: str, timeout: float) -> Tuple[str, str]:
    """("passed" | "failed" | "timeout", the output's tail), the command
    killed with its whole process group at `timeout` seconds."""
    process = subprocess.Popen(command, cwd=cwd, env={**os.environ, **ENVIRONMENT},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    with _running_lock:
        _running[process.pid] = process
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return "timeout", output[-2000:]
    except BaseException:       # interrupted: the test goes with this run
        os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:
        with _running_lock:
            _running.pop(process.pid, None)
    return ("passed" if process.returncode == 0 else "failed"), output[-2000:]


def kill_running() -> None:
    """Every test still running, with its process group."""
    with _running_lock:
        for pid in list(_running):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Judge:
    """Runs a file's tests in one tree: the unit tests its mutant changed
    and its pytest files with -x, quickest first."""

    def __init__(self, layout: build.Layout, python: str, cuda_python: Optional[str]) -> None:
        self.layout, self.python, self.cuda_python = layout, python, cuda_python
        self.baseline: Dict[Tuple[str, ...], float] = {}
        self.lock = threading.Lock()

    def commands(self, tree: str, path: str) -> List[Tuple[str, List[str]]]:
        tests = targets.tests_for(path)
        found = [(name, [build.output_of(tree, name)]) for name in tests.ctests
                 if path in self.layout.sources.get(name, ())]
        if tests.pytests:
            found.append(("pytest", [self.python, "-m", "pytest", "-q", "-x", "-p",
                                     "no:cacheprovider", *tests.pytests]))
        if tests.cuda_pytests and self.cuda_python:
            found.append(("pytest-cuda", [self.cuda_python, "-m", "pytest", "-q", "-x", "-p",
                                          "no:cacheprovider", *tests.cuda_pytests]))
        return found

    def judge(self, tree: str, path: str, timeout: Optional[float] = None) -> Tuple[str, str]:
        """("passed" | "failed" | "timeout", which test said so), the
        quickest of the unmutated runs first (a unit test under
        ThreadSanitizer can take longer than the pytest files)."""
        commands = sorted(self.commands(tree, path),
                          key=lambda item: self.baseline.get(self.key(path, item[0]), 0.0))
        for name, command in commands:
            limit = timeout if timeout is not None else self.limit(path, name)
            status, output = run_command(command, tree, limit)
            if status != "passed":
                return status, f"{name}: {output.strip().splitlines()[-1] if output.strip() else ''}"
        return "passed", ""

    def limit(self, path: str, name: str) -> float:
        """Three times what the unmutated run took, and 10 s more for a
        unit test (a binary), a minute for pytest (interpreter, torch)."""
        return 3 * self.baseline[self.key(path, name)] + \
            (60 if name.startswith("pytest") else 10)

    @staticmethod
    def key(path: str, name: str) -> Tuple[str, ...]:
        """One command of one file's tests: measured once for every file
        that names the same tests."""
        tests = targets.tests_for(path)
        return (name, *tests.ctests, *tests.pytests, *tests.cuda_pytests)

    def measure(self, tree: str, path: str) -> None:
        """The unmutated tests of `path` pass, and how long each took."""
        for name, command in self.commands(tree, path):
            key = self.key(path, name)
            with self.lock:
                if key in self.baseline:
                    continue
                self.baseline[key] = 0.0    # measured once, by this thread
            start = time.monotonic()
            status, output = run_command(command, tree, 1800)
            if status != "passed":
                raise SystemExit(f"mutants: the unmutated tests of {path} fail ({name}):\n{output}")
            self.baseline[key] = time.monotonic() - start
            log.info("baseline %s for %s: %.0f s", name, path, self.baseline[key])


class Worker:
    """One copy of the checkout, judging one mutant at a time."""

    def __init__(self, index: int, base: str, layout: build.Layout, judge: Judge) -> None:
        self.tree = os.path.join(base, f"w{index}")
        self.objects = os.path.join(self.tree, "build", "mutants-obj")
        self.pristine_tree = os.path.join(base, "tree")
        self.layout, self.judge = layout, judge
        if os.path.exists(self.tree):
            shutil.rmtree(self.tree)
        shutil.copytree(self.pristine_tree, self.tree, symlinks=True)
        for target in layout.sources:
            os.makedirs(os.path.dirname(build.output_of(self.tree, target)), exist_ok=True)
        build.restore(layout, self.tree, self.pristine_tree, list(layout.sources))

    def run(self, mutant: operators.Mutant, text: str, pristine_objects: str) -> Dict[str, object]:
        start = time.monotonic()
        source = os.path.join(self.tree, mutant.path)
        wanted = set(build.LIBRARIES) | set(targets.tests_for(mutant.path).ctests)
        changed = [target for target in self.layout.targets_of(mutant.path) if target in wanted]
        try:
            with open(source, "w", encoding="utf-8") as handle:
                handle.write(mutant.apply(text))
            for target in changed:
                built = build.compile_one(self.layout, self.tree, target, mutant.path, self.objects)
                build.link(self.layout, self.tree, target, pristine_objects, {mutant.path: built})
            status, detail = self.judge.judge(self.tree, mutant.path)
            status = {"passed": "survived", "failed": "killed", "timeout": "timeout"}[status]
        except build.CompileError as error:
            status, detail = "invalid", str(error)
        finally:
            with open(source, "w", encoding="utf-8") as handle:
                handle.write(text)
            build.restore(self.layout, self.tree, self.pristine_tree, changed)
        return {"key": mutant.key, "path": mutant.path, "line": mutant.line,
                "operator": mutant.operator, "change": mutant.describe(text),
                "status": status, "detail": detail, "seconds": round(time.monotonic() - start, 1)}


def sample(found: List[operators.Mutant], count: Optional[int], seed: int) -> List[operators.Mutant]:
    """`count` mutants spread over the files in proportion to their
    mutants (all of them without a count), in random order."""
    rng = random.Random(seed)
    chosen = list(found)
    if count is not None and count < len(found):
        by_file: Dict[str, List[operators.Mutant]] = {}
        for mutant in found:
            by_file.setdefault(mutant.path, []).append(mutant)
        chosen = []
        for path, mutants in sorted(by_file.items()):
            share = max(1, round(count * len(mutants) / len(found)))
            chosen += rng.sample(mutants, min(share, len(mutants)))
    rng.shuffle(chosen)
    return chosen


def c_files(folders: List[str]) -> List[str]:
    return sorted(os.path.join(folder, name) for folder in folders
                  for name in os.listdir(os.path.join(ROOT, folder)) if name.endswith(".c"))


def parse_arguments(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folders", nargs="+", default=targets.FOLDERS)
    parser.add_argument("--files", nargs="*", default=None, help="only these C files")
    parser.add_argument("--sample", type=int, default=None, help="mutants in all (default: every one)")
    parser.add_argument("--rerun", default=None, metavar="REPORT_JSON",
                        help="only the mutants that survived in an earlier report (after new tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-minutes", type=float, default=60.0)
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--python", default=sys.executable, help="the test environment's python")
    parser.add_argument("--cuda-python", default=None,
                        help="a python with torch's CUDA build, for the C++ adapter's tests "
                             "(default: the .venv-214 beside --python's environment)")
    parser.add_argument("--cc", default=os.environ.get("CC", "cc"))
    parser.add_argument("--ctest", action="append", default=[], metavar="NAME=SOURCES",
                        help="a C unit test and its sources (the Makefile's list)")
    parser.add_argument("--ctest-flags", default="", help="their compile flags (CTEST_CFLAGS)")
    parser.add_argument("--tsan-flags", default="",
                        help="their flags under ThreadSanitizer, for the NAME:tsan unit tests")
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "mutants"))
    return parser.parse_args(argv)


def main(argv: List[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_arguments(argv)
    args.out = os.path.abspath(args.out)    # the compilers run in the copies of the checkout
    ctests = {name: value.split() for name, _, value in (item.partition("=") for item in args.ctest)}
    paths = args.files or c_files(args.folders)
    found = [m for path in paths for m in operators.mutants(path, read(path))]
    if args.rerun:
        found = [m for m in found if m.key in survivors(args.rerun)]
    chosen = sample(found, args.sample, args.seed)
    log.info("%d mutants in %d files, %d chosen, %d at once", len(found), len(paths), len(chosen),
             args.jobs)
    pristine = os.path.join(args.out, "tree")
    build.copy_tree(ROOT, pristine)
    layout = build.layout_of(pristine, args.cc, ctests, shlex.split(args.ctest_flags),
                             shlex.split(args.tsan_flags))
    objects = os.path.join(args.out, "obj")
    build.build_pristine(layout, pristine, objects, args.jobs)
    cuda_python = args.cuda_python or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(args.python))), ".venv-214", "bin",
        "python")
    if not os.path.exists(cuda_python):
        log.warning("no %s: the C++ adapter's tests (cuda_pytests) are left out", cuda_python)
        cuda_python = None
    args.cuda_python = cuda_python          # as the report records it
    judge = Judge(layout, args.python, cuda_python)
    workers = [Worker(i, args.out, layout, judge) for i in range(args.jobs)]
    for path in sorted({m.path for m in chosen}):
        judge.measure(workers[0].tree, path)
    results = run_all(chosen, workers, objects, args.budget_minutes * 60)
    report.write(args.out, results, found, targets.EQUIVALENT, vars(args))
    return 0


def survivors(report_json: str) -> set:
    """The keys of the mutants an earlier run saw survive, or judged equivalent."""
    with open(report_json, encoding="utf-8") as handle:
        results = json.load(handle)["results"]
    return {r["key"] for r in results if r["status"] in ("survived", "equivalent")}


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return handle.read()


def run_all(chosen: List[operators.Mutant], workers: List[Worker], objects: str,
            budget_s: float) -> List[Dict[str, object]]:
    """Every chosen mutant judged, or marked not run once the budget is spent."""
    deadline = time.monotonic() + budget_s
    queue = list(chosen)
    lock = threading.Lock()
    results: List[Dict[str, object]] = []
    texts = {path: read(path) for path in {m.path for m in chosen}}

    stopping = threading.Event()

    def work(worker: Worker) -> None:
        while not stopping.is_set():
            with lock:
                if not queue:
                    return
                mutant = queue.pop(0)
            if time.monotonic() > deadline:
                result = {"key": mutant.key, "path": mutant.path, "line": mutant.line,
                          "operator": mutant.operator, "change": mutant.describe(texts[mutant.path]),
                          "status": "not run", "detail": "", "seconds": 0}
            else:
                result = worker.run(mutant, texts[mutant.path], objects)
                log.info("%-8s %s %s", result["status"], result["change"], result["detail"][:100])
            with lock:
                results.append(result)

    with ThreadPoolExecutor(max_workers=len(workers)) as pool:
        running = [pool.submit(work, worker) for worker in workers]
        try:
            for future in running:
                while not future.done():
                    time.sleep(0.5)     # a signal's KeyboardInterrupt lands here
                future.result()
        except KeyboardInterrupt:
            stopping.set()
            kill_running()
            raise
    counts = Counter(str(r["status"]) for r in results)
    log.info("done: %s", dict(counts))
    return results


def _interrupt(number: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    # SIGTERM (a `kill` of this run) ends it as Ctrl-C does, its tests too
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main(sys.argv[1:]))
