"""What one block costs (:class:`BlockProfile`, measured once by
:func:`matepoint.plan`, with a :class:`PolicyFigures` per saving policy)
and its conversion into the record the C planner takes (``_records``: one
dict per block keyed by ``_C.PLAN_BLOCK_FIELDS``, one per policy keyed by
``_C.PLAN_POLICY_FIELDS``). A new figure is a field here with its entry in
``_records``, and the C side (its row in plan.c's field table, the cost
model); a new policy needs nothing here."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from matepoint import _C
from matepoint._planning.choices import _OFFLOADS, _POLICY_OF

# A block whose selective or attention run was not measured (a plan saved
# before it was, a block without attention) is given this time: never
# chosen, as it holds at least what recompute does.
_UNMEASURED_S = _C.PLAN_UNMEASURED_S


# Where no offload can run, each offload is given the same as copy time: any
# plan with one costs more than every plan without, so the exact solver
# picks one only when nothing else fits (and solve() then raises instead).
_NO_OFFLOAD_COPY_S = _UNMEASURED_S


@dataclasses.dataclass(frozen=True)
class PolicyFigures:
    """What a block measured under one saving policy of ``_C.PLAN_POLICIES``
    (``"selective"``, ``"attention"``): checkpointed, saving the outputs the
    policy names and recomputing the rest."""

    seconds: float       # forward + backward under the policy, recompute included
    held_bytes: int      # held after its forward: its input and the saved outputs
    stay_bytes: int = 0  # of those, what an offload leaves on the device


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
    # forward + backward checkpointed, its recompute included (which stops
    # at the last saved tensor: often less than a second forward); None:
    # taken as 2 forward_s + backward_s (a plan saved before it was measured)
    recompute_s: Optional[float] = None
    # what offloading leaves on the device of its input: the tensors the
    # engine does not move (under min_offload_bytes as set when profiled,
    # parameters); None: nothing (a plan saved before it was measured)
    offload_stay_bytes: Optional[int] = None
    # per name of _C.PLAN_POLICIES, its figures; a policy not measured (a
    # block without attention) is absent
    policies: Dict[str, PolicyFigures] = dataclasses.field(default_factory=dict)

    def checkpointed_s(self) -> float:
        """Forward + backward when recomputed."""
        return 2 * self.forward_s + self.backward_s if self.recompute_s is None \
            else self.recompute_s

    def keep_work_bytes(self) -> int:
        """Its own peak when kept: forward, or backward over what it saved."""
        return max(self.input_bytes + self.forward_peak_bytes,
                   self.activation_bytes + self.output_bytes + self.backward_peak_bytes)

    def checkpoint_work_bytes(self) -> int:
        """Its own peak when checkpointed: the recompute runs with the output
        gradient waiting, then backward over the recomputed tensors."""
        return self.input_bytes + self.output_bytes + max(
            self.forward_peak_bytes, self.activation_bytes + self.backward_peak_bytes)


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
    figures = p.policies.get(policy)
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
