"""The simulated GPU of test builds (csrc/testing/cudart_sim.h), for tests.

CPU tensors stand for device tensors: matepoint's allocator library, running
over the simulated runtime, replaces torch's CPU allocator, so every tensor
lives in one simulated device's memory, is handed out on the thread's
current stream of the thread's current device, is reused in stream order
only, and is filled with NaN bytes when handed out (memory reused while a
copy still reads or writes it shows up as wrong data). Each allocation
first lets its stream catch up: the "GPU" otherwise lags as far as a test
likes.

as_on_cuda() makes the rest as on a GPU: kernels lag in data
(sim_kernels.py: an op's output reads as poison until its stream reaches
it), and backward runs on a worker thread per device, each node on the
device and stream it was created under (sim_autograd.py)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Iterator, List, Optional, Tuple

import pytest

from matepoint import _C, _oom
from matepoint._allocator import allocator_path
import sim_autograd
import sim_kernels

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "c", "host_cpu_allocator.cpp")
EVERYTHING = 1 << 62   # operations per call: a GPU that keeps up with the CPU

_memory: Optional[Tuple[ctypes.CDLL, ctypes.CDLL, int]] = None
_side_streams: List[int] = []
# unmap faults a test provoked on purpose and judged itself (the
# simulated fixtures fail a test on any other): unmap_faults_judged()
_judged_unmap_faults = 0


def require_test_build() -> None:
    """The simulated GPU exists only in test builds (MATEPOINT_TESTING=1)."""
    if getattr(_C, "TEST_BUILD", 0):
        return
    message = "needs a test build: MATEPOINT_TESTING=1 pip install -e . (make test does)"
    if os.environ.get("MATEPOINT_TESTING") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _attach() -> Tuple[ctypes.CDLL, ctypes.CDLL, int]:
    """Once per process: the allocator library over the simulated GPU, its
    out-of-memory handler, and the CPU-allocator harness."""
    global _memory
    if _memory is None:
        path = allocator_path()
        library = ctypes.CDLL(path)
        where = _C._sim_attach_allocator(path)
        assert _oom.attach_oom_handler(library), "the OOM unit could not be built"
        harness = _oom.load_library(HARNESS, "host_cpu_allocator")
        _memory = (library, harness, where)
    return _memory


def allocator_library() -> ctypes.CDLL:
    """The allocator library serving the simulated devices' memory."""
    return _attach()[0]


@contextlib.contextmanager
def device_memory(enabled: bool = True) -> Iterator[Optional[ctypes.CDLL]]:
    """torch's CPU tensors come from the simulated devices meanwhile (or,
    not `enabled`, from torch's own allocator as before)."""
    if not enabled:
        yield None
        return
    library, harness, where = _attach()
    pointer = ctypes.c_void_p
    harness.matepoint_test_use_sim_cpu_allocator(
        ctypes.cast(library.matepoint_malloc, pointer), ctypes.cast(library.matepoint_free, pointer),
        pointer(where))
    try:
        yield library
    finally:
        harness.matepoint_test_restore_cpu_allocator()


@contextlib.contextmanager
def device(index: int) -> Iterator[None]:
    """cudaSetDevice for the block (torch.cuda.device)."""
    previous = _C._sim_get_device()
    _C._sim_set_device(index)
    try:
        yield
    finally:
        _C._sim_set_device(previous)


@contextlib.contextmanager
def stream(index: int, handle: Optional[int]) -> Iterator[None]:
    """torch.cuda.stream: `handle` is the current stream of device `index`,
    with the waits a correct program makes around a side stream (its
    kernels lag in data: without them it reads poison): the side stream
    waits for the current one first (s.wait_stream(current)), and the
    current one for the side stream after (current.wait_stream(s))."""
    previous = _C._sim_current_stream(index)
    _C._sim_order_streams(index, handle, index, previous)
    _C._sim_set_stream(index, handle)
    try:
        yield
    finally:
        _C._sim_set_stream(index, previous)
        _C._sim_order_streams(index, previous, index, handle)


def install_adapter() -> ctypes.CDLL:
    """matepoint's allocator, serving the simulated GPU, made torch's CUDA
    allocator through the C++ adapter (for the rest of the process: the
    adapter tests run in a subprocess of their own); its library."""
    from matepoint import _adapter
    require_test_build()
    library, _, _ = _attach()
    _adapter.install(library)
    _C._attach_allocator(allocator_path())
    return library


def empty_device_cache() -> None:
    """torch.cuda.empty_cache() for the simulated devices' allocator: its
    cached segments and the completed events it keeps for reuse (at most
    64 a device) go back."""
    library, _, _ = _attach()
    library.matepoint_reset.argtypes = []
    library.matepoint_reset.restype = None
    library.matepoint_reset()


@contextlib.contextmanager
def unmap_faults_judged() -> Iterator[None]:
    """Unmap faults made inside (_sim_stats()["unmap_faults"]: memory freed
    under another stream's queued work, the simulated fixtures' check) are
    the test's own to judge: a proof that a wait is needed provokes one."""
    global _judged_unmap_faults
    before = _C._sim_stats()["unmap_faults"]
    try:
        yield
    finally:
        _judged_unmap_faults += _C._sim_stats()["unmap_faults"] - before


def unjudged_unmap_faults() -> int:
    """The unmap faults so far, but those a test judged itself."""
    return _C._sim_stats()["unmap_faults"] - _judged_unmap_faults


def record_stream(tensor, index: int, handle: Optional[int]) -> None:
    """tensor.record_stream(stream) for `handle` of device `index`: the
    memory goes back to the stream that allocated it only once the work
    queued on `handle` so far ran."""
    library, _, _ = _attach()
    library.matepoint_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    library.matepoint_record_stream.restype = None
    with device(index):
        library.matepoint_record_stream(tensor.untyped_storage().data_ptr(), handle)


def side_streams() -> List[int]:
    """Two streams of device 0 besides its legacy one, made once per process:
    the allocator keys cached blocks by stream, and a destroyed handle's
    address may come back as another stream's."""
    if not _side_streams:
        _side_streams.extend(_C._sim_stream_create(0) for _ in range(2))
    return list(_side_streams)


def long_lived_streams() -> int:
    return len(_side_streams)


@contextlib.contextmanager
def as_on_cuda(lag: bool = True) -> Iterator[None]:
    """Backward as on CUDA (sim_autograd.py) and, with `lag`, kernels that
    lag in data (sim_kernels.py) meanwhile. `lag` needs every tensor in the
    simulated devices' memory (device_memory()): a write landing late into
    memory torch's own allocator already gave back would corrupt the heap."""
    with sim_autograd.backward_as_on_cuda(), _in_new_threads(lag), _lagging(lag):
        yield


@contextlib.contextmanager
def _lagging(lag: bool) -> Iterator[None]:
    if not lag:
        yield
        return
    with sim_kernels.LaggingKernels():
        yield


@contextlib.contextmanager
def _modes(lag: bool) -> Iterator[None]:
    with sim_autograd.StreamTags(), _lagging(lag):
        yield


@contextlib.contextmanager
def _in_new_threads(lag: bool) -> Iterator[None]:
    """torch's modes are per thread: a thread a test starts meanwhile runs
    under them too (on a GPU every thread's ops are kernels), but the
    backward workers, which take their caller's."""
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        if getattr(self, "simulated_gpu_worker", False):
            return original(self)
        with _modes(lag):
            return original(self)

    threading.Thread.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.run = original  # type: ignore[method-assign]


def finish() -> None:
    """Let the "GPU" run everything queued; nothing may wait forever."""
    _C._sim_advance(EVERYTHING)
    assert _C._sim_stats()["ops_queued"] == 0, "queued work waits forever"


def assert_no_cuda_error() -> None:
    """None on this thread, nor on the backward threads (as of their last
    backward)."""
    assert _C._sim_peek_last_error() == 0, f"CUDA last error left: {_C._sim_peek_last_error()}"
    left = {device: error for device, error in sim_autograd.workers_last_errors().items() if error}
    assert not left, f"CUDA last error left on a backward thread: {left}"
