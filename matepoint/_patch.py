"""A global switch: every call of torch's checkpoint runs matepoint's.

``patch_torch_checkpoint()`` must reach libraries that bound the function by
name before the patch (``from torch.utils.checkpoint import checkpoint`` at
import), functions that keep it as a default argument or in a
``functools.partial`` made earlier (transformers and diffusers store
``partial(checkpoint, **kwargs)`` on each layer), and code imported later.
Rebinding module globals would miss the last three kinds of reference, so
the patch keeps the *function objects* and swaps their code instead: the
``__code__`` of ``torch.utils.checkpoint.checkpoint`` (and of the function it
wraps, and of ``checkpoint_sequential``) becomes a trampoline with the same
parameters that calls matepoint. Every reference, however old, is the same
object and so runs the trampoline. Defaults, ``__wrapped__``, the docstring and
``inspect.signature`` stay what they were, and unpatching puts the original
code objects back: nothing else was changed, so the undo is exact.

Under ``torch.compile`` Dynamo recognises torch's checkpoint by identity and
traces the region as its own higher-order op without running the function, so
compiled code keeps torch's (compiled) checkpointing; eager calls go to
matepoint.
"""
from __future__ import annotations

import functools
import logging
import threading
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

# checkpoint options of torch's curried form (torch 2.14: checkpoint(use_reentrant=False)(fn))
from matepoint._C import CHECKPOINT_KEYWORDS as _CURRY_OPTIONS
from matepoint._C import checkpoint as _checkpoint
from matepoint._sequential import checkpoint_sequential as _checkpoint_sequential

log = logging.getLogger("matepoint")


class _CheckpointedFunction:
    """``fn`` whose every call is checkpointed by matepoint (torch 2.14's curried form)."""

    def __init__(self, function: Callable[..., Any], options: Dict[str, Any]) -> None:
        self.function = function
        self.options = options
        functools.update_wrapper(self, function, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _checkpoint(_call, self.function, args, kwargs, **self.options)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        bind = getattr(self.function, "__get__", None)
        if instance is None or bind is None:
            return self
        return type(self)(bind(instance, owner), self.options)


def _call(function: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return function(*args, **kwargs)


_warned_reentrant = False


def _warn_reentrant_once() -> None:
    global _warned_reentrant
    if not _warned_reentrant:
        _warned_reentrant = True
        # stacklevel 4: the caller of torch's checkpoint, past this, the route and the trampoline
        warnings.warn("torch.utils.checkpoint.checkpoint(use_reentrant=True) runs "
                      "matepoint.checkpoint while patch_torch_checkpoint() is in force: the "
                      "result is matepoint's (non-reentrant) one", UserWarning, stacklevel=4)


def route_checkpoint(function: Any = None, *args: Any, **kwargs: Any) -> Any:
    """What ``torch.utils.checkpoint.checkpoint`` runs while patched."""
    if kwargs.get("use_reentrant"):
        _warn_reentrant_once()
        kwargs["use_reentrant"] = False
    if function is None and not args:
        unknown = sorted(set(kwargs) - _CURRY_OPTIONS)
        if unknown:
            raise ValueError("Unexpected keyword arguments: " + ",".join(unknown))
        return functools.partial(_CheckpointedFunction, options=kwargs)
    return _checkpoint(function, *args, **kwargs)


def route_checkpoint_sequential(functions: Any, segments: Any, input: Any,
                                use_reentrant: Optional[bool] = None, **kwargs: Any) -> Any:
    """What ``torch.utils.checkpoint.checkpoint_sequential`` runs while patched."""
    if use_reentrant:
        _warn_reentrant_once()
    return _checkpoint_sequential(functions, segments, input, use_reentrant=False, **kwargs)


def _parameters(code: types.CodeType) -> Tuple[str, str]:
    """The parameter list of ``code`` and the call passing each one on, as source."""
    names = code.co_varnames
    positional = list(names[:code.co_argcount])
    keyword_only = list(names[code.co_argcount:code.co_argcount + code.co_kwonlyargcount])
    rest = code.co_argcount + code.co_kwonlyargcount
    varargs = varkw = None
    if code.co_flags & 0x04:  # CO_VARARGS
        varargs, rest = names[rest], rest + 1
    if code.co_flags & 0x08:  # CO_VARKEYWORDS
        varkw = names[rest]
    params: List[str] = list(positional)
    if code.co_posonlyargcount:
        params.insert(code.co_posonlyargcount, "/")
    if varargs is not None:
        params.append("*" + varargs)
    elif keyword_only:
        params.append("*")
    params += keyword_only
    call = list(positional) + (["*" + varargs] if varargs else [])
    call += [f"{name}={name}" for name in keyword_only]
    if varkw is not None:
        params.append("**" + varkw)
        call.append("**" + varkw)
    return ", ".join(params), ", ".join(call)


_ROUTE = "matepoint: the route"  # placeholder constant, replaced by the route itself


def _trampoline(target: types.FunctionType, route: Callable[..., Any]) -> types.CodeType:
    """Code with ``target``'s parameters (and free-variable count) calling ``route``.

    The function's own defaults apply, since they live on the function object.
    The route is a constant of the code (compiled as a placeholder string, then
    swapped), so no name is added to torch's globals and no lookup runs per
    call; the free variables are only mentioned, as CPython requires a
    closure and a code object to agree on their number.
    """
    code = target.__code__
    params, call = _parameters(code)
    free = code.co_freevars
    mention = f"        ({', '.join(free)},)\n" if free else ""
    source = (f"def _factory({', '.join(free)}):\n"
              f"    def {code.co_name}({params}):\n"
              f"{mention}"
              f"        return {_ROUTE!r}({call})\n"
              f"    return {code.co_name}.__code__\n")
    namespace: Dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # "str is not callable": swapped below
        # a file name of its own: tracebacks must not show lines of this file
        exec(compile(source, "<matepoint.patch_torch_checkpoint>", "exec"),  # noqa: S102
             namespace)
    made = namespace["_factory"](*([None] * len(free)))
    if made.co_consts.count(_ROUTE) != 1:
        raise RuntimeError("matepoint.patch_torch_checkpoint: cannot build the trampoline")
    changes: Dict[str, Any] = {
        "co_name": code.co_name,
        "co_consts": tuple(route if const == _ROUTE else const for const in made.co_consts)}
    if hasattr(code, "co_qualname"):  # Python 3.11 and newer
        changes["co_qualname"] = code.co_qualname
    return made.replace(**changes)


def _targets() -> List[Tuple[types.FunctionType, Callable[..., Any]]]:
    """torch's function objects to patch, each with the route it gets."""
    import torch.utils.checkpoint as torch_checkpoint

    found: List[Tuple[types.FunctionType, Callable[..., Any]]] = []
    for name, route in (("checkpoint", route_checkpoint),
                        ("checkpoint_sequential", route_checkpoint_sequential)):
        function = getattr(torch_checkpoint, name)
        if not isinstance(function, types.FunctionType):
            raise TypeError(f"matepoint.patch_torch_checkpoint: torch.utils.checkpoint.{name} is "
                            f"{function!r}, not torch's function; was it replaced by hand?")
        # the function torch._disable_dynamo wraps is reachable too (as __wrapped__)
        while isinstance(function, types.FunctionType):
            found.append((function, route))
            function = getattr(function, "__wrapped__", None)
    return found


class TorchCheckpointPatch:
    """One :func:`patch_torch_checkpoint` call; a context manager that undoes it on exit.

    Only :func:`patch_torch_checkpoint` makes one that is in force. One made
    directly (``TorchCheckpointPatch()``) patches nothing: its ``undo()`` does
    nothing, and ``with`` on it, or on one already undone, raises
    RuntimeError rather than run the block unpatched.
    """

    def __init__(self) -> None:
        self.active = False   # patch_torch_checkpoint() sets it once the patch is in force

    def undo(self) -> None:
        """Undo this patch (once; later calls, and calls on a patch never in
        force, do nothing)."""
        _release(self)

    def __enter__(self) -> "TorchCheckpointPatch":
        if not self.active:
            raise RuntimeError(
                "matepoint.TorchCheckpointPatch: this patch is not in force (made directly, "
                "or undone already); write `with matepoint.patch_torch_checkpoint():`")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


_lock = threading.Lock()
_active: List[TorchCheckpointPatch] = []
_saved: List[Tuple[types.FunctionType, types.CodeType]] = []


def patch_torch_checkpoint() -> TorchCheckpointPatch:
    """Make every call of torch's checkpoint run :func:`matepoint.checkpoint`.

    ``torch.utils.checkpoint.checkpoint`` and ``checkpoint_sequential`` run
    matepoint's versions, wherever the caller found them: libraries that
    imported them by name before this call (timm, diffusers, transformers,
    torchtitan, accelerate), ``functools.partial`` objects made earlier, and
    code imported later. Calls with ``use_reentrant=True`` get matepoint's
    non-reentrant result (warned once). Nested calls are counted; the original
    functions come back when the last patch is undone, by
    :func:`unpatch_torch_checkpoint` or by leaving ``with
    matepoint.patch_torch_checkpoint():``. Compiled regions keep torch's own.
    """
    with _lock:
        if not _active:
            targets = _targets()
            trampolines = [_trampoline(function, route) for function, route in targets]
            for (function, _), code in zip(targets, trampolines):
                _saved.append((function, function.__code__))
                function.__code__ = code
            log.debug("matepoint: torch.utils.checkpoint now runs matepoint.checkpoint")
        handle = TorchCheckpointPatch()
        handle.active = True
        _active.append(handle)
        return handle


def _release(handle: TorchCheckpointPatch) -> None:
    with _lock:
        if not handle.active:
            return
        handle.active = False
        _active.remove(handle)
        if not _active:
            while _saved:
                function, code = _saved.pop()
                function.__code__ = code
            log.debug("matepoint: torch.utils.checkpoint restored")


def unpatch_torch_checkpoint() -> None:
    """Undo the latest :func:`patch_torch_checkpoint` still in force.

    Raises RuntimeError when none is.
    """
    with _lock:
        if not _active:
            raise RuntimeError("matepoint.unpatch_torch_checkpoint: torch's checkpoint is not "
                               "patched (no patch_torch_checkpoint() in force)")
        handle: Optional[TorchCheckpointPatch] = _active[-1]
    if handle is not None:
        handle.undo()


def torch_checkpoint_patched() -> bool:
    """Whether torch's checkpoint currently runs matepoint's."""
    return bool(_active)
