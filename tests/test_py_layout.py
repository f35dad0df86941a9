"""The Python package in layers: no import circle among matepoint's own
modules, counting imports inside functions as well as at module level (a
function-level import only hides a circle), and no file over 600 lines."""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "matepoint")
MAX_LINES = 600


def _modules() -> Dict[str, str]:
    """Dotted name -> path of every .py file of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3]
                dotted = relative.replace(os.sep, ".")
                if dotted.endswith(".__init__"):
                    dotted = dotted[: -len(".__init__")]
                found[dotted] = path
    return found


def _imports(dotted: str, path: str, known: Set[str]) -> Set[str]:
    """The package's modules that ``dotted`` imports, anywhere in its code."""
    with open(path, encoding="utf-8") as file:
        tree = ast.parse(file.read(), path)
    package = dotted if path.endswith("__init__.py") else dotted.rpartition(".")[0]
    targets: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from matepoint.bench import modes` imports the module modes
            # (its package's __init__ runs first, as for any submodule: no
            # edge of its own); `from matepoint._planning.planner import plan`
            # imports the module planner
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            targets.update(submodules or {base})
    return {t for t in targets if t in known and t != dotted}


def import_graph() -> Dict[str, Set[str]]:
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    # the package itself imports everything it exports: a module importing
    # `matepoint` (for matepoint.options) is no circle through its own file
    for name in graph:
        graph[name].discard("matepoint")
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph()
    assert "matepoint._planning.planner" in graph and graph["matepoint._planning.planner"]
    assert circles(graph) == []


def test_the_circle_finder_finds_a_function_level_circle(tmp_path) -> None:
    """A circle held by an import inside a function is still a circle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from matepoint._enable import enable\n")
    assert _imports("matepoint._x", str(source), {"matepoint._enable"}) == {"matepoint._enable"}


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_python_file_over_the_limit(name: str) -> None:
    with open(_modules()[name], encoding="utf-8") as file:
        lines = sum(1 for _ in file)
    assert lines <= MAX_LINES, f"{name}: {lines} lines; split it by concept"
