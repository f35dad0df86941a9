"""The host-device link: pinned copy bandwidth each way, how much of it the
offload path reaches when copying out is all a step does (bytes moved /
time / the probe's D2H bandwidth, on a warm pool), and how many times a
training step that offloads makes the host wait for the GPU, against the
same step under torch's checkpoint (the claim: offload adds none)."""
from __future__ import annotations

import functools
from typing import Any, Dict, List

import torch

from matepoint.bench.selfcheck.outcome import CheckFailed, counted, options_kept
from matepoint.bench.selfcheck.training_checks import assert_settled, chain, torch_checkpoint
from matepoint._timing import time_call

# the least share of the D2H probe the offload path must reach on a GPU
# (transfer-bound, warm pool; a copy engine kept busy reaches most of it)
LINK_FLOOR = 0.5


def _pinned(nbytes: int, count: int) -> None:
    """``count`` pinned buffers of ``nbytes`` in the pool, as offload takes them."""
    import matepoint
    try:
        matepoint.reserve_pool(nbytes, count=count)
    except MemoryError as error:
        raise CheckFailed(f"pinning {count} host buffer(s) of {nbytes} bytes failed: "
                          f"{error}") from None


def _doubled(t: torch.Tensor) -> torch.Tensor:
    return t * 2.0


def _offload_round(target: Any, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    """One checkpoint per input, their copies out finished."""
    import matepoint
    outs = [matepoint.checkpoint(_doubled, x) for x in inputs]
    target.synchronize()
    matepoint.pool_stats()  # lets finished copies go
    return outs


def offload_rate(target: Any, d2h_bytes_per_s: float, count: int, nbytes: int,
                 rounds: int = 3) -> Dict[str, Any]:
    """Checkpoints whose work is trivial, so the copies out of their inputs
    are the step: GB/s offloaded and the fraction of ``d2h_bytes_per_s``, on
    a warm pool (reserved up front; a first round also warms the streams),
    and what the pool did while measured. The benchmark's figure too
    (matepoint/bench/link.py)."""
    import matepoint
    inputs = [torch.randn(nbytes // 4, device=target.device, requires_grad=True)
              for _ in range(count)]
    _pinned(nbytes, count)
    _offload_round(target, inputs)
    before = matepoint.pool_stats()
    best = min(time_call(functools.partial(_offload_round, target, inputs), rounds,
                         device=target.timing_device()))
    pool = counted(before, matepoint.pool_stats(), ["hits", "misses", "host_allocations",
                                                    "fallbacks"])
    rate = count * nbytes / best
    return {"offload_GBps": rate / 1e9, "fraction_of_d2h": rate / d2h_bytes_per_s,
            "host_allocations_while_measured": pool["host_allocations"],
            "fallbacks_while_measured": pool["fallbacks"],
            "offloaded_while_measured": pool["hits"] + pool["misses"],
            "expected_offloads": rounds * count}


def check_copy_bandwidth(target: Any) -> Dict[str, Any]:
    import matepoint
    nbytes = target.link_bytes
    _pinned(nbytes, 1)
    matepoint.empty_pool()
    measured = target.copy_bandwidth(nbytes)
    return {"bytes": nbytes, "h2d_GBps": measured.h2d / 1e9, "d2h_GBps": measured.d2h / 1e9}


def check_link_use(target: Any) -> Dict[str, Any]:
    nbytes = target.link_bytes
    d2h = target.copy_bandwidth(nbytes).d2h
    with options_kept(offload=True, min_offload_bytes=min(target.min_offload_bytes, nbytes)):
        figures = offload_rate(target, d2h, target.link_inputs, nbytes)
        assert_settled(target)
    figures["d2h_probe_GBps"] = d2h / 1e9
    if figures["offloaded_while_measured"] != figures["expected_offloads"]:
        raise CheckFailed(f"premise: {figures['offloaded_while_measured']} of "
                          f"{figures['expected_offloads']} inputs were offloaded while measured")
    if figures["host_allocations_while_measured"] or figures["fallbacks_while_measured"]:
        raise CheckFailed(f"the pool was not reused while measured: "
                          f"{figures['host_allocations_while_measured']} new pinned buffers, "
                          f"{figures['fallbacks_while_measured']} offloads to pageable memory")
    if target.judges_speed and figures["fraction_of_d2h"] < LINK_FLOOR:
        raise CheckFailed(f"the offload path moved {figures['offload_GBps']:.1f} GB/s, "
                          f"{figures['fraction_of_d2h']:.0%} of the D2H probe's "
                          f"{d2h / 1e9:.1f} GB/s (at least {LINK_FLOOR:.0%} expected)")
    return figures


def _step(blocks: Any, x: torch.Tensor, wrap: Any) -> None:
    """Forward and backward, nothing waited for."""
    blocks.zero_grad(set_to_none=True)
    h = x.detach().requires_grad_(True)
    for block in blocks:
        h = wrap(block, h)
    (h.float() ** 2).mean().backward()


def check_host_waits(target: Any) -> Dict[str, Any]:
    """A warm training step with offload and prefetch: the host waits for
    the GPU no more often than in the same step under torch's checkpoint
    (synchronizing runtime calls, and offloads to pageable memory, whose
    copies synchronize)."""
    import matepoint
    with options_kept(offload=True, pipeline=True, prefetch_depth=1,
                      min_offload_bytes=target.min_offload_bytes):
        blocks, x = chain(target)
        for wrap in (torch_checkpoint, matepoint.checkpoint):    # warm: pool, streams
            _step(blocks, x, wrap)
            target.synchronize()
        before = matepoint.pool_stats()
        _, mine = target.count_host_waits(lambda: _step(blocks, x, matepoint.checkpoint))
        pageable = counted(before, matepoint.pool_stats(), ["fallbacks"])["fallbacks"]
        target.synchronize()
        _, theirs = target.count_host_waits(lambda: _step(blocks, x, torch_checkpoint))
        target.synchronize()
        assert_settled(target)
    figures = {"host_waits_per_step": mine, "pageable_offloads_per_step": pageable,
               "torch_checkpoint_host_waits_per_step": theirs}
    if mine + pageable > theirs:
        raise CheckFailed(f"a training step that offloads made the host wait for the GPU "
                          f"{mine + pageable} times ({mine} synchronizing calls, {pageable} "
                          f"offloads to pageable memory), the same step under torch's "
                          f"checkpoint {theirs}")
    return figures
