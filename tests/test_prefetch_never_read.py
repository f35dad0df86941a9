"""A span prefetched and never read: its device buffer came from the
compute stream's pool and the copy-in stream writes it. When backward
stops before reaching its region (torch.autograd.grad with respect to an
intermediate tensor, or an error half-way), the copy dies with that buffer
unread: it goes back to the compute stream's pool at once, and the next
allocations there get memory the copy back may still write on a real GPU.

Shown on the simulated GPU far behind the CPU: after such a backward, new
tensors on the compute stream must hold what their kernels wrote.

The fix: offload_restore.c's fetch_copy marks a prefetched buffer used by
the copy-in stream (record_stream), so it goes back to the compute
stream's pool only once that stream passed the copy. Without it, 1152
elements come out wrong. tests/test_waits_needed.py cites this test as the
proof that record_stream is needed."""
from __future__ import annotations

import gc

import pytest
import torch

import matepoint
import sim

from conftest import MLP

WIDTH, BATCH, DEPTH = 64, 32, 6


def test_memory_of_spans_prefetched_and_never_read_is_reused_after_the_copy(simulated) -> None:
    matepoint.set_options(offload_window=1, prefetch_depth=2)
    torch.manual_seed(0)
    model = MLP(WIDTH, DEPTH)
    h = torch.randn(BATCH, WIDTH, requires_grad=True)
    outputs = []
    for layer in model.layers:
        h = matepoint.checkpoint(layer, h)
        outputs.append(h)
    before = matepoint.pool_stats()["prefetched"]
    # backward stops at the third region's output: the regions before it
    # were prefetched and are never recomputed
    torch.autograd.grad((h.float() ** 2).mean(), [outputs[2]])
    assert matepoint.pool_stats()["prefetched"] > before
    del h, outputs
    gc.collect()
    results = []
    for _ in range(8):                      # spans' size: BATCH * WIDTH floats
        results.append(torch.zeros(BATCH * WIDTH) + 1.0)
    sim.finish()
    wrong = sum(int((result != 1.0).sum()) for result in results)
    assert wrong == 0, f"{wrong} elements overwritten by a copy back into memory reused early"
