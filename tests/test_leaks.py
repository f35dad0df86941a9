"""Nothing outlives the step: inputs, activations, frames, Python objects."""
import gc
import weakref

import torch
import torch.nn as nn

import matepoint


def test_inputs_and_activations_die_after_backward() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    hidden = lin(x)
    activations = []

    def fn(t):
        y = t.sin()
        activations.append(weakref.ref(y))
        return y.exp()

    out = matepoint.checkpoint(fn, hidden)
    hidden_ref = weakref.ref(hidden)
    del hidden
    assert hidden_ref() is not None  # the frame keeps the input for backward
    out.sum().backward()
    del out
    assert hidden_ref() is None
    assert all(ref() is None for ref in activations)


def test_graph_dropped_without_backward_frees_everything() -> None:
    x = torch.randn(16, requires_grad=True)
    hidden = x * 2
    out = matepoint.checkpoint(lambda t: t.sin().exp(), hidden)
    hidden_ref = weakref.ref(hidden)
    del hidden, out
    assert hidden_ref() is None


def test_region_saving_nothing_releases_its_inputs_at_once() -> None:
    x = torch.randn(16, requires_grad=True)
    hidden = x * 2
    out = matepoint.checkpoint(lambda t: t * 3 + 1, hidden)  # saves no tensor
    hidden_ref = weakref.ref(hidden)
    del hidden
    assert hidden_ref() is None
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 6.0))


def test_no_growth_over_many_iterations() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.1), nn.Tanh())
    x = torch.randn(8, 16)

    def step() -> None:
        out = matepoint.checkpoint(model, x.requires_grad_(True))
        out = matepoint.checkpoint(lambda t, k: {"y": (t * k).exp()}, out, k=0.5)["y"]
        out.sum().backward()

    for _ in range(20):
        step()
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(500):
        step()
    gc.collect()
    after = len(gc.get_objects())
    assert after - before < 50, f"live objects grew from {before} to {after}"
