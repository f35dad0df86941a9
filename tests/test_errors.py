"""Bad input ends in a clear exception, and nothing stays installed after one."""
import pytest
import torch
import torch.nn as nn

import matepoint
from conftest import ReadsSavedTwice


def top_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def still_works() -> None:
    x = torch.randn(3, requires_grad=True)
    matepoint.checkpoint(lambda t: t.sin().exp(), x).sum().backward()
    assert torch.allclose(x.grad, (x.sin().exp() * x.cos()).detach())


def test_non_callable_function() -> None:
    with pytest.raises(TypeError, match="function must be callable, got int"):
        matepoint.checkpoint(3, torch.randn(2))
    with pytest.raises(TypeError, match="missing required argument 'function'"):
        matepoint.checkpoint()


def test_input_modified_in_place_between_forward_and_backward() -> None:
    x = torch.randn(4, requires_grad=True)
    y = x * 1.0
    out = matepoint.checkpoint(lambda t: t.sin().exp(), y)
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError, match=r"input tensor #0 .* modified in place"):
        out.sum().backward()
    still_works()


def test_nested_input_modified_in_place_is_named() -> None:
    a = torch.randn(4, requires_grad=True) * 1.0
    b = torch.randn(4, requires_grad=True) * 1.0
    out = matepoint.checkpoint(lambda items: items[0].sin() * items[1].exp(), [a, b])
    with torch.no_grad():
        b.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"input tensor #1 .* modified in place"):
        out.sum().backward()


def test_recompute_with_different_shape_names_the_tensor() -> None:
    calls = []

    def fn(t):
        calls.append(1)
        if len(calls) == 1:
            return t.sin().exp()
        return t[:2].sin().exp()

    x = torch.randn(4, requires_grad=True)
    out = matepoint.checkpoint(fn, x, early_stop=False)
    with pytest.raises(RuntimeError, match=r"tensor at position 0:\nsaved metadata: "
                       r"\{'shape': torch.Size\(\[4\]\)"):
        out.sum().backward()
    still_works()


def test_recompute_saving_fewer_tensors_is_reported() -> None:
    calls = []

    def fn(t):
        calls.append(1)
        out = t.sin()
        return out.exp() if len(calls) == 1 else out + 1

    x = torch.randn(4, requires_grad=True)
    out = matepoint.checkpoint(fn, x)
    with pytest.raises(RuntimeError, match="saved 2 tensors but the recomputation saved 1"):
        out.sum().backward()


@pytest.mark.parametrize("phase", ["forward", "recompute"])
def test_exception_in_function_leaves_no_hook(phase: str) -> None:
    calls = []

    def fn(t):
        calls.append(1)
        y = t.sin()
        if (phase == "forward") == (len(calls) == 1):
            raise KeyError("boom in " + phase)
        return y.exp()

    x = torch.randn(3, requires_grad=True)
    before_rng = torch.get_rng_state()
    with pytest.raises(KeyError, match="boom"):
        matepoint.checkpoint(fn, x).sum().backward()
    assert top_hooks() is None
    assert not matepoint.is_recomputing()
    assert torch.equal(torch.get_rng_state(), before_rng)
    still_works()


def test_exception_in_recompute_restores_batchnorm_buffers() -> None:
    bn = nn.BatchNorm1d(4)
    calls = []

    def fn(t):
        calls.append(1)
        y = bn(t)
        if len(calls) == 2:
            raise ValueError("fail in recompute")
        return y.exp()

    x = torch.randn(8, 4, requires_grad=True)
    out = matepoint.checkpoint(fn, x)
    mean = bn.running_mean
    with pytest.raises(ValueError):
        out.sum().backward()
    assert bn.running_mean is mean
    assert bn.num_batches_tracked.item() == 1


def test_forward_context_suppressing_an_error_is_refused() -> None:
    class Swallow:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return True

    def fn(t):
        raise ValueError("lost")

    with pytest.raises(RuntimeError, match="suppressed an exception"):
        matepoint.checkpoint(fn, torch.randn(2, requires_grad=True),
                             context_fn=lambda: (Swallow(), Swallow()))
    assert top_hooks() is None


def test_bad_context_fn() -> None:
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(TypeError, match="context_fn must be callable"):
        matepoint.checkpoint(torch.sin, x, context_fn=5)
    with pytest.raises(TypeError, match="tuple of two context managers"):
        matepoint.checkpoint(torch.sin, x, context_fn=lambda: None)
    with pytest.raises(ValueError, match="debug=True is incompatible"):
        matepoint.checkpoint(torch.sin, x, debug=True, context_fn=lambda: (None, None))
    assert top_hooks() is None


def test_unpacking_a_saved_tensor_twice_is_an_error() -> None:
    x = torch.randn(3, requires_grad=True)
    out = matepoint.checkpoint(lambda t: ReadsSavedTwice.apply(t.sin()), x)
    with pytest.raises(RuntimeError, match="unpacked twice"):
        out.sum().backward()
    still_works()


def test_backward_twice_without_retain_graph() -> None:
    x = torch.randn(3, requires_grad=True)
    out = matepoint.checkpoint(lambda t: t.sin().exp(), x)
    out.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()
    still_works()
