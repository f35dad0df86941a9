"""No copy that buys nothing (issue 37): at the start of backward the
inputs of the last `offload_window` regions may still be on the device,
their copies out queued but their sources not yet retired. Backward uses
them there: no copy back, and their host buffers go back to the pool
(after the copy out that still writes them). On the lagging simulator
(tests/sim.py: nothing runs until something waits for it) every source
of the window is still held when backward begins, so the last
`offload_window` regions make no host-to-device copy at all; the earlier
ones make theirs. Counted three ways: the simulator's cudaMemcpyAsync
calls, pool_stats(), and where each recompute's input lives (the very
storage of the forward, or a new one)."""
from __future__ import annotations

import gc
from typing import Callable, Dict, List, Optional

import pytest
import torch
import torch.nn as nn

import matepoint
import sim
from matepoint import _C

from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step

WIDTH, BATCH, DEPTH = 32, 16, 8
INPUT_BYTES = WIDTH * BATCH * 4


class Probe(nn.Module):
    """Records whether its recompute gets the very storage its forward got,
    and the host pool's bytes in use when its recompute starts. A weak
    reference keeps the forward storage's record from being reused (its
    address could come back as a copy back's, its memory does not stay)."""

    def __init__(self, inner: nn.Module, log: Dict[str, List]) -> None:
        super().__init__()
        self.inner, self.log = inner, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        if matepoint.is_recomputing():
            weak, cdata = self.log["weak"][id(self)]
            alive = not torch.UntypedStorage._expired(weak)
            self.log["recompute"].append((id(self), alive and storage._cdata == cdata))
            self.log["pool_in_use"].append(matepoint.pool_stats()["bytes_in_use"])
        else:
            self.log["forward"].append((id(self), True))
            self.log["weak"][id(self)] = (storage._weak_ref(), storage._cdata)
        return self.inner(x)


def probed_mlp(log: Dict[str, List], depth: int = DEPTH) -> nn.Module:
    torch.manual_seed(0)
    model = MLP(WIDTH, depth)
    model.layers = nn.ModuleList(Probe(layer, log) for layer in model.layers)
    return model


def new_log() -> Dict[str, List]:
    return {"forward": [], "recompute": [], "pool_in_use": [], "weak": WeakRefs()}


class WeakRefs(dict):
    """Probe id -> (weak reference, storage record); freed with the log."""

    def __setitem__(self, key, value) -> None:
        if key in self:
            torch.UntypedStorage._free_weak_ref(self[key][0])
        super().__setitem__(key, value)

    def __del__(self) -> None:
        for weak, _ in self.values():
            torch.UntypedStorage._free_weak_ref(weak)


def copies_back() -> int:
    """cudaMemcpyAsync calls so far (backward makes no copy out)."""
    return _C._sim_stats()["calls"]["cudaMemcpyAsync"]


def counters() -> Dict[str, int]:
    stats = matepoint.pool_stats()
    return {key: stats[key] for key in ("prefetched", "fetched_at_need", "used_in_place")}


def delta(after: Dict[str, int], before: Dict[str, int]) -> Dict[str, int]:
    return {key: after[key] - before[key] for key in after}


def in_place_regions(log: Dict[str, List]) -> List[bool]:
    """Per region, in forward order: did its last recompute get the
    forward's storage itself?"""
    recompute = dict(log["recompute"][-len(log["forward"]):])
    return [recompute[key] for key, _ in log["forward"]]


@pytest.mark.parametrize("backwards", [1, 2], ids=["one-backward", "retain-graph-twice"])
@pytest.mark.parametrize("window", [1, 2, 4])
def test_the_last_window_regions_make_no_copy_back(simulated, window: int, backwards: int):
    matepoint.set_options(offload_window=window, prefetch_depth=1)
    log = new_log()
    model = probed_mlp(log)
    x = torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    log.clear()
    log.update(new_log())

    torch.manual_seed(0)
    leaf = x.detach().clone().requires_grad_(True)
    loss = (model(leaf, matepoint.checkpoint).float() ** 2).mean()
    assert matepoint.pool_stats()["device_bytes_in_flight"] == window * INPUT_BYTES
    for index in range(backwards):
        model.zero_grad(set_to_none=True)
        leaf.grad = None
        before, calls = counters(), copies_back()
        loss.backward(retain_graph=index + 1 < backwards)
        made = delta(counters(), before)
        # the first backward finds the window's sources on the device; a
        # second one finds them there still, and copies the rest back again
        assert copies_back() - calls == DEPTH - window
        assert made["prefetched"] + made["fetched_at_need"] == DEPTH - window
        assert made["used_in_place"] == (window if index == 0 else 0)
        assert in_place_regions(log) == [False] * (DEPTH - window) + [True] * window
        grads = [leaf.grad] + [p.grad for p in model.parameters()]
        assert_bitwise_equal(grads, expected[:len(grads)])
        if index == 0:
            # their host buffers went back as the first recompute began
            assert log["pool_in_use"][0] == (DEPTH - window) * INPUT_BYTES
    assert matepoint.pool_stats()["device_bytes_in_flight"] == 0
    del loss
    gc.collect()
    assert matepoint.pool_stats()["bytes_in_use"] == 0


def test_sources_retired_before_backward_are_copied_back(offload):
    """On a GPU that keeps up, each copy out completed and its source was
    retired while the forward went on: backward copies every region back."""
    log = new_log()
    model = probed_mlp(log)
    x = torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    log.clear()
    log.update(new_log())
    before, calls = counters(), copies_back()
    _, grads = train_step(model, x, matepoint.checkpoint)
    made = delta(counters(), before)
    assert made["used_in_place"] == 0
    assert made["prefetched"] + made["fetched_at_need"] == DEPTH
    assert copies_back() - calls == 2 * DEPTH                       # out and back
    assert in_place_regions(log) == [False] * DEPTH
    assert_bitwise_equal(grads, expected)


def test_steady_state_pins_nothing_new(simulated):
    """A buffer returned behind a copy out that has not run yet does not hold
    up those returned after copies back that did: the second step finds every
    buffer of the first in the pool."""
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    train_step(model, x, matepoint.checkpoint)
    pinned = matepoint.pool_stats()["host_allocations"]
    assert pinned == DEPTH
    for _ in range(2):
        _, grads = train_step(model, x, matepoint.checkpoint)
        assert_bitwise_equal(grads, expected)
        assert matepoint.pool_stats()["host_allocations"] == pinned


class OffsetViews(nn.Module):
    """Each region's input is a view 5 elements (20 bytes: not a multiple of
    the span alignment) into a larger storage, and a second view of the
    same storage: one span, two records, neither at the storage's start."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))

    def forward(self, x: torch.Tensor, wrap: Callable) -> torch.Tensor:
        for layer in self.layers:
            flat = torch.cat([torch.zeros(5), x.flatten(), torch.zeros(3)])
            inner = flat[5:5 + x.numel()].view_as(x)
            tail = flat[7:7 + WIDTH]
            x = wrap(lambda a, b, layer=layer: torch.tanh(layer(a)) + b.sum(), inner, tail)
        return x


@pytest.mark.parametrize("fixture", ["simulated", "offload"])
def test_views_into_a_storage_are_used_in_place_exactly(request, fixture: str):
    request.getfixturevalue(fixture)
    matepoint.set_options(offload_window=2)
    torch.manual_seed(0)
    model, x = OffsetViews(), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    before = counters()
    _, grads = train_step(model, x, matepoint.checkpoint)
    assert_bitwise_equal(grads, expected)
    if fixture == "simulated":
        assert delta(counters(), before)["used_in_place"] == 2


def test_partial_grad_then_full_backward(simulated):
    """torch.autograd.grad over the last regions only, then a full backward
    over the same graph: both exact, each region restored however it was."""
    log = new_log()
    model = probed_mlp(log, depth=5)
    x = torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    torch.manual_seed(0)
    leaf = x.detach().clone().requires_grad_(True)
    loss = (model(leaf, matepoint.checkpoint).float() ** 2).mean()
    last = list(model.layers[-1].parameters())
    partial = torch.autograd.grad(loss, last, retain_graph=True)
    for got, want in zip(partial, expected[-2:]):
        assert torch.equal(got, want)
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert_bitwise_equal([leaf.grad] + [p.grad for p in model.parameters()],
                         expected[:1 + len(list(model.parameters()))])


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


def test_an_exception_mid_forward_leaves_nothing_held(simulated):
    """A region that raises after others offloaded: their sources and
    buffers go with the graph, and the next step uses the window in place
    again, exactly."""
    model, x = MLP(WIDTH, 4), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    broken = MLP(WIDTH, 3)
    broken.layers.append(Fails())
    with pytest.raises(ValueError, match="boom"):
        broken(torch.randn(BATCH, WIDTH, requires_grad=True), matepoint.checkpoint)
    gc.collect()
    before = counters()
    _, grads = train_step(model, x, matepoint.checkpoint)
    assert_bitwise_equal(grads, expected)
    assert delta(counters(), before)["used_in_place"] == 2
    gc.collect()
    sim.finish()
    assert matepoint.pool_stats()["bytes_in_use"] == 0


def test_a_later_graphs_inputs_are_not_kept_for_an_earlier_backward(simulated):
    """Two forwards, then the first graph's backward: the window holds the
    second graph's last inputs, which that backward never reaches. They are
    retired as before (not kept on the device through it) and copied back
    when their own backward comes; both exact."""
    model, x = MLP(WIDTH, 4), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    graphs = []
    for _ in range(2):
        torch.manual_seed(0)
        leaf = x.detach().clone().requires_grad_(True)
        graphs.append((leaf, (model(leaf, matepoint.checkpoint).float() ** 2).mean()))
    assert matepoint.pool_stats()["device_bytes_in_flight"] == 2 * INPUT_BYTES
    for leaf, loss in graphs:
        model.zero_grad(set_to_none=True)
        before = counters()
        loss.backward()
        assert matepoint.pool_stats()["device_bytes_in_flight"] == 0
        made = delta(counters(), before)
        assert made["used_in_place"] == 0
        assert made["prefetched"] + made["fetched_at_need"] == 4
        assert_bitwise_equal([leaf.grad] + [p.grad for p in model.parameters()], expected)


def test_one_input_passed_twice_and_backward_twice_without_retain(simulated):
    """The same input twice (one span, two records) used in place; a second
    backward without retain_graph raises as torch does, and nothing stays."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    hidden = x * 1.5
    out = matepoint.checkpoint(lambda a, b: torch.tanh(a) * b, hidden, hidden)
    before = counters()
    out.sum().backward()
    assert delta(counters(), before)["used_in_place"] == 1
    plain = x.detach().clone().requires_grad_(True)
    h = plain * 1.5
    (torch.tanh(h) * h).sum().backward()
    assert torch.equal(x.grad, plain.grad)
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()
    del out, hidden
    gc.collect()
    assert matepoint.pool_stats()["bytes_in_use"] == 0


def matmul_last(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # the recompute stops at the matmul's saved tensors, before asking the
    # selective-checkpoint cache for its output: that output is let go
    return torch.mm(torch.tanh(x), weight)


@pytest.mark.parametrize("window", [1, 2, 4])
def test_let_go_outputs_are_not_counted_as_used_in_place(simulated, window: int):
    """Selective checkpointing offloads each region's last matmul output,
    which the recompute never asks for (let go when the forward ends). On
    the lagging simulator those copies are still in the window when
    backward begins: only spans a restore really took on the device count
    as used in place, and every span backward needed was either copied
    back or used in place, once."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, func, *args, **kwargs):
        return (CheckpointPolicy.MUST_CPU_OFFLOAD if func is torch.ops.aten.mm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    matepoint.set_options(offload_window=window, prefetch_depth=1)
    depth = 4
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    weights = [torch.randn(WIDTH, WIDTH, requires_grad=True) for _ in range(depth)]
    h = x
    for weight in weights:
        h = matepoint.checkpoint(matmul_last, h, weight,
                                 context_fn=lambda: create_selective_checkpoint_contexts(policy))
    before = counters()
    h.sum().backward()
    made = delta(counters(), before)
    # two input spans a region (h and its weight); the matmuls' outputs never come back
    needed = 2 * depth
    assert made["prefetched"] + made["fetched_at_need"] + made["used_in_place"] == needed, made
    assert made["used_in_place"] == 2 * min(window, depth), made
    got = [x.grad] + [w.grad for w in weights]
    x.grad = None
    for weight in weights:
        weight.grad = None
    h = x
    for weight in weights:
        h = matmul_last(h, weight)
    h.sum().backward()
    assert_bitwise_equal([x.grad] + [w.grad for w in weights], got)
    del h
    gc.collect()
