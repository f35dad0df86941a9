"""The host-device link: the copy bandwidth probe, and how much of it the
offload path reaches when copies are all there is to do."""
from __future__ import annotations

from typing import Dict

import torch

from matepoint._meter import copy_bandwidth


def probe(megabytes: int = 256) -> Dict[str, float]:
    """Pinned host<->device bandwidth in GB/s (median of five copies each way)."""
    measured = copy_bandwidth(torch.device("cuda"), megabytes << 20)
    torch.cuda.empty_cache()  # the runs that follow, in other processes, get the memory
    return {"h2d_GBps": measured.h2d / 1e9, "d2h_GBps": measured.d2h / 1e9}


def offload_throughput(d2h_GBps: float, depth: int = 16, megabytes: int = 64,
                       rounds: int = 3) -> Dict[str, float]:
    """Checkpoints whose work is trivial, so the copies out of their inputs
    are the step: GB/s offloaded and the fraction of the D2H probe, on a
    warm pool (``python -m matepoint check``'s measure of it, on this GPU)."""
    from matepoint.bench.selfcheck.link_checks import offload_rate
    from matepoint.bench.selfcheck.target import CudaTarget
    figures = offload_rate(CudaTarget(), d2h_GBps * 1e9, depth, megabytes << 20, rounds)
    return {key: figures[key] for key in ("offload_GBps", "fraction_of_d2h",
                                          "host_allocations_while_measured")}
