"""matepoint.patch_torch_checkpoint: torch's checkpoint runs matepoint's for
libraries imported before the patch and after it, and the undo is exact."""
import functools
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

import matepoint

LIBRARY = textwrap.dedent("""
    import functools
    import torch
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential
    import torch.utils.checkpoint as tuc

    BOUND_AT_IMPORT = functools.partial(checkpoint, use_reentrant={reentrant})

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Tanh())

        def forward(self, x):
            return self.inner(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))
            self.tail = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())

        def forward(self, x):
            x = checkpoint(self.blocks[0], x, use_reentrant={reentrant})   # name bound at import
            x = tuc.checkpoint(self.blocks[1], x, use_reentrant={reentrant})  # attribute
            x = BOUND_AT_IMPORT(self.blocks[2], x)                         # partial made earlier
            x = self.blocks[3](x)
            return checkpoint_sequential(self.tail, 2, x, use_reentrant={reentrant})
""")


def load(tmp_path, name, reentrant=False):
    (tmp_path / f"{name}.py").write_text(LIBRARY.format(reentrant=reentrant))
    sys.path.insert(0, str(tmp_path))
    try:
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def run(module, counter):
    """Two steps; losses and the last gradients; matepoint's recomputes counted."""
    torch.manual_seed(0)
    model = module.Model()
    for block in model.modules():
        if isinstance(block, nn.Linear):
            block.register_forward_hook(counter)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(2):
        torch.manual_seed(10 + step)
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
        optimizer.step()
    return losses, [p.grad.clone() for p in model.parameters()]


class Recomputes:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self, *args) -> None:
        self.count += matepoint.is_recomputing()


def assert_same(a, b) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def originals():
    return [(f, f.__code__) for f in (torch_checkpoint.checkpoint,
                                      torch_checkpoint.checkpoint.__wrapped__,
                                      torch_checkpoint.checkpoint_sequential)]


def test_libraries_imported_before_and_after_the_patch(tmp_path) -> None:
    before = load(tmp_path, "lib_before")
    torch_counts = Recomputes()
    expected = run(before, torch_counts)              # torch's own checkpointing
    assert torch_counts.count == 0
    saved = originals()
    signatures = [inspect.signature(f) for f, _ in saved]
    with matepoint.patch_torch_checkpoint() as patch:
        assert matepoint.torch_checkpoint_patched() and patch.active
        after = load(tmp_path, "lib_after")
        for module in (before, after):
            counts = Recomputes()
            assert_same(expected, run(module, counts))
            # blocks 0-2 (one Linear each) and the first segment of the tail, per step
            assert counts.count == 2 * (3 + 1)
        assert [inspect.signature(f) for f, _ in saved] == signatures
    assert not matepoint.torch_checkpoint_patched()
    assert all(f.__code__ is code for f, code in saved)
    counts = Recomputes()
    assert_same(expected, run(after, counts))         # after the undo: torch's again
    assert counts.count == 0


def test_use_reentrant_true_from_a_library_works_and_warns_once(tmp_path) -> None:
    library = load(tmp_path, "lib_reentrant", reentrant=True)
    expected = run(load(tmp_path, "lib_plain"), Recomputes())   # non-reentrant torch
    matepoint._patch._warned_reentrant = False
    with matepoint.patch_torch_checkpoint():
        counts = Recomputes()
        with pytest.warns(UserWarning, match=r"use_reentrant=True\) runs matepoint") as caught:
            got = run(library, counts)
    assert_same(expected, got)
    assert counts.count == 8
    assert len([w for w in caught if "use_reentrant" in str(w.message)]) == 1
    assert caught[0].filename == str(tmp_path / "lib_reentrant.py")  # names the library's call


def test_nesting_counts_and_unpatch_without_patch_is_an_error() -> None:
    saved = originals()
    outer = matepoint.patch_torch_checkpoint()
    with matepoint.patch_torch_checkpoint() as inner:
        pass
    assert not inner.active and matepoint.torch_checkpoint_patched()
    inner.undo()                                       # a second undo does nothing
    assert matepoint.torch_checkpoint_patched()
    matepoint.unpatch_torch_checkpoint()
    assert not outer.active and not matepoint.torch_checkpoint_patched()
    assert all(f.__code__ is code for f, code in saved)
    with pytest.raises(RuntimeError, match="not patched"):
        matepoint.unpatch_torch_checkpoint()


def test_errors_and_no_grad_under_the_patch() -> None:
    x = torch.randn(3, requires_grad=True)
    with matepoint.patch_torch_checkpoint():
        with pytest.raises(ZeroDivisionError):
            torch_checkpoint.checkpoint(lambda t: 1 / 0, x, use_reentrant=False)
        with torch.no_grad():
            assert torch.equal(torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=False),
                               torch.sin(x))
        with pytest.raises(TypeError, match="function must be callable"):
            torch_checkpoint.checkpoint(3, x, use_reentrant=False)
    assert not matepoint.torch_checkpoint_patched()


@pytest.mark.skipif(inspect.signature(torch_checkpoint.checkpoint).parameters["function"].default
                    is inspect.Parameter.empty, reason="torch before 2.14 has no curried form")
def test_curried_form_of_torch_214() -> None:
    x = torch.randn(3, requires_grad=True)
    seen = []

    def fn(t, scale):
        seen.append(matepoint.is_recomputing())
        return t.sin() * scale

    with matepoint.patch_torch_checkpoint():
        wrapped = torch_checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=False)(fn)
        wrapped(x, scale=2).sum().backward()
        with pytest.raises(ValueError, match="Unexpected keyword arguments: bogus"):
            torch_checkpoint.checkpoint(use_reentrant=False, bogus=1)
    assert seen == [False, True]
    assert torch.equal(x.grad, 2 * x.detach().cos())
    assert wrapped.__name__ == "fn"


@pytest.mark.parametrize("graph_break", [True, False], ids=["graph-break", "traced"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_region_with_a_graph_break_runs_matepoint(backend, graph_break) -> None:
    # Dynamo cannot trace a region with a graph break as torch's checkpoint op and
    # calls torch's checkpoint eagerly: under the patch that is matepoint's,
    # which Dynamo must run untraced, as it runs torch's (issue 35 item 2).
    # A region it can trace stays torch's compiled checkpoint (README).
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    recomputes = Recomputes()

    def block(t):
        if graph_break:
            recomputes()
            torch._dynamo.graph_break()
        return lin(t)

    def step():
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        compiled(x).sum().backward()
        found = [x.grad, lin.weight.grad.clone(), lin.bias.grad.clone()]
        lin.zero_grad(set_to_none=True)
        return found

    compiled = torch.compile(lambda x: torch_checkpoint.checkpoint(
        block, x.cos(), use_reentrant=False).sin(), backend=backend)
    try:
        expected = step()                                 # torch's checkpoint
        assert recomputes.count == 0
        counters.clear()
        with matepoint.patch_torch_checkpoint():
            got = step()
        assert recomputes.count == (1 if graph_break else 0)
        # traced: one graph, torch's checkpoint op in it, nothing called eagerly
        assert graph_break or not counters["graph_break"]
    finally:
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


class Layers:
    """A user's sequence: only len() and [index], as torch's checkpoint_sequential uses."""

    def __init__(self, modules) -> None:
        self.modules = list(modules)

    def __len__(self) -> int:
        return len(self.modules)

    def __getitem__(self, index):
        return self.modules[index]


def sequential_layers():
    torch.manual_seed(0)
    return [nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.ReLU()]


@pytest.mark.parametrize("container", [nn.ModuleList, lambda m: nn.Sequential(*m), list, tuple,
                                       Layers],
                         ids=["ModuleList", "Sequential", "list", "tuple", "a-sequence"])
@pytest.mark.parametrize("segments", [2, 3, np.int64(2), torch.tensor(3)], ids=str)
def test_checkpoint_sequential_takes_what_torch_takes(container, segments) -> None:
    # torch's own test_checkpoint_module_list, plus every sequence torch's takes
    # (issue 35 item 3); the same under the patch
    layers = sequential_layers()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def grads(run):
        out = run(container(layers), segments, x)
        out.sum().backward()
        found = [out.detach(), x.grad.clone()] + [p.grad.clone() for m in layers
                                                  for p in m.parameters()]
        x.grad = None
        for module in layers:
            module.zero_grad(set_to_none=True)
        return found

    counter = Recomputes()
    hooks = [m.register_forward_hook(counter) for m in layers]
    expected = grads(functools.partial(torch_checkpoint.checkpoint_sequential,
                                       use_reentrant=False))
    assert counter.count == 0
    got = grads(matepoint.checkpoint_sequential)
    direct = counter.count
    with matepoint.patch_torch_checkpoint():
        patched = grads(functools.partial(torch_checkpoint.checkpoint_sequential,
                                          use_reentrant=False))
    for handle in hooks:
        handle.remove()
    assert direct > 0 and counter.count == 2 * direct      # matepoint's recomputes, twice
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert all(torch.equal(a, b) for a, b in zip(expected, patched))


@pytest.mark.parametrize("functions,segments,kwargs", [
    ((f for f in sequential_layers()), 2, {}),        # no len(): TypeError
    ([nn.ReLU(), 3], 1, {}),                          # an element not callable: TypeError
    (nn.ModuleDict({"a": nn.ReLU()}), 1, {}),          # [0] of a ModuleDict: KeyError
    (sequential_layers(), 7, {}),                     # more segments than functions
    ([], 1, {}),                                      # nothing to run: ValueError
    (sequential_layers(), 1.5, {}),                   # not an int: TypeError
    (sequential_layers(), 2, {"bogus": 1}),           # Unexpected keyword arguments
], ids=["generator", "not-callable", "module-dict", "too-many", "empty", "float", "keyword"])
def test_checkpoint_sequential_raises_where_torch_raises(functions, segments, kwargs) -> None:
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(Exception) as theirs:
        torch_checkpoint.checkpoint_sequential(functions, segments, x, use_reentrant=False,
                                               **kwargs)
    with pytest.raises(Exception) as ours:
        matepoint.checkpoint_sequential(functions, segments, x, **kwargs)
    assert ours.type is theirs.type
    assert "checkpoint_sequential" in str(ours.value) or ours.type is KeyError or \
        str(ours.value) == str(theirs.value)


# a worker module that never imports matepoint: only the patch can bring it
WORKER = textwrap.dedent("""
    import sys
    import torch
    import torch.utils.checkpoint as tuc

    def work(rank, out):
        counted = []

        def block(t):
            mp = sys.modules.get("matepoint")
            counted.append(bool(mp is not None and mp.is_recomputing()))
            return torch.tanh(t * (rank + 1))

        x = torch.randn(3, requires_grad=True)
        tuc.checkpoint(block, x, use_reentrant=False).sum().backward()
        with open(f"{out}/{rank}", "w") as handle:
            handle.write(str(sum(counted)))
""")


def spawn_workers(tmp_path, patched: bool) -> list:
    import torch.multiprocessing as torch_mp

    (tmp_path / "mp_worker.py").write_text(WORKER)
    out = tmp_path / ("patched" if patched else "plain")
    out.mkdir()
    sys.path.insert(0, str(tmp_path))          # the children get the parent's sys.path
    try:
        import mp_worker
        if patched:
            with matepoint.patch_torch_checkpoint():
                torch_mp.spawn(mp_worker.work, args=(str(out),), nprocs=2)
        else:
            torch_mp.spawn(mp_worker.work, args=(str(out),), nprocs=2)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mp_worker", None)
    return [int((out / str(rank)).read_text()) for rank in range(2)]


def test_spawned_workers_get_the_patch(tmp_path, monkeypatch) -> None:
    # issue 35 item 4: mp.spawn (and Lightning's ddp_spawn, through
    # torch.multiprocessing.start_processes) under the patch ran torch's checkpoint
    monkeypatch.delenv(matepoint._patch.ENVIRONMENT, raising=False)
    saved = originals()
    assert spawn_workers(tmp_path, patched=False) == [0, 0]
    assert spawn_workers(tmp_path, patched=True) == [1, 1]   # one recompute each
    assert matepoint._patch.ENVIRONMENT not in os.environ    # taken back with the patch
    assert all(f.__code__ is code for f, code in saved)


def test_the_environment_variable_patches_at_import_and_while_patched(monkeypatch) -> None:
    variable = matepoint._patch.ENVIRONMENT
    monkeypatch.delenv(variable, raising=False)
    with matepoint.patch_torch_checkpoint():
        assert os.environ[variable] == "1"                   # inherited by children
        with matepoint.patch_torch_checkpoint():
            pass
        assert os.environ[variable] == "1"
    assert variable not in os.environ
    script = ("import matepoint, torch.utils.checkpoint as t; "
              "print(matepoint.torch_checkpoint_patched(), t.checkpoint.__code__.co_filename)")
    for value, expected in (("1", "True <matepoint.patch_torch_checkpoint>"),
                            ("0", "False")):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                env={**os.environ, variable: value}, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.startswith(expected)
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(ValueError, match=r"MATEPOINT_PATCH_TORCH_CHECKPOINT='maybe': expected "
                                         r"one of 1/0"):
        matepoint._patch.patch_from_environment()
    assert not matepoint.torch_checkpoint_patched()


def test_a_patch_that_cannot_reach_spawned_children_warns(monkeypatch) -> None:
    import torch.multiprocessing as torch_mp

    monkeypatch.setenv(matepoint._patch.ENVIRONMENT, "0")   # the user's explicit no
    with matepoint.patch_torch_checkpoint():
        with pytest.warns(UserWarning, match=r"MATEPOINT_PATCH_TORCH_CHECKPOINT='0': the "
                                             r"processes started with 'spawn' run torch's") as w:
            torch_mp.spawn(print, nprocs=0)                  # starts nothing
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch_mp.start_processes(print, nprocs=0, start_method="fork")  # inherits it
    assert w[0].filename == __file__
    assert os.environ[matepoint._patch.ENVIRONMENT] == "0"
