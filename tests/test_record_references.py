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



def _live(name: str) -> list:
    return [o for o in gc.get_objects()
            if type(o).__module__ == "matepoint._C" and type(o).__name__ == name]


def test_the_collector_sees_what_backward_holds(offload) -> None:
    """While backward recomputes the last region, the inputs of the one
    before it are prefetched: their copies hold the restored data and each
    record its group. The collector must see both references, or a cycle
    through them (a user's object kept on a restored input, say) could
    never be collected."""
    calls, seen = [], []

    def fn(x, a):
        calls.append(1)
        if len(calls) == 3:         # the last region's recompute, inside backward
            seen.extend((type(o).__name__, gc.get_referents(o))
                        for o in _live("_StorageCopy") + _live("_TensorRecord"))
        return (x * a).sin()

    x, a = torch.randn(256, requires_grad=True), torch.randn(256, requires_grad=True)
    before = matepoint.pool_stats()["prefetched"]
    y = matepoint.checkpoint(fn, x, a)
    matepoint.checkpoint(fn, y, a).sum().backward()
    assert len(calls) == 4, "premise: backward recomputed both regions"
    assert matepoint.pool_stats()["prefetched"] > before, "premise: backward prefetched"
    copies = [refs for name, refs in seen if name == "_StorageCopy"]
    records = [refs for name, refs in seen if name == "_TensorRecord"]
    assert records, f"premise: the inputs were offloaded: {seen}"
    assert any(isinstance(r, torch.Tensor) for refs in copies for r in refs), copies
    for refs in records:
        assert any(type(r).__name__ == "_OffloadGroup" for r in refs), refs
