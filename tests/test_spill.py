"""The disk tier under the pinned pool (issue 37): with host_limit_bytes and
spill_dir, offloaded inputs past the limit go to unnamed files and come back
ahead of their recompute, gradients exact, pinned memory within the limit."""
from __future__ import annotations

import os
import stat
import warnings

import pytest
import torch
import torch.nn as nn

import matepoint

from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step

WIDTH, BATCH, DEPTH = 64, 64, 24
INPUT_BYTES = WIDTH * BATCH * 4            # one region's offloaded input (a pool class size)
LIMIT = DEPTH * INPUT_BYTES // 3          # offloaded bytes are 3x the limit


class Watched(nn.Module):
    """Checks the pool after the layer ran: in the forward and in its
    recompute alike."""

    def __init__(self, inner: nn.Module, limit: int, seen: list) -> None:
        super().__init__()
        self.inner, self.limit, self.seen = inner, limit, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        stats = matepoint.pool_stats()
        assert stats["bytes_reserved"] <= self.limit, stats
        self.seen.append(stats["bytes_reserved"])
        return out


def watched_model(limit: int, seen: list) -> MLP:
    torch.manual_seed(0)
    model = MLP(WIDTH, DEPTH)
    model.layers = nn.ModuleList(Watched(layer, limit, seen) for layer in model.layers)
    return model


def entries(path: str) -> list:
    return sorted(os.listdir(path))


@pytest.fixture
def spill_dir(tmp_path):
    path = str(tmp_path / "spill")
    yield path
    matepoint.set_options(spill_dir=None, host_limit_bytes=None)


def checked_step(spill_dir: str, limit: int):
    seen: list = []
    model, x = watched_model(limit, seen), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=limit)
    _, grads = train_step(model, x, matepoint.checkpoint)
    assert_bitwise_equal(grads, expected)
    return seen


@pytest.mark.parametrize("fixture", ["simulated", "offload"])
def test_three_times_the_limit_trains_bit_identically(request, fixture, spill_dir):
    request.getfixturevalue(fixture)
    seen = checked_step(spill_dir, LIMIT)
    stats = matepoint.pool_stats()
    assert len(seen) == 2 * DEPTH                # every op of forward and recompute checked
    assert max(seen) <= LIMIT and stats["bytes_reserved"] <= LIMIT
    assert stats["fallbacks"] == 0 and stats["spill_failures"] == 0
    assert stats["spill_writes"] >= DEPTH // 2   # the spans past the limit went to disk
    assert stats["spill_reads"] == stats["spill_writes"]
    assert stats["peak_spilled_bytes"] >= DEPTH * INPUT_BYTES - LIMIT
    assert stats["spilled_bytes"] == 0
    assert entries(spill_dir) == []


def test_a_span_larger_than_the_limit_is_never_pinned(simulated, spill_dir):
    """Nothing can make room for it: it goes to pageable memory (the pool's
    fallback), and pinned memory still stays within the limit."""
    with pytest.warns(RuntimeWarning, match="pageable"):
        seen = checked_step(spill_dir, INPUT_BYTES // 2)
    stats = matepoint.pool_stats()
    assert max(seen) <= INPUT_BYTES // 2 and stats["fallbacks"] >= DEPTH
    assert entries(spill_dir) == []
