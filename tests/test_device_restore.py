"""The engine makes the thread's earlier CUDA device current again after
work on another device; where CUDA refuses (cudaSetDevice fails), it says
so, as torch's device guards warn, instead of leaving the thread on the
other device without a word, and leaves no CUDA error for torch's next
launch. Found by the review of the offload floors (issue 54)."""
from __future__ import annotations

import warnings

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
