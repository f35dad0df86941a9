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
import gc
import itertools
import logging
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._python_dispatch import (_get_current_dispatch_mode,
                                          _get_current_dispatch_mode_stack, _pop_mode, _push_mode)

from matepoint._C import checkpoint, is_recomputing
from matepoint._composable import CheckpointedForward, _call, is_checkpointed, uncheckpoint_module
from matepoint._errors import check_module, type_error
from matepoint._meter import StorageCounter, _cuda_allocated, _StorageSampler, copy_bandwidth
from matepoint._options import settings
from matepoint._planner import (BlockProfile, Plan, PlanError, _check_plan_arguments,
                                _choice_options, _detached, _state_preserved, _storage_bytes,
                                _tensors_in, default_unit, head_profile, no_offload_reason,
                                profile_block, reduce_profiles, solve)

log = logging.getLogger("matepoint.planner")
Key = Tuple[Any, ...]
_PLANNER = "_matepoint_planner"
# a head's autograd graph is a few nodes; a walk this long went into the blocks
_MAX_HEAD_NODES = 10_000


def shape_key(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Key:
    """What a block's plan depends on: the shapes, dtypes and devices of the
    tensors it is called with."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in _tensors_in((args, kwargs)))


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclasses.dataclass(frozen=True)
class Outside:
    """What a measured step held outside its planned blocks.

    ``held_bytes``: held while every block runs (what the model made before
    the first block, such as masks and rotary tables, and what its head
    leaves until backward is done); ``head_bytes``: the peak after the last
    block (the head, the loss and their backward) above what the blocks hold
    and ``held_bytes``."""

    held_bytes: int = 0
    head_bytes: int = 0


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


class _Gauge:
    """Bytes in use on the device of a step that may be measured, from the
    step's start: on CUDA the allocator's; on the CPU the tensors made since
    (a :class:`StorageCounter` fed every operation of the model's forward
    and, in backward, the gradients handed to :meth:`in_use`). Not the
    heap's: its figure moves run to run with what else it holds.

    On the CPU the forward runs without the cyclic collector (when garbage
    goes must not move the figures) until :meth:`stop_watching`, and under a
    dispatch mode except while a block runs (:meth:`pause`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counter: Optional[StorageCounter] = None
        self.sampler: Optional[_StorageSampler] = None
        self.window: Optional[int] = None       # the peak since open_window
        self.gc_was_enabled = False
        self.paused = False
        # the mode stack is per thread: only the step's own thread enters and
        # leaves ours (DataParallel runs replicas' blocks in other threads)
        self.thread = threading.get_ident()
        if device.type == "cuda":
            self.start = _cuda_allocated(device)
            return
        self.start = 0
        self.counter = StorageCounter(device)
        self.gc_was_enabled = gc.isenabled()
        gc.disable()
        self.sampler = _StorageSampler(self.counter, self._sample)
        self.sampler.__enter__()

    def _sample(self, in_use: int) -> None:
        if self.window is not None:
            self.window = max(self.window, in_use)

    def in_use(self, tensors: Any = ()) -> int:
        """Bytes in use now; on the CPU, the tensors in ``tensors`` (made
        where no operation was watched) counted first."""
        if self.counter is None:
            return _cuda_allocated(self.device)
        self.counter.count()
        self.counter.add_new(tensors)
        return self.counter.bytes

    def open_window(self) -> None:
        """Starts watching for the peak that :meth:`close_window` returns."""
        self.window = self.in_use()
        if self.counter is None:
            _cuda_allocated(self.device, reset_peak=True)

    def close_window(self) -> int:
        """The most bytes in use since :meth:`open_window` (on the CPU,
        after each operation)."""
        peak, self.window = self.window or 0, None
        if self.counter is None:
            peak = max(peak, _cuda_allocated(self.device, peak=True))
        return peak

    def pause(self) -> None:
        """A block runs: neither its profiling nor its checkpoint is watched
        (a Python mode around them would slow what profiling times); its
        output comes to :meth:`resume`. Where ours is not the innermost
        mode, watching stops instead."""
        if self.sampler is None or self.paused or threading.get_ident() != self.thread:
            return
        if _get_current_dispatch_mode() is not self.sampler:
            self.stop_watching()
            return
        self.sampler.__exit__(None, None, None)
        self.paused = True

    def resume(self, out: Any) -> None:
        """The block returned ``out``: counted, and the forward watched again."""
        self.in_use(out)
        if self.paused and self.sampler is not None and threading.get_ident() == self.thread:
            self.paused = False
            self.sampler.__enter__()

    def stop_watching(self) -> None:
        """The forward is over (or is not measured): no more dispatch mode,
        the collector as it was. Modes entered after ours and still on
        (none, in well-nested code) stay, in their order."""
        if self.sampler is None or threading.get_ident() != self.thread:
            return
        sampler, self.sampler = self.sampler, None
        self.paused = False
        if sampler in _get_current_dispatch_mode_stack():
            above = []
            while _get_current_dispatch_mode() is not sampler:
                above.append(_pop_mode())
            sampler.__exit__(None, None, None)
            for mode in reversed(above):
                _push_mode(mode)
        if self.gc_was_enabled:
            gc.enable()


class _OutsideMeter:
    """Measures :class:`Outside` in a measured step, beside the blocks.

    The head's forward is sampled from the last block's return to the end
    of the model's forward; its backward at the boundaries of its autograd
    nodes (between the model's outputs and the last block's output), until
    the gradient reaches the last block. Only the model's own forward and
    backward are seen: a loss computed outside it counts by what it leaves."""

    def __init__(self, gauge: _Gauge, gradless: List[torch.Tensor]) -> None:
        self.gauge = gauge
        self.gradless = gradless
        self.before: Optional[int] = None
        self.records = 0            # what the checkpointed blocks left beyond their outputs
        self.ready = 0              # in use as the latest block's checkpoint starts
        self.held_after = 0         # in use after the latest block, its output aside
        self.head = 0
        self.leftover = 0
        self.forward = False        # the head's forward may be running (a window open)
        self.stops: set = set()     # the blocks' outputs' autograd nodes
        self.handles: List[Any] = []
        self.reached = False

    def block_starts(self, args: Tuple[Any, ...]) -> None:
        if self.forward:
            self.gauge.close_window()
            self.forward = False
        if self.before is None:
            inputs = _storage_bytes(_tensors_in(args))
            self.before = max(0, self.gauge.in_use() - self.gauge.start - inputs)
        self.gauge.pause()

    def block_measured(self) -> None:
        """The block was profiled; its checkpoint in the step starts now."""
        self.ready = self.gauge.in_use()

    def block_ended(self, out: Any) -> None:
        self.gauge.resume(out)
        tensors = _tensors_in(out)
        output_bytes = _storage_bytes(tensors)
        self.held_after = self.gauge.in_use() - output_bytes
        self.records += max(0, self.held_after - self.ready)
        self.head = output_bytes
        for tensor in tensors:
            if tensor.requires_grad and tensor.grad_fn is not None:
                self.stops.add(tensor.grad_fn)
                tensor.register_hook(self._backward_reached)
        self.gauge.open_window()
        self.forward = True

    def forward_ended(self, output: Any) -> None:
        """The model's forward returned ``output``: the head's forward is
        done; watch its backward."""
        if not self.forward:
            return
        self.head = max(self.head, self.gauge.close_window() - self.held_after)
        self.forward = False
        for node in _nodes_between(_tensors_in(output), self.stops):
            self.handles.append(node.register_prehook(self._sample))
            self.handles.append(node.register_hook(self._sample))

    def _sample(self, *gradients: Any) -> None:
        # on the CPU no operation of backward is watched: the gradients the
        # head's nodes hand on are what its backward makes
        self.head = max(self.head, self.gauge.in_use(gradients) - self.held_after)

    def _backward_reached(self, gradient: torch.Tensor) -> None:
        if self.reached:
            return
        self.reached = True
        # what the head still holds now stays through every block's backward;
        # the gradient that arrived is the block's to count, new parameter
        # gradients are nobody's activations
        grads = [p.grad for p in self.gradless if p.grad is not None]
        self._sample(gradient, grads)
        waiting = _storage_bytes([gradient]) + _storage_bytes(grads)
        self.leftover = max(0, self.gauge.in_use() - self.held_after - waiting)
        self._release()

    def _release(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.stops = set()

    def finish(self) -> Outside:
        """The figures measured (zeros for what the step never reached)."""
        if self.forward:
            self.gauge.close_window()
            self.forward = False
        self.gauge.stop_watching()
        self._release()
        # what the blocks' forwards keep beyond their inputs (autograd's graph,
        # the checkpoints' own records: on CUDA, device memory) grows to
        # `records` by the last block and stays through the head
        held = (self.before or 0) + self.records + self.leftover
        return Outside(held, max(0, self.head - self.leftover))


def _nodes_between(outputs: List[torch.Tensor], stops: set) -> List[Any]:
    """The autograd nodes from ``outputs`` back to (not into) ``stops``,
    parameters' gradient accumulators left out."""
    nodes: List[Any] = []
    seen: set = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack and len(nodes) < _MAX_HEAD_NODES:
        node = stack.pop()
        if node in seen or node in stops:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(following for following, _ in node.next_functions
                     if following is not None and type(following).__name__ != "AccumulateGrad")
    return nodes


def _reduce_outside(outside: Outside) -> Outside:
    """The max of each figure over the ranks (as :func:`reduce_profiles`)."""
    import torch.distributed as dist

    if not _distributed():
        return outside
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    figures = torch.tensor([outside.held_bytes, outside.head_bytes], dtype=torch.float64,
                           device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    held, head = (int(v) for v in figures.cpu().tolist())
    return Outside(held, head)


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
                 where: str = "matepoint.plan") -> None:
        _check_plan_arguments(budget_bytes, unit_bytes, pipeline, None, repeats, where)
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
        profiles = reduce_profiles([profile for _, _, profile in self.measured])
        self.measured = []
        outside = self.meter.finish() if self.meter is not None else Outside()
        self.meter = None
        self.outside = _reduce_outside(outside)
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
        if self.plans and _distributed():
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


def apply(model: nn.Module, budget_bytes: int,
          check_fn: Optional[Callable[[nn.Module], bool]] = None, *,
          unit_bytes: Optional[int] = None, pipeline: Optional[bool] = None, repeats: int = 1,
          **checkpoint_kwargs: Any) -> nn.Module:
    """Plan ``model``'s blocks within ``budget_bytes`` from its first training step.

    For any module tree. Blocks: the modules ``check_fn`` accepts (not those
    inside one), by default the children of the longest ``nn.ModuleList`` or
    ``nn.Sequential``; their ``forward`` is replaced on the instance, so names
    and ``state_dict`` keys stay and keyword arguments pass through. The first
    training step measures every block and what the model holds outside
    them; from the next, each runs as planned (:func:`planned`), the whole
    step within the budget. ``budget_bytes``, ``unit_bytes``, ``pipeline``,
    ``repeats``: see :func:`plan`; ``**checkpoint_kwargs``: see :func:`checkpoint`.
    """
    from matepoint._enable import _CHECKPOINT_KEYWORDS

    check_module("matepoint.apply", "model", model)
    unknown = sorted(set(checkpoint_kwargs) - _CHECKPOINT_KEYWORDS)
    if unknown:
        raise TypeError(f"matepoint.apply: unknown checkpoint argument(s) {', '.join(unknown)}; "
                        f"known: {', '.join(sorted(_CHECKPOINT_KEYWORDS))}")
    # every argument is checked before check_fn runs or anything changes
    _check_plan_arguments(budget_bytes, unit_bytes, pipeline, None, repeats, "matepoint.apply")
    blocks = _selected_blocks(model, check_fn)
    if not blocks:
        raise ValueError(f"matepoint.apply: no block found in {type(model).__name__} (check_fn "
                         f"accepted no module, or there is no nn.ModuleList/nn.Sequential)")
    planner = StepPlanner(type(model).__name__, budget_bytes, unit_bytes, pipeline, repeats,
                          checkpoint_kwargs, where="matepoint.apply")
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
