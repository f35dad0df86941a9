"""The host-device link: the copy bandwidth probe, and how much of it the
offload path reaches when copies are all there is to do."""
from __future__ import annotations

import functools
from typing import Dict

import torch

from matepoint._meter import copy_bandwidth
from matepoint._timing import time_call


def probe(megabytes: int = 256) -> Dict[str, float]:
    """Pinned host<->device bandwidth in GB/s (median of five copies each way)."""
    measured = copy_bandwidth(torch.device("cuda"), megabytes << 20)
    torch.cuda.empty_cache()  # the runs that follow, in other processes, get the memory
    return {"h2d_GBps": measured.h2d / 1e9, "d2h_GBps": measured.d2h / 1e9}


def _offload_round(inputs: list) -> list:
    """One checkpoint per input, their copies out finished; returns the outputs."""
    import matepoint
    outs = [matepoint.checkpoint(lambda t: t * 2.0, x) for x in inputs]
    torch.cuda.synchronize()
    matepoint.pool_stats()  # lets finished copies go
    return outs


def offload_throughput(d2h_GBps: float, depth: int = 16, megabytes: int = 64,
                       rounds: int = 3) -> Dict[str, float]:
    """Checkpoints whose work is trivial, so the copies out of their inputs
    are the step: GB/s offloaded and the fraction of the D2H probe, on a
    warm pool (reserved up front; a first round also warms the streams)."""
    import matepoint
    nbytes = megabytes << 20
    inputs = [torch.randn(nbytes // 4, device="cuda", requires_grad=True) for _ in range(depth)]
    matepoint.reserve_pool(nbytes, count=depth)
    _offload_round(inputs)
    before = matepoint.pool_stats()["host_allocations"]
    best = min(time_call(functools.partial(_offload_round, inputs), rounds, device="cuda"))
    gbps = depth * nbytes / best / 1e9
    return {"offload_GBps": gbps, "fraction_of_d2h": gbps / d2h_GBps,
            "host_allocations_while_measured": matepoint.pool_stats()["host_allocations"] - before}
