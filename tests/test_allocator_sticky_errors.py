"""A CUDA error that is not out of memory, met by matepoint's allocator.

CUDA's errors from a faulting kernel are sticky: once a kernel made an
illegal memory access (CUDA error 700), every later call of the process
fails with it, cudaMalloc included. torch's own allocator then raises that
error. matepoint's allocator said "CUDA out of memory. Tried to allocate
... GPU 0 has a total capacity of 0 bytes" instead: a debugging trap, and
a retry bait for code that catches out of memory and tries a smaller
batch. On the simulated GPU, a cudaMalloc failing with 700 must surface
as that CUDA error, and a real out of memory still as out of memory."""
from __future__ import annotations

import pytest
import torch

import sim
from matepoint import _C

ILLEGAL_ADDRESS = 700
MEMORY_ALLOCATION = 2
LARGE = 16 << 20        # elements: a new segment, so cudaMalloc runs


def test_a_sticky_cuda_error_in_cudamalloc_is_not_reported_as_out_of_memory(offload):
    side, _ = sim.side_streams()
    with sim.stream(0, side):
        _C._sim_fail("cudaMalloc", 0, 1, ILLEGAL_ADDRESS)
        try:
            with pytest.raises(RuntimeError) as raised:
                torch.empty(LARGE)
        finally:
            _C._sim_fail("cudaMalloc", 0, 0, 0)
    message = str(raised.value)
    assert not message.startswith("CUDA out of memory"), message
    assert "cudaMalloc failed" in message and f"CUDA error {ILLEGAL_ADDRESS}" in message, message
    assert _C._sim_take_last_error() == 0


def test_out_of_memory_is_still_out_of_memory(offload):
    side, _ = sim.side_streams()
    with sim.stream(0, side):
        _C._sim_fail("cudaMalloc", 0, 2, MEMORY_ALLOCATION)     # the call and its retry
        try:
            with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
                torch.empty(LARGE)
        finally:
            _C._sim_fail("cudaMalloc", 0, 0, 0)
