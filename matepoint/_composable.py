"""Checkpoint a module in place: its forward runs under matepoint.checkpoint.

torch's composable ``checkpoint(module)`` and ``checkpoint_wrapper`` differ in
what they leave behind: the wrapper adds a module level (parameter names gain
``_checkpoint_wrapped_module.``, undone only in ``state_dict`` by hooks), the
composable form does not. ``checkpoint_module`` is the composable form: the
module gets an instance attribute ``forward`` (an object, not a closure, so
``copy.deepcopy`` of the model points the copy at the copy) that runs the
class's ``forward`` (or the ``forward`` the instance already had) through
``matepoint.checkpoint``. Parameters, buffers, ``state_dict`` keys, module
hooks and ``type(module)`` stay as they were; the module's forward hooks run
once per call, outside the checkpointed region. With offload on, the module's
buffers stay on the device, as when the module itself is checkpointed.
"""
from __future__ import annotations

from types import MethodType
from typing import Any, Callable, Dict, Optional, Tuple

import torch.nn as nn

from matepoint import _C
from matepoint._C import checkpoint
from matepoint._errors import check_module


def _call(forward: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return forward(*args, **kwargs)


def _call_of(module: nn.Module, forward: Callable[..., Any], args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> Any:
    """:func:`_call`, bound to ``module`` (``MethodType``) when it runs a
    checkpointed module: the offload engine keeps the buffers of the module
    a checkpointed method is bound to on the device, as for the module itself."""
    return forward(*args, **kwargs)


def check_checkpoint_keywords(where: str, checkpoint_kwargs: Dict[str, Any]) -> None:
    """TypeError naming the keywords of ``checkpoint_kwargs`` that
    :func:`matepoint.checkpoint` does not take (``_C.CHECKPOINT_KEYWORDS``,
    the C parser's own list); ``where`` is the public function asked."""
    unknown = sorted(set(checkpoint_kwargs) - _C.CHECKPOINT_KEYWORDS)
    if unknown:
        raise TypeError(f"{where}: unknown checkpoint argument(s) {', '.join(unknown)}; "
                        f"known: {', '.join(sorted(_C.CHECKPOINT_KEYWORDS))}")


class CheckpointedForward:
    """A module's ``forward`` while :func:`checkpoint_module` is in force."""

    def __init__(self, module: nn.Module, previous: Optional[Callable[..., Any]],
                 options: Dict[str, Any]) -> None:
        self.module = module
        self.previous = previous      # the instance's own forward before, if it had one
        self.options = options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.previous
        if forward is None:
            forward = type(self.module).forward.__get__(self.module)
        # args and kwargs go in as two arguments: a keyword of the module's forward that
        # happens to be named like a checkpoint option stays the module's
        return checkpoint(MethodType(_call_of, self.module), forward, args, kwargs,
                          **self.options)


def checkpoint_module(module: nn.Module, **checkpoint_kwargs: Any) -> nn.Module:
    """Run ``module``'s forward under :func:`matepoint.checkpoint` from now on.

    Like ``torch.distributed._composable.checkpoint(module)``: no wrapper
    module, so parameter names and ``state_dict`` keys do not change, and
    ``fully_shard`` or DDP can be applied before or after. Positional and
    keyword arguments reach ``forward`` as they are. ``checkpoint_kwargs`` are
    those of :func:`matepoint.checkpoint`. Undo with :func:`uncheckpoint_module`.
    Returns ``module``; one already checkpointed raises RuntimeError.
    """
    check_module("matepoint.checkpoint_module", "module", module)
    check_checkpoint_keywords("matepoint.checkpoint_module", checkpoint_kwargs)
    previous = module.__dict__.get("forward")
    if isinstance(previous, CheckpointedForward):
        raise RuntimeError(f"matepoint.checkpoint_module: this {type(module).__name__} is "
                           f"already checkpointed (call matepoint.uncheckpoint_module first)")
    module.__dict__["forward"] = CheckpointedForward(module, previous, dict(checkpoint_kwargs))
    return module


def uncheckpoint_module(module: nn.Module) -> nn.Module:
    """Give ``module`` its own forward back (RuntimeError if :func:`checkpoint_module` is not)."""
    check_module("matepoint.uncheckpoint_module", "module", module)
    current = module.__dict__.get("forward")
    if not isinstance(current, CheckpointedForward):
        what = "forward was replaced since" if current is not None else "is not checkpointed"
        raise RuntimeError(f"matepoint.uncheckpoint_module: this {type(module).__name__} {what} "
                           f"(matepoint.checkpoint_module was not the last to set its forward)")
    if current.previous is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = current.previous
    return module


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_module` is in force on ``module``."""
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)
