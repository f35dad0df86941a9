"""csrc/ shows the architecture: folders in layers, each including only
headers of its own folder or of a folder below it, and calling only
functions defined in its own folder or below it, no circle of calls and
includes between folders, no file over 600 lines."""
from __future__ import annotations

import functools
import os
import re
from typing import Dict, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
MAX_LINES = 600

# Bottom first. A folder may include headers of its own folder and of the
# folders listed before it; testing (test builds only) sits above the
# engine it drives and below the module that registers it; torch_cxx (the
# C++ units compiled against torch) sits on the allocator whose table it reads.
LAYERS = ("common", "cuda", "pool", "spill", "alloc", "torch_cxx", "planner", "base", "offload",
          "checkpoint", "testing", "module")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _sources(csrc: str = CSRC) -> list[str]:
    found = []
    for folder, _, names in os.walk(csrc):
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


def test_the_allocator_host_backend_is_built_into_test_builds_only() -> None:
    # a test seam (tests select it with MATEPOINT_ALLOC_BACKEND=host); no
    # product feature runs the allocator on host memory
    from matepoint import _build_layout as layout
    host = "csrc/alloc/alloc_host.c"
    assert host in layout.allocator_sources(ROOT, True)
    assert host not in layout.allocator_sources(ROOT, False)
    with open(os.path.join(CSRC, "alloc", "entry.c"), encoding="utf-8") as handle:
        entry = handle.read()
    guarded = re.search(r'#ifdef MATEPOINT_TESTING\s*#include "alloc_host.h"\s*#endif', entry)
    assert guarded and entry.count('#include "alloc_host.h"') == 1


def test_no_source_file_runs_over_the_limit() -> None:
    long = []
    for source in _sources():
        with open(source, encoding="utf-8") as handle:
            count = sum(1 for _ in handle)
        if count > MAX_LINES:
            long.append(f"{os.path.relpath(source, CSRC)}: {count} lines")
    assert not long, f"over {MAX_LINES} lines:\n" + "\n".join(long)


# ---- calls ---------------------------------------------------------------
# Includes alone miss a function declared in a low header but defined in a
# high folder (mp_state_from_type was: declared in base/state.h, defined in
# module/module.c, called from base/hooks.c). So the C is read for what each
# file defines and which functions it names, and each name is traced to the
# file that defines it. A reader of tokens, not a compiler: comments,
# strings and preprocessor lines are dropped, both arms of an #ifdef are
# read, a definition is a name with parameters and a body at file level, and
# a use is any mention of a function's name inside braces (a call, or a
# function handed on as a value: method tables, type slots) that does not
# follow `.` or `->`. A local variable named as another file's function
# would count as a use: strict, never lenient.
TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|/\*.*?\*/|//[^\n]*'
                   r"|[A-Za-z_]\w*|\d[\w.]*|\S", re.DOTALL)
NAME = re.compile(r"[A-Za-z_]\w*$")
NOT_FUNCTIONS = frozenset((
    "if", "while", "for", "switch", "return", "sizeof", "defined", "case", "do", "else",
    "_Alignof", "_Static_assert", "_Generic", "__attribute__", "offsetof", "void"))


def _tokens(text: str) -> List[str]:
    kept, continued = [], False
    for line in text.split("\n"):
        directive = continued or line.lstrip().startswith("#")
        continued = directive and line.rstrip().endswith("\\")
        kept.append("" if directive else line)
    return [token for token in TOKEN.findall("\n".join(kept))
            if not token.startswith(("/*", "//", '"', "'"))]


def _close(tokens: List[str], start: int) -> int:
    """Index of the parenthesis that closes the one at `start`."""
    depth = 0
    for index in range(start, len(tokens)):
        depth += {"(": 1, ")": -1}.get(tokens[index], 0)
        if depth == 0:
            return index
    return len(tokens) - 1


class _Parsed:
    """What one file defines (`exported`: seen from other files; static
    functions of a .c file are its own), declares, and names in bodies;
    `bodies`: each function's names, in the order first named."""

    def __init__(self, text: str) -> None:
        self.exported: Set[str] = set()
        self.own: Set[str] = set()
        self.declared: Set[str] = set()
        self.named: Set[str] = set()
        self.bodies: Dict[str, Dict[str, None]] = {}
        body = None
        tokens = _tokens(text)
        depth = index = 0
        while index < len(tokens):
            token = tokens[index]
            depth += {"{": 1, "}": -1}.get(token, 0)
            body = body if depth > 0 else None
            if not NAME.match(token) or token in NOT_FUNCTIONS:
                index += 1
                continue
            if depth == 0 and index + 1 < len(tokens) and tokens[index + 1] == "(":
                end = _close(tokens, index + 1)
                after = tokens[end + 1] if end + 1 < len(tokens) else ""
                if after == "{":
                    start = index
                    while start > 0 and tokens[start - 1] not in (";", "}", "{"):
                        start -= 1
                    self.own.add(token)
                    body = self.bodies.setdefault(token, {})
                    if "static" not in tokens[start:index]:
                        self.exported.add(token)
                elif after == ";":
                    self.declared.add(token)
                index = end
            elif depth > 0 and tokens[index - 1] not in (".", "->"):
                self.named.add(token)
                if body is not None:
                    body[token] = None
            index += 1


@functools.lru_cache(maxsize=None)
def _parsed(csrc: str = CSRC) -> Dict[str, _Parsed]:
    """Every csrc file by its path under csrc/."""
    found = {}
    for source in _sources(csrc):
        with open(source, encoding="utf-8") as handle:
            found[os.path.relpath(source, csrc)] = _Parsed(handle.read())
    return found


def _definers(csrc: str = CSRC) -> Dict[str, List[str]]:
    """Function name -> the files defining it for the others: a .c file's
    non-static functions and a header's (static inline) ones."""
    definers: Dict[str, List[str]] = {}
    for path, parsed in _parsed(csrc).items():
        for name in parsed.own if path.endswith(".h") else parsed.exported:
            definers.setdefault(name, []).append(path)
    return definers


def _folder(path: str) -> str:
    return path.split("/")[0]


def _calls() -> Dict[Tuple[str, str], Set[str]]:
    """(file, file defining a function it names) -> the names."""
    definers = _definers()
    calls: Dict[Tuple[str, str], Set[str]] = {}
    for path, parsed in _parsed().items():
        for name in parsed.named - parsed.own:
            for target in definers.get(name, ()):
                if target != path:
                    calls.setdefault((path, target), set()).add(name)
    return calls


def _includes() -> Dict[Tuple[str, str], Set[str]]:
    found: Dict[Tuple[str, str], Set[str]] = {}
    for source in _sources():
        with open(source, encoding="utf-8") as handle:
            text = handle.read()
        path = os.path.relpath(source, CSRC)
        for included in INCLUDE.findall(text):
            target = f"{_folder_of_include(source, included)}/{os.path.basename(included)}"
            found.setdefault((path, target), set()).add("#include")
    return found


def _circles(edges: Dict[Tuple[str, str], Set[str]]) -> List[List[str]]:
    """The strongly connected parts of more than one file (Tarjan)."""
    graph: Dict[str, List[str]] = {}
    for source, target in edges:
        graph.setdefault(source, []).append(target)
        graph.setdefault(target, [])
    order: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    circles: List[List[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                circles.append(sorted(part))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return circles


def test_the_call_reader_finds_each_declared_function_once() -> None:
    # the checks below are only as good as this reader: every function a
    # header declares must be found defined, in one file, and known ones
    # where they are
    definers = _definers()
    declared = {name: path for path, parsed in _parsed().items() if path.endswith(".h")
                for name in parsed.declared}
    missing = sorted(f"{path}: {name}" for name, path in declared.items() if name not in definers)
    twice = sorted(f"{name}: {paths}" for name, paths in definers.items() if len(paths) > 1)
    assert not missing, "declared, but no definition found:\n" + "\n".join(missing)
    assert not twice, "defined in more than one file:\n" + "\n".join(twice)
    assert len(declared) > 200, len(declared)
    assert definers["mp_state_of"] == ["base/state.h"]
    assert definers["frame_recompute"] == ["checkpoint/recompute.c"]
    assert ("module/module.c", "checkpoint/checkpoint.c") in _calls()


def test_no_folder_calls_a_function_defined_above_it() -> None:
    upward = [f"{source} -> {target}: {', '.join(sorted(names))}"
              for (source, target), names in sorted(_calls().items())
              if LAYERS.index(_folder(target)) > LAYERS.index(_folder(source))]
    assert not upward, "calls pointing up the layers:\n" + "\n".join(upward)


def test_no_circle_of_calls_and_includes_crosses_folders() -> None:
    # circles inside one folder are that folder's business (its files share
    # a private header); one through two folders makes the layers a fiction
    edges = _includes()
    for pair, names in _calls().items():
        edges.setdefault(pair, set()).update(names)
    crossing = []
    for circle in _circles(edges):
        if len({_folder(path) for path in circle}) > 1:
            inside = [f"  {source} -> {target}: {', '.join(sorted(edges[source, target]))}"
                      for source in circle for target in circle if (source, target) in edges]
            crossing.append(" ".join(circle) + "\n" + "\n".join(inside))
    assert not crossing, "circles through more than one folder:\n" + "\n\n".join(crossing)


# ---- floors inside csrc/offload -------------------------------------------
# The offload engine's files in floors, bottom first: a file calls and
# includes only files of its own floor or of the floors below, with no
# circle of calls between files (inside a floor too). The two directions of
# work sit on the policies, and those on the mechanisms. The one list:
# offload_internal.h's sections follow it, and docs/architecture.md's table
# of the offload floors is checked against it.
OFFLOAD_LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("contract", ("offload.h", "offload_internal.h", "offload_types.h", "offload_runtime.h",
                  "offload_sites.h")),
    ("gpu", ("offload_runtime_torch.c", "streams.h", "streams.c")),
    ("limits", ("offload_limits.c",)),
    ("device", ("offload_device.c",)),
    ("records", ("offload_records.c",)),
    ("return", ("offload_return.c",)),
    ("window", ("offload_window.c",)),
    ("spill", ("offload_spill_fork.c", "offload_spill.c", "offload_spill_retire.c")),
    ("copy", ("offload_copy.c",)),
    ("inspect", ("offload_inspect.c",)),
    ("directions", ("offload_save.c", "offload_restore.c")),
    ("entry", ("offload_engine.c", "offload_sac.c")),
)


def _offload_floor() -> Dict[str, int]:
    return {f"offload/{name}": floor for floor, (_, names) in enumerate(OFFLOAD_LAYERS)
            for name in names}


def _offload_edges() -> Dict[Tuple[str, str], Set[str]]:
    """Calls and includes between two files of csrc/offload."""
    edges: Dict[Tuple[str, str], Set[str]] = {}
    for found in (_includes(), _calls()):
        for (source, target), names in found.items():
            if source != target and _folder(source) == _folder(target) == "offload":
                edges.setdefault((source, target), set()).update(names)
    return edges


def _upward(edges: Dict[Tuple[str, str], Set[str]], floor: Dict[str, int]) -> List[str]:
    """Each call or include from a file to a file of a floor above it (a
    file on no floor is test_every_offload_file_is_on_one_floor's)."""
    name = {index: layer for index, (layer, _) in enumerate(OFFLOAD_LAYERS)}
    return [f"{source} ({name[floor[source]]}) -> {target} ({name[floor[target]]}): "
            f"{', '.join(sorted(names))}"
            for (source, target), names in sorted(edges.items())
            if source in floor and target in floor and floor[target] > floor[source]]


def test_every_offload_file_is_on_one_floor() -> None:
    listed = [f"offload/{name}" for _, names in OFFLOAD_LAYERS for name in names]
    present = sorted(os.path.relpath(path, CSRC) for path in _sources()
                     if _folder(os.path.relpath(path, CSRC)) == "offload")
    assert sorted(listed) == present, (sorted(set(listed) ^ set(present)), listed)
    assert len(set(listed)) == len(listed)


def test_the_floor_check_names_a_planted_upward_call() -> None:
    # its premise: the check flags a call up and names both files and the
    # floors, and the real edges it reads include a known downward call
    floor = _offload_floor()
    planted = {("offload/offload_device.c", "offload/offload_save.c"): {"start_d2h"}}
    assert _upward(planted, floor) == [
        "offload/offload_device.c (device) -> offload/offload_save.c (directions): start_d2h"]
    edges = _offload_edges()
    assert "offload_device_order" in edges["offload/offload_save.c", "offload/offload_device.c"]
    assert ("offload/offload_window.c", "offload/offload_internal.h") in edges


def test_no_offload_file_calls_or_includes_a_file_above_it() -> None:
    upward = _upward(_offload_edges(), _offload_floor())
    assert not upward, "calls and includes pointing up csrc/offload's floors:\n" + "\n".join(upward)


def test_no_circle_of_calls_between_offload_files() -> None:
    edges = _offload_edges()
    circles = [" ".join(circle) + "\n" + "\n".join(
        f"  {source} -> {target}: {', '.join(sorted(edges[source, target]))}"
        for source in circle for target in circle if (source, target) in edges)
        for circle in _circles(edges)]
    assert not circles, "circles between files of csrc/offload:\n" + "\n\n".join(circles)


def test_the_architecture_page_draws_the_offload_floors() -> None:
    # its offload table, bottom floor first as its folder table: | floor | files | holds |
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as handle:
        text = handle.read()
    section = text.split("### The offload engine's floors", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z]+)` \| ([^|]+) \|", section, re.MULTILINE)
    drawn = [(layer, tuple(re.findall(r"`([^`]+)`", files))) for layer, files in rows]
    assert drawn == list(OFFLOAD_LAYERS)


# ---- a saved input's paths -------------------------------------------------
# How far a reader goes following one saved input through the engine, as
# the call reader sees it: `stops`, the functions of csrc/offload the path
# reaches from its entry points, following calls inside csrc/offload (each
# once); `files`, the files those are in; `climbs`, the calls among them
# from one file into another that calls back into the first, directly or
# through others (a climb back to a file already passed: none when the
# files are in floors). benchmarks/offload_paths.py prints them for any
# checkout, to compare with earlier commits.

# Where the two paths begin: the save direction's entry points
# (checkpoint's forward) and the restore direction's (backward's unpack).
OFFLOAD_PATHS = {
    "save": ("offload_save_inputs", "offload_check_forward"),
    "restore": ("offload_restore_group", "offload_unpack_hook"),
}


def _function_calls(csrc: str) -> Dict[Tuple[str, str], List[Tuple[str, str]]]:
    """(file, function) -> the (file, function) it names, in order; a name
    is the file's own function first, else the one other files see."""
    definers = _definers(csrc)
    calls = {}
    for path, parsed in _parsed(csrc).items():
        for function, names in parsed.bodies.items():
            calls[path, function] = [
                (path, name) if name in parsed.own else (definers[name][0], name)
                for name in names if name != function and (name in parsed.own or name in definers)]
    return calls


def offload_paths(csrc: str = CSRC) -> Dict[str, Dict[str, int]]:
    """Each path of OFFLOAD_PATHS measured in `csrc` (the section above)."""
    calls = _function_calls(csrc)
    definers = _definers(csrc)
    figures = {}
    for path, roots in OFFLOAD_PATHS.items():
        reached: Dict[Tuple[str, str], None] = {}
        pending = [(definers[root][0], root) for root in reversed(roots)]
        while pending:
            node = pending.pop()
            if node not in reached and _folder(node[0]) == "offload":
                reached[node] = None
                pending += reversed(calls.get(node, []))
        between: Dict[Tuple[str, str], Set[str]] = {}
        for caller in reached:
            for callee in calls.get(caller, []):
                if callee in reached and callee[0] != caller[0]:
                    between.setdefault((caller[0], callee[0]), set()).add(callee[1])
        circles = _circles(between)
        climbs = sum(len(names) for (source, target), names in between.items()
                     if any(source in circle and target in circle for circle in circles))
        figures[path] = {"stops": len(reached), "files": len({file for file, _ in reached}),
                         "climbs": climbs}
    return figures


def test_a_saved_input_never_climbs_back_to_a_file_it_passed() -> None:
    # the reader's premise: it follows calls from function to function
    # across files, through both directions
    figures = offload_paths()
    assert figures["save"]["stops"] > 50 and figures["restore"]["stops"] > 50, figures
    assert figures["save"]["files"] > 5 and figures["restore"]["files"] > 5, figures
    assert figures["save"]["climbs"] == figures["restore"]["climbs"] == 0, figures
