"""matepoint for models that follow Hugging Face's gradient-checkpointing
convention: each layer that may be checkpointed has a boolean attribute
``gradient_checkpointing`` and, when it is set (and the layer is training),
calls ``self._gradient_checkpointing_func(layer_call, *args)``. transformers
models (4.35 and newer) work this way; ``model.gradient_checkpointing_enable``
hard-wires torch's checkpoint there, ``matepoint.enable`` puts matepoint's.

The library turns its own checkpointing back on later, and not only when the
user asks: ``Trainer.train()`` with ``gradient_checkpointing=True`` (or
``activation_checkpointing=True``), PEFT's ``prepare_model_for_kbit_training``
and many scripts call ``model.gradient_checkpointing_enable()`` /
``activation_checkpointing_enable()``. Every one of those paths ends in
``_set_gradient_checkpointing(enable=True, gradient_checkpointing_func=...)``,
so ``enable`` wraps that method (on the class that defines it, once per
process) and the wrapper swaps in matepoint's checkpoint for the models
``enable`` marked, keeping the keyword arguments the caller asked for.
Unmarked models, and marked ones after ``disable``, run the library's own
code unchanged. The mark is a plain attribute, so ``copy.deepcopy`` and
pickling carry it. Whatever sets a layer's checkpoint function by another
route is caught at the next training forward: a warning names the function
that replaced matepoint's.
"""
from __future__ import annotations

import functools
import inspect
import logging
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from matepoint._C import CHECKPOINT_KEYWORDS as _CHECKPOINT_KEYWORDS, checkpoint  # noqa: F401
from matepoint._planning.autoplan import StepPlanner, apply_blocks, attach
from matepoint._composable import check_checkpoint_keywords
from matepoint._errors import check_module
from matepoint._planning.ranks import check_group

log = logging.getLogger("matepoint")
_SETTER = "_set_gradient_checkpointing"
_MARK = "_matepoint_enabled"


class _Enabled:
    """What :func:`enable` left on a model: its function, layers and guard hook."""

    __slots__ = ("function", "layers", "hook_id", "warned", "planner")

    def __init__(self, function: functools.partial, layers: List[nn.Module],
                 planner: Any = None) -> None:
        self.function = function
        self.layers = layers
        self.planner = planner
        self.hook_id: Optional[int] = None
        self.warned = False


def _checkpointed_layers(model: nn.Module, action: str) -> List[nn.Module]:
    check_module(f"matepoint.{action}", "model", model)
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


def _is_matepoint(function: Any) -> bool:
    return isinstance(function, _LayerFunction) or \
        (isinstance(function, functools.partial) and function.func is checkpoint)


class _LayerFunction:
    """A layer's checkpoint function under a budget (``apply`` on a model of the
    transformers convention):
    the layer runs as the model's plan says."""

    def __init__(self, planner: Any, index: int, layer: nn.Module) -> None:
        self.planner = planner
        self.index = index
        self.layer = layer

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.planner.run(self.index, self.layer, function, args, kwargs)


def _install(state: "_Enabled") -> None:
    """Each layer's checkpoint function: the plan's runner, or the shared one."""
    for index, layer in enumerate(state.layers):
        layer._gradient_checkpointing_func = state.function if state.planner is None \
            else _LayerFunction(state.planner, index, layer)


def _torch_checkpoint() -> Callable[..., Any]:
    import torch.utils.checkpoint as torch_checkpoint

    return torch_checkpoint.checkpoint


def _caller_name() -> str:
    """The function that called the setter (transformers: ``_activation_checkpointing_enable``)."""
    code = sys._getframe(3).f_code  # past this, _matepoint_function and the wrapper
    return f"{getattr(code, 'co_qualname', code.co_name)}()"


def _matepoint_function(model: nn.Module, state: _Enabled, requested: Any) -> functools.partial:
    """matepoint's checkpoint, with the keyword arguments ``requested`` carried."""
    if _is_matepoint(requested):
        return requested
    keywords: Dict[str, Any] = {}
    target = requested
    if isinstance(requested, functools.partial):
        keywords, target = dict(requested.keywords), requested.func
    if target is not _torch_checkpoint():
        message = (f"matepoint.enable({type(model).__name__}): {_caller_name()} asked for the "
                   f"checkpoint function {requested!r}; matepoint.checkpoint runs instead. Call "
                   f"matepoint.disable(model) first to use that one.")
        if _library_made(model, target):
            # the library's own default around torch's checkpoint: diffusers' closure calling
            # it, transformers' offload=True (torch's under save_on_cpu; matepoint offloads
            # checkpoint inputs itself)
            log.info(message)
        else:
            warnings.warn(message, UserWarning, stacklevel=3)
    return functools.partial(checkpoint, **{**state.function.keywords, **keywords})


def _library_made(model: nn.Module, function: Any) -> bool:
    """Whether ``function`` comes from the package that defines ``model``'s class."""
    package = type(model).__module__.split(".")[0]
    return getattr(function, "__module__", "").split(".")[0] == package


def _guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a class's ``_set_gradient_checkpointing``), routed for marked models."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _set_gradient_checkpointing(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__.get(_MARK)
        if state is None or "gradient_checkpointing_func" not in signature.parameters:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        enabling = bound.arguments.get("enable", True)
        if enabling:
            bound.arguments["gradient_checkpointing_func"] = _matepoint_function(
                self, state, bound.arguments["gradient_checkpointing_func"])
        result = original(*bound.args, **bound.kwargs)
        if enabling and state.planner is not None:
            _install(state)   # the plan's runners, not the one function the library set
        return result

    _set_gradient_checkpointing._matepoint_original = original  # type: ignore[attr-defined]
    return _set_gradient_checkpointing


def _owners(model: nn.Module) -> List[nn.Module]:
    """``model`` and its submodules whose class defines the library's setter."""
    found = []
    for module in model.modules():
        for cls in type(module).__mro__:
            if _SETTER in cls.__dict__:
                setter = cls.__dict__[_SETTER]
                if not hasattr(setter, "_matepoint_original") and callable(setter):
                    setattr(cls, _SETTER, _guarded(setter))
                found.append(module)
                break
    return found


def _check_layers(model: nn.Module, args: Any) -> None:
    """Forward pre-hook: warn once when a layer's checkpoint function is no longer ours."""
    state = model.__dict__.get(_MARK)
    if state is None or state.warned or not model.training or not torch.is_grad_enabled():
        return
    if torch.compiler.is_compiling():  # a constant for Dynamo: nothing of this gets traced
        return
    for layer in state.layers:
        function = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(layer, "gradient_checkpointing", False) and not _is_matepoint(function):
            state.warned = True
            warnings.warn(
                f"matepoint.enable({type(model).__name__}): the {type(layer).__name__} layers "
                f"now checkpoint with {function!r}, set after matepoint.enable by a call that "
                f"bypassed {_SETTER}; call matepoint.enable(model) again to use matepoint",
                UserWarning, stacklevel=4)  # past this hook and torch's two call frames
            return


def _unmark(model: nn.Module) -> None:
    state = model.__dict__.get(_MARK)
    if state is not None and state.hook_id is not None:
        model._forward_pre_hooks.pop(state.hook_id, None)
    if state is not None and state.planner is not None:
        attach(model, None)
    for module in model.modules():
        module.__dict__.pop(_MARK, None)


def enable(model: nn.Module, budget_bytes: Optional[int] = None, *,
           unit_bytes: Optional[int] = None, repeats: int = 1, group: Optional[Any] = None,
           **checkpoint_kwargs: Any) -> nn.Module:
    """Checkpoint ``model``'s layers with matepoint while it trains.

    The one-line replacement for ``model.gradient_checkpointing_enable()``
    on a transformers model (or any module whose layers follow the same
    convention). ``checkpoint_kwargs`` are those of :func:`matepoint.checkpoint`
    (``preserve_rng_state``, ``early_stop``, ``matepoint_offload``, ...).
    Layers checkpoint only in training mode, so ``model.eval()`` and
    generation are untouched. A later ``model.gradient_checkpointing_enable()``
    or ``activation_checkpointing_enable()``, direct or from ``Trainer`` or
    PEFT, keeps matepoint (with the keyword arguments it passes, and its
    ``every_n_layers``). Returns ``model``.

    ``budget_bytes``, ``unit_bytes``, ``repeats``, ``group``: deprecated
    (FutureWarning), still planning; ``apply(model, budget_bytes=...)``
    plans the same layers the same way (see :func:`apply`, :func:`plan`).
    """
    if budget_bytes is not None:
        warnings.warn("matepoint.enable(model, budget_bytes=...) is deprecated: use "
                      "matepoint.apply(model, budget_bytes=...), which plans the same layers "
                      "for any model", FutureWarning, stacklevel=2)
    return _enable(model, budget_bytes, unit_bytes, None, repeats, group, checkpoint_kwargs,
                   "matepoint.enable")


def _enable(model: nn.Module, budget_bytes: Optional[int], unit_bytes: Optional[int],
            pipeline: Optional[bool], repeats: int, group: Optional[Any],
            checkpoint_kwargs: Dict[str, Any], where: str) -> nn.Module:
    """:func:`enable`, planned when ``budget_bytes`` is given; errors name ``where``."""
    check_checkpoint_keywords(where, checkpoint_kwargs)
    check_group(where, group)
    layers = _checkpointed_layers(model, where.rpartition(".")[2])
    function = functools.partial(checkpoint, **checkpoint_kwargs)
    planner = None
    if budget_bytes is not None:
        planner = StepPlanner(type(model).__name__, budget_bytes, unit_bytes, pipeline, repeats,
                              checkpoint_kwargs, where=where, group=group)
    elif unit_bytes is not None or repeats != 1:
        # without a budget nothing is planned: these would be ignored silently
        raise ValueError("matepoint.enable: unit_bytes and repeats need budget_bytes, "
                         "got budget_bytes=None")
    elif group is not None:
        raise ValueError("matepoint.enable: group needs budget_bytes (it names the ranks "
                         "that plan together), got budget_bytes=None")
    _unmark(model)
    state = _Enabled(function, layers, planner)
    for owner in _owners(model):
        owner.__dict__[_MARK] = state
    model.__dict__[_MARK] = state
    state.hook_id = model.register_forward_pre_hook(_check_layers).id
    if planner is not None:
        attach(model, planner)
    _install(state)
    for layer in layers:
        layer.gradient_checkpointing = True
    return model


def _follows_the_convention(model: Any) -> bool:
    """Whether ``model``'s layers follow transformers' checkpointing convention."""
    return (isinstance(model, nn.Module)
            and getattr(model, "supports_gradient_checkpointing", True) is not False
            and any(hasattr(m, "gradient_checkpointing") for m in model.modules()))


def apply(model: nn.Module, budget_bytes: int,
          check_fn: Optional[Callable[[nn.Module], bool]] = None, *,
          unit_bytes: Optional[int] = None, pipeline: Optional[bool] = None, repeats: int = 1,
          group: Optional[Any] = None, **checkpoint_kwargs: Any) -> nn.Module:
    """Plan ``model``'s blocks within ``budget_bytes`` from its first training step.

    The door for a memory budget, any module tree. The first training step
    measures every block and what the model holds outside them; from the
    next, each runs as planned (:func:`planned`), the whole step within the
    budget. Blocks: the modules ``check_fn`` accepts (not those inside one),
    by default the children of the longest ``nn.ModuleList``/``nn.Sequential``;
    names, ``state_dict`` keys and keyword arguments stay. Layers following
    transformers' convention are planned through it, as :func:`enable` does.
    ``unit_bytes``, ``pipeline``, ``repeats``, ``group``: see :func:`plan`;
    ``**checkpoint_kwargs``: see :func:`checkpoint`. Returns ``model``.
    """
    if check_fn is None and _follows_the_convention(model):
        return _enable(model, budget_bytes, unit_bytes, pipeline, repeats, group,
                       checkpoint_kwargs, "matepoint.apply")
    return apply_blocks(model, budget_bytes, check_fn, unit_bytes=unit_bytes,
                        pipeline=pipeline, repeats=repeats, group=group, **checkpoint_kwargs)


def disable(model: nn.Module) -> nn.Module:
    """Stop checkpointing ``model``'s layers (undoes :func:`enable`).

    The library's own ``gradient_checkpointing_enable()`` then installs its
    own checkpoint again. A model never enabled is no error.
    """
    for layer in _checkpointed_layers(model, "disable"):
        layer.gradient_checkpointing = False
    _unmark(model)
    return model
