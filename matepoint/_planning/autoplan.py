"""Planning a model's blocks from its own training steps.

``matepoint.plan(blocks, x)`` needs the blocks' input by hand; inside a real
model (a transformers model, timm, diffusers, a user's model) the blocks'
inputs are made by the model itself. Here each block's call goes through a
:class:`StepPlanner`: the first training step runs every block checkpointed
and measures each one on the real batch (time, input, saved and peak bytes,
as :func:`matepoint.plan` profiles a block); the next step solves the plan
(the chain is the order the blocks ran in) and from then on each block runs
its choice. A step whose first block sees inputs of another shape is
measured and planned again; plans are kept per shape.

When ``torch.distributed`` is initialized, every figure is reduced across
ranks (the max of each) before solving, so every rank holds the same plan:
different plans would unbalance DDP/FSDP and hang tensor parallelism.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from matepoint._C import checkpoint, is_recomputing
from matepoint._composable import (CheckpointedForward, _call, check_checkpoint_keywords,
                                   is_checkpointed, uncheckpoint_module)
from matepoint._errors import check_module, type_error
from matepoint._meter import copy_bandwidth
from matepoint._options import settings
from matepoint._planning.planner import no_offload_reason
from matepoint._planning.arguments import _check_plan_arguments, _tensors_in
from matepoint._planning.block_profile import BlockProfile, head_profile
from matepoint._planning.choices import _choice_options
from matepoint._planning.plan_record import Plan, PlanError
from matepoint._planning.profiling import (_detached, _state_preserved, profile_block,
                                           reduce_profiles)
from matepoint._planning.ranks import check_group, distributed
from matepoint._planning.solve import default_unit, solve
from matepoint._planning.step_meter import Outside, _Gauge, _OutsideMeter, _reduce_outside

log = logging.getLogger("matepoint.planner")
Key = Tuple[Any, ...]
_PLANNER = "_matepoint_planner"


def shape_key(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Key:
    """What a block's plan depends on: the shapes, dtypes and devices of the
    tensors it is called with."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in _tensors_in((args, kwargs)))


def plan_step(profiles: List[BlockProfile], budget_bytes: int, outside: Outside,
              unit_bytes: int, pipeline: bool, offload: bool = True, note: str = "") -> Plan:
    """:func:`solve` for blocks that run inside a training step.

    The blocks are planned within ``budget_bytes - outside.held_bytes``, the
    head's peak counted where it occurs: on top of everything the blocks
    hold after the last one. The plan's ``predicted_peak_bytes`` is the whole
    step's, as are its rows and table (``outside_bytes`` and ``head_bytes``
    set); a budget no plan meets raises :class:`PlanError` naming the
    smallest budget for the whole step."""
    inner = budget_bytes - outside.held_bytes
    try:
        solved = solve(profiles + [head_profile(outside.head_bytes)], max(inner, 1), unit_bytes,
                       pipeline, offload, note)
    except PlanError as error:
        raise PlanError(budget_bytes, error.smallest_budget_bytes + outside.held_bytes) from None
    # the head runs as it is: its row is evaluated kept, whatever the solver
    # gave the extra block (a tie at no time; kept holds the least)
    stepped = dataclasses.replace(solved, choices=solved.choices[:-1], profiles=list(profiles),
                                  budget_bytes=budget_bytes, outside_bytes=outside.held_bytes,
                                  head_bytes=outside.head_bytes)
    peak = max(peak for _, peak in stepped.rows())
    if peak > budget_bytes:
        raise PlanError(budget_bytes, peak)
    return dataclasses.replace(stepped, predicted_peak_bytes=peak)




class _StepPlan:
    """A solved plan for one input shape: per block index, its choice."""

    def __init__(self, plan: Plan, order: List[int], keys: List[Key]) -> None:
        self.plan = plan
        self.choices: Dict[int, Tuple[str, bool, Key]] = {}
        for position, (index, key) in enumerate(zip(order, keys)):
            prefetch = position > 0 and plan.choices[position - 1] == "offload"
            self.choices[index] = (plan.choices[position], prefetch, key)


class StepPlanner:
    """Chooses, per block of one model, how it runs, from a measured step.

    The measured step also measures what the model holds outside its blocks
    (:class:`Outside`: the embedding's output, masks, the head and its loss);
    the blocks are planned within the budget less that (:func:`plan_step`).

    Args:
        name: the model's class name, for messages.
        budget_bytes: the activation budget of a whole step.
        unit_bytes, pipeline, repeats: as for :func:`matepoint.plan`.
        checkpoint_kwargs: what every checkpointed block passes to
            :func:`matepoint.checkpoint` (the plan's choice wins for
            ``matepoint_offload`` and ``matepoint_prefetch``).
        where: the public function a bad argument's error names.
    """

    def __init__(self, name: str, budget_bytes: int, unit_bytes: Optional[int] = None,
                 pipeline: Optional[bool] = None, repeats: int = 1,
                 checkpoint_kwargs: Optional[Dict[str, Any]] = None,
                 where: str = "matepoint.plan", group: Optional[Any] = None) -> None:
        _check_plan_arguments(budget_bytes, unit_bytes, pipeline, None, repeats, where)
        check_group(where, group)
        self.where = where
        self.group = group
        self.name = name
        self.budget_bytes = budget_bytes
        self.unit_bytes = unit_bytes
        self.pipeline = pipeline
        self.repeats = repeats
        self.checkpoint_kwargs = dict(checkpoint_kwargs or {})
        self.checkpoint_kwargs.setdefault("use_reentrant", False)
        self.plans: Dict[Key, _StepPlan] = {}
        self.current: Optional[_StepPlan] = None
        self.measuring = False
        self.measured: List[Tuple[int, Key, BlockProfile]] = []
        self.step_key: Optional[Key] = None
        self.first_call = True
        self.note: Optional[str] = None
        self.bandwidth: Optional[float] = None
        self.warned = False
        self.outside = Outside()    # what the last solve counted outside the blocks
        self.meter: Optional[_OutsideMeter] = None
        # what a measured step counts from, and the parameters it gives gradients first
        self.gauge: Optional[_Gauge] = None
        self.gradless: List[torch.Tensor] = []

    @property
    def plan(self) -> Optional[Plan]:
        """The plan the last step ran (None until one was solved)."""
        return self.current.plan if self.current is not None else None

    def begin_step(self, model: nn.Module) -> None:
        """A training forward of ``model`` starts: solve what the last step
        measured, and let the next block call pick the plan."""
        if self.measuring and self.measured:
            self._solve()
        self.measuring = False
        self.first_call = True
        # where this step starts from, should it be measured
        tensors = itertools.chain(model.parameters(), model.buffers())
        device = next((t.device for t in tensors), torch.device("cpu"))
        self._stop_gauge()
        if device.type in ("cuda", "cpu"):
            # gradients this step creates are the parameters', not activations
            self.gradless = [p for p in model.parameters() if p.grad is None]
            self.gauge = _Gauge(device)

    def _stop_gauge(self) -> None:
        """This step's forward is not watched any further."""
        if self.gauge is not None:
            self.gauge.stop_watching()
        self.gauge = None

    def end_forward(self, output: Any) -> None:
        """The model's forward returned ``output``."""
        if self.meter is not None:
            self.meter.forward_ended(output)
        self._stop_gauge()

    def _solve(self) -> None:
        order = [index for index, _, _ in self.measured]
        keys = [key for _, key, _ in self.measured]
        profiles = reduce_profiles([profile for _, _, profile in self.measured], self.group,
                                   self.where)
        self.measured = []
        outside = self.meter.finish() if self.meter is not None else Outside()
        self.meter = None
        self.outside = _reduce_outside(outside, self.where, self.group)
        budget = self.budget_bytes
        pipeline = settings.current.pipeline if self.pipeline is None else self.pipeline
        plan = plan_step(profiles, budget, self.outside, self.unit_bytes or default_unit(budget),
                         bool(pipeline), offload=self.note is None, note=self.note or "")
        self.plans[self.step_key] = _StepPlan(plan, order, keys)
        log.info("matepoint: planned %s within %d bytes (%d held outside its blocks, head "
                 "%d): %s", self.name, budget, self.outside.held_bytes,
                 self.outside.head_bytes, plan.choices)

    def _start_step(self, key: Key, args: Tuple[Any, ...]) -> None:
        self.first_call = False
        self.step_key = key
        self.current = self.plans.get(key)
        if self.current is not None:
            self._stop_gauge()
            return
        if self.plans and distributed(self.group):
            self._stop_gauge()
            # ranks may see different shapes here: measuring on some ranks only would
            # leave the others waiting in the reduction
            self.current = next(reversed(self.plans.values()))
            self._warn_once(f"the blocks' input shapes changed; under torch.distributed the "
                            f"plan is not solved again (ranks could disagree): the first plan "
                            f"runs on. Call matepoint.enable/apply again to plan anew.")
            return
        if self.plans:
            log.info("matepoint: %s's input shapes changed: measuring this step to plan again",
                     self.name)
        self.measuring = True
        self.measured = []
        devices = [t.device for t in _tensors_in(args)][:1]
        if self.meter is not None:
            self.meter.finish()
        self.meter = None
        if self.gauge is not None and devices == [self.gauge.device]:
            self.meter = _OutsideMeter(self.gauge, self.gradless)
        else:
            self._stop_gauge()

    def _warn_once(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(f"matepoint ({self.name}): {message}", UserWarning, stacklevel=4)

    def run(self, index: int, owner: Optional[nn.Module], function: Callable[..., Any],
            args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Runs block ``index`` (``function(*args, **kwargs)``, whose
        parameters are ``owner``'s) as the plan says, measuring it first in
        a measured step."""
        if not torch.is_grad_enabled() or is_recomputing():
            return function(*args, **kwargs)
        key = shape_key(args, kwargs)
        if self.first_call:
            self._start_step(key, args)
        if self.measuring:
            if self.meter is not None:
                self.meter.block_starts(args)
            self._measure(index, owner, function, args, kwargs, key)
            if self.meter is not None:
                self.meter.block_measured()
            out = checkpoint(_call, function, args, kwargs,
                             **{**self.checkpoint_kwargs, "matepoint_offload": False})
            if self.meter is not None:
                self.meter.block_ended(out)
            return out
        planned = self.current.choices.get(index) if self.current is not None else None
        if planned is None or planned[2] != key:
            # a block the measured step did not run, or with other shapes: the safe choice
            return checkpoint(_call, function, args, kwargs,
                              **{**self.checkpoint_kwargs, "matepoint_offload": False})
        choice, prefetch, _ = planned
        if choice == "keep":
            return function(*args, **kwargs)
        return checkpoint(_call, function, args, kwargs,
                          **{**self.checkpoint_kwargs, **_choice_options(choice, prefetch)})

    def _measure(self, index: int, owner: Optional[nn.Module], function: Callable[..., Any],
                 args: Tuple[Any, ...], kwargs: Dict[str, Any], key: Key) -> None:
        if self.bandwidth is None:
            self.note = no_offload_reason(args)
            tensors = _tensors_in(args)
            self.bandwidth = copy_bandwidth(tensors[0].device).d2h \
                if self.note is None and tensors else float("inf")
        # keyword tensors (masks, rotary tables) are shared by the blocks, made once:
        # neither this block's input nor what it saves
        shared = {t.untyped_storage().data_ptr() for t in _tensors_in(kwargs)}
        call = functools.partial(_call_detached, function, _detached(kwargs))
        modules = [owner] if owner is not None else []
        devices = [t.device for t in _tensors_in(args)][:1]
        try:
            with _state_preserved(modules, devices):
                profile, _ = profile_block(
                    call, args, self.bandwidth, self.repeats, owner=owner, resident=shared,
                    neighbour=self.measured[-1][2] if self.measured else None)
        except Exception as error:
            raise RuntimeError(f"matepoint: measuring block {index} of {self.name} "
                               f"failed: {error}") from error
        self.measured.append((index, key, profile))


def _call_detached(function: Callable[..., Any], kwargs: Dict[str, Any], *args: Any) -> Any:
    """``function`` with its own bound arguments cut from the step's graph:
    profiling's backward must stay inside the block."""
    if isinstance(function, functools.partial):
        return function.func(*_detached(function.args), *args,
                             **{**_detached(function.keywords), **kwargs})
    return function(*args, **kwargs)


class PlannedForward(CheckpointedForward):
    """A block's ``forward`` while :func:`matepoint.apply` plans it."""

    def __init__(self, module: nn.Module, previous: Optional[Callable[..., Any]],
                 planner: StepPlanner, index: int) -> None:
        super().__init__(module, previous, {})
        self.planner = planner
        self.index = index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.previous
        if forward is None:
            forward = type(self.module).forward.__get__(self.module)
        if not self.module.training:
            return forward(*args, **kwargs)
        return self.planner.run(self.index, self.module, forward, args, kwargs)


def _default_blocks(model: nn.Module) -> List[nn.Module]:
    """The children of the longest ``nn.ModuleList`` / ``nn.Sequential`` in ``model``."""
    best: List[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > len(best):
            best = list(module)
    return best


def _selected_blocks(model: nn.Module, check_fn: Optional[Callable[[nn.Module], bool]]
                     ) -> List[nn.Module]:
    if check_fn is None:
        return _default_blocks(model)
    if not callable(check_fn):
        raise type_error("matepoint.apply", "check_fn",
                         "a callable taking a module and returning a bool, or None", check_fn)
    chosen: List[nn.Module] = []
    inside: set = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if check_fn(module):
            chosen.append(module)
            inside.update(id(m) for m in module.modules())
    return chosen


def apply_blocks(model: nn.Module, budget_bytes: int,
                 check_fn: Optional[Callable[[nn.Module], bool]] = None, *,
                 unit_bytes: Optional[int] = None, pipeline: Optional[bool] = None,
                 repeats: int = 1, group: Optional[Any] = None,
                 **checkpoint_kwargs: Any) -> nn.Module:
    """:func:`matepoint.apply` on the blocks ``check_fn`` picks (by default the
    children of the longest ``nn.ModuleList``/``nn.Sequential``): each
    block's ``forward`` is replaced on the instance by a :class:`PlannedForward`."""
    check_module("matepoint.apply", "model", model)
    check_checkpoint_keywords("matepoint.apply", checkpoint_kwargs)
    check_group("matepoint.apply", group)
    # every argument is checked before check_fn runs or anything changes
    _check_plan_arguments(budget_bytes, unit_bytes, pipeline, None, repeats, "matepoint.apply")
    blocks = _selected_blocks(model, check_fn)
    if not blocks:
        raise ValueError(f"matepoint.apply: no block found in {type(model).__name__} (check_fn "
                         f"accepted no module, or there is no nn.ModuleList/nn.Sequential)")
    planner = StepPlanner(type(model).__name__, budget_bytes, unit_bytes, pipeline, repeats,
                          checkpoint_kwargs, where="matepoint.apply", group=group)
    for index, block in enumerate(blocks):
        if is_checkpointed(block):
            uncheckpoint_module(block)
        previous = block.__dict__.get("forward")
        block.__dict__["forward"] = PlannedForward(block, previous, planner, index)
    attach(model, planner)
    return model


class _BeginStep:
    """The model's forward pre-hook: a training forward begins a step."""

    def __init__(self, planner: StepPlanner) -> None:
        self.planner = planner

    def __call__(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.planner.begin_step(module)


class _EndForward:
    """The model's forward hook (run on errors too): a measured step's head
    ends its forward there."""

    def __init__(self, planner: StepPlanner) -> None:
        self.planner = planner

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.planner.end_forward(output)


def attach(model: nn.Module, planner: Optional[StepPlanner]) -> None:
    """Makes ``planner`` the one of ``model`` (None: detach the last one)."""
    old = model.__dict__.pop(_PLANNER, None)
    if old is not None:
        model._forward_pre_hooks.pop(old[1], None)
        model._forward_hooks.pop(old[2], None)
        model._forward_hooks_always_called.pop(old[2], None)
    if planner is not None:
        begin_id = model.register_forward_pre_hook(_BeginStep(planner)).id
        end_id = model.register_forward_hook(_EndForward(planner), always_call=True).id
        model.__dict__[_PLANNER] = (planner, begin_id, end_id)


def planned(model: nn.Module) -> Optional[Plan]:
    """The plan ``model`` ran by in its last training step (after :func:`apply` or
    ``enable(model, budget_bytes=...)``), None before one is; TypeError for a non-module."""
    check_module("matepoint.planned", "model", model)
    entry = model.__dict__.get(_PLANNER)
    return entry[0].plan if entry is not None else None
