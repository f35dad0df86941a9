"""torch's offload adapter (csrc/offload/offload_runtime_torch.c) under test
without a GPU: the engine runs over the simulated GPU while the current
stream, record_stream (through default_stream / ExternalStream) and the
primary-context query go through the adapter to a torch.cuda stand-in
written in Python (tests/fake_torch_cuda.py), so the GIL may switch threads
inside them as it can on a GPU.

The simulated-GPU suites of test_gpu_timeline.py, test_offload_window.py and
part of test_offload.py run here once more over the adapter: this module's
`simulated` and `offload` fixtures replace conftest's for them."""
from __future__ import annotations

import pytest
import torch

import conftest
import fake_torch_cuda
import matepoint
import sim
import test_gpu_timeline
import test_offload
import test_offload_window
from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step
from matepoint import _C


@pytest.fixture
def simulated():
    """conftest's `simulated` (a GPU as far behind as CUDA allows), torch's
    adapter answering for torch."""
    yield from fake_torch_cuda.adapter_runtime(conftest._on_simulated_gpu(0))


@pytest.fixture
def offload():
    """conftest's `offload` (a GPU that keeps up), torch's adapter answering."""
    yield from fake_torch_cuda.adapter_runtime(conftest._on_simulated_gpu(sim.EVERYTHING))


# ---- the simulated-GPU suites once more, over the adapter ----------------------------------

_OFFLOAD_TESTS = (
    "test_gradients_bit_identical_with_offload", "test_pool_empty_after_backward_and_reused_next_step",
    "test_graph_dropped_without_backward_returns_buffers", "test_prefetch_runs_ahead_in_backward",
    "test_views_shared_storage_and_strides", "test_pool_limit_falls_back_with_one_warning",
    "test_retain_graph_and_several_forwards_with_offload",
    "test_input_stays_on_its_device_when_no_host_memory_at_all",
)


def _suite() -> dict:
    tests = {}
    for module, names in ((test_gpu_timeline, None), (test_offload_window, None),
                          (test_offload, _OFFLOAD_TESTS)):
        for name, value in vars(module).items():
            if name.startswith("test_") and callable(value) and (names is None or name in names):
                assert name not in tests, f"two suites define {name}"
                tests[name] = value
        assert names is None or set(names) <= set(tests), "a test named here was renamed"
    return tests


globals().update(_suite())


# ---- the adapter itself ------------------------------------------------------------------

WIDTH, BATCH, DEPTH = 64, 32, 6


def test_every_entry_point_answers_through_the_adapter(simulated):
    """A lagging GPU, window 1, regions on a side stream and on the legacy
    stream: the window retires sources in stream order, so record_stream
    runs through ExternalStream (side stream) and default_stream (legacy)."""
    standin = simulated
    matepoint.set_options(offload_window=1)
    side, _ = sim.side_streams()
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)

    def on_side_stream(fn, x):
        with sim.stream(0, side):
            return matepoint.checkpoint(fn, x)

    for wrap in (matepoint.checkpoint, on_side_stream):
        _, grads = train_step(model, x, wrap)
        assert_bitwise_equal(grads, expected)
    for name in ("_cuda_getCurrentRawStream", "default_stream", "ExternalStream",
                 "record_stream"):
        assert standin.calls[name] > 0, (name, standin.calls)
    handles = {handle for _, handle, _ in standin.recorded}
    # both compute streams; beside them only the engine's own copy streams
    # (a source retired while another stream is current is recorded on the
    # copy-out stream that read it)
    copy_streams = set(_C._offload_streams()[0].values())
    assert {0, side} <= handles <= {0, side} | copy_streams, handles
    assert {device for _, _, device in standin.recorded} == {0}


def test_context_query_goes_through_the_adapter(simulated):
    """Pinning from a new thread asks which device has a context (the
    adapter's _cuda_hasPrimaryContext) instead of creating one on GPU 0."""
    standin = simulated
    test_gpu_timeline.test_pinning_from_a_new_thread_creates_no_context_on_gpu_0(standin)
    assert standin.calls["_cuda_hasPrimaryContext"] > 0, standin.calls


def test_target_device_goes_through_the_adapter(simulated):
    """Leaving GPU 1 for a GPU 0 without a context tells torch through
    torch._C._cuda_maybeExchangeDevice, once per leave of that kind."""
    standin = simulated
    test_gpu_timeline.test_torch_keeps_its_current_device_when_the_engine_leaves_another(standin)
    assert standin.calls["_cuda_maybeExchangeDevice"] > 0, standin.calls


def test_tensor_device_of_the_adapter():
    """CUDA tensors are copied from their device's index (None: device 0);
    anything else stays."""
    t = torch.ones(1)
    assert _C._torch_tensor_device(t, torch.device("cuda", 1)) == 1
    assert _C._torch_tensor_device(t, torch.device("cuda")) == 0
    assert _C._torch_tensor_device(t, torch.device("cpu")) is None
    assert _C._torch_tensor_device(t, torch.device("meta")) is None
    with pytest.raises(AttributeError):
        _C._torch_tensor_device(t, object())


def test_cpu_tensors_stay_under_torchs_runtime():
    """The real runtime with torch's CUDA answering (the stand-in): a CPU
    tensor is no CUDA tensor, so nothing is copied and gradients are exact."""
    sim.require_test_build()
    saved = matepoint.options.min_offload_bytes
    matepoint.set_options(min_offload_bytes=0)
    try:
        with fake_torch_cuda.installed() as standin:
            model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
            _, expected = train_step(model, x, no_checkpoint)
            _, grads = train_step(model, x, matepoint.checkpoint)
            assert_bitwise_equal(grads, expected)
            assert _C._offload_copies() == []
            assert matepoint.pool_stats()["peak_device_bytes_in_flight"] == 0
            assert standin.calls == {}       # no CUDA tensor: torch.cuda never asked
            # the pool loads the CUDA runtime (libcudart, or none on a machine
            # without it: then plain host memory serves)
            matepoint.reserve_pool(1 << 12, 1)
            assert matepoint.pool_stats()["bytes_reserved"] >= 1 << 12
            matepoint.empty_pool()
    finally:
        matepoint.set_options(min_offload_bytes=saved)


def test_entry_points_are_checked_and_put_back():
    sim.require_test_build()
    before = _C._torch_cuda_entries({})
    with pytest.raises(ValueError, match="no torch CUDA entry point named 'cuda_stream'"):
        _C._torch_cuda_entries({"default_stream": len, "cuda_stream": len})
    with pytest.raises(TypeError, match="record_stream must be callable"):
        _C._torch_cuda_entries({"record_stream": 3})
    with pytest.raises(TypeError, match="must be a dict"):
        _C._torch_cuda_entries([])
    assert _C._torch_cuda_entries({}) == before          # nothing changed
    with fake_torch_cuda.installed() as standin:
        assert _C._torch_cuda_entries({}) == standin.entries()
    assert _C._torch_cuda_entries({}) == before


@pytest.mark.parametrize("missing, message", [
    ("record_stream", "torch.Tensor.record_stream"),
    ("default_stream", "torch.cuda.default_stream"),
])
def test_a_torch_without_cuda_streams_raises_a_clear_error(simulated, missing, message):
    """A torch build whose CUDA API lacks what the adapter calls: the forward
    that needs it raises naming it, and nothing stays held (the fixture)."""
    matepoint.set_options(offload_window=1)
    previous = _C._torch_cuda_entries({missing: None})
    try:
        model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH, requires_grad=True)
        with pytest.raises(RuntimeError, match=f"this torch build has no CUDA \\(no {message}\\)"):
            model(x, matepoint.checkpoint)
    finally:
        _C._torch_cuda_entries(previous)


def test_stand_in_errors_reach_the_caller(simulated):
    """torch raising inside record_stream (a stream of another device, a
    destroyed one): the forward raises it, nothing leaks, the next step is exact."""
    standin = simulated
    matepoint.set_options(offload_window=1)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)

    def fail(name: str) -> None:
        if name == "record_stream":
            raise RuntimeError("CUDA error: invalid resource handle")

    standin.inside = fail
    with pytest.raises(RuntimeError, match="invalid resource handle"):
        train_step(model, x, matepoint.checkpoint)
    standin.inside = None
    _, grads = train_step(model, x, matepoint.checkpoint)
    assert_bitwise_equal(grads, expected)


# ---- two sweeps of one window at once (issue 34, defect 1) --------------------------------

_SWEEP_SCRIPT = r'''
import sys, threading
import torch
import conftest, fake_torch_cuda, matepoint, sim
from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step
from matepoint import _C

where = sys.argv[1]
fixture = fake_torch_cuda.adapter_runtime(conftest._on_simulated_gpu(0))
standin = next(fixture)
matepoint.set_options(offload_window=1)
model, x = MLP(64, 6), torch.randn(32, 64)
_, expected = train_step(model, x, no_checkpoint)
swept = []

other, y = MLP(64, 4), torch.randn(32, 64)
_, other_expected = train_step(other, y, no_checkpoint)
other_out, started = [], []

def forward_other():
    # a second thread training on the same GPU: its regions add copies to
    # the window (and sweep it) while the first sweep is inside record_stream
    torch.manual_seed(0)
    other.zero_grad(set_to_none=True)
    inputs = y.detach().clone().requires_grad_(True)
    other_out.append((inputs, other(inputs, matepoint.checkpoint)))
    swept.append(matepoint.pool_stats())

def inside(name):
    # meanwhile the GPU ran the copy, and another sweep of the window runs:
    # a monitoring thread's pool_stats(), this thread's own, or a second
    # training thread's regions
    if name != "record_stream" or (where == "training thread" and started):
        return
    started.append(True)
    _C._sim_advance(sim.EVERYTHING)
    if where == "same thread":
        swept.append(matepoint.pool_stats())
        return
    work = forward_other if where == "training thread" else \
        (lambda: swept.append(matepoint.pool_stats()))
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()

standin.inside = inside
_, grads = train_step(model, x, matepoint.checkpoint)
standin.inside = None
assert swept, "record_stream never ran: the test proves nothing"
assert_bitwise_equal(grads, expected)
if where == "training thread":
    inputs, out = other_out.pop()
    (out.float() ** 2).mean().backward()
    other_grads = [inputs.grad] + [p.grad for p in other.parameters()]
    assert_bitwise_equal(other_grads, other_expected)
    del inputs, out
next(fixture, None)   # the fixture's checks: nothing held, every counter back to zero
print("swept", len(swept), "times inside record_stream")
'''


@pytest.mark.parametrize("where", ["same thread", "another thread", "training thread"])
def test_window_swept_again_inside_record_stream(where):
    """A forced retire calls record_stream, Python on a GPU: a second sweep
    of the same window runs inside it. Each copy is retired once, none is
    dropped from the window, gradients are exact. Before the fix the same
    copy was retired twice (an invariant aborted): hence a subprocess."""
    sim.require_test_build()
    import os
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(os.path.abspath(matepoint.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, tests]))
    done = subprocess.run([sys.executable, "-c", _SWEEP_SCRIPT, where], env=env, cwd=tests,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "swept" in done.stdout
