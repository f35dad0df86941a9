"""Each fact the Python package and the C core share is defined in one
place: the other side reads it from there, and these tests fail when a
second copy appears or the two drift apart."""
from __future__ import annotations

import dataclasses
import os
import re

import pytest

import matepoint
from matepoint import _C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return handle.read()


# ---- options ----------------------------------------------------------------

def test_options_defaults_come_from_the_c_table() -> None:
    fields = {field.name: field.default for field in dataclasses.fields(matepoint.Options)}
    assert list(fields) == list(_C.OPTIONS)
    assert fields == {name: default for name, (default, _) in _C.OPTIONS.items()}


@pytest.mark.parametrize("name", ["prefetch_depth", "offload_window", "min_offload_bytes",
                                  "pool_limit_bytes"])
def test_option_ranges_are_the_c_tables(name: str) -> None:
    accepted = _C.OPTIONS[name][1]
    low, high = re.match(r"an int from (\d+) to 2\*\*(\d+) - 1", accepted).groups()
    _C._check_option(name, int(low))
    _C._check_option(name, 2 ** int(high) - 1)
    for value in (int(low) - 1, 2 ** int(high)):
        with pytest.raises(ValueError, match=re.escape(accepted)):
            _C._check_option(name, value)
        with pytest.raises(ValueError, match=re.escape(accepted)):
            matepoint.set_options(**{name: value})


def test_configure_checks_like_set_options_and_changes_nothing_on_error() -> None:
    before = matepoint.options
    with pytest.raises(ValueError, match="offload_window must be positive"):
        _C._configure(prefetch_depth=5, offload_window=0)
    with pytest.raises(TypeError, match="unknown matepoint option 'depth'"):
        _C._configure(depth=5)
    with pytest.raises(TypeError, match="keywords only"):
        _C._configure(True)
    # nothing was applied: the engine still runs with matepoint.options
    _C._configure()
    assert matepoint.options == before


def test_option_numbers_are_written_once() -> None:
    """Defaults and bounds appear in the C table only, not in _options.py."""
    python = read("matepoint/_options.py")
    for number in ("1 << 20", "2**31", "2**63", "(1 << 31)", "(1 << 63)"):
        assert number not in python, number
    table = read("csrc/module/options.c")
    assert "1 << 20" in table and "2**31 - 1" in table
    assert "1 << 20" not in read("csrc/offload/offload_engine.c")
    assert "window < 1" not in read("csrc/module/module.c")


# ---- checkpoint keywords --------------------------------------------------------

def test_checkpoint_keywords_are_the_parsers() -> None:
    """The signature in the docstring, the docs of each option, _enable.py's
    and _patch.py's lists are all the C parser's table."""
    import inspect

    from matepoint import _enable, _patch
    parameters = inspect.signature(_C.checkpoint).parameters.values()
    keyword_only = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keyword_only == _C.CHECKPOINT_KEYWORDS
    for name in _C.CHECKPOINT_KEYWORDS:
        assert re.search(rf"^{name}: ", _C.checkpoint.__doc__, re.M), name
    assert _enable._CHECKPOINT_KEYWORDS is _C.CHECKPOINT_KEYWORDS
    assert _patch._CURRY_OPTIONS is _C.CHECKPOINT_KEYWORDS


@pytest.mark.parametrize("name", sorted(_C.CHECKPOINT_KEYWORDS))
def test_every_listed_keyword_is_taken_by_checkpoint_not_the_function(name: str) -> None:
    import torch
    seen = {}

    def function(x: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen.update(kwargs)
        return x * 2

    value = {"context_fn": None, "determinism_check": "default"}.get(name, False)
    if name == "use_reentrant":
        value = False
    x = torch.ones(2, requires_grad=True)
    matepoint.checkpoint(function, x, **{name: value}).sum().backward()
    assert seen == {}


def test_keyword_names_are_written_once() -> None:
    for path in ("matepoint/_enable.py", "matepoint/_patch.py"):
        assert '"matepoint_prefetch"' not in read(path), path


# ---- pool_stats keys ----------------------------------------------------------

def test_pool_stats_has_exactly_the_c_tables_keys() -> None:
    assert list(matepoint.pool_stats()) == list(_C.POOL_STATS_KEYS)


def test_pool_stats_docs_name_only_real_keys() -> None:
    doc = matepoint.pool_stats.__doc__
    missing = [key for key in _C.POOL_STATS_KEYS if not re.search(rf"\b{key}\b", doc)]
    assert not missing, f"pool_stats' docstring does not describe {missing}"
    guide = read("docs/guides/offload.md")
    listed = re.search(r"matepoint\.pool_stats\(\)\s+# (.*?)\.\.\.", guide, re.S).group(1)
    names = re.findall(r"[a-z_]+", listed)
    assert names and set(names) <= set(_C.POOL_STATS_KEYS), set(names) - set(_C.POOL_STATS_KEYS)


# ---- the allocator library ---------------------------------------------------------

def test_allocator_symbols_are_exactly_what_the_library_defines() -> None:
    """entry.c and entry_pools.c define the functions; _C.ALLOCATOR_SYMBOLS
    is the one list of their names that _C, _allocator.py and _oom.py look
    them up by."""
    import ctypes

    from matepoint._allocator import allocator_path
    entries = read("csrc/alloc/entry.c") + read("csrc/alloc/entry_pools.c")
    defined = set(re.findall(r"^(matepoint_\w+)\(", entries, re.M))
    defined.discard("matepoint_alloc_use_runtime")  # test builds only, for tests/sim.py
    # test builds only: graph pools and cacheInfo for the simulated GPU's tests
    defined -= {name for name in defined if name.startswith("matepoint_test_")}
    assert defined == set(_C.ALLOCATOR_SYMBOLS.values())
    library = ctypes.CDLL(allocator_path())
    for name in _C.ALLOCATOR_SYMBOLS.values():
        assert getattr(library, name) is not None
    for path in ("matepoint/_allocator.py", "matepoint/_oom.py"):
        assert not re.search(r"\bmatepoint_(alloc_\w+|malloc|free|init|reset)\b", read(path)), path


def test_tags_are_decoded_by_c() -> None:
    """The tag encoding (region << 2 | phase) is C's alone, in the allocator's
    header: Python gets rows, _C and the torch adapter decode through it."""
    assert not re.search(r">>\s*2|&\s*3\b", read("matepoint/_allocator.py"))
    assert not re.search(r">>\s*2|&\s*3\b", read("csrc/torch_cxx/torch_adapter.cpp"))
    assert "TAG_PHASE_BITS" in read("csrc/alloc/alloc.h")
    assert "TAG_PHASE_BITS" not in read("csrc/base/alloc_link.c")


# ---- sources and build flags ----------------------------------------------------------

def test_every_c_file_is_built_from_the_one_source_list() -> None:
    from matepoint import _build_layout as layout
    on_disk = {os.path.relpath(os.path.join(folder, name), ROOT)
               for folder, _, names in os.walk(os.path.join(ROOT, "csrc"))
               for name in names if name.endswith(".c")}
    built = set(layout.extension_sources(ROOT, testing=True)) | \
        set(layout.allocator_sources(ROOT, testing=True))
    assert built == on_disk
    plain = set(layout.extension_sources(ROOT, testing=False))
    assert not any("testing" in path or "sim" in path for path in plain), plain
    assert os.path.exists(os.path.join(ROOT, layout.OOM_UNIT_SOURCE))


def test_build_files_read_the_layout_instead_of_restating_it() -> None:
    setup, makefile, oom = read("setup.py"), read("Makefile"), read("matepoint/_oom.py")
    for text, name in ((setup, "setup.py"), (makefile, "Makefile"), (oom, "_oom.py")):
        assert "csrc/torch_cxx/oom_raise.cpp" not in text and '"oom_raise.cpp"' not in text, name
        assert "-std=c11" not in text and '"-std=c++17"' not in text, name
    assert "glob(" not in setup and "_build_layout" in setup
    assert "cp matepoint" not in makefile and "_build_layout.py cflags" in makefile


# ---- the typed stub _C.pyi -------------------------------------------------------------

def stub_names() -> tuple:
    """(names of every build, names of test builds only) that _C.pyi declares,
    and its functions by name."""
    import ast
    text = read("matepoint/_C.pyi")
    shipped, test_only = text.split("\n# ---- test builds only")
    test_only = test_only.split("\n", 1)[1]
    functions = {}

    def names(source: str) -> set:
        found = set()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                functions[node.name] = node
                found.add(node.name)
            elif isinstance(node, ast.AnnAssign) and not node.target.id.startswith("_"):
                found.add(node.target.id)
        return found
    return names(shipped), names(test_only), functions


def test_stub_declares_exactly_what_c_defines() -> None:
    shipped, test_only, _ = stub_names()
    defined = {name for name in dir(_C) if not name.startswith("__")}
    expected = shipped | test_only if _C.TEST_BUILD else shipped
    assert defined == expected, (sorted(defined - expected), sorted(expected - defined))


def test_stub_signatures_are_the_c_signatures() -> None:
    import ast
    import inspect
    _, _, functions = stub_names()
    kinds = {"posonlyargs": inspect.Parameter.POSITIONAL_ONLY,
             "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
             "kwonlyargs": inspect.Parameter.KEYWORD_ONLY}
    for name, node in functions.items():
        if not hasattr(_C, name):
            continue
        declared = [(arg.arg, kind) for field, kind in kinds.items()
                    for arg in getattr(node.args, field)]
        if node.args.vararg:
            declared.append((node.args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
        if node.args.kwarg:
            declared.append((node.args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
        order = {kind: i for i, kind in enumerate(inspect._ParameterKind)}
        declared.sort(key=lambda item: order[item[1]])
        actual = [(p.name, p.kind) for p in inspect.signature(getattr(_C, name)).parameters.values()]
        assert declared == actual, name
        assert isinstance(node.returns, ast.AST), f"{name} has no return type"


def test_stub_ships_with_the_package() -> None:
    assert '"*.pyi"' in read("pyproject.toml")
    assert os.path.exists(os.path.join(ROOT, "matepoint", "py.typed"))


# ---- CPython idioms in the C core ---------------------------------------------------------

def c_sources(*folders: str) -> dict:
    found = {}
    for folder in folders:
        for name in sorted(os.listdir(os.path.join(ROOT, "csrc", folder))):
            if name.endswith((".c", ".h")):
                found[f"{folder}/{name}"] = read(f"csrc/{folder}/{name}")
    return found


PYTHON_FOLDERS = ("base", "offload", "checkpoint", "testing", "module")


def test_every_type_allocates_and_frees_through_its_slots() -> None:
    """Heap types get their memory from tp_alloc and give it back with
    tp_free (which pairs with tp_alloc's type reference and GC tracking),
    both read through PyType_GetSlot (csrc/base/compat.h: mp_type_alloc,
    mp_type_free) as the limited C API requires."""
    sources = c_sources(*PYTHON_FOLDERS)
    raw = [path for path, text in sources.items()
           if re.search(r"\bPyObject_(GC_)?(New|NewVar|Del|Free)\b", text)]
    assert not raw, raw
    specs = sum(len(re.findall(r"^PyType_Spec \w+ = ", text, re.M)) for text in sources.values())
    frees = sum(len(re.findall(r"\bmp_type_free\((?!PyTypeObject)", text))
                for text in sources.values())
    assert not any("->tp_free(" in text or "->tp_alloc(" in text for text in sources.values())
    assert specs >= 9 and frees == specs, (specs, frees)


def test_the_module_reaches_its_state_one_way() -> None:
    for path, text in c_sources(*PYTHON_FOLDERS).items():
        if path != "base/state.h":
            assert "PyModule_GetState" not in text and "PyType_GetModuleState" not in text, path


def test_module_declares_interpreters_and_gil() -> None:
    module = read("csrc/module/module.c")
    assert "{Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED}" in module
    assert "{Py_mod_gil, Py_MOD_GIL_USED}" in module


# ---- what `import matepoint` changes ------------------------------------------------------

IMPORT_EFFECTS = """
import logging, sys, warnings, types
import torch
import torch.nn.modules.module as nn_module
import torch.utils.checkpoint as torch_checkpoint
{dynamo}

def snapshot():
    return dict(
        path_hooks=list(sys.path_hooks), torch=dict(vars(torch)),
        checkpoint=dict(vars(torch_checkpoint)), nn=dict(vars(torch.nn)),
        tensor=dict(vars(torch.Tensor)),
        hooks=[dict(getattr(nn_module, name)) for name in dir(nn_module)
               if name.startswith("_global_") and isinstance(getattr(nn_module, name), dict)],
        filters=list(warnings.filters), handlers=list(logging.getLogger().handlers),
        logger_handlers=list(logging.getLogger("matepoint").handlers),
        excepthook=sys.excepthook, trace=sys.gettrace(), profile=sys.getprofile(),
        dtype=torch.get_default_dtype(), grad=torch.is_grad_enabled(),
        torch_module_type=type(torch))

def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a is b or a == b

finders = list(sys.meta_path)
before = snapshot()
import matepoint
after = snapshot()
changed = [name for name in before if not same(before[name], after[name])]
added = [type(f).__name__ for f in sys.meta_path if all(f is not g for g in finders)]
print("changed", changed)
print("added", added)
print("module", type(sys.modules["matepoint"]).__name__)
import torch._dynamo
print("after dynamo", [type(f).__name__ for f in sys.meta_path if all(f is not g for g in finders)])
print("kept", len([f for f in finders if any(f is g for g in sys.meta_path)]) == len(finders))
"""


@pytest.mark.parametrize("dynamo_first", [False, True], ids=["plain", "dynamo-imported-first"])
def test_import_changes_only_what_it_needs(dynamo_first: bool) -> None:
    """torch's namespace, checkpoint module, global hooks, warnings and
    logging stay as they were; sys.meta_path gets one finder, only while
    torch._dynamo is not imported, and loses it once it is."""
    import subprocess
    import sys
    code = IMPORT_EFFECTS.format(dynamo="import torch._dynamo" if dynamo_first else "")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MATEPOINT_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=environ)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "changed []"
    assert lines[1] == ("added []" if dynamo_first else "added ['_AfterDynamoImport']")
    assert lines[2] == "module _Module"
    assert lines[3] == "after dynamo []"
    assert lines[4] == "kept True"


def test_the_finder_leaves_without_disturbing_an_import_in_progress() -> None:
    """Another thread's import walks sys.meta_path while Dynamo is imported:
    the finder's leaving must not make that walk skip a finder."""
    import subprocess
    import sys
    code = """
import sys, torch, matepoint
walk = iter(sys.meta_path)
first = next(walk)            # another import, at the finder...
rest = list(sys.meta_path[1:])
import torch._dynamo           # ...when the finder leaves
print(type(first).__name__, [f for f in walk] == rest)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["_AfterDynamoImport", "True"]


def test_the_adapter_ships_with_every_header_it_includes() -> None:
    """An installed package compiles torch_adapter.cpp from its own copy of
    csrc/: each local header it includes, transitively, must be shipped
    with it (and hashed into the cached build's key). A header is named by
    its path under csrc/ or, in its own folder, by its bare name."""
    from matepoint import _build_layout as layout
    shipped = set(layout.ADAPTER_HEADER_SOURCES)
    seen, todo = set(), [layout.ADAPTER_UNIT_SOURCE]
    while todo:
        path = todo.pop()
        for name in re.findall(r'#include "([^"]+)"', read(path)):
            header = os.path.join("csrc", name) if "/" in name else \
                os.path.join(os.path.dirname(path), name)
            if header not in seen:
                seen.add(header)
                todo.append(header)
    assert seen == shipped, (seen, shipped)
    assert set(layout.RUNTIME_UNIT_SOURCES) >= shipped | {layout.ADAPTER_UNIT_SOURCE}
