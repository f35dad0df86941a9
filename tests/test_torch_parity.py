"""matepoint behaves like torch's non-reentrant checkpoint where torch's own
tests look: saved tensors keep their identity, and the CheckpointErrors
torch raises start with torch's sentence for each case."""
from __future__ import annotations

import re
from typing import Callable, List

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tc

import matepoint
from conftest import ReadsSavedTwice, assert_bitwise_equal


def torch_checkpoint(fn: Callable, *args, **kwargs):
    return tc.checkpoint(fn, *args, use_reentrant=False, **kwargs)


CHECKPOINTS = {"torch": torch_checkpoint, "matepoint": matepoint.checkpoint}


# ---- saved tensors that do not require grad come back as themselves ------

class SavesBoth(torch.autograd.Function):
    """x @ w * w.scale, saving x and w; backward records what it got back."""

    seen: List[torch.Tensor] = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (x @ w) * getattr(w, "scale", 1.0)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        SavesBoth.seen.append(w)
        scale = getattr(w, "scale", 1.0)
        grad_x = (grad * scale) @ w.t()
        grad_w = x.t() @ (grad * scale) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


class Quantised(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        weight = torch.randn(5, 5)
        if kind == "frozen_parameter":
            self.weight = nn.Parameter(weight, requires_grad=False)
        elif kind == "buffer":
            self.register_buffer("weight", weight)
        else:  # a plain tensor carrying a Python attribute
            self.weight = weight
        self.weight.scale = 0.5

    def forward(self, x):
        return SavesBoth.apply(x.sin(), self.weight).tanh()


@pytest.mark.parametrize("kind", ["frozen_parameter", "buffer", "attribute_tensor"])
def test_saved_tensor_without_grad_is_the_same_object_in_backward(kind: str) -> None:
    torch.manual_seed(0)
    model = Quantised(kind)
    x = torch.randn(3, 5)
    grads = {}
    for name, wrap in [("none", None), *CHECKPOINTS.items()]:
        SavesBoth.seen.clear()
        leaf = x.clone().requires_grad_(True)
        out = model(leaf) if wrap is None else wrap(model, leaf)
        out.sum().backward()
        (w,) = SavesBoth.seen
        assert w is model.weight, f"{name}: backward got a different object"
        assert type(w) is type(model.weight)
        assert w.scale == 0.5
        grads[name] = leaf.grad
    assert_bitwise_equal([grads["matepoint"]], [grads["torch"]])
    assert_bitwise_equal([grads["matepoint"]], [grads["none"]])


def test_saved_tensor_as_checkpoint_argument_keeps_identity_like_torch() -> None:
    w = nn.Parameter(torch.randn(5, 5), requires_grad=False)
    w.scale = 2.0
    results = {}
    for name, wrap in CHECKPOINTS.items():
        SavesBoth.seen.clear()
        x = torch.randn(3, 5, requires_grad=True)
        wrap(lambda a, b: SavesBoth.apply(a * 1.0, b), x, w).sum().backward()
        (got,) = SavesBoth.seen
        results[name] = (got is w, isinstance(got, nn.Parameter), getattr(got, "scale", None))
    assert results["matepoint"] == results["torch"] == (True, True, 2.0)


def test_saved_tensor_requiring_grad_is_detached_like_torch() -> None:
    """Tensors that require grad are stored detached, as torch does: the
    object differs, the values and gradients do not."""
    w0 = torch.randn(5, 5)
    grads, seen = {}, {}
    for name, wrap in CHECKPOINTS.items():
        SavesBoth.seen.clear()
        w = nn.Parameter(w0.clone())
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
        wrap(lambda a: SavesBoth.apply(a.sin(), w), x).sum().backward()
        (got,) = SavesBoth.seen
        assert torch.equal(got, w)
        seen[name] = (got is w, type(got), got.requires_grad)
        grads[name] = (x.grad, w.grad)
    assert seen["matepoint"] == seen["torch"]
    assert seen["torch"][0] is False
    assert_bitwise_equal(grads["matepoint"], grads["torch"])


# ---- the CheckpointErrors torch raises start with torch's sentence -------

def first_sentence(message: str) -> str:
    match = re.match(r"(.+?\.)(?=\s|$)", message, re.S)
    assert match is not None, message
    return match.group(1)


def raised(wrap: Callable, case: Callable[[Callable], None]) -> str:
    with pytest.raises(tc.CheckpointError) as info:
        case(wrap)
    return str(info.value)


def unpacked_twice(wrap: Callable) -> None:
    x = torch.randn(3, requires_grad=True)
    wrap(lambda t: ReadsSavedTwice.apply(t.sin()), x).sum().backward()


def overlapping_backwards_in_one_group(wrap: Callable) -> None:
    x = torch.randn(3, requires_grad=True)
    out = wrap(lambda t: t.sin().exp(), x)
    with tc.GraphExecGroup():
        torch.autograd.grad(out.sum(), x, retain_graph=True)
        torch.autograd.grad(out.sum(), x)


def changes_on_second_call(first: Callable, second: Callable, **kwargs) -> Callable:
    def case(wrap: Callable) -> None:
        calls = []

        def fn(t):
            calls.append(1)
            return (first if len(calls) == 1 else second)(t)

        wrap(fn, torch.randn(4, requires_grad=True), **kwargs).sum().backward()
    return case


CASES = {
    "unpacked twice": (unpacked_twice, False),
    "overlapping backwards under GraphExecGroup": (overlapping_backwards_in_one_group, False),
    "fewer tensors in the recompute": (
        changes_on_second_call(lambda t: t.sin().exp(), lambda t: t.sin() + 1), True),
    "more tensors in the recompute": (
        changes_on_second_call(lambda t: t.sin() + 1, lambda t: t.sin().exp(), early_stop=False),
        True),
    "different metadata": (
        changes_on_second_call(lambda t: t.sin().exp(), lambda t: t[:2].sin().exp()), True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_checkpoint_error_starts_with_torchs_sentence(name: str) -> None:
    case, debug_tip = CASES[name]
    expected = raised(torch_checkpoint, case)
    got = raised(matepoint.checkpoint, case)
    assert first_sentence(got) == first_sentence(expected)
    assert expected.startswith("torch.utils.checkpoint: ")
    assert "matepoint.checkpoint: " in got, "matepoint's own detail is missing"
    if debug_tip:
        assert "`debug=True`" in expected and "`debug=True`" in got
        assert "set_checkpoint_debug_enabled(True)" in got
    # torch's whole report of the case comes before matepoint's detail
    if "GraphExecGroup" in name:
        overlap = re.search(r"Performing two backward calls.*?context\.", expected).group(0)
        assert overlap in got and overlap not in raised(matepoint.checkpoint, unpacked_twice)


def test_metadata_error_lists_every_tensor_like_torch() -> None:
    case = changes_on_second_call(lambda t: t.sin().exp(), lambda t: t[:2].double().sin().exp(),
                                  early_stop=False)
    expected = raised(torch_checkpoint, case)
    got = raised(matepoint.checkpoint, case)
    entries = re.findall(r"tensor at position \d+:\nsaved metadata: .*\nrecomputed metadata: .*\n",
                         expected)
    assert len(entries) >= 2
    assert got.startswith(first_sentence(expected) + "\n" + "".join(entries))


def test_count_error_gives_torchs_counts() -> None:
    case, _ = CASES["fewer tensors in the recompute"]
    expected = raised(torch_checkpoint, case).split("\n")[:3]
    assert raised(matepoint.checkpoint, case).split("\n")[:3] == expected


def test_bare_checkpoint_runs_non_reentrant_and_warns_nothing() -> None:
    """torch warns when use_reentrant is left out; matepoint has one
    implementation and, as its README says, does not."""
    import warnings
    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        matepoint.checkpoint(lambda t: t.sin().exp(), x).sum().backward()
    assert torch.equal(x.grad, (x.sin().exp() * x.cos()).detach())
