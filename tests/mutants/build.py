"""The test build of a copy of the checkout, object by object, so that a
mutant rebuilds one file and relinks (`make mutants`).

One pristine copy (build/mutants/tree) is compiled once: every source of
matepoint._C and of the allocator library (the test build's lists,
matepoint/_build_layout.py, with its flags and -O1), and every source of
the C unit tests named (the Makefile's lists and ASan/UBSan flags, passed
on the command line). Each worker gets a copy of that tree; a mutant is
compiled into the worker's own object folder and linked with the pristine
objects into the worker's libraries and unit tests, which go back to the
pristine ones afterwards."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional

EXTENSION_SUFFIX = ".abi3.so"
LIBRARIES = {"ext": "matepoint/_C", "alloc": "matepoint/_alloc"}


class CompileError(Exception):
    """A mutant that does not compile: no test judges it."""


@dataclass
class Layout:
    """How each library and unit test of the checkout `root` is built."""
    root: str
    cc: str
    sources: Dict[str, List[str]]       # library or unit test -> sources
    flags: Dict[str, List[str]]         # ... -> compile flags
    link: Dict[str, List[str]]          # ... -> link flags and libraries
    ctests: List[str] = field(default_factory=list)

    def targets_of(self, path: str) -> List[str]:
        """The libraries and unit tests that compile `path`."""
        return [target for target, sources in self.sources.items() if path in sources]


def _build_layout(root: str):
    spec = importlib.util.spec_from_file_location(
        "_build_layout", os.path.join(root, "matepoint", "_build_layout.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layout_of(root: str, cc: str, ctests: Dict[str, List[str]], ctest_flags: List[str],
              tsan_flags: List[str]) -> Layout:
    """The libraries as setup.py builds them in a test build, and the unit
    tests `ctests` (name -> sources) with `ctest_flags` (ASan and UBSan)
    and, as `name:tsan`, with `tsan_flags` (ThreadSanitizer: a lock a
    mutant removed shows as a race or an unlock of an unlocked mutex)."""
    build = _build_layout(root)
    environ = {"MATEPOINT_TESTING": "1", "MATEPOINT_WERROR": "1"}
    python = sysconfig.get_paths()["include"]
    common = build.c_flags(environ) + ["-fPIC", "-fwrapv", "-O1", "-Icsrc", f"-I{python}"]
    sources = {"ext": build.extension_sources(root, True), "alloc": build.allocator_sources(root, True)}
    flags = {"ext": common, "alloc": common + ["-fexceptions"]}
    link = {"ext": ["-shared", "-ldl", "-lpthread"], "alloc": ["-shared", "-ldl", "-lpthread"]}
    for name, files in ctests.items():
        for target, target_flags in ((name, ctest_flags), (f"{name}:tsan", tsan_flags)):
            if not target_flags:
                continue
            sources[target] = files
            flags[target] = target_flags
            link[target] = [flag for flag in target_flags if flag.startswith("-fsanitize")] + \
                ["-lpthread"]
    return Layout(root, cc, sources, flags, link, sorted(ctests))


# the prebuilt C++ units (`make units`, ignored by git): the adapter's
# tests load them instead of compiling the adapter in every copy
PREBUILT = "matepoint/_prebuilt"


def copy_tree(source: str, target: str) -> None:
    """The checkout's tracked and untracked-but-not-ignored files, built
    libraries aside, and its prebuilt C++ units from `source` into a
    fresh `target`."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=source,
                            check=True, capture_output=True).stdout.decode().split("\0")
    if os.path.exists(target):
        shutil.rmtree(target)
    for path in filter(None, listed):
        if path.endswith(".so") or not os.path.isfile(os.path.join(source, path)):
            continue
        os.makedirs(os.path.dirname(os.path.join(target, path)) or target, exist_ok=True)
        shutil.copy2(os.path.join(source, path), os.path.join(target, path))
    if os.path.isdir(os.path.join(source, PREBUILT)):
        shutil.copytree(os.path.join(source, PREBUILT), os.path.join(target, PREBUILT))


def _object(folder: str, target: str, path: str) -> str:
    return os.path.join(folder, target.replace(":", "."), path[:-2] + ".o")


def compile_one(layout: Layout, tree: str, target: str, path: str, objects: str) -> str:
    """Compiles `path` of `tree` for `target` into `objects`; its object."""
    output = _object(objects, target, path)
    os.makedirs(os.path.dirname(output), exist_ok=True)
    done = subprocess.run([layout.cc, *layout.flags[target], "-c", path, "-o", output], cwd=tree,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise CompileError(_first_error(done.stderr) or "cc failed")
    return output


def _first_error(stderr: str) -> str:
    """The line of a compiler's output that says what failed (not the
    "In function" or "Assembler messages:" line above it)."""
    lines = stderr.strip().splitlines()
    return next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")


def output_of(tree: str, target: str) -> str:
    """Where `target`'s library or binary goes in `tree`."""
    if target in LIBRARIES:
        return os.path.join(tree, LIBRARIES[target] + EXTENSION_SUFFIX)
    return os.path.join(tree, "build", "mutants-ctest", target.replace(":", "."))


def link(layout: Layout, tree: str, target: str, pristine: str,
         replaced: Optional[Dict[str, str]] = None) -> None:
    """Links `target` into `tree` from the pristine objects, `replaced`
    (source -> object) taking their sources' place."""
    replaced = replaced or {}
    objects = [replaced.get(path, _object(pristine, target, path)) for path in layout.sources[target]]
    output = output_of(tree, target)
    os.makedirs(os.path.dirname(output), exist_ok=True)
    done = subprocess.run([layout.cc, "-o", output, *objects, *layout.link[target]], cwd=tree,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise CompileError(f"link of {target}: {done.stderr.strip()[:300]}")


def build_pristine(layout: Layout, tree: str, objects: str, jobs: int) -> None:
    """Every object of every target of `tree` into `objects`, then every
    target linked into `tree`."""
    work = [(target, path) for target, sources in layout.sources.items() for path in sources]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for _ in pool.map(lambda item: compile_one(layout, tree, item[0], item[1], objects), work):
            pass
    for target in layout.sources:
        link(layout, tree, target, objects)


def restore(layout: Layout, tree: str, pristine_tree: str, targets: List[str]) -> None:
    """`targets` of a worker's `tree` back to the pristine tree's."""
    for target in targets:
        shutil.copy2(output_of(pristine_tree, target), output_of(tree, target))
