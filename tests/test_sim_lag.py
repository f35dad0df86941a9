"""The simulated GPU as the offload tests rely on it (tests/sim.py): kernels
lag in data, so a read not ordered after its producer reads poison; and
backward runs as on CUDA, on a worker thread with each node's forward
device and stream current. If these fail, a missing wait in the engine
passes every other test."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import matepoint
import sim
from matepoint import _C
from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step


def _raw_stream(handle):
    """torch.cuda.stream without the waits sim.stream adds."""
    previous = _C._sim_current_stream(0)
    _C._sim_set_stream(0, handle)
    return previous


def test_a_kernel_on_another_stream_reads_poison_unless_ordered(simulated):
    first, second = sim.side_streams()
    x = torch.arange(8, dtype=torch.float32)
    sim.finish()
    previous = _raw_stream(first)
    try:
        produced = x * 2                        # lags on `first`
        _C._sim_set_stream(0, second)
        unordered = produced + 0                # nothing orders it after the product
        _C._sim_order_streams(0, second, 0, first)
        ordered = produced + 0
    finally:
        _C._sim_set_stream(0, previous)
    sim.finish()
    assert torch.isnan(unordered).all()
    assert torch.equal(ordered, x * 2)
    assert torch.equal(produced, x * 2)


def test_a_kernel_on_its_own_stream_and_host_reads_see_its_results(simulated):
    x = torch.arange(6, dtype=torch.float32)
    y = (x * 3).sum()
    assert _C._sim_stats()["kernels_queued"] > 0          # still lagging
    assert y.item() == 45.0                                # a host read catches up
    z = x.clone()
    z.add_(1.0)                                            # written in place: lags too
    assert torch.equal(z, torch.arange(1, 7, dtype=torch.float32))


def test_a_queued_kernel_reads_what_is_there_when_it_runs(simulated):
    first, second = sim.side_streams()
    source = torch.ones(16)
    sim.finish()
    before = _C._sim_stats()["kernels_poisoned"]
    previous = _raw_stream(first)
    try:
        doubled = source * 2                    # queued on `first`, reads `source`
        _C._sim_set_stream(0, second)
        source.fill_(5.0)                       # another stream writes what it reads
        _C._sim_launch(0, second)               # ... and gets there first
    finally:
        _C._sim_set_stream(0, previous)
    sim.finish()
    assert torch.isnan(doubled).all()
    assert _C._sim_stats()["kernels_poisoned"] == before + 1


class RecordsWhereItRuns(torch.autograd.Function):
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        RecordsWhereItRuns.seen.append((threading.current_thread(), _C._sim_get_device(),
                                        _C._sim_current_stream(_C._sim_get_device())))
        return grad * 1.0


def test_backward_runs_on_a_worker_with_each_nodes_forward_stream(simulated):
    first, second = sim.side_streams()
    RecordsWhereItRuns.seen = []
    x = torch.randn(4, 4, requires_grad=True)
    with sim.stream(0, first):
        a = RecordsWhereItRuns.apply(x)
    with sim.stream(0, second):
        b = RecordsWhereItRuns.apply(a)
    with sim.device(1):
        c = RecordsWhereItRuns.apply(b * 1.0)
    c.sum().backward()
    assert [place[1:] for place in RecordsWhereItRuns.seen] == [(1, None), (0, second),
                                                                 (0, first)]
    assert all(place[0] is not threading.current_thread() for place in RecordsWhereItRuns.seen)
    assert _C._sim_current_stream(0) is None and _C._sim_get_device() == 0
    assert torch.equal(x.grad, torch.ones(4, 4))     # the caller's stream waited for backward


def test_grad_and_errors_come_back_from_the_worker(simulated):
    x = torch.randn(3, requires_grad=True)
    (g,) = torch.autograd.grad((x * 2).sum(), x)
    assert torch.equal(g, torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.ones(2).sum().backward()


@pytest.mark.parametrize("fixture", ["simulated", "offload"])
def test_offload_on_side_streams_is_exact(request, fixture):
    """Forward regions alternate between two streams; backward runs each
    recompute on its region's stream (every kernel lagging)."""
    request.getfixturevalue(fixture)
    streams = sim.side_streams()
    calls = [0]

    def on_alternate_streams(fn, x):
        calls[0] += 1
        with sim.stream(0, streams[calls[0] % 2]):
            return matepoint.checkpoint(fn, x)

    model, x = MLP(32, 6), torch.randn(16, 32)
    _, expected = train_step(model, x, no_checkpoint)
    _, grads = train_step(model, x, on_alternate_streams)
    assert_bitwise_equal(grads, expected)
    assert _C._sim_stats()["kernels_run"] > 0


def test_a_gradient_handed_to_another_stream_is_recorded_there(simulated):
    """Each region's input comes from a chain on a side stream, so backward
    hands gradients made on the current stream to nodes on the side stream
    while the current stream goes on with work of its own. As torch's
    engine does, each such gradient is recorded on its consumer's stream:
    without that the current stream reuses its memory before the side
    stream's kernel read it (the leaf's gradient turns NaN)."""
    branch = sim.side_streams()[0]

    def from_a_chain(checkpointed):
        chain = []

        def wrap(fn, x):
            previous = _C._sim_current_stream(0)
            if not chain:
                with sim.stream(0, branch):
                    chain.append(x * 0.5)
            _raw_stream(branch)
            try:
                chain[0] = chain[0] * 0.5       # the side stream's own work
            finally:
                _C._sim_set_stream(0, previous)
            with sim.stream(0, branch):
                made = x + chain[0]
            return matepoint.checkpoint(fn, made) if checkpointed else fn(made)
        return wrap

    matepoint.set_options(offload_window=1)
    model, x = MLP(32, 5), torch.randn(16, 32)
    _, expected = train_step(model, x, from_a_chain(False))
    _, grads = train_step(model, x, from_a_chain(True))
    assert_bitwise_equal(grads, expected)
