"""The planner's choices and what each runs.

The table of choices is C's (``_C.PLAN_CHOICES``, csrc/planner/choices.c):
per choice its name, what it saves, the policy it runs under and whether
it offloads. Here: the checkpoint options and selective-checkpoint
policies that run each one, :func:`apply_choice` and :class:`PlannedBlock`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from matepoint import _C
from matepoint._composable import _call, checkpoint_module, is_checkpointed, uncheckpoint_module

# the one table of choices is C's (csrc/planner/choices.c): per choice its
# name, what it saves, the policy it runs under and whether it offloads
CHOICES = tuple(choice["name"] for choice in _C.PLAN_CHOICES)


_POLICY_OF = {choice["name"]: choice["policy"] for choice in _C.PLAN_CHOICES}


_OFFLOADS = {choice["name"]: choice["offloads"] for choice in _C.PLAN_CHOICES}


# the choices that need the offload engine
_OFFLOADING = frozenset(i for i, choice in enumerate(_C.PLAN_CHOICES) if choice["offloads"])


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
