"""Shared models and helpers for the matepoint test-suite."""
from __future__ import annotations

import gc
from typing import Callable, Sequence

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _long_lived_objects_frozen():
    """What is alive between two test files (torch, the modules imported so
    far, their tables: some 200,000 objects) lives for the rest of the run.
    The collector is told so (gc.freeze), or each of the suite's
    gc.collect() calls, one or more per test, walks all of it again (0.4 s
    each here). Collected first, so no garbage is kept; a test's own objects
    are collected as before, and a frozen object is still freed when its
    last reference goes."""
    gc.collect()
    gc.freeze()
    yield


def _clear_frames(error: BaseException | None) -> None:
    """The frames of `error`'s traceback, and of the errors it chains, let
    go of their local variables."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            try:
                tb.tb_frame.clear()
            except RuntimeError:     # a frame still running: not the test's
                pass
            # Python 3.11 keeps the dict f_locals made (for pytest's
            # report) after clear(): reading f_locals again empties it
            tb.tb_frame.f_locals
            tb = tb.tb_next
        for inner in getattr(error, "exceptions", ()):    # an ExceptionGroup's
            _clear_frames(inner)
        error = error.__cause__ or error.__context__


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Once a phase that raised is reported (its text and, with -l, its
    locals are in the report), the frames of its traceback let go of their
    locals: a test that fails half-way holds its offloaded inputs, streams
    and tensors in them, and pytest keeps the traceback (sys.last_traceback)
    after the test; freed now, _nothing_left_behind's teardown finds them
    gone. Kept for --pdb, which reads them after the report."""
    report = yield
    if call.excinfo is not None and not item.config.getoption("usepdb", False):
        _clear_frames(call.excinfo.value)
    return report


@pytest.fixture(autouse=True)
def _nothing_left_behind(request: pytest.FixtureRequest):
    """Whatever a test leaves behind (tests/leftovers.py: offloaded inputs,
    a saved-tensor hook, options, the checkpoint patch, torch's CUDA entry
    points, the simulated runtime) is put back after it, and the test fails
    naming it: a failing test cannot take the tests after it down. Set up
    before, so torn down after, every fixture a test asks for. A leftover
    that cannot be put back stops the session (the tests after it would
    all fail for it) with this test named."""
    import leftovers
    before = leftovers.snapshot()
    yield
    left = leftovers.put_back(before)
    if any("NOT put back" in line for line in left):
        request.session.shouldstop = (f"{request.node.nodeid} left state behind that could "
                                      f"not be put back: {'; '.join(left)}")
    if left:
        pytest.fail("the test left behind:\n  " + "\n  ".join(left), pytrace=False)


def _on_simulated_gpu(progress: int, device_memory: bool = True):
    """The offload engine over the simulated GPU (tests/sim.py), every tensor
    eligible, kernels lagging in data and backward on a worker thread as on
    CUDA (sim.as_on_cuda; no lag without device_memory); the pool, the
    windows and the GPU's queues end empty, no CUDA error is left (on the
    backward threads either), and every stream and event is given back. Without
    device_memory, tensors keep torch's own CPU allocator (all on device 0)."""
    import gc
    import matepoint
    from matepoint import _C
    import sim
    import sim_autograd
    sim.require_test_build()
    saved = matepoint.options
    matepoint.set_options(min_offload_bytes=0)
    _C._simulate_cuda(True)
    _C._sim_set_progress(progress)
    # device memory freed as torch's allocator with expandable segments
    # frees it (after syncing its own stream only), not after every
    # stream as cudaFree waits: work still queued on it is a fault
    _C._sim_expandable(device_memory)
    launch_errors, unmap_faults = _C._sim_stats()["launch_errors"], sim.unjudged_unmap_faults()
    live_before = _live_on_simulated_gpu()
    try:
        with sim.device_memory(device_memory) as allocator:
            with sim.as_on_cuda(lag=device_memory):
                yield
            sim.assert_no_cuda_error()
            sim.finish()    # the GPU catches up eventually; then nothing may be held
            gc.collect()
            stats = matepoint.pool_stats()
            assert stats["bytes_in_use"] == 0, "a pool buffer outlived its graph"
            assert stats["device_bytes_in_flight"] == 0, stats
            assert _C._offload_copies() == []
            assert _C._sim_stats()["launch_errors"] == launch_errors, \
                "a kernel launch found a CUDA error left behind (torch would raise)"
            assert sim.unjudged_unmap_faults() == unmap_faults, \
                "device memory was freed while another stream's queued work used it"
            if allocator is not None:
                allocator.matepoint_reset()   # the allocator's events of pending frees go too
    finally:
        sim_autograd.take_workers_errors()   # the next test starts clean
        _C._sim_set_progress(0)
        _C._sim_expandable(False)
        matepoint.set_options(**{name: getattr(saved, name) for name in saved.__dataclass_fields__})
        _C._simulate_cuda(False)     # refused while inputs live: _nothing_left_behind tries again
    assert _C._sim_stats()["ops_queued"] == 0, "queued work waits forever"
    # counted from the test's start: what an earlier test leaked (pinned
    # memory the pool forgot) was that test's failure, not this one's
    live_after = _live_on_simulated_gpu()
    assert live_after == live_before, f"left live on the simulated GPU: {live_before} -> {live_after}"


def _live_on_simulated_gpu() -> dict:
    """The simulated GPU's streams (but the tests' long-lived side
    streams), events and pinned host bytes live."""
    import sim
    from matepoint import _C
    counts = _C._sim_stats()
    return {"streams": counts["streams_live"] - sim.long_lived_streams(),
            "events": counts["events_live"], "host_bytes": counts["host_bytes_live"]}


@pytest.fixture
def every_tensor_moves():
    """min_offload_bytes=0 for one test: profiles count no tensor as too
    small to offload."""
    import matepoint
    saved = matepoint.options.min_offload_bytes
    matepoint.set_options(min_offload_bytes=0)
    yield
    matepoint.set_options(min_offload_bytes=saved)


@pytest.fixture
def offload():
    """Offload on a simulated GPU that keeps up with the CPU: copies, and
    the kernels they wait for, run at every runtime call; a kernel nothing
    waits for lands late, so a copy not ordered after it reads poison."""
    import sim
    yield from _on_simulated_gpu(sim.EVERYTHING)


@pytest.fixture
def offload_heap_memory():
    """Offload on a simulated GPU that keeps up, tensors in the C heap (where
    the planner's host meter sees them)."""
    import sim
    yield from _on_simulated_gpu(sim.EVERYTHING, device_memory=False)


@pytest.fixture
def simulated():
    """Offload on a simulated GPU that runs nothing until something waits
    for it: as far behind the CPU as CUDA allows."""
    yield from _on_simulated_gpu(0)


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor, wrap: Callable) -> torch.Tensor:
        for layer in self.layers:
            x = wrap(layer, x)
        return x


class Transformer(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=64, dropout=0.2,
                                       batch_first=True)
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor, wrap: Callable) -> torch.Tensor:
        for block in self.blocks:
            x = wrap(block, x)
        return x


class CNN(nn.Module):
    def __init__(self, channels: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
                          nn.ReLU(), nn.Dropout2d(0.1))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor, wrap: Callable) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = wrap(block, x)
        return x


class ReadsSavedTwice(torch.autograd.Function):
    """Unpacks its saved tensor twice in backward (an error inside a checkpoint)."""

    @staticmethod
    def forward(ctx, t):
        ctx.save_for_backward(t)
        return t * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors
        (t,) = ctx.saved_tensors
        return grad * 2


def no_checkpoint(fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def torch_checkpoint(fn: Callable, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def train_step(model: nn.Module, x: torch.Tensor, wrap: Callable, seed: int = 0
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward/backward; returns (output, [input grad, param grads..., buffers...])."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = model(x, wrap)
    (out.float() ** 2).mean().backward()
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return out.detach(), grads + [b.detach().clone() for b in model.buffers()]


def run_in_thread(function: Callable[[], object]) -> None:
    """Runs `function` on a new thread and re-raises what it raised."""
    import threading
    errors: list = []

    def target() -> None:
        try:
            function()
        except BaseException as error:  # noqa: BLE001 (re-raised below)
            errors.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


class OpCounter(TorchDispatchMode):
    """Counts the aten operators run, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def assert_bitwise_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for index, (left, right) in enumerate(zip(a, b)):
        assert left is not None and right is not None, f"missing tensor #{index}"
        assert torch.equal(left, right), f"tensor #{index} differs"
