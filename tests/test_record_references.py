"""What an offloaded input's record holds it gives back when it dies:
counted on objects every tensor shares, where one reference kept per
step shows at once (test_refcounts.py counts matepoint's own types)."""
from __future__ import annotations

import gc
import sys

import torch

import matepoint
from test_refcounts import offloaded_inputs, reachable_types, steps

STEPS = 20


def test_offload_records_give_back_what_they_hold(offload) -> None:
    """An offloaded input's record holds its dtype (a torch object every
    tensor of that dtype shares): the record gives it back when it dies,
    or every step would add references to torch.float32."""
    def growth() -> int:
        gc.collect()
        before = sys.getrefcount(torch.float32)
        steps(offloaded_inputs)()
        gc.collect()
        return sys.getrefcount(torch.float32) - before

    steps(offloaded_inputs)()                   # warm-up
    offloads = matepoint.pool_stats()["hits"] + matepoint.pool_stats()["misses"]
    grown = [growth() for _ in range(STEPS)]
    assert matepoint.pool_stats()["hits"] + matepoint.pool_stats()["misses"] > offloads, \
        "premise: the inputs went through the offload path"
    assert sum(grown) <= 0, grown


def test_the_garbage_collector_walks_every_offload_object(offload) -> None:
    """gc.get_referents (the walk the collector makes) goes through each
    object of an offloaded input: a traversal that stopped early would
    raise there, and would hide references from the collector."""
    reached = {kind.__name__ for kind in reachable_types(offloaded_inputs)}
    assert {"_OffloadGroup", "_TensorRecord", "_StorageCopy"} <= reached, reached

