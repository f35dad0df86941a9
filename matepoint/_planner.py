"""Budget planner: per block of a chain, keep its activations, recompute it,
recompute it and offload its input, or recompute it selectively (keeping the
outputs of its matmuls, convolutions and attention, or offloading them with
its input), so that activation memory fits a budget at the least step time.

``matepoint.plan(blocks, x, budget_bytes=...)`` profiles each block once,
solves the choice exactly in C (csrc/planner) and returns a :class:`Plan`
that prints as a table, wraps the blocks and saves to JSON.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import numbers
import os
import statistics
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from matepoint import _C
from matepoint._composable import (_call, checkpoint_module, is_checkpointed,
                                   uncheckpoint_module)
from matepoint._meter import PeakMeter, TensorMeter, copy_bandwidth, saved_tensor_bytes
from matepoint._options import settings, show_int
from matepoint._timing import time_call

log = logging.getLogger("matepoint.planner")

# the one table of choices is C's (csrc/planner/choices.c): per choice its
# name, what it saves, the policy it runs under and whether it offloads
CHOICES = tuple(choice["name"] for choice in _C.PLAN_CHOICES)
_POLICY_OF = {choice["name"]: choice["policy"] for choice in _C.PLAN_CHOICES}
_OFFLOADS = {choice["name"]: choice["offloads"] for choice in _C.PLAN_CHOICES}
# the choices that need the offload engine
_OFFLOADING = frozenset(i for i, choice in enumerate(_C.PLAN_CHOICES) if choice["offloads"])
MIB = float(1 << 20)
# byte counts stay within the solver's 64-bit arithmetic
MAX_BYTES = (1 << 63) - 1
MAX_REPEATS = 1_000_000
MAX_FRONTIER_POINTS = 1 << 20
# A block whose selective or attention run was not measured (a plan saved
# before it was, a block without attention) is given this time: never
# chosen, as it holds at least what recompute does.
_UNMEASURED_S = _C.PLAN_UNMEASURED_S
# Where no offload can run, each offload is given the same as copy time: any
# plan with one costs more than every plan without, so the exact solver
# picks one only when nothing else fits (and solve() then raises instead).
_NO_OFFLOAD_COPY_S = _UNMEASURED_S
# The least a selective or recompute run is taken to cost over keeping, relative.
_OVER_KEEP = 1e-6
Blocks = Union[nn.Sequential, nn.ModuleList, Sequence[Callable]]


def _int_argument(where: str, name: str, value: Any, low: int, high: int = MAX_BYTES) -> int:
    """``value`` if it is an int from ``low`` to ``high``; else a TypeError or
    ValueError naming ``name`` and that range."""
    high_text = "2**63 - 1" if high == MAX_BYTES else f"{high:_}"
    message = f"{where}: {name}" if where else name
    message += f" must be an int from {low} to {high_text}, got "
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(message + repr(value))
    if not low <= value <= high:
        raise ValueError(message + show_int(value))
    return value


def _show(value: Any) -> str:
    return show_int(value) if isinstance(value, int) else repr(value)


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:   # an int beyond any float
        return False


def _path_argument(where: str, path: Any) -> Any:
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{where}: path must be a str, bytes or os.PathLike file name, "
                        f"got {type(path).__name__}")
    return path


class PlanError(ValueError):
    """No plan fits the budget: ``budget_bytes`` was asked for,
    ``smallest_budget_bytes`` is the smallest any plan meets."""

    def __init__(self, budget_bytes: int, smallest_budget_bytes: int) -> None:
        super().__init__(
            f"matepoint.plan: no plan keeps activation memory within {budget_bytes} bytes "
            f"({budget_bytes / MIB:.1f} MiB); the smallest budget any plan meets is "
            f"{smallest_budget_bytes} bytes ({smallest_budget_bytes / MIB:.1f} MiB)")
        self.budget_bytes = budget_bytes
        self.smallest_budget_bytes = smallest_budget_bytes


@dataclasses.dataclass(frozen=True)
class PolicyFigures:
    """What a block measured under one saving policy (selective, attention)."""

    seconds: float     # forward + backward under the policy
    held_bytes: int    # held after its forward: its input and the saved outputs
    stay_bytes: int    # of those, what an offload leaves on the device


# Per policy of _C.PLAN_POLICIES, the BlockProfile fields holding its
# figures (seconds, bytes, stay bytes): the names plan files use.
_POLICY_FIELDS = {"selective": ("selective_s", "selective_bytes", "selective_stay_bytes"),
                  "attention": ("attention_s", "attention_bytes", "attention_stay_bytes")}


@dataclasses.dataclass
class BlockProfile:
    """What one block costs, measured once by :func:`plan`."""

    forward_s: float
    backward_s: float
    copy_s: float           # one way, its input between device and host
    input_bytes: int
    activation_bytes: int   # saved for backward, its input included if saved
    output_bytes: int
    forward_peak_bytes: int   # above its input, while its forward runs
    backward_peak_bytes: int  # above its saved tensors and output gradient, in backward
    # forward + backward under the selective policy, and what it holds after
    # its forward (its input and the saved outputs); None: not measured
    selective_s: Optional[float] = None
    selective_bytes: Optional[int] = None
    # forward + backward checkpointed, its recompute included (which stops
    # at the last saved tensor: often less than a second forward); None:
    # taken as 2 forward_s + backward_s (a plan saved before it was measured)
    recompute_s: Optional[float] = None
    # as selective_s and selective_bytes, under the policy that saves only
    # attention outputs; None: not measured (a block without attention)
    attention_s: Optional[float] = None
    attention_bytes: Optional[int] = None
    # what each offloading choice leaves on the device, the tensors the
    # engine does not move (under min_offload_bytes as set when profiled,
    # parameters): of its input (offload), of selective_bytes
    # (offload+selective), of attention_bytes (offload+attention); None:
    # nothing (a plan saved before they were measured)
    offload_stay_bytes: Optional[int] = None
    selective_stay_bytes: Optional[int] = None
    attention_stay_bytes: Optional[int] = None

    def checkpointed_s(self) -> float:
        """Forward + backward when recomputed."""
        return 2 * self.forward_s + self.backward_s if self.recompute_s is None \
            else self.recompute_s

    def policy(self, name: str) -> Optional[PolicyFigures]:
        """Its figures under the policy ``name`` (one of ``_C.PLAN_POLICIES``),
        or None where that policy was not measured."""
        seconds, nbytes, stay = (getattr(self, field) for field in _POLICY_FIELDS[name])
        if seconds is None or nbytes is None:
            return None
        return PolicyFigures(seconds, nbytes, stay or 0)

    def keep_work_bytes(self) -> int:
        """Its own peak when kept: forward, or backward over what it saved."""
        return max(self.input_bytes + self.forward_peak_bytes,
                   self.activation_bytes + self.output_bytes + self.backward_peak_bytes)

    def checkpoint_work_bytes(self) -> int:
        """Its own peak when checkpointed: the recompute runs with the output
        gradient waiting, then backward over the recomputed tensors."""
        return self.input_bytes + self.output_bytes + max(
            self.forward_peak_bytes, self.activation_bytes + self.backward_peak_bytes)


@dataclasses.dataclass
class Plan:
    """The planner's choice per block, with what it predicts.

    ``str(plan)`` is a table; :meth:`apply` wraps blocks accordingly;
    :meth:`save` and :meth:`load` keep it as JSON so a run can reuse it.

    Attributes:
        choices: per block, ``"keep"``, ``"recompute"``, ``"offload"``,
            ``"selective"``, ``"offload+selective"``, ``"attention"`` or
            ``"offload+attention"``.
        profiles: what each block measured (:class:`BlockProfile`).
        budget_bytes: the activation budget it was planned for.
        unit_bytes: the solver's memory quantum.
        pipeline: whether backward prefetches offloaded inputs.
        predicted_peak_bytes, predicted_time_s: the planner's prediction.
        offload: whether offload was among the choices; False where none
            can run (inputs not on a GPU, or the ``offload`` option off).
        note: why offload was left out, or ``""``.
        outside_bytes, head_bytes: for a plan made from a training step
            (``enable(model, budget_bytes=...)``, :func:`matepoint.apply`),
            what the model holds outside its blocks through the step and its
            head's peak after the last block; 0 for :func:`plan`. Rows, the
            table and ``predicted_peak_bytes`` all count them.
    """

    choices: List[str]
    profiles: List[BlockProfile]
    budget_bytes: int
    unit_bytes: int
    pipeline: bool
    predicted_peak_bytes: int
    predicted_time_s: float
    offload: bool = True
    note: str = ""
    outside_bytes: int = 0
    head_bytes: int = 0

    def _modelled(self) -> Tuple[List[BlockProfile], List[str]]:
        """The profiles and choices the cost model is given: the blocks,
        then, for a plan made from a training step, the head as one more
        block (it runs as it is: kept)."""
        if not (self.head_bytes or self.outside_bytes):
            return self.profiles, self.choices
        return self.profiles + [head_profile(self.head_bytes)], self.choices + ["keep"]

    def apply(self, blocks: Blocks) -> Blocks:
        """Runs each block as planned from now on, in place.

        Modules keep their place, class, parameter names and ``state_dict``
        keys: a checkpointed block gets its ``forward`` replaced on the
        instance (as :func:`matepoint.checkpoint_module` does), so weights
        saved before load as they are and keyword arguments reach the block's
        own ``forward``. A kept block runs its own ``forward``; a block
        checkpointed by an earlier plan or ``checkpoint_module`` is reset
        first. Callables that are not modules are wrapped in a
        :class:`PlannedBlock`.

        Args:
            blocks: the blocks the plan was made for, in the same order (an
                ``nn.Sequential``, an ``nn.ModuleList`` or a list of callables).

        Returns:
            ``blocks`` itself for an ``nn.Sequential`` or ``nn.ModuleList``;
            for a list, a list of the same modules (non-module callables
            wrapped). Raises ValueError when the number of blocks differs.
        """
        blocks_list = _check_blocks(blocks, "matepoint.Plan.apply")
        if len(blocks_list) != len(self.choices):
            raise ValueError(f"matepoint.Plan.apply: blocks must be those planned (the plan is "
                             f"for {len(self.choices)} blocks), got {len(blocks_list)}")
        # only an offloaded block right after another prefetches it: what
        # the planner's model counts
        follows_offload = [False] + [c == "offload" for c in self.choices[:-1]]
        applied = [apply_choice(block, choice, prefetch=follows)
                   for block, choice, follows in zip(blocks_list, self.choices, follows_offload)]
        if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
            return blocks
        return applied

    def frontier(self, max_points: int = 64) -> List[Tuple[int, float]]:
        """(peak bytes, step seconds) of the fastest plan at each memory level.

        From the fastest plan down to the smallest, at most ``max_points``
        of them; each is exact under the planner's model. Plans with an
        offload are left out when this plan could not offload.

        Args:
            max_points: the most points returned (a positive int).
        """
        _int_argument("matepoint.Plan.frontier", "max_points", max_points, 1, MAX_FRONTIER_POINTS)
        profiles, _ = self._modelled()
        points = _C._plan_frontier(_records(profiles, self.unit_bytes, self.offload),
                                   self.pipeline, max_points)
        return [(peak * self.unit_bytes + self.outside_bytes, seconds) for seconds, peak in points
                if seconds < _NO_OFFLOAD_COPY_S]

    def rows(self) -> List[Tuple[float, int]]:
        """Per block, (seconds, peak bytes while it runs) under the planner's
        cost model, and for a plan made from a training step one more row
        for its head after the last block: the seconds, copies a block
        leaves exposed included, add up to the plan's step time and the
        peaks' max is its ``predicted_peak_bytes`` (what the model holds
        outside its blocks counted in every row)."""
        profiles, choices = self._modelled()
        codes = bytes(CHOICES.index(c) for c in choices)
        costs = _C._plan_evaluate_blocks(_records(profiles, self.unit_bytes, self.offload),
                                         codes, self.pipeline)
        return [(seconds, peak * self.unit_bytes + self.outside_bytes) for seconds, peak in costs]

    def table(self) -> str:
        """The plan as a readable table, one row per block; the rows' times
        add up to the step time in the header (computed by the same model)."""
        rows = self.rows()
        step_s = math.fsum(seconds for seconds, _ in rows)
        outside = f", {self.outside_bytes / MIB:.2f} MiB held outside the blocks" \
            if self.outside_bytes else ""
        lines = [f"matepoint plan: budget {self.budget_bytes / MIB:.1f} MiB, predicted peak "
                 f"{max(peak for _, peak in rows) / MIB:.1f} MiB{outside}, step "
                 f"{step_s * 1e3:.2f} ms ({'pipelined' if self.pipeline else 'unpipelined'} "
                 f"copies)" + (f"; {self.note}" if self.note else ""),
                 f"{'block':>5} {'choice':>17} {'held MiB':>9} {'peak MiB':>9} {'input MiB':>9} "
                 f"{'act MiB':>9} {'time ms':>9}"]
        for i, (choice, p, (seconds, peak)) in enumerate(zip(self.choices, self.profiles, rows)):
            held = _held_bytes(p, choice)
            lines.append(f"{i:>5} {choice:>17} {held / MIB:>9.2f} {peak / MIB:>9.2f} "
                         f"{p.input_bytes / MIB:>9.2f} {p.activation_bytes / MIB:>9.2f} "
                         f"{seconds * 1e3:>9.3f}")
        for seconds, peak in rows[len(self.choices):]:
            lines.append(f"{'head':>5} {'-':>17} {0:>9.2f} {peak / MIB:>9.2f} {'-':>9} {'-':>9} "
                         f"{seconds * 1e3:>9.3f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> Dict[str, Any]:
        """The plan as plain JSON-ready values (what :meth:`save` writes),
        with ``"format": "matepoint-plan-1"``."""
        data = dataclasses.asdict(self)
        data["format"] = "matepoint-plan-1"
        return data

    def save(self, path: str) -> None:
        """Writes the plan as JSON to the file ``path`` (replacing it)."""
        _path_argument("matepoint.Plan.save", path)
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_dict(), file, indent=1)

    @classmethod
    def load(cls, path: str) -> "Plan":
        """Reads a plan written by :meth:`save` from the file ``path``; a file
        that is not one, or whose fields are out of range, raises ValueError
        naming the field."""
        _path_argument("matepoint.Plan.load", path)
        with open(path, encoding="utf-8") as file:
            try:
                data = json.load(file)
            except ValueError as error:
                raise ValueError(f"{path!r} is not a matepoint plan: {error}") from None
        if not isinstance(data, dict) or data.pop("format", None) != "matepoint-plan-1":
            raise ValueError(f"{path!r} is not a matepoint plan")
        try:
            if not isinstance(data["profiles"], list) or \
                    not all(isinstance(p, dict) for p in data["profiles"]):
                raise TypeError("profiles must be a list of objects")
            data["profiles"] = [BlockProfile(**p) for p in data["profiles"]]
            plan = cls(**data)
            _check_loaded(plan)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path!r} is not a matepoint plan: {error}") from None
        return plan


def _check_loaded(plan: Plan) -> None:
    """Every field of a plan read from a file, in range (raises TypeError or
    ValueError naming the field)."""
    if not isinstance(plan.choices, list) or \
            not all(isinstance(c, str) and c in CHOICES for c in plan.choices):
        raise ValueError(f"choices must be a list of {CHOICES}, not {plan.choices!r}")
    if len(plan.choices) != len(plan.profiles) or not plan.choices:
        raise ValueError(f"bad choices {plan.choices}: need one per block "
                         f"({len(plan.profiles)} profiles)")
    _int_argument("", "budget_bytes", plan.budget_bytes, 1)
    _int_argument("", "unit_bytes", plan.unit_bytes, 1)
    _int_argument("", "predicted_peak_bytes", plan.predicted_peak_bytes, 0)
    _int_argument("", "outside_bytes", plan.outside_bytes, 0)
    _int_argument("", "head_bytes", plan.head_bytes, 0)
    if not isinstance(plan.pipeline, bool):
        raise TypeError(f"pipeline must be true or false, not {plan.pipeline!r}")
    if not (_finite_number(plan.predicted_time_s) and plan.predicted_time_s >= 0):
        raise ValueError(f"predicted_time_s must be a finite number >= 0, "
                         f"not {_show(plan.predicted_time_s)}")
    for i, profile in enumerate(plan.profiles):
        values = dataclasses.astuple(profile)
        # the figures that may be absent (None) come after the others
        policies = [(profile.selective_s, profile.selective_bytes),
                    (profile.attention_s, profile.attention_bytes)]
        # what an offload leaves on the device, and what it is part of
        stays = [(profile.offload_stay_bytes, profile.input_bytes),
                 (profile.selective_stay_bytes, profile.selective_bytes),
                 (profile.attention_stay_bytes, profile.attention_bytes)]
        sizes = values[3:8] + tuple(nbytes for _, nbytes in policies if nbytes is not None) \
            + tuple(stay for stay, _ in stays if stay is not None)
        given = values[:8] + tuple(v for v in values[8:] if v is not None)
        if not all(_finite_number(v) and v >= 0 for v in given) or \
                not all(isinstance(v, int) and v <= MAX_BYTES for v in sizes) or \
                any((seconds is None) != (nbytes is None) for seconds, nbytes in policies) or \
                any(stay is not None and (whole is None or stay > whole)
                    for stay, whole in stays):
            raise ValueError(f"block {i} has {values}: times must be finite numbers >= 0 "
                             f"and sizes ints from 0 to 2**63 - 1 (selective_s and "
                             f"selective_bytes both given or both null, attention_s and "
                             f"attention_bytes too; recompute_s may be null; each "
                             f"*_stay_bytes null or at most the bytes it is part of)")


class PlannedBlock(nn.Module):
    """One block run as its plan says; :meth:`Plan.apply` makes them.

    Args:
        block: the module or callable to run.
        choice: ``"keep"`` (run as is), ``"recompute"`` (checkpointed, its
            input kept on the device), ``"offload"`` (checkpointed, its
            input offloaded to host memory), ``"selective"`` (checkpointed,
            the outputs of its matmuls, convolutions and attention kept),
            ``"attention"`` (checkpointed, the outputs of its attention
            kept), or ``"offload+selective"`` and ``"offload+attention"``
            (as those, the kept outputs and the input offloaded); anything
            else is a ValueError.
        prefetch: whether its recompute may start bringing back the input of
            the offloaded region before it.
    """

    def __init__(self, block: Callable, choice: str, prefetch: bool = True) -> None:
        super().__init__()
        if not callable(block):
            raise TypeError(f"matepoint.PlannedBlock: block must be callable, "
                            f"got {type(block).__name__}")
        if not isinstance(choice, str) or choice not in CHOICES:
            raise ValueError(f"matepoint.PlannedBlock: choice must be one of {CHOICES}, "
                             f"got {choice!r}")
        if not isinstance(prefetch, bool):
            raise TypeError(f"matepoint.PlannedBlock: prefetch must be a bool, got {prefetch!r}")
        self.block = block
        self.choice = choice
        self.prefetch = prefetch

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the block on ``args`` and ``kwargs`` as the choice says;
        returns its output."""
        if self.choice == "keep":
            return self.block(*args, **kwargs)
        return _C.checkpoint(_call, self.block, args, kwargs,
                             **_choice_options(self.choice, self.prefetch))

    def extra_repr(self) -> str:
        return f"choice={self.choice}, prefetch={self.prefetch}"


# The outputs the attention choice keeps, by qualified name (an operator
# outside aten registers only when its module loads): at long context
# attention costs the most recompute time per byte it holds.
ATTENTION_SAVED_OPS = frozenset(
    "aten::" + name for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
        "_efficient_attention_forward", "_cudnn_attention_forward")
) | {"torch_attn::_varlen_attn"}
# The expensive operations whose outputs the selective choice keeps; the
# rest (pointwise, norms, views) costs little to recompute.
SELECTIVE_SAVED_OPS = ATTENTION_SAVED_OPS | {
    "aten::" + name for name in ("mm", "addmm", "bmm", "baddbmm", "convolution")}


def _argument(func: Any, name: str, args: Tuple, kwargs: Dict[str, Any]) -> Any:
    """The value of ``func``'s argument ``name`` in this call (its default
    when left out), or None where ``func`` has no such argument."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if name in kwargs:
                return kwargs[name]
            return args[index] if index < len(args) else argument.default_value
    return None


def _draws_random_numbers(func: Any, args: Tuple, kwargs: Dict[str, Any]) -> bool:
    """Whether this call of ``func`` may draw from the random number
    generator: fused attention does when its ``dropout_p`` is above zero."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    dropout_p = _argument(func, "dropout_p", args, kwargs)
    return dropout_p is None or dropout_p > 0


def _saving_policy(saved_ops: frozenset, saved_as: CheckpointPolicy) -> Callable[..., Any]:
    """A ``context_fn`` policy: ``saved_as`` for the outputs of ``saved_ops``,
    recompute for the rest.

    An operator that draws random numbers is recomputed: a saved output
    skips its draw in the recompute, and every random operator after it
    (dropout) would then draw other numbers than in the forward."""
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        # higher-order operators (flex_attention) have a name but no schema
        if func.name() in saved_ops and hasattr(func, "_schema") \
                and not _draws_random_numbers(func, args, kwargs):
            return saved_as
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


_selective_policy = _saving_policy(SELECTIVE_SAVED_OPS, CheckpointPolicy.MUST_SAVE)
_offload_selective_policy = _saving_policy(SELECTIVE_SAVED_OPS, CheckpointPolicy.MUST_CPU_OFFLOAD)
_attention_policy = _saving_policy(ATTENTION_SAVED_OPS, CheckpointPolicy.MUST_SAVE)
_offload_attention_policy = _saving_policy(ATTENTION_SAVED_OPS, CheckpointPolicy.MUST_CPU_OFFLOAD)


def selective_context() -> Tuple[Any, Any]:
    """The ``context_fn`` of the selective choice: save the outputs of
    matmuls, convolutions and attention, recompute the rest."""
    return create_selective_checkpoint_contexts(_selective_policy)


def offload_selective_context() -> Tuple[Any, Any]:
    """The ``context_fn`` of the offload+selective choice: the outputs
    selective saves go to host memory (kept where offload cannot run)."""
    return create_selective_checkpoint_contexts(_offload_selective_policy)


def attention_context() -> Tuple[Any, Any]:
    """The ``context_fn`` of the attention choice: save the outputs of
    attention, recompute the rest (the matmuls included)."""
    return create_selective_checkpoint_contexts(_attention_policy)


def offload_attention_context() -> Tuple[Any, Any]:
    """The ``context_fn`` of the offload+attention choice: the outputs
    attention saves go to host memory (kept where offload cannot run)."""
    return create_selective_checkpoint_contexts(_offload_attention_policy)


# the choices checkpointed under a policy, and its context_fn
_CONTEXTS = {"selective": selective_context, "offload+selective": offload_selective_context,
             "attention": attention_context, "offload+attention": offload_attention_context}


def _choice_options(choice: str, prefetch: bool) -> Dict[str, Any]:
    """The checkpoint keyword arguments that run ``choice``."""
    offloads_saved = _OFFLOADS[choice] and _POLICY_OF[choice] is not None
    # offload+selective and offload+attention neither prefetch nor are
    # prefetched (the planner's model): a restore brings back only its input
    options = {"use_reentrant": False,
               "matepoint_offload": choice == "offload" or offloads_saved,
               "matepoint_prefetch": prefetch and not offloads_saved}
    if choice in _CONTEXTS:
        options["context_fn"] = _CONTEXTS[choice]
    return options


def apply_choice(block: Callable, choice: str, prefetch: bool = True) -> Callable:
    """Makes ``block`` run as ``choice`` says; returns what to call.

    A module is changed in place (its ``forward`` replaced on the instance
    for any choice but ``"keep"``, its own ``forward`` back for ``"keep"``)
    and returned; any other callable comes back wrapped in a
    :class:`PlannedBlock`.
    """
    if not isinstance(choice, str) or choice not in CHOICES:
        raise ValueError(f"choice must be one of {CHOICES}, not {choice!r}")
    if not isinstance(block, nn.Module):
        return PlannedBlock(block, choice, prefetch)
    if is_checkpointed(block):
        uncheckpoint_module(block)
    if choice != "keep":
        checkpoint_module(block, **_choice_options(choice, prefetch))
    return block


def planned_choice(block: nn.Module) -> str:
    """What ``block`` runs as: ``"keep"`` (its own forward), ``"recompute"``,
    ``"offload"``, ``"selective"``, ``"offload+selective"``, ``"attention"``
    or ``"offload+attention"`` (checkpointed by :meth:`Plan.apply` or
    :func:`matepoint.checkpoint_module`)."""
    if not is_checkpointed(block):
        return "keep"
    options = block.forward.options
    for choice, context_fn in _CONTEXTS.items():
        if options.get("context_fn") is context_fn:
            return choice
    return "offload" if options.get("matepoint_offload") else "recompute"


def plan(blocks: Blocks, *sample_inputs: Any, budget_bytes: int,
         unit_bytes: Optional[int] = None, pipeline: Optional[bool] = None,
         bandwidth_bytes_per_s: Optional[float] = None, repeats: int = 3) -> Plan:
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
        pipeline: whether backward prefetches offloaded inputs; default:
            matepoint's ``pipeline`` option.
        bandwidth_bytes_per_s: the device-host copy bandwidth; default:
            measured once here.
        repeats: how many times each block is run to time it.

    Under ``torch.distributed`` (all ranks call it) one plan for all ranks.

    Offload is planned only where it can run: on CUDA tensors (or the
    simulated GPU of test builds) with the ``offload`` option on, tensors
    under ``min_offload_bytes`` counted as staying; otherwise no choice
    offloads, and the plan's ``note`` says why (choices: :class:`PlannedBlock`).

    Returns:
        A :class:`Plan`.

    Raises:
        PlanError: no plan fits; it names the smallest feasible budget.
        TypeError, ValueError: a bad argument, named in the message.
        RuntimeError: a block failed while being profiled (names its index).
    """
    blocks_list = _check_blocks(blocks, "matepoint.plan")
    _check_plan_arguments(budget_bytes, unit_bytes, pipeline, bandwidth_bytes_per_s, repeats)
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
    profiles = reduce_profiles(profile_blocks(blocks_list, sample_inputs, bandwidth, repeats))
    return solve(profiles, budget_bytes, unit_bytes or default_unit(budget_bytes), bool(pipeline),
                 offload=note is None, note=note or "")


def reduce_profiles(profiles: List[BlockProfile]) -> List[BlockProfile]:
    """``profiles`` with each figure replaced by its max over the ranks of
    the default process group; a figure some rank did not measure (None) is
    None on all. Unchanged when torch.distributed is not initialized. Every
    rank must call it with the same number of blocks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return profiles
    # infinity stands for None: the max of it is defined (NaN's is not)
    # and no measured figure is infinite
    rows = [[math.inf if v is None else float(v) for v in vars(p).values()] for p in profiles]
    fields = list(vars(profiles[0]))
    # float64 holds byte counts exactly below 2**53; gloo and NCCL both reduce it
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    table = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    reduced = []
    for row in table.cpu().tolist():
        values = {f: (None if math.isinf(v) else v if f.endswith("_s") else int(v))
                  for f, v in zip(fields, row)}
        reduced.append(BlockProfile(**values))
    return reduced


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


def _check_plan_arguments(budget_bytes: Any, unit_bytes: Any, pipeline: Any,
                          bandwidth_bytes_per_s: Any, repeats: Any,
                          where: str = "matepoint.plan") -> None:
    """TypeError or ValueError naming the first bad argument of plan() (or
    of ``where``, the public function that takes them)."""
    _int_argument(where, "budget_bytes", budget_bytes, 1)
    if unit_bytes is not None:
        _int_argument(where, "unit_bytes", unit_bytes, 1)
    if pipeline is not None and not isinstance(pipeline, bool):
        raise TypeError(f"{where}: pipeline must be a bool or None, got {pipeline!r}")
    if bandwidth_bytes_per_s is not None:
        accepted = "a finite number of bytes per second above 0, or None to measure it"
        if isinstance(bandwidth_bytes_per_s, bool) or \
                not isinstance(bandwidth_bytes_per_s, numbers.Real):
            raise TypeError(f"{where}: bandwidth_bytes_per_s must be {accepted}, "
                            f"got {bandwidth_bytes_per_s!r}")
        if not (_finite_number(bandwidth_bytes_per_s) and bandwidth_bytes_per_s > 0):
            raise ValueError(f"{where}: bandwidth_bytes_per_s must be {accepted}, "
                             f"got {_show(bandwidth_bytes_per_s)}")
    _int_argument(where, "repeats", repeats, 1, MAX_REPEATS)


def solve(profiles: List[BlockProfile], budget_bytes: int, unit_bytes: int,
          pipeline: bool, offload: bool = True, note: str = "") -> Plan:
    """The fastest plan for measured ``profiles`` within ``budget_bytes``.

    Args:
        profiles: one :class:`BlockProfile` per block, in order.
        budget_bytes: the activation budget.
        unit_bytes: the solver's memory quantum.
        pipeline: whether backward prefetches offloaded inputs.
        offload: False leaves the choices that offload out.
        note: why offload was left out, for the plan's table.

    Raises:
        PlanError: no plan fits; it names the smallest feasible budget.
    """
    units = _records(profiles, unit_bytes, offload)
    budget_units = budget_bytes // unit_bytes
    solved = _C._plan_solve(units, budget_units, pipeline)
    if solved is None or (not offload and _OFFLOADING.intersection(solved[0])):
        raise PlanError(budget_bytes, _smallest_budget(units, pipeline, offload) * unit_bytes)
    choices, seconds, peak_units = solved
    result = Plan([CHOICES[c] for c in choices], profiles, budget_bytes, unit_bytes, pipeline,
                  peak_units * unit_bytes, seconds, offload, note)
    log.debug("%s", result)
    return result


def predict(profiles: List[BlockProfile], choices: List[str], unit_bytes: int,
            pipeline: bool) -> Tuple[int, float]:
    """(peak bytes, step seconds) the planner's model gives ``choices``."""
    if len(choices) != len(profiles) or set(choices) - set(CHOICES):
        raise ValueError(f"need one of {CHOICES} per block, got {choices}")
    codes = bytes(CHOICES.index(c) for c in choices)
    seconds, peak_units = _C._plan_evaluate(_records(profiles, unit_bytes), codes, pipeline)
    return peak_units * unit_bytes, seconds


def auto_checkpoint(blocks: Blocks, *sample_inputs: Any, budget_bytes: int,
                    **plan_options: Any) -> Blocks:
    """Plans ``blocks`` within ``budget_bytes`` and returns them wrapped.

    Shorthand for ``matepoint.plan(blocks, *sample_inputs,
    budget_bytes=...).apply(blocks)``; ``**plan_options`` are the other
    keyword arguments of :func:`plan` (``unit_bytes``, ``pipeline``,
    ``bandwidth_bytes_per_s``, ``repeats``).
    """
    return plan(blocks, *sample_inputs, budget_bytes=budget_bytes, **plan_options).apply(blocks)


def default_unit(budget_bytes: int) -> int:
    """A power of two that keeps the solver's tables near 100k units."""
    return max(1024, 1 << max(0, math.ceil(math.log2(max(1, budget_bytes // 100_000)))))


def head_profile(head_bytes: int) -> BlockProfile:
    """A model's head after its last block as one more block for the cost
    model: it holds nothing, takes no time, and its peak is ``head_bytes``
    above what the blocks hold, kept or checkpointed alike."""
    return BlockProfile(0.0, 0.0, 0.0, 0, 0, 0, head_bytes, 0)


def _policy_copy_s(p: BlockProfile, nbytes: int) -> float:
    """One-way copy of the input and a policy's saves (``nbytes`` in all):
    copy_s scaled by bytes (a block without input bytes gives no bandwidth:
    never chosen)."""
    if p.input_bytes == 0:
        return 0.0 if nbytes == 0 else _NO_OFFLOAD_COPY_S
    return p.copy_s * (nbytes / p.input_bytes)


def _policy_figures(p: BlockProfile, policy: str) -> PolicyFigures:
    """The figures of ``policy``; unmeasured, it holds what recompute holds
    (offloaded, what offload does) at a time that is never chosen."""
    figures = p.policy(policy)
    if figures is None:
        return PolicyFigures(_UNMEASURED_S, p.input_bytes, p.offload_stay_bytes or 0)
    return figures


def _held_bytes(p: BlockProfile, choice: str) -> int:
    """What a block holds on the device after its forward under ``choice``,
    as the cost model counts it."""
    if choice == "keep":
        return p.activation_bytes
    if choice == "recompute":
        return p.input_bytes
    if choice == "offload":
        return p.offload_stay_bytes or 0
    figures = _policy_figures(p, _POLICY_OF[choice])
    return figures.stay_bytes if _OFFLOADS[choice] else figures.held_bytes


def _records(profiles: List[BlockProfile], unit_bytes: int,
             offload: bool = True) -> List[Dict[str, Any]]:
    """The blocks as the C planner takes them: one record each, keyed by
    ``_C.PLAN_BLOCK_FIELDS`` and, per policy, ``_C.PLAN_POLICY_FIELDS``;
    sizes in units of ``unit_bytes`` (rounded up). Without ``offload``
    every copy takes a time that is never chosen."""
    def up(nbytes: int) -> int:
        return -(-nbytes // unit_bytes)

    def copy_s(p: BlockProfile, held: int, stay: int) -> float:
        """One-way copy of what moves of ``held`` bytes, ``stay`` of them staying."""
        return _policy_copy_s(p, held - stay) if offload else _NO_OFFLOAD_COPY_S
    records = []
    for p in profiles:
        input_stay = p.offload_stay_bytes or 0
        record: Dict[str, Any] = {
            "forward_s": p.forward_s, "backward_s": p.backward_s,
            "recompute_s": p.checkpointed_s(),
            "copy_s": copy_s(p, p.input_bytes, input_stay),
            "input_units": up(p.input_bytes), "activation_units": up(p.activation_bytes),
            "offload_held_units": up(input_stay),
            "keep_work_units": up(p.keep_work_bytes()),
            "checkpoint_work_units": up(p.checkpoint_work_bytes())}
        for name in _C.PLAN_POLICIES:
            figures = _policy_figures(p, name)
            record[name] = {"time_s": figures.seconds, "units": up(figures.held_bytes),
                            "copy_s": copy_s(p, figures.held_bytes, figures.stay_bytes),
                            "offload_held_units": up(figures.stay_bytes)}
        records.append(record)
    return records


def _smallest_budget(units: List[Dict[str, Any]], pipeline: bool, offload: bool) -> int:
    """The smallest budget in units any plan meets; without offload, found
    by bisection between the smallest with offload (a lower bound) and the
    peak of recomputing every block (always a plan without offload)."""
    low = _C._plan_min_budget(units, pipeline)
    if offload:
        return low
    recompute = bytes([CHOICES.index("recompute")] * len(units))
    high = _C._plan_evaluate(units, recompute, pipeline)[1]

    def fits(budget: int) -> bool:
        solved = _C._plan_solve(units, budget, pipeline)
        return solved is not None and not _OFFLOADING.intersection(solved[0])

    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return high


def _check_blocks(blocks: Blocks, where: str) -> List[Callable]:
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        blocks_list = list(blocks)
    elif isinstance(blocks, (list, tuple)):
        blocks_list = list(blocks)
    else:
        raise TypeError(f"{where}: blocks must be an nn.Sequential, an nn.ModuleList or a list "
                        f"of callables, got {type(blocks).__name__}")
    if not blocks_list:
        raise ValueError(f"{where}: blocks must be a non-empty nn.Sequential, nn.ModuleList "
                         f"or list, got an empty {type(blocks).__name__}")
    for i, block in enumerate(blocks_list):
        if not callable(block):
            raise TypeError(f"{where}: block {i} ({type(block).__name__}) is not callable")
    return blocks_list


def _tensors_in(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors_in(item)]
    return []


def _device_of(sample_inputs: Tuple) -> torch.device:
    tensors = _tensors_in(sample_inputs)
    if not tensors:
        raise ValueError("matepoint.plan: sample_inputs must be the batch to profile the "
                         "blocks on (at least one tensor), got no tensor")
    return tensors[0].device


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
    measured = {choice: (max(seconds, least), saved + input_bytes, stay + input_stay)
                for (choice, (_, saved, stay)), seconds in zip(policies.items(), timed[3:])}
    selective_s, selective_bytes, selective_stay = measured.get("selective", (None,) * 3)
    attention_s, attention_bytes, attention_stay = measured.get("attention", (None,) * 3)
    profile = BlockProfile(forward_s, backward_s, input_bytes / bandwidth,
                           input_bytes, activation_bytes, output_bytes,
                           forward_peak, backward_peak, selective_s, selective_bytes,
                           recompute_s, attention_s, attention_bytes, input_stay,
                           selective_stay, attention_stay)
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
