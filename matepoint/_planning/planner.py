"""Budget planner: per block of a chain, keep its activations, recompute it,
recompute it and offload its input, or recompute it selectively (keeping the
outputs of its matmuls, convolutions and attention, or offloading them with
its input), so that activation memory fits a budget at the least step time.

``matepoint.plan(blocks, x, budget_bytes=...)`` profiles each block once,
solves the choice exactly in C (csrc/planner) and returns a :class:`Plan`
that prints as a table, wraps the blocks and saves to JSON.

The planner is one package, ``matepoint._planning``, one file per concept
(docs/architecture.md, "The Python package"): arguments (argument checks),
choices (the choices and what each runs), block_profile (what a block
costs, and its record for C), profiling, solve, plan_record
(:class:`Plan`), ranks, step_meter and autoplan (planning from training
steps); this file is the entry point and names what the others export.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Optional, Tuple

from matepoint import _C
from matepoint._meter import copy_bandwidth
from matepoint._options import settings
from matepoint._planning.arguments import (Blocks, _check_blocks, _check_plan_arguments, _device_of,
                                           _tensors_in)
from matepoint._planning.block_profile import BlockProfile, PolicyFigures, head_profile
from matepoint._planning.choices import CHOICES, PlannedBlock, apply_choice, planned_choice
from matepoint._planning.plan_record import Plan, PlanError
from matepoint._planning.profiling import profile_block, profile_blocks, reduce_profiles
from matepoint._planning.ranks import check_group
from matepoint._planning.solve import default_unit, predict, solve

__all__ = ["BlockProfile", "CHOICES", "Plan", "PlanError", "PlannedBlock", "PolicyFigures",
           "apply_choice", "auto_checkpoint", "default_unit", "head_profile",
           "no_offload_reason", "plan", "planned_choice", "predict", "profile_block",
           "profile_blocks", "reduce_profiles", "solve"]

log = logging.getLogger("matepoint.planner")


def plan(blocks: Blocks, *sample_inputs: Any, budget_bytes: int,
         unit_bytes: Optional[int] = None, pipeline: Optional[bool] = None,
         bandwidth_bytes_per_s: Optional[float] = None, repeats: int = 3,
         group: Optional[Any] = None) -> Plan:
    """Chooses keep, recompute, offload, selective or attention-only per block.

    Args:
        blocks: run in order, each on the previous one's output (as
            ``nn.Sequential`` does): an ``nn.Sequential``, an ``nn.ModuleList``
            or a list of callables.
        *sample_inputs: what the first block receives, with the batch you
            will train on (profiling runs each block on them).
        budget_bytes: bounds the activation memory of a step (what autograd
            keeps for backward, plus the recompute of one block), not
            parameters, their gradients (counted as already allocated) or
            optimizer state. A positive int.
        unit_bytes: the solver's memory quantum (sizes are rounded up to it);
            default: a power of two keeping its tables near 100k units.
        pipeline: whether backward prefetches offloaded inputs (default: the option).
        bandwidth_bytes_per_s: the device-host copy bandwidth (default: measured).
        repeats: how many times each block is run to time it.
        group: the process group that plans together (None: the default).

    Under ``torch.distributed`` every rank of ``group`` must call it: one plan for all.
    Offload is planned only where the engine would offload (CUDA tensors, the
    ``offload`` option on, ``min_offload_bytes``); otherwise no choice offloads
    and the plan's ``note`` says why (choices: :class:`PlannedBlock`).

    Returns:
        A :class:`Plan`.

    Raises:
        PlanError: no plan fits; it names the smallest feasible budget.
        TypeError, ValueError: a bad argument, named in the message.
        RuntimeError: a block failed while being profiled (names its index).
    """
    blocks_list = _check_blocks(blocks, "matepoint.plan")
    _check_plan_arguments(budget_bytes, unit_bytes, pipeline, bandwidth_bytes_per_s, repeats)
    check_group("matepoint.plan", group)
    device = _device_of(sample_inputs)
    options = settings.current
    if pipeline is None:
        pipeline = options.pipeline
    note = no_offload_reason(sample_inputs)
    if note is None and options.prefetch_depth > 1:
        log.warning("matepoint.plan counts one prefetched input in backward; prefetch_depth=%d "
                    "holds more", options.prefetch_depth)
    # without offload the copy time plays no part: no need to measure it
    if bandwidth_bytes_per_s is not None:
        bandwidth = bandwidth_bytes_per_s
    else:
        bandwidth = copy_bandwidth(device).d2h if note is None else math.inf
    # every rank solves the same problem: timings differ per process
    profiles = reduce_profiles(profile_blocks(blocks_list, sample_inputs, bandwidth, repeats),
                               group)
    return solve(profiles, budget_bytes, unit_bytes or default_unit(budget_bytes), bool(pipeline),
                 offload=note is None, note=note or "")


def no_offload_reason(sample_inputs: Tuple) -> Optional[str]:
    """Why no input of a chain run on ``sample_inputs`` can be offloaded
    under the current options, or None when offload can run."""
    options = settings.current
    if not options.offload:
        return "offload not planned: matepoint's offload option is off"
    devices = {t.device.type for t in _tensors_in(sample_inputs)}
    if _C._offload_device_type() not in devices:
        return "offload not planned: the inputs are not on a GPU (offload needs CUDA tensors)"
    return None


def auto_checkpoint(blocks: Blocks, *sample_inputs: Any, budget_bytes: int,
                    **plan_options: Any) -> Blocks:
    """Deprecated (FutureWarning): ``plan(blocks, *sample_inputs, budget_bytes=B)
    .apply(blocks)`` does the same and keeps the :class:`Plan`.
    ``**plan_options``: the other keywords of :func:`plan`.
    """
    warnings.warn("matepoint.auto_checkpoint is deprecated: use matepoint.plan(blocks, "
                  "*sample_inputs, budget_bytes=...).apply(blocks), which does the same and "
                  "returns the Plan", FutureWarning, stacklevel=2)
    return plan(blocks, *sample_inputs, budget_bytes=budget_bytes, **plan_options).apply(blocks)
