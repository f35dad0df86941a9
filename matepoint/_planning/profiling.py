"""Profiling: each block of a chain measured once (times under every
choice, saved bytes, peaks, what an offload would leave on the device by
the engine's own rule), and the figures reduced over the ranks of a
process group so that every rank plans the same."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import statistics
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from matepoint import _C
from matepoint._composable import _call, is_checkpointed, uncheckpoint_module
from matepoint._meter import PeakMeter, TensorMeter, saved_tensor_bytes
from matepoint._planning.arguments import _device_of, _tensors_in
from matepoint._planning.block_profile import BlockProfile, PolicyFigures
from matepoint._planning.choices import _CONTEXTS, _choice_options
from matepoint._planning.ranks import distributed, reduce_max
from matepoint._timing import time_call

log = logging.getLogger("matepoint.planner")
# The least a selective or recompute run is taken to cost over keeping, relative.
_OVER_KEEP = 1e-6


def reduce_profiles(profiles: List[BlockProfile], group: Optional[Any] = None,
                    where: str = "matepoint.plan") -> List[BlockProfile]:
    """``profiles`` with each figure replaced by its max over the ranks of
    ``group`` (None: the default process group); a figure some rank did not
    measure (None) is None on all. Unchanged when torch.distributed is not
    initialized. A collective: every rank of the group must call it with the
    same number of blocks (:func:`matepoint._planning.ranks.reduce_max`)."""
    if not distributed(group):
        return profiles
    # infinity stands for None (and a policy not measured): the max of it is
    # defined (NaN's is not) and no measured figure is infinite
    rows = [[math.inf if v is None else float(v) for v in _figures(p).values()]
            for p in profiles]
    names = list(_figures(profiles[0])) if profiles else []
    return [_from_figures(dict(zip(names, row))) for row in reduce_max(rows, where, group)]


# A profile's figures by name, a policy's as "policy.field", every policy
# of _C.PLAN_POLICIES present (None where not measured): what the ranks
# reduce, name for name.
_BLOCK_FIGURES = [f.name for f in dataclasses.fields(BlockProfile) if f.name != "policies"]
_POLICY_FIGURES = [f.name for f in dataclasses.fields(PolicyFigures)]


def _figures(profile: BlockProfile) -> Dict[str, Optional[float]]:
    figures = {name: getattr(profile, name) for name in _BLOCK_FIGURES}
    for policy in _C.PLAN_POLICIES:
        measured = profile.policies.get(policy)
        figures.update({f"{policy}.{name}": None if measured is None else getattr(measured, name)
                        for name in _POLICY_FIGURES})
    return figures


def _from_figures(figures: Dict[str, float]) -> BlockProfile:
    """The profile of reduced ``figures`` (infinite: not measured)."""
    def value(name: str, number: float) -> Optional[float]:
        """A time stays a float, a size becomes an int again."""
        return None if math.isinf(number) else number if name.endswith("_s") or \
            name == "seconds" else int(number)
    policies = {}
    for policy in _C.PLAN_POLICIES:
        own = {name: value(name, figures[f"{policy}.{name}"]) for name in _POLICY_FIGURES}
        if own["seconds"] is not None:
            policies[policy] = PolicyFigures(**own)
    return BlockProfile(**{name: value(name, figures[name]) for name in _BLOCK_FIGURES},
                        policies=policies)


def _storage_bytes(tensors: List[torch.Tensor], resident: AbstractSet[int] = frozenset()) -> int:
    """Bytes of the distinct storages of ``tensors``, those whose data
    pointer is in ``resident`` left out."""
    seen: Dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in resident:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _detached(value: Any, requires_grad: bool = False) -> Any:
    """``value`` with every tensor in it cut from its graph."""
    if isinstance(value, torch.Tensor):
        leaf = value.detach()
        return leaf.requires_grad_(True) if requires_grad and leaf.is_floating_point() else leaf
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v, requires_grad) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v, requires_grad) for k, v in value.items()}
    return value


def _fresh_inputs(args: Tuple) -> Tuple:
    """The block's inputs as leaves, so one block's backward runs alone."""
    return _detached(args, requires_grad=True)


def _timed_in_turn(runs: List[Callable[[], Any]], device: torch.device,
                   repeats: int) -> List[float]:
    """The median seconds of each of ``runs``, timed in turn ``repeats``
    times over: a burst of load on a shared machine then falls on every run
    alike (timed one after the other, it fell on whichever ran during it,
    and the planner compared choices measured under different loads)."""
    samples: List[List[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, times in zip(runs, samples):
            times.extend(time_call(run, 1, device=device))
    return [statistics.median(times) for times in samples]


def _backward(out: Any) -> None:
    outputs = [t for t in _tensors_in(out) if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def profile_block(block: Callable, args: Tuple, bandwidth: float, repeats: int,
                  owner: Optional[nn.Module] = None,
                  resident: Optional[set] = None,
                  neighbour: Optional[BlockProfile] = None) -> Tuple[BlockProfile, Any]:
    """Measures one block on ``args``; returns its profile and its output
    (detached: profiling holds one block's activations at a time).

    ``owner`` is the module whose parameters ``block`` uses (``block``
    itself when it is a module); ``resident`` holds data pointers of more
    storages that are not the block's to count (shared inputs);
    ``neighbour`` is the block before's profile, against which a peak far
    above is measured again (:func:`_steady_peaks`)."""
    device = _device_of(args)
    owner = owner if owner is not None else block if isinstance(block, nn.Module) else None
    resident = set(resident or ())
    if owner is not None:
        resident |= {t.untyped_storage().data_ptr()
                     for t in list(owner.parameters()) + list(owner.buffers())}
    args = _fresh_inputs(args)
    with _gradients_preserved(owner):
        # warm-up: workspaces and parameter gradients exist before measuring
        _backward(block(*args))
        forward_peak, backward_peak = _steady_peaks(block, args, device, neighbour)
        out, activation_bytes = saved_tensor_bytes(lambda: block(*args), resident)
        output_bytes = _storage_bytes(_tensors_in(out))
        # the next block needs the values, not this block's activations
        out = _detached(out)
        options = _choice_options("recompute", False)
        runs = [lambda: _forward_only(block, args), lambda: _backward(block(*args)),
                lambda: _backward(_C.checkpoint(_call, block, args, {}, **options))]
        policies = _profile_policies(block, args, resident)
        try:
            timed = _timed_in_turn(runs + [run for run, _, _ in policies.values()], device,
                                   repeats)
        except RuntimeError as error:
            log.info("matepoint.plan: a block cannot be timed under %s (%s); not planned",
                     " and ".join(policies), error)
            policies, timed = {}, _timed_in_turn(runs, device, repeats)
    forward_s, both_s, recompute_s = timed[:3]
    input_bytes = _storage_bytes(_tensors_in(args))
    input_stay = _storage_bytes(_left_on_device(_tensors_in(args)))
    backward_s = max(both_s - forward_s, 0.0)
    # recompute and the policies run all that keep runs and more: a timing
    # as fast is noise, which would otherwise make them win where everything
    # fits (a hair slower so that keep wins the tie)
    least = (forward_s + backward_s) * (1 + _OVER_KEEP)
    recompute_s = max(recompute_s, least)
    measured = {name: PolicyFigures(max(seconds, least), saved + input_bytes, stay + input_stay)
                for (name, (_, saved, stay)), seconds in zip(policies.items(), timed[3:])}
    profile = BlockProfile(forward_s, backward_s, input_bytes / bandwidth,
                           input_bytes, activation_bytes, output_bytes,
                           forward_peak, backward_peak, recompute_s, input_stay, measured)
    return profile, out


def _left_on_device(tensors: List[torch.Tensor], function: Callable = _call
                    ) -> List[torch.Tensor]:
    """Those of ``tensors`` an offload of ``checkpoint(function, ...)``
    leaves on the device, as the offload engine itself decides
    (``_C._offload_left_on_device``: parameters, module buffers of
    ``function``, nested, sparse and other layouts it does not copy, tensors
    under ``min_offload_bytes``, tensors off the offload device). The
    default is the function a planned block's checkpoint gets (:func:`_call`)."""
    stays = _C._offload_left_on_device(function, tensors)
    return [t for t, stay in zip(tensors, stays) if stay]


def _forward_only(block: Callable, args: Tuple) -> None:
    with torch.no_grad():
        block(*args)


def _profile_policies(block: Callable, args: Tuple, resident: set
                      ) -> Dict[str, Tuple[Callable[[], None], int, int]]:
    """Per policy the block can run, a run of its forward + backward under
    it, the bytes of the outputs it keeps after its forward, and of those
    the bytes an offload would leave on the device: selective always,
    attention where it keeps any (the block runs fused attention)."""
    policies = {}
    for choice in ("selective", "attention"):
        try:
            kept, nbytes, stay = _policy_saved_bytes(block, args, resident, choice)
        except RuntimeError as error:
            log.info("matepoint.plan: a block cannot run the %s policy (%s); not planned",
                     choice, error)
            continue
        if kept or choice == "selective":
            options = _choice_options(choice, False)
            policies[choice] = (functools.partial(_run_checkpointed, block, args, options),
                                nbytes, stay)
    return policies


def _run_checkpointed(block: Callable, args: Tuple, options: Dict[str, Any]) -> None:
    _backward(_C.checkpoint(_call, block, args, {}, **options))


def _policy_saved_bytes(block: Callable, args: Tuple, resident: set, choice: str
                        ) -> Tuple[int, int, int]:
    """(how many outputs, their bytes, the bytes of those an offload
    leaves) the policy of ``choice`` keeps after the block's forward, its
    input aside: the distinct storages left in the policy's cache when the
    forward ends (those after the last saved tensor are let go then; the
    forward runs with gradients, as in training)."""
    modes: List[Any] = []

    def context() -> Tuple[Any, Any]:
        pair = _CONTEXTS[choice]()
        modes.append(pair[0])
        return pair

    options = dict(_choice_options(choice, False), context_fn=context)
    out = _C.checkpoint(_call, block, args, {}, **options)
    cached = [leaf.val for entries in modes[0].storage.values() for entry in entries.values()
              for leaf in tree_leaves(entry)
              if isinstance(getattr(leaf, "val", None), torch.Tensor)]
    kept, nbytes = len(cached), _storage_bytes(cached, resident)
    stay = _storage_bytes(_left_on_device(cached), resident)
    del cached
    # the first selective run in a process leaves its cache in cyclic
    # garbage (later runs free it at once): emptied here, it cannot stay
    # until the collector runs, on top of the timed runs that follow
    modes[0].storage.clear()
    del out
    return kept, nbytes, stay


# A peak this many times another measure of it (its own repeat, or the
# block before's on an input of the same size) is taken for a one-off (a
# cache or workspace made once, seen at 4x) and measured again.
_OUTLIER_RATIO = 1.5


_PEAK_RUNS = 5


def _outlier(peaks: Tuple[int, int], others: Tuple[int, int]) -> bool:
    """Whether a forward or backward peak is _OUTLIER_RATIO times the
    other measure of it (a few KiB of difference aside: tiny blocks)."""
    return any(peak > _OUTLIER_RATIO * other + (4 << 10) for peak, other in zip(peaks, others))


def _steady_peaks(block: Callable, args: Tuple, device: torch.device,
                  neighbour: Optional[BlockProfile]) -> Tuple[int, int]:
    """The block's forward and backward peaks (:func:`_peaks`), measured
    twice: agreeing runs give their larger figures. Where one run is an
    outlier against the other, a third is measured and the median planned
    on; where the result is an outlier against an alike neighbour (the block
    before, on an input of the same size), more runs up to _PEAK_RUNS, and
    the median of all."""
    runs = [_peaks(block, args, device) for _ in range(2)]

    def settled() -> Tuple[int, int]:
        if len(runs) == 2:
            return (max(runs[0][0], runs[1][0]), max(runs[0][1], runs[1][1]))
        return (statistics.median_low(run[0] for run in runs),
                statistics.median_low(run[1] for run in runs))

    if _outlier(settled(), (min(runs[0][0], runs[1][0]), min(runs[0][1], runs[1][1]))):
        runs.append(_peaks(block, args, device))
    alike = None
    if neighbour is not None and neighbour.input_bytes == _storage_bytes(_tensors_in(args)):
        alike = (neighbour.forward_peak_bytes, neighbour.backward_peak_bytes)
    while alike is not None and len(runs) < _PEAK_RUNS and _outlier(settled(), alike):
        runs.append(_peaks(block, args, device))
    if len(runs) > 2:
        log.info("matepoint.plan: a block's peaks (forward, backward) measured again, runs "
                 "apart or far above the block before's %s: %s; planned on %s", alike, runs,
                 settled())
    return settled()


def _peaks(block: Callable, args: Tuple, device: torch.device) -> Tuple[int, int]:
    """Peak bytes of the block's forward above its input, and of its
    backward above what the forward left and the output gradient; zeros
    where memory cannot be measured (then the sizes alone plan).

    On the CPU the tensors made are counted (:class:`TensorMeter`), not
    the heap: the same figures every run. Forward and backward are one
    meter, so the backward sees the forward's tensors go."""
    if device.type == "cpu":
        with TensorMeter(device) as meter:
            out = block(*args)
            forward_peak = meter.peak_bytes
            outputs = [t for t in _tensors_in(out) if t.requires_grad]
            gradients = [torch.ones_like(t) for t in outputs]
            meter.restart()
            if outputs:
                torch.autograd.backward(outputs, gradients)
            return forward_peak, meter.peak_bytes
    if device.type != "cuda":
        return 0, 0
    with PeakMeter(device) as forward:
        out = block(*args)
    outputs = [t for t in _tensors_in(out) if t.requires_grad]
    gradients = [torch.ones_like(t) for t in outputs]
    with PeakMeter(device) as backward:
        if outputs:
            torch.autograd.backward(outputs, gradients)
    return forward.peak_bytes, backward.peak_bytes


@contextlib.contextmanager
def _gradients_preserved(block: Optional[Callable]):
    """Profiling's backward passes leave the parameters' .grad as they were."""
    parameters = list(block.parameters()) if isinstance(block, nn.Module) else []
    saved = [(p, p.grad) for p in parameters]
    try:
        yield
    finally:
        for parameter, grad in saved:
            parameter.grad = grad


@contextlib.contextmanager
def _state_preserved(blocks: List[Callable], devices: List[torch.device]):
    """Profiling runs blocks several times: their buffers (BatchNorm's
    running statistics) and the random number streams come out untouched."""
    modules = [b for b in blocks if isinstance(b, nn.Module)]
    saved = [[(buffer, buffer.detach().clone()) for buffer in m.buffers()] for m in modules]
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            with torch.no_grad():
                for pairs in saved:
                    for buffer, copy in pairs:
                        buffer.copy_(copy)


@contextlib.contextmanager
def _own_forwards(blocks: List[Callable]):
    """Blocks checkpointed by an earlier plan run their own forward while
    profiled (a checkpointed forward saves only its input)."""
    checkpointed = [b for b in blocks if isinstance(b, nn.Module) and is_checkpointed(b)]
    replaced = [(b, b.__dict__["forward"]) for b in checkpointed]
    for block in checkpointed:
        uncheckpoint_module(block)
    try:
        yield
    finally:
        for block, forward in replaced:
            block.__dict__["forward"] = forward


def profile_blocks(blocks: List[Callable], sample_inputs: Tuple, bandwidth: float,
                   repeats: int) -> List[BlockProfile]:
    """Profiles each block in turn, feeding each the previous one's output."""
    profiles, args = [], sample_inputs
    with _state_preserved(blocks, [_device_of(sample_inputs)]), _own_forwards(blocks):
        for i, block in enumerate(blocks):
            try:
                profile, out = profile_block(block, args, bandwidth, repeats,
                                             neighbour=profiles[-1] if profiles else None)
            except Exception as error:
                raise RuntimeError(f"matepoint.plan: profiling block {i} failed: {error}") \
                    from error
            profiles.append(profile)
            args = (out,)
    return profiles
