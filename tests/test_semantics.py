"""torch.utils.checkpoint (non-reentrant) semantics, feature by feature."""
import collections
import warnings

import pytest
import torch
import torch.nn as nn

import matepoint
from conftest import assert_bitwise_equal

Pair = collections.namedtuple("Pair", "first second")


def grads_of(fn, *inputs):
    for t in inputs:
        t.grad = None
    fn().sum().backward()
    return [t.grad.clone() for t in inputs]


def test_kwargs_reach_the_function() -> None:
    x = torch.randn(4, requires_grad=True)
    scale = torch.randn(4, requires_grad=True)

    def fn(a, *, scale, power=2):
        return (a * scale).sin() ** power

    ref = grads_of(lambda: fn(x, scale=scale, power=3), x, scale)
    got = grads_of(lambda: matepoint.checkpoint(fn, x, scale=scale, power=3), x, scale)
    assert_bitwise_equal(ref, got)


def test_nested_tensor_arguments() -> None:
    a, b, c, d = (torch.randn(3, requires_grad=True) for _ in range(4))

    def fn(pair, items, table, flag):
        assert isinstance(pair, Pair) and isinstance(items, list) and flag == "on"
        return pair.first.sin() * pair.second.cos() + items[0].exp() * table["d"].tanh()

    ref = grads_of(lambda: fn(Pair(a, b), [c], {"d": d}, "on"), a, b, c, d)
    got = grads_of(lambda: matepoint.checkpoint(fn, Pair(a, b), [c], {"d": d}, "on"), a, b, c, d)
    assert_bitwise_equal(ref, got)


def test_any_output_structure() -> None:
    x = torch.randn(5, requires_grad=True)

    def fn(t):
        return {"y": [t.sin(), (t.cos(), 7)], "name": "out", "none": None}

    out = matepoint.checkpoint(fn, x)
    assert out["name"] == "out" and out["none"] is None and out["y"][1][1] == 7
    (out["y"][0] * out["y"][1][0]).sum().backward()
    expected = torch.cos(2 * x.detach())  # d/dx sin(x)cos(x)
    assert torch.allclose(x.grad, expected)


def test_nested_checkpoints() -> None:
    x = torch.randn(6, requires_grad=True)

    def inner(t):
        return t.sin().exp()

    def outer(t):
        return matepoint.checkpoint(inner, t.cos()) * t.tanh()

    ref = grads_of(lambda: inner(x.cos()) * x.tanh(), x)
    got = grads_of(lambda: matepoint.checkpoint(outer, x), x)
    assert_bitwise_equal(ref, got)


def test_autograd_grad_on_subset_of_inputs() -> None:
    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    out = matepoint.checkpoint(lambda a, b: (a * b).sin() * b, x, w)
    (gx,) = torch.autograd.grad(out.sum(), [x])
    ref = torch.autograd.grad(((x * w).sin() * w).sum(), [x])[0]
    assert torch.equal(gx, ref)
    assert w.grad is None


def test_retain_graph_and_second_backward() -> None:
    x = torch.randn(4, requires_grad=True)
    out = matepoint.checkpoint(lambda t: t.sin().exp(), x)
    out.sum().backward(retain_graph=True)
    first = x.grad.clone()
    out.sum().backward()
    assert torch.equal(x.grad, 2 * first)


def test_several_forwards_before_one_backward() -> None:
    x = torch.randn(4, requires_grad=True)
    fn = lambda t, k: (t * k).sin().exp()  # noqa: E731
    outs = [matepoint.checkpoint(fn, x, k) for k in (1.0, 2.0, 3.0)]
    sum(o.sum() for o in outs).backward()
    got = x.grad.clone()
    x.grad = None
    sum(fn(x, k).sum() for k in (1.0, 2.0, 3.0)).backward()
    assert torch.equal(got, x.grad)


def test_inputs_without_requires_grad() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    matepoint.checkpoint(lin, x).sum().backward()
    got = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    lin(x).sum().backward()
    assert_bitwise_equal(got, [p.grad for p in lin.parameters()])


def test_no_grad_just_calls_the_function() -> None:
    calls = []
    x = torch.randn(3, requires_grad=True)

    def fn(t):
        calls.append(torch.is_grad_enabled())
        return t * 2

    with torch.no_grad():
        out = matepoint.checkpoint(fn, x)
    assert calls == [False] and out.grad_fn is None and not out.requires_grad


def test_use_reentrant_true_warns_once_and_works() -> None:
    import matepoint._C as core
    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matepoint.checkpoint(torch.sin, x, use_reentrant=True).sum().backward()
        matepoint.checkpoint(torch.sin, x, use_reentrant=True).sum().backward()
    messages = [str(w.message) for w in caught if "use_reentrant" in str(w.message)]
    assert len(messages) <= 1  # once per process; an earlier test may have used it
    assert torch.equal(x.grad, 2 * torch.cos(x.detach()))
    assert core.is_recomputing() is False


def test_is_recomputing_only_during_recompute() -> None:
    seen = []
    x = torch.randn(3, requires_grad=True)

    def fn(t):
        seen.append(matepoint.is_recomputing())
        return t.sin()

    out = matepoint.checkpoint(fn, x)
    out.sum().backward()
    assert seen == [False, True]
    assert matepoint.is_recomputing() is False


def test_early_stop_skips_the_rest_of_the_function() -> None:
    trace = []
    x = torch.randn(3, requires_grad=True)

    def fn(t):
        a = t.sin()
        trace.append("after-first-op")
        b = a.exp()
        trace.append("after-last-save")
        return b + 1

    matepoint.checkpoint(fn, x).sum().backward()
    # forward runs everything; the recompute stops once exp() saved its output
    assert trace == ["after-first-op", "after-last-save", "after-first-op"]
    trace.clear()
    matepoint.checkpoint(fn, x, early_stop=False).sum().backward()
    assert trace == ["after-first-op", "after-last-save"] * 2


def test_context_fn_runs_forward_and_recompute_contexts() -> None:
    events = []

    class Marker:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            events.append(self.name + "+")

        def __exit__(self, *exc):
            events.append(self.name + "-")
            return False

    x = torch.randn(3, requires_grad=True)
    out = matepoint.checkpoint(torch.sin, x, context_fn=lambda: (Marker("fwd"), Marker("re")))
    out.sum().backward()
    assert events == ["fwd+", "fwd-", "re+", "re-"]


def test_determinism_check_none_is_accepted_and_bad_value_rejected() -> None:
    x = torch.randn(3, requires_grad=True)
    matepoint.checkpoint(torch.sin, x, determinism_check="none").sum().backward()
    with pytest.raises(ValueError, match="determinism_check"):
        matepoint.checkpoint(torch.sin, x, determinism_check="strict")


def test_debug_mode_runs() -> None:
    x = torch.randn(3, requires_grad=True)
    matepoint.checkpoint(lambda t: t.sin().exp(), x, debug=True).sum().backward()
    assert torch.allclose(x.grad, (x.sin().exp() * x.cos()).detach())


def test_rng_state_replayed_for_dropout_and_left_untouched() -> None:
    x = torch.randn(64, requires_grad=True)
    fn = lambda t: torch.nn.functional.dropout(t, 0.5, training=True).exp()  # noqa: E731
    torch.manual_seed(5)
    ref = grads_of(lambda: fn(x), x)
    after_ref = torch.rand(1)
    torch.manual_seed(5)
    got = grads_of(lambda: matepoint.checkpoint(fn, x), x)
    after_got = torch.rand(1)
    assert_bitwise_equal(ref, got)
    assert torch.equal(after_ref, after_got)  # recompute restored the caller's RNG


def test_autocast_state_replayed_in_recompute() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = matepoint.checkpoint(lin, x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()  # recompute outside autocast must still use bf16
    got = x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = lin(x)
    ref_out.float().sum().backward()
    assert torch.equal(got, x.grad)


def test_frames_are_independent_of_creation_order() -> None:
    """Backward of an earlier region first, then of a later one (no global LIFO)."""
    x = torch.randn(4, requires_grad=True)
    first = matepoint.checkpoint(lambda t: t.sin().exp(), x)
    second = matepoint.checkpoint(lambda t: t.cos().exp(), x)
    first.sum().backward()
    g1 = x.grad.clone()
    x.grad = None
    second.sum().backward()
    assert torch.allclose(g1, (x.sin().exp() * x.cos()).detach())
    assert torch.allclose(x.grad, (-x.cos().exp() * x.sin()).detach())
