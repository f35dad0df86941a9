"""The engine makes the thread's earlier CUDA device current again after
work on another device; where CUDA refuses (cudaSetDevice fails), it says
so, as torch's device guards warn, instead of leaving the thread on the
other device without a word, and leaves no CUDA error for torch's next
launch. Found by the review of the offload floors (issue 54)."""
from __future__ import annotations

import contextlib
import os
import resource
import warnings
from typing import Iterator

import pytest
import torch

import matepoint
import sim
from matepoint import _C

from conftest import assert_bitwise_equal, no_checkpoint, train_step
from test_cuda_failures import FAILURE, calls, fresh_engine
from test_gpu_timeline import TwoDevices

WIDTH, BATCH = 64, 32


def _step_with_set_device_failing(model, x, position: int):
    """A step with cudaSetDevice #position failing: (grads or None, the
    warnings' texts, the thread's device after it)."""
    fresh_engine()
    _C._sim_set_device(0)
    _C._sim_fail("cudaSetDevice", position, 1, FAILURE)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                grads = train_step(model, x, matepoint.checkpoint)[1]
            except RuntimeError:
                grads = None
    finally:
        _C._sim_fail("cudaSetDevice", 0, 0, 0)
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return grads, texts, _C._sim_get_device()


def test_a_device_left_current_after_a_failed_restore_is_warned_about(simulated) -> None:
    model, x = TwoDevices(depth=2), torch.randn(BATCH, WIDTH)
    expected = train_step(model, x, no_checkpoint)[1]
    fresh_engine()
    _C._sim_set_device(0)
    before = calls().get("cudaSetDevice", 0)
    train_step(model, x, matepoint.checkpoint)
    positions = calls().get("cudaSetDevice", 0) - before
    left_behind = 0
    for position in range(positions):
        grads, texts, device = _step_with_set_device_failing(model, x, position)
        sim.finish()
        assert _C._sim_peek_last_error() == 0, f"#{position}: a CUDA error left for torch"
        if grads is None or device == 0:
            _C._sim_set_device(0)
            continue
        left_behind += 1   # the step ran on, but the thread stayed on another device
        assert_bitwise_equal(grads, expected)
        assert any(f"this thread's current device stays {device}" in text
                   and "cudaSetDevice(0) failed" in text for text in texts), (position, texts)
        _C._sim_set_device(0)
    assert left_behind > 0, "no failed cudaSetDevice left the thread on another device"


def test_a_copy_back_to_another_device_leaves_the_thread_on_its_own(offload) -> None:
    """An input of GPU 1 offloaded, its GPU copy let go (offload_window=1
    and two regions after it), and copied back while GPU 0 is this
    thread's current device: the copy back runs on GPU 1, and afterwards
    GPU 0 is current again (for CUDA, and as torch.cuda.current_device()
    answers), with the data back exact."""
    matepoint.set_options(offload_window=1)
    with sim.device(1):
        source = torch.randn(BATCH, WIDTH)
        group, saved = _C._sac_offload([source], True)
        later = [_C._sac_offload([torch.randn(BATCH, WIDTH) * 1], True) for _ in range(2)]
    expected = source.clone()
    del source
    assert _C._sim_get_device() == 0
    before = matepoint.pool_stats()
    (restored,) = _C._sac_restore(group, saved)
    device_after = (_C._sim_get_device(), _C._sim_torch_device())
    after = matepoint.pool_stats()
    for other, _ in later:
        _C._sac_discard(other)
    assert after["fetched_at_need"] - before["fetched_at_need"] == 1, "not copied back"
    assert device_after == (0, 0), "the thread was left on GPU 1"
    assert torch.equal(restored, expected)


MIB = 1 << 20


@contextlib.contextmanager
def _address_space_capped(room: int) -> Iterator[None]:
    """The process may map only `room` bytes more meanwhile (as a memory
    limit leaves a container's host): a larger span gets neither pinned
    nor pageable host memory."""
    saved = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    cap = kib * 1024 + room
    if saved[1] != resource.RLIM_INFINITY:
        cap = min(cap, saved[1])
    resource.setrlimit(resource.RLIMIT_AS, (cap, saved[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, saved)


# AddressSanitizer's allocator stops the process when the address space runs out
@pytest.mark.skipif(bool(os.environ.get("MATEPOINT_SANITIZED")), reason="checked in the plain run")
def test_an_input_of_another_gpu_the_host_has_no_memory_for_stays_there(simulated) -> None:
    """A block on GPU 1 checkpointed while GPU 0 is current, its 128 MiB
    input finding no host memory at all (no pinned buffer, no pageable
    one): the forward still succeeds with the input left on GPU 1, GPU 0
    is current again afterwards (for CUDA, and as torch.cuda.current_device()
    answers), and the gradients equal those without checkpointing."""
    with sim.device(1):
        x = torch.randn(128 * MIB // 4)

    def on_gpu_1(t: torch.Tensor) -> torch.Tensor:
        with sim.device(1):
            return torch.linalg.vector_norm(t)

    leaf = x.detach().requires_grad_(True)
    on_gpu_1(leaf).backward()         # also starts the threads its kernels use
    expected = leaf.grad
    before = matepoint.pool_stats()["failures"]
    leaf = x.detach().requires_grad_(True)
    with _address_space_capped(32 * MIB):
        out = matepoint.checkpoint(on_gpu_1, leaf, preserve_rng_state=False)
        device_after = (_C._sim_get_device(), _C._sim_torch_device())
        copies = _C._offload_copies()
    failures = matepoint.pool_stats()["failures"] - before
    out.backward()
    assert failures == 1, "the pool did get host memory for the input"
    assert copies == [], "the input did not stay on GPU 1"
    assert device_after == (0, 0), "the thread was left on GPU 1"
    assert_bitwise_equal([leaf.grad], [expected])
