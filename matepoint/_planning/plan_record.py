"""The plan record: :class:`Plan` (choices, profiles, predictions; as a
table, applied to blocks, saved to and loaded from JSON) and
:class:`PlanError`."""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, List, Tuple

import torch.nn as nn

from matepoint import _C
from matepoint._planning.arguments import (MAX_BYTES, MAX_FRONTIER_POINTS, MIB, Blocks,
                                           _check_blocks, _finite_number, _int_argument,
                                           _path_argument, _show)
from matepoint._planning.block_profile import (_NO_OFFLOAD_COPY_S, BlockProfile, PolicyFigures,
                                               _held_bytes, _records, head_profile)
from matepoint._planning.choices import CHOICES, apply_choice

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
            (:func:`matepoint.apply`),
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
        with ``"format": "matepoint-plan-2"``."""
        data = dataclasses.asdict(self)
        data["format"] = PLAN_FORMAT
        return data

    def save(self, path: str) -> None:
        """Writes the plan as JSON to the file ``path`` (replacing it)."""
        _path_argument("matepoint.Plan.save", path)
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_dict(), file, indent=1)

    @classmethod
    def load(cls, path: str) -> "Plan":
        """Reads a plan written by :meth:`save` from the file ``path`` (one
        saved by an earlier matepoint too); a file that is not one, or whose
        fields are out of range, raises ValueError naming the field."""
        _path_argument("matepoint.Plan.load", path)
        with open(path, encoding="utf-8") as file:
            try:
                data = json.load(file)
            except ValueError as error:
                raise ValueError(f"{path!r} is not a matepoint plan: {error}") from None
        file_format = data.pop("format", None) if isinstance(data, dict) else None
        if file_format not in (PLAN_FORMAT, _PLAN_FORMAT_1):
            raise ValueError(f"{path!r} is not a matepoint plan")
        try:
            if not isinstance(data["profiles"], list) or \
                    not all(isinstance(p, dict) for p in data["profiles"]):
                raise TypeError("profiles must be a list of objects")
            if file_format == _PLAN_FORMAT_1:
                data["profiles"] = [_upgraded_profile(p) for p in data["profiles"]]
            data["profiles"] = [profile_from_dict(p) for p in data["profiles"]]
            plan = cls(**data)
            _check_loaded(plan)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path!r} is not a matepoint plan: {error}") from None
        return plan


# What save writes. Plan-1 files (matepoint before PolicyFigures) kept
# each policy's figures as flat fields of the profile: seconds, bytes and
# stay bytes under these names, all null where not measured (absent in
# files older still).
PLAN_FORMAT = "matepoint-plan-2"
_PLAN_FORMAT_1 = "matepoint-plan-1"
_PLAN_1_POLICY_FIELDS = {
    "selective": ("selective_s", "selective_bytes", "selective_stay_bytes"),
    "attention": ("attention_s", "attention_bytes", "attention_stay_bytes")}


def _upgraded_profile(fields: Dict[str, Any]) -> Dict[str, Any]:
    """A profile as a plan-1 file holds it, in the shape of
    :func:`profile_from_dict`."""
    upgraded = dict(fields)
    upgraded["policies"] = {}
    for policy, names in _PLAN_1_POLICY_FIELDS.items():
        seconds, held, stay = (upgraded.pop(name, None) for name in names)
        if seconds is None and held is None and stay is None:
            continue
        if seconds is None or held is None:
            raise ValueError(f"{names[0]} and {names[1]} must be both given or both null "
                             f"(a {policy} stay needs them too)")
        upgraded["policies"][policy] = {"seconds": seconds, "held_bytes": held,
                                        "stay_bytes": 0 if stay is None else stay}
    return upgraded


def profile_from_dict(fields: Dict[str, Any]) -> BlockProfile:
    """The :class:`BlockProfile` of a profile as :meth:`Plan.to_dict` writes
    it; an unknown or missing name raises TypeError (a value out of range
    passes: :func:`_check_loaded` names it)."""
    fields = dict(fields)
    policies = fields.pop("policies", {})
    if not isinstance(policies, dict) or not all(isinstance(f, dict) for f in policies.values()):
        raise TypeError(f"policies must map a policy's name to its figures, not {policies!r}")
    unknown = set(policies) - set(_C.PLAN_POLICIES)
    if unknown:
        raise ValueError(f"policies must be some of {_C.PLAN_POLICIES}, not {sorted(unknown)}")
    return BlockProfile(**fields, policies={name: PolicyFigures(**figures)
                                            for name, figures in policies.items()})


# the figures a profile may leave null (not measured); a policy's figures
# never are: a policy not measured is absent
_MAY_BE_NULL = frozenset(field.name for field in dataclasses.fields(BlockProfile)
                         if field.default is None)


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
        _check_loaded_profile(i, profile)


def _check_loaded_profile(index: int, profile: BlockProfile) -> None:
    """Every figure of block ``index``'s profile in range: by name, not
    position, each a time (``*_s``, ``seconds``) or a size (``*_bytes``);
    raises ValueError naming the block and the figure."""
    named = {field.name: getattr(profile, field.name) for field in dataclasses.fields(profile)
             if field.name != "policies"}
    # what is part of what: an offload's stay of the input, a policy's
    # stay of what it holds
    parts = [("offload_stay_bytes", profile.offload_stay_bytes, profile.input_bytes)]
    for policy, figures in profile.policies.items():
        named.update({f"{policy}.{field.name}": getattr(figures, field.name)
                      for field in dataclasses.fields(figures)})
        parts.append((f"{policy}.stay_bytes", figures.stay_bytes, figures.held_bytes))
    for name, value in named.items():
        if value is None and name in _MAY_BE_NULL:
            continue
        if name.endswith("_bytes"):
            good = isinstance(value, int) and not isinstance(value, bool) and \
                0 <= value <= MAX_BYTES
            kind = "a size: an int from 0 to 2**63 - 1"
        else:
            good = _finite_number(value) and value >= 0
            kind = "a time: a finite number >= 0"
        if not good:
            raise ValueError(f"block {index}'s {name} must be {kind}, not {_show(value)}")
    for name, part, whole in parts:
        if part is not None and part > whole:
            raise ValueError(f"block {index}'s {name} ({part}) is more than the bytes it is "
                             f"part of ({whole})")
