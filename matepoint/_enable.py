"""matepoint for models that follow Hugging Face's gradient-checkpointing
convention: each layer that may be checkpointed has a boolean attribute
``gradient_checkpointing`` and, when it is set (and the layer is training),
calls ``self._gradient_checkpointing_func(layer_call, *args)``. transformers
models (4.35 and newer) work this way; ``model.gradient_checkpointing_enable``
hard-wires torch's checkpoint there, ``matepoint.enable`` puts matepoint's.
"""
from __future__ import annotations

import functools
from typing import Any, List

import torch.nn as nn

from matepoint._C import checkpoint

_CHECKPOINT_KEYWORDS = {"use_reentrant", "preserve_rng_state", "context_fn", "determinism_check",
                        "debug", "early_stop", "matepoint_offload", "matepoint_prefetch"}


def _checkpointed_layers(model: nn.Module, action: str) -> List[nn.Module]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"matepoint.{action} needs a torch.nn.Module, got {type(model).__name__}")
    name = type(model).__name__
    if getattr(model, "supports_gradient_checkpointing", True) is False:
        raise ValueError(f"matepoint.{action}: {name} does not support activation checkpointing "
                         f"(its supports_gradient_checkpointing is False)")
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    if not layers:
        raise ValueError(
            f"matepoint.{action}: {name} has no layer that supports activation checkpointing "
            f"(no submodule has a `gradient_checkpointing` attribute, the convention of Hugging "
            f"Face transformers models); wrap its blocks with matepoint.checkpoint instead")
    return layers


def enable(model: nn.Module, **checkpoint_kwargs: Any) -> nn.Module:
    """Checkpoint ``model``'s layers with matepoint while it trains.

    The one-line replacement for ``model.gradient_checkpointing_enable()``
    on a transformers model (or any module whose layers follow the same
    convention). ``checkpoint_kwargs`` are those of :func:`matepoint.checkpoint`
    (``preserve_rng_state``, ``early_stop``, ``matepoint_offload``, ...).
    Layers checkpoint only in training mode, so ``model.eval()`` and
    generation are untouched. Returns ``model``.
    """
    unknown = sorted(set(checkpoint_kwargs) - _CHECKPOINT_KEYWORDS)
    if unknown:
        raise TypeError(f"matepoint.enable: unknown checkpoint argument(s) {', '.join(unknown)}; "
                        f"known: {', '.join(sorted(_CHECKPOINT_KEYWORDS))}")
    function = functools.partial(checkpoint, **checkpoint_kwargs)
    for layer in _checkpointed_layers(model, "enable"):
        layer._gradient_checkpointing_func = function
        layer.gradient_checkpointing = True
    return model


def disable(model: nn.Module) -> nn.Module:
    """Stop checkpointing ``model``'s layers (undoes :func:`enable`)."""
    for layer in _checkpointed_layers(model, "disable"):
        layer.gradient_checkpointing = False
    return model
