"""Every public function meets wrong types, wrong values, calls in the wrong
order and double calls: a TypeError, ValueError or RuntimeError in one
wording (``matepoint.<function>: <argument> must be <what>, got <what>``),
and nothing left patched, hooked, installed or changed after it."""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

import matepoint
from matepoint._allocator import is_installed
from matepoint._planning.planner import BlockProfile, Plan, solve


class Layer(nn.Module):
    """A layer following Hugging Face's checkpointing convention."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.gradient_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(self.linear, x)
        return self.linear(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def deprecated_enable(**kwargs: Any) -> Any:
    """``enable(model, budget_bytes=...)``, deprecated: it warns naming apply."""
    with pytest.warns(FutureWarning, match="use matepoint.apply"):
        return matepoint.enable(Model(), **kwargs)


def a_function(x: Any) -> Any:
    return x


def sample_plan() -> Plan:
    profile = BlockProfile(1e-3, 2e-3, 1e-4, 4096, 8192, 4096, 1024, 1024)
    return solve([profile] * 3, 1 << 20, 1024, True)


def chain() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def torch_codes() -> Tuple[Any, ...]:
    function = torch_checkpoint.checkpoint
    codes = []
    while function is not None:
        codes.append(function.__code__)
        function = getattr(function, "__wrapped__", None)
    return tuple(codes) + (torch_checkpoint.checkpoint_sequential.__code__,)


def forwards(model: nn.Module) -> List[Any]:
    """What each module runs as forward and the hooks it has: enable, apply
    and checkpoint_module change these."""
    return [(m.__dict__.get("forward"), dict(m._forward_pre_hooks), dict(m._forward_hooks),
             m.__dict__.get("_matepoint_enabled"), m.__dict__.get("_matepoint_planner"),
             getattr(m, "gradient_checkpointing", None)) for m in model.modules()]


@pytest.fixture(autouse=True)
def nothing_changes():
    """After every case: torch's checkpoint is torch's own, options as they
    were, no saved-tensor hook, no allocator installed."""
    codes, options = torch_codes(), matepoint.options
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    yield
    assert not matepoint.torch_checkpoint_patched()
    assert torch_codes() == codes, "torch's checkpoint was left patched"
    assert matepoint.options == options
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks
    assert not is_installed()


def said(function: str, argument: str, accepted: str, got: str) -> str:
    """The one wording, as a regular expression."""
    return (re.escape(f"matepoint.{function}: {argument} must be ") + accepted
            + re.escape(", got ") + got)


MODULE = r"a torch\.nn\.Module instance"
LINEAR = r"the class torch\.nn\.modules\.linear\.Linear"


# (case id, call, error, message pattern); each call gets a fresh model
def wrong_types() -> List[Tuple[str, Callable[[], Any], type, str]]:
    cases: List[Tuple[str, Callable[[], Any], type, str]] = []
    for name, function in [("enable", matepoint.enable), ("disable", matepoint.disable),
                           ("planned", matepoint.planned),
                           ("checkpoint_module", matepoint.checkpoint_module),
                           ("uncheckpoint_module", matepoint.uncheckpoint_module)]:
        cases += [
            (f"{name}(None)", lambda f=function: f(None), TypeError,
             said(name, "model" if name in ("enable", "disable", "planned") else "module",
                  MODULE, "None")),
            (f"{name}(nn.Linear)", lambda f=function: f(nn.Linear), TypeError,
             said(name, "model" if name in ("enable", "disable", "planned") else "module",
                  MODULE, LINEAR)),
            (f"{name}(a_function)", lambda f=function: f(a_function), TypeError,
             said(name, "model" if name in ("enable", "disable", "planned") else "module",
                  MODULE, "the function a_function")),
        ]
    cases += [
        ("apply(None)", lambda: matepoint.apply(None, 1 << 20), TypeError,
         said("apply", "model", MODULE, "None")),
        ("apply(nn.Linear)", lambda: matepoint.apply(nn.Linear, 1 << 20), TypeError,
         said("apply", "model", MODULE, LINEAR)),
        ("apply budget text", lambda: matepoint.apply(Model(), "1GB"), TypeError,
         said("apply", "budget_bytes", r"an int from 1 to 2\*\*63 - 1", "'1GB'")),
        ("apply check_fn int", lambda: matepoint.apply(Model(), 1 << 20, check_fn=3), TypeError,
         said("apply", "check_fn", ".*", "3")),
        ("apply pipeline text", lambda: matepoint.apply(Model(), 1 << 20, pipeline="yes"),
         TypeError, said("apply", "pipeline", "a bool or None", "'yes'")),
        ("enable budget float", lambda: deprecated_enable(budget_bytes=1e6), TypeError,
         said("enable", "budget_bytes", r"an int from 1 to 2\*\*63 - 1", "1000000.0")),
        ("plan(None)", lambda: matepoint.plan(None, torch.randn(2, 4), budget_bytes=1 << 20),
         TypeError, said("plan", "blocks", ".*", "NoneType")),
        ("Plan.apply(3)", lambda: sample_plan().apply(3), TypeError,
         said("Plan.apply", "blocks", ".*", "int")),
        ("Plan.save(None)", lambda: sample_plan().save(None), TypeError,
         said("Plan.save", "path", ".*", "NoneType")),
        ("Plan.load(3)", lambda: Plan.load(3), TypeError, said("Plan.load", "path", ".*", "int")),
        ("Plan.frontier('3')", lambda: sample_plan().frontier("3"), TypeError,
         said("Plan.frontier", "max_points", ".*", "'3'")),
        ("Plan.table(1)", lambda: sample_plan().table(1), TypeError, "positional argument"),
        ("Plan.rows(1)", lambda: sample_plan().rows(1), TypeError, "positional argument"),
        ("reserve_pool('1024')", lambda: matepoint.reserve_pool("1024"), TypeError,
         said("reserve_pool", "buffer_bytes", ".*", "'1024'")),
        ("set_options(offload=1)", lambda: matepoint.set_options(offload=1), TypeError,
         "matepoint option offload must be a bool, got 1"),
        ("set_options(bogus=1)", lambda: matepoint.set_options(bogus=1), TypeError,
         "unknown matepoint option"),
        ("memory_stats('0')", lambda: matepoint.memory_stats("0"), TypeError,
         said("memory_stats", "device", ".*", "'0'")),
        ("memory_report(1.5)", lambda: matepoint.memory_report(1.5), TypeError,
         said("memory_report", "device", ".*", "1.5")),
        ("memory_stats(None)", lambda: matepoint.memory_stats(None), TypeError,
         said("memory_stats", "device", ".*", "None")),
    ]
    for function in (matepoint.patch_torch_checkpoint, matepoint.unpatch_torch_checkpoint,
                     matepoint.torch_checkpoint_patched, matepoint.TorchCheckpointPatch,
                     matepoint.install_allocator, matepoint.pool_stats, matepoint.empty_pool,
                     matepoint.is_recomputing, matepoint.reset_peak_memory_stats,
                     matepoint.empty_cache):
        cases.append((f"{function.__name__}(1)", lambda f=function: f(1), TypeError,
                      r"takes (no arguments|0 positional arguments|1 positional argument)"))
    return cases


def wrong_values() -> List[Tuple[str, Callable[[], Any], type, str]]:
    return [
        ("set_options(prefetch_depth=2**62)", lambda: matepoint.set_options(prefetch_depth=2**62),
         ValueError, re.escape("option prefetch_depth must be at most 2**31 - 1 (an int from 0 "
                               "to 2**31 - 1), got 4611686018427387904")),
        ("set_options(min_offload_bytes=2**63)",
         lambda: matepoint.set_options(min_offload_bytes=2**63), ValueError,
         re.escape("option min_offload_bytes must be at most 2**63 - 1")),
        ("set_options(pool_limit_bytes=2**80)",
         lambda: matepoint.set_options(pool_limit_bytes=2**80), ValueError,
         re.escape("option pool_limit_bytes must be at most 2**63 - 1")),
        ("set_options(prefetch_depth=-1)", lambda: matepoint.set_options(prefetch_depth=-1),
         ValueError, re.escape("option prefetch_depth must be positive or zero (an int from 0")),
        ("apply budget 0", lambda: matepoint.apply(Model(), 0), ValueError,
         said("apply", "budget_bytes", r"an int from 1 to 2\*\*63 - 1", "0")),
        ("apply repeats 0", lambda: matepoint.apply(Model(), 1 << 20, repeats=0), ValueError,
         said("apply", "repeats", ".*", "0")),
        ("enable budget -1", lambda: deprecated_enable(budget_bytes=-1), ValueError,
         said("enable", "budget_bytes", ".*", "-1")),
        ("enable unit_bytes without budget", lambda: matepoint.enable(Model(), unit_bytes=1024),
         ValueError, "matepoint.enable: unit_bytes and repeats need budget_bytes"),
        ("plan([])", lambda: matepoint.plan([], torch.randn(2, 4), budget_bytes=1 << 20),
         ValueError, said("plan", "blocks", "a non-empty .*", "an empty list")),
        ("plan without tensors", lambda: matepoint.plan(chain(), 3, budget_bytes=1 << 20),
         ValueError, said("plan", "sample_inputs", ".*", "no tensor")),
        ("plan budget 2**80", lambda: matepoint.plan(chain(), torch.randn(2, 4),
                                                     budget_bytes=2**300),
         ValueError, said("plan", "budget_bytes", ".*", "an int of 301 bits")),
        ("Plan.apply too few", lambda: sample_plan().apply([nn.Tanh()]), ValueError,
         said("Plan.apply", "blocks", r"those planned \(the plan is for 3 blocks\)", "1")),
        ("Plan.frontier(0)", lambda: sample_plan().frontier(0), ValueError,
         said("Plan.frontier", "max_points", ".*", "0")),
        ("reserve_pool(0)", lambda: matepoint.reserve_pool(0), ValueError,
         said("reserve_pool", "buffer_bytes", ".*", "0")),
        ("memory_stats(-1)", lambda: matepoint.memory_stats(-1), ValueError,
         said("memory_stats", "device", ".*", "-1")),
        ("memory_stats('cpu')", lambda: matepoint.memory_stats("cpu"), ValueError,
         said("memory_stats", "device", ".*", "'cpu'")),
        ("memory_report(cpu)", lambda: matepoint.memory_report(torch.device("cpu")), ValueError,
         said("memory_report", "device", ".*", "a device")),
    ]


def wrong_order() -> List[Tuple[str, Callable[[], Any], type, str]]:
    def enter_unapplied() -> None:
        with matepoint.TorchCheckpointPatch():
            pass

    def enter_undone() -> None:
        patch = matepoint.patch_torch_checkpoint()
        patch.undo()
        with patch:
            pass

    def uncheckpoint_twice() -> None:
        block = chain()
        matepoint.checkpoint_module(block)
        matepoint.uncheckpoint_module(block)
        matepoint.uncheckpoint_module(block)

    def replaced_since() -> None:
        block = chain()
        matepoint.checkpoint_module(block)
        block.forward = a_function
        matepoint.uncheckpoint_module(block)

    return [
        ("with TorchCheckpointPatch()", enter_unapplied, RuntimeError,
         r"matepoint.TorchCheckpointPatch: this patch is not in force"),
        ("with an undone patch", enter_undone, RuntimeError,
         r"matepoint.TorchCheckpointPatch: this patch is not in force"),
        ("unpatch_torch_checkpoint() unpatched", matepoint.unpatch_torch_checkpoint, RuntimeError,
         r"matepoint.unpatch_torch_checkpoint: torch's checkpoint is not patched"),
        ("uncheckpoint_module never", lambda: matepoint.uncheckpoint_module(chain()),
         RuntimeError, r"matepoint.uncheckpoint_module: this Sequential is not checkpointed"),
        ("uncheckpoint_module twice", uncheckpoint_twice, RuntimeError, "is not checkpointed"),
        ("uncheckpoint_module replaced since", replaced_since, RuntimeError,
         "forward was replaced since"),
        ("memory_stats before install_allocator", lambda: matepoint.memory_stats("cuda:0"),
         RuntimeError, "allocator is not installed"),
        ("memory_report before install_allocator",
         lambda: matepoint.memory_report(torch.device("cuda", 0)), RuntimeError,
         "allocator is not installed"),
        ("reset_peak_memory_stats before install_allocator", matepoint.reset_peak_memory_stats,
         RuntimeError, "allocator is not installed"),
        ("empty_cache before install_allocator", matepoint.empty_cache, RuntimeError,
         "allocator is not installed"),
    ]


CASES = wrong_types() + wrong_values() + wrong_order()


@pytest.mark.parametrize("call,error,pattern", [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_bad_call_raises_and_changes_nothing(call: Callable[[], Any], error: type,
                                             pattern: str) -> None:
    with pytest.raises(error, match=pattern) as raised:
        call()
    assert type(raised.value) is error, f"{type(raised.value).__name__}: {raised.value}"


@pytest.mark.parametrize("function", [matepoint.enable, matepoint.disable, matepoint.apply,
                                      matepoint.checkpoint_module,
                                      matepoint.uncheckpoint_module])
def test_a_refused_argument_leaves_the_model_as_it_was(function) -> None:
    model = Model()
    before = forwards(model)
    bad = {"budget_bytes": -1} if function in (matepoint.enable, matepoint.apply) else \
        {"use_reentrent": False}
    deprecated = pytest.warns(FutureWarning, match="use matepoint.apply") \
        if function is matepoint.enable else contextlib.nullcontext()
    with pytest.raises((TypeError, ValueError, RuntimeError)), deprecated:
        if function is matepoint.uncheckpoint_module:
            function(model)
        else:
            function(model, **bad)
    assert forwards(model) == before


def test_refused_enable_keeps_the_previous_one() -> None:
    model = matepoint.enable(Model(), preserve_rng_state=False)
    before = forwards(model)
    with pytest.raises(ValueError, match="matepoint.enable: budget_bytes"), \
            pytest.warns(FutureWarning, match="matepoint.apply"):
        matepoint.enable(model, budget_bytes=0)
    assert forwards(model) == before
    matepoint.disable(model)


def test_checkpoint_module_twice_keeps_the_first_options() -> None:
    block = chain()
    matepoint.checkpoint_module(block, preserve_rng_state=False)
    first = block.forward
    with pytest.raises(RuntimeError, match="matepoint.checkpoint_module: this Sequential is "
                       "already checkpointed"):
        matepoint.checkpoint_module(block, preserve_rng_state=True)
    assert block.forward is first and first.options == {"preserve_rng_state": False}
    matepoint.uncheckpoint_module(block)
    assert "forward" not in block.__dict__


def test_undoing_a_patch_never_applied_does_nothing() -> None:
    patch = matepoint.TorchCheckpointPatch()
    patch.undo()
    patch.undo()
    held = matepoint.patch_torch_checkpoint()
    matepoint.TorchCheckpointPatch().undo()    # must not undo the one in force
    assert matepoint.torch_checkpoint_patched()
    held.undo()


def test_double_calls() -> None:
    """Calls that may be repeated: each undo matches one do; a second undo
    of the same patch, a second enable or disable, a second apply."""
    first, second = matepoint.patch_torch_checkpoint(), matepoint.patch_torch_checkpoint()
    first.undo()
    first.undo()
    assert matepoint.torch_checkpoint_patched()
    matepoint.unpatch_torch_checkpoint()
    assert not matepoint.torch_checkpoint_patched() and not second.active
    with pytest.raises(RuntimeError, match="not patched"):
        matepoint.unpatch_torch_checkpoint()

    model = Model()
    matepoint.disable(model)    # never enabled: no error, nothing added
    assert model._forward_pre_hooks == {}
    matepoint.enable(matepoint.enable(model))
    assert len(model._forward_pre_hooks) == 1
    matepoint.disable(matepoint.disable(model))
    assert model._forward_pre_hooks == {} and "_matepoint_enabled" not in model.__dict__

    depth = matepoint.options.prefetch_depth
    assert matepoint.set_options(prefetch_depth=depth) == matepoint.set_options(
        prefetch_depth=depth)
    matepoint.empty_pool()
    matepoint.empty_pool()
    assert matepoint.pool_stats()["blocks_in_use"] == 0

    # blocks picked by check_fn: their forward replaced on the instance
    picked = lambda m: isinstance(m, Layer)  # noqa: E731
    matepoint.apply(matepoint.apply(model, 1 << 20, picked), 1 << 20, picked)
    layer = model.layers[0]
    assert layer.__dict__["forward"].previous is None, "a second apply nested the first"
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1

    # layers of the transformers convention, planned through it: one
    # planner, one guard hook
    model = Model()
    matepoint.apply(matepoint.apply(model, 1 << 20), 1 << 20)
    assert "forward" not in model.layers[0].__dict__
    assert len(model._forward_pre_hooks) == 2 and len(model._forward_hooks) == 1


def test_planned_before_and_after() -> None:
    model = Model()
    assert matepoint.planned(model) is None
    matepoint.apply(model, 1 << 20)
    assert matepoint.planned(model) is None    # nothing solved before two training steps


def test_accepts_what_torch_accepts_for_a_device() -> None:
    """torch.cuda.memory_stats takes an index, a torch.device or 'cuda:N':
    so does memory_stats (here refused only because no allocator is in)."""
    for device in (0, "cuda", "cuda:1", torch.device("cuda", 1)):
        with pytest.raises(RuntimeError, match="allocator is not installed"):
            matepoint.memory_stats(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="would install the allocator")
def test_install_allocator_without_cuda_installs_nothing() -> None:
    for _ in range(2):
        with pytest.raises(RuntimeError, match="matepoint.install_allocator: CUDA is not "
                           "available"):
            matepoint.install_allocator()
    assert not is_installed()


def test_errors_show_what_they_got_briefly() -> None:
    with pytest.raises(TypeError) as raised:
        matepoint.planned(torch.zeros(10_000))
    assert str(raised.value) == ("matepoint.planned: model must be a torch.nn.Module "
                                 "instance, got a Tensor")
