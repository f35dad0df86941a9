"""No reference to matepoint._C's type objects leaks per object.

Every C type of ``_C`` is a heap type: each instance holds one reference to
its type, taken by ``tp_alloc`` and given back by ``tp_dealloc``. An extra
``Py_INCREF(type)`` in a constructor leaks one reference per object, which
shows as a type refcount growing with every checkpoint step.
"""
from __future__ import annotations

import gc
import sys
from typing import Callable, Dict, Set

import pytest
import torch

import matepoint
from matepoint import _C

STEPS = 1000
# types every checkpoint step creates instances of (the offload path's own
# types are checked where the offload path runs)
CORE = {"_Frame", "_Holder", "_RecomputeHook", "_TreeSlot", "_TreeNode", "_StopRecomputation"}
OFFLOAD = {"_StorageCopy", "_TensorRecord", "_OffloadGroup", "_OffloadPacker"}


def c_types() -> Dict[str, type]:
    """Every type object ``_C`` holds: those in its module state (reached
    through the module's GC traversal) and those in its namespace."""
    held = [o for o in gc.get_referents(_C) if isinstance(o, type)]
    held += [v for v in vars(_C).values() if isinstance(v, type)]
    return {t.__name__: t for t in held if t.__module__ == "matepoint._C"}


def region(x, pair, *, scale):
    """Saves tensors (holders), takes a nested argument (a template node)."""
    (a, table) = pair
    return ((x * scale).sin() * a.exp() + table["b"].tanh()).exp()


def step(make: Callable[[], tuple], early_stop: bool) -> None:
    x, a, b, scale = make()
    out = matepoint.checkpoint(region, x, [a, {"b": b}], scale=scale, early_stop=early_stop)
    out.sum().backward()


def matepoint_objects(roots: list) -> Set[type]:
    """Types of matepoint._C objects reachable from ``roots`` through
    matepoint objects and the lists, tuples and dicts they hold."""
    seen, types, todo = set(), set(), list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if type(obj).__module__ == "matepoint._C":
            types.add(type(obj))
            todo.extend(gc.get_referents(obj))
        elif isinstance(obj, (list, tuple, dict)):
            todo.extend(gc.get_referents(obj))
    return types


def reachable_types(make: Callable[[], tuple]) -> Set[type]:
    """Types of the objects one checkpoint step lets Python reach: the frame
    (the pack hook inside the region), what it holds (argument templates,
    offload records), what holds it (its holders), and the recompute's
    hook."""
    hooks = []

    def probed(*args, **kwargs):
        hooks.append(torch._C._autograd._top_saved_tensors_default_hooks(False)[0])
        return region(*args, **kwargs)

    x, a, b, scale = make()
    out = matepoint.checkpoint(probed, x, [a, {"b": b}], scale=scale)
    frame = hooks[0]
    holders = [r for r in gc.get_referrers(frame) if type(r).__module__ == "matepoint._C"]
    found = matepoint_objects([frame, *holders])
    out.sum().backward()
    found |= matepoint_objects(hooks[1:])
    return found


def dense() -> tuple:
    return (torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True),
            torch.randn(4), torch.tensor(1.5))


def steps(make: Callable[[], tuple]) -> Callable[[], None]:
    def run() -> None:
        step(make, early_stop=True)
        step(make, early_stop=False)
    return run


def reference_growth(run: Callable[[], None], count: int = STEPS) -> Dict[str, int]:
    """How many references each ``_C`` type gained over ``count`` runs."""
    types = c_types()
    for _ in range(10):   # warm-up: lazily created module objects exist
        run()
    gc.collect()
    before = {name: sys.getrefcount(t) for name, t in types.items()}
    for _ in range(count):
        run()
    gc.collect()
    return {name: sys.getrefcount(t) - before[name] for name, t in types.items()}


def test_every_c_type_is_enumerated() -> None:
    """The enumeration the leak tests rely on finds each type a step
    creates, so none escapes the check."""
    types = c_types()
    assert CORE <= set(types), sorted(types)
    reached = reachable_types(dense)
    assert reached <= set(types.values())
    assert {"_Frame", "_Holder", "_RecomputeHook", "_TreeSlot", "_TreeNode"} <= \
        {t.__name__ for t in reached}


def test_no_type_reference_leaks_over_many_steps() -> None:
    growth = reference_growth(steps(dense))
    assert {name: n for name, n in growth.items() if n > 0} == {}


def sparse() -> tuple:
    x = torch.randn(4, 4).to_sparse().requires_grad_(True)
    return x, torch.randn(4, 4, requires_grad=True), torch.randn(4, 4), torch.tensor(1.5)


def sparse_region(x, pair, *, scale):
    (a, table) = pair
    return (torch.sparse.mm(x, a * scale).sin() + table["b"].tanh()).exp()


def test_no_type_reference_leaks_with_sparse_inputs() -> None:
    """Sparse inputs are never offloaded: the frames keep them as they are."""
    def run() -> None:
        x, a, b, scale = sparse()
        out = matepoint.checkpoint(sparse_region, x, [a, {"b": b}], scale=scale)
        out.sum().backward()
        assert x.grad is not None

    growth = reference_growth(run)
    assert {name: n for name, n in growth.items() if n > 0} == {}


def offloaded_inputs() -> tuple:
    """Inputs the offload fixture sends through the offload path."""
    return (torch.randn(256, requires_grad=True), torch.randn(256, requires_grad=True),
            torch.randn(256), torch.tensor(1.5))


def test_core_types_do_not_leak_while_offloading(offload) -> None:
    before = matepoint.pool_stats()["hits"] + matepoint.pool_stats()["misses"]
    growth = reference_growth(steps(offloaded_inputs))
    assert matepoint.pool_stats()["hits"] + matepoint.pool_stats()["misses"] > before, \
        "nothing went through the offload path"
    assert {name: n for name, n in growth.items() if name not in OFFLOAD and n > 0} == {}


def test_offload_types_do_not_leak(offload) -> None:
    types = c_types()
    reached = {t.__name__ for t in reachable_types(offloaded_inputs)}
    assert {"_OffloadGroup", "_TensorRecord", "_StorageCopy"} <= reached
    growth = reference_growth(steps(offloaded_inputs))
    assert {name: growth[name] for name in OFFLOAD & set(types) if growth[name] > 0} == {}
