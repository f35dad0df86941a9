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

import functools
import logging
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from matepoint._C import checkpoint, is_recomputing
from matepoint._composable import CheckpointedForward, _call, is_checkpointed, uncheckpoint_module
from matepoint._meter import copy_bandwidth
from matepoint._options import settings
from matepoint._planner import (BlockProfile, Plan, _check_plan_arguments, _choice_options,
                                _detached, _state_preserved, _tensors_in, default_unit,
                                no_offload_reason, profile_block, reduce_profiles, solve)

log = logging.getLogger("matepoint.planner")
Key = Tuple[Any, ...]
_PLANNER = "_matepoint_planner"


def shape_key(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Key:
    """What a block's plan depends on: the shapes, dtypes and devices of the
    tensors it is called with."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in _tensors_in((args, kwargs)))


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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

    Args:
        name: the model's class name, for messages.
        budget_bytes: the activation budget of a step (as for
            :func:`matepoint.plan`).
        unit_bytes, pipeline, repeats: as for :func:`matepoint.plan`.
        checkpoint_kwargs: what every checkpointed block passes to
            :func:`matepoint.checkpoint` (the plan's choice wins for
            ``matepoint_offload`` and ``matepoint_prefetch``).
    """

    def __init__(self, name: str, budget_bytes: int, unit_bytes: Optional[int] = None,
                 pipeline: Optional[bool] = None, repeats: int = 1,
                 checkpoint_kwargs: Optional[Dict[str, Any]] = None) -> None:
        _check_plan_arguments(budget_bytes, unit_bytes, pipeline, None, repeats)
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

    @property
    def plan(self) -> Optional[Plan]:
        """The plan the last step ran (None until one was solved)."""
        return self.current.plan if self.current is not None else None

    def begin_step(self) -> None:
        """A training forward of the model starts: solve what the last step
        measured, and let the next block call pick the plan."""
        if self.measuring and self.measured:
            self._solve()
        self.measuring = False
        self.first_call = True

    def _solve(self) -> None:
        order = [index for index, _, _ in self.measured]
        keys = [key for _, key, _ in self.measured]
        profiles = reduce_profiles([profile for _, _, profile in self.measured])
        self.measured = []
        budget = self.budget_bytes
        pipeline = settings.current.pipeline if self.pipeline is None else self.pipeline
        plan = solve(profiles, budget, self.unit_bytes or default_unit(budget), bool(pipeline),
                     offload=self.note is None, note=self.note or "")
        self.plans[self.step_key] = _StepPlan(plan, order, keys)
        log.info("matepoint: planned %s within %d bytes: %s", self.name, budget, plan.choices)

    def _start_step(self, key: Key) -> None:
        self.first_call = False
        self.step_key = key
        self.current = self.plans.get(key)
        if self.current is not None:
            return
        if self.plans and _distributed():
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
            self._start_step(key)
        if self.measuring:
            self._measure(index, owner, function, args, kwargs, key)
            return checkpoint(_call, function, args, kwargs,
                              **{**self.checkpoint_kwargs, "matepoint_offload": False})
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
                profile, _ = profile_block(call, args, self.bandwidth, self.repeats,
                                           owner=owner, resident=shared)
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
        raise TypeError(f"matepoint.apply: check_fn must be a callable taking a module and "
                        f"returning a bool, or None, not {type(check_fn).__name__}")
    chosen: List[nn.Module] = []
    inside: set = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if check_fn(module):
            chosen.append(module)
            inside.update(id(m) for m in module.modules())
    return chosen


def apply(model: nn.Module, budget_bytes: int,
          check_fn: Optional[Callable[[nn.Module], bool]] = None, *,
          unit_bytes: Optional[int] = None, pipeline: Optional[bool] = None, repeats: int = 1,
          **checkpoint_kwargs: Any) -> nn.Module:
    """Plan ``model``'s blocks within ``budget_bytes`` from its first training step.

    For any module tree. Blocks: the modules ``check_fn`` accepts (not those
    inside one), by default the children of the longest ``nn.ModuleList`` or
    ``nn.Sequential``; their ``forward`` is replaced on the instance, so names
    and ``state_dict`` keys stay and keyword arguments pass through. The first
    training step checkpoints and measures every block; from the next, each
    is kept, recomputed or offloaded as planned (:func:`planned`); new input
    shapes are planned again. ``budget_bytes``, ``unit_bytes``, ``pipeline``,
    ``repeats``: see :func:`plan`; ``**checkpoint_kwargs``: see :func:`checkpoint`.
    """
    from matepoint._enable import _CHECKPOINT_KEYWORDS

    if not isinstance(model, nn.Module):
        raise TypeError(f"matepoint.apply needs a torch.nn.Module, got {type(model).__name__}")
    unknown = sorted(set(checkpoint_kwargs) - _CHECKPOINT_KEYWORDS)
    if unknown:
        raise TypeError(f"matepoint.apply: unknown checkpoint argument(s) {', '.join(unknown)}; "
                        f"known: {', '.join(sorted(_CHECKPOINT_KEYWORDS))}")
    blocks = _selected_blocks(model, check_fn)
    if not blocks:
        raise ValueError(f"matepoint.apply: no block found in {type(model).__name__} (check_fn "
                         f"accepted no module, or there is no nn.ModuleList/nn.Sequential)")
    planner = StepPlanner(type(model).__name__, budget_bytes, unit_bytes, pipeline, repeats,
                          checkpoint_kwargs)
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
            self.planner.begin_step()


def attach(model: nn.Module, planner: Optional[StepPlanner]) -> None:
    """Makes ``planner`` the one of ``model`` (None: detach the last one)."""
    old = model.__dict__.pop(_PLANNER, None)
    if old is not None:
        model._forward_pre_hooks.pop(old[1], None)
    if planner is not None:
        hook_id = model.register_forward_pre_hook(_BeginStep(planner)).id
        model.__dict__[_PLANNER] = (planner, hook_id)


def planned(model: nn.Module) -> Optional[Plan]:
    """The plan ``model`` ran by in its last training step (after :func:`apply`
    or ``enable(model, budget_bytes=...)``), or None before one was solved."""
    entry = model.__dict__.get(_PLANNER)
    return entry[0].plan if entry is not None else None
