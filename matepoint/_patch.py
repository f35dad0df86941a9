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
matepoint, and so does a region Dynamo cannot trace (a graph break inside):
Dynamo then calls the function eagerly, and the trampoline is marked so that
Dynamo runs it and all below it untraced, as it runs torch's original.

A patch lives in one process's memory: children started with spawn or
forkserver begin without it. While patched, ``MATEPOINT_PATCH_TORCH_CHECKPOINT=1``
is set in ``os.environ`` (children inherit it, and ``import matepoint`` reads
it), and ``torch.multiprocessing.start_processes`` (``mp.spawn``, Lightning's
``ddp_spawn``) hands each child its function wrapped in an object of this
module, so unpickling it imports matepoint before the function runs.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import threading
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

# checkpoint options of torch's curried form (torch 2.14: checkpoint(use_reentrant=False)(fn))
from matepoint._C import CHECKPOINT_KEYWORDS as _CURRY_OPTIONS
from matepoint._C import checkpoint as _checkpoint
from matepoint._options import _FALSE, _TRUE
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
    if isinstance(use_reentrant, torch.Tensor):
        # torch tests it with a bare `if` deep inside (or not at all, with one
        # segment): a tensor here is a stray fourth positional argument
        raise TypeError("torch.utils.checkpoint.checkpoint_sequential (patched by matepoint) "
                        "takes (functions, segments, input, use_reentrant=None, **kwargs): "
                        "use_reentrant must be a bool, got a Tensor (a second input passed "
                        "positionally? the input is one tensor or tuple)")
    if use_reentrant:
        _warn_reentrant_once()
    return _checkpoint_sequential(functions, segments, input, use_reentrant=False, **kwargs)


ENVIRONMENT = "MATEPOINT_PATCH_TORCH_CHECKPOINT"


class _PatchedInChild:
    """The function a spawned child runs, carrying the patch into the child.

    Unpickling this object in the child imports matepoint, which reads
    MATEPOINT_PATCH_TORCH_CHECKPOINT (inherited from the parent) and patches
    torch's checkpoint before ``function`` runs, even when nothing else the
    child loads imports matepoint.
    """

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


# torch.multiprocessing.start_processes' own code, as a function of its own,
# while the patch is in force (set and cleared under _lock)
_start_processes: Optional[Callable[..., Any]] = None


def _outside_torch_multiprocessing() -> int:
    """The stacklevel naming the first caller past torch.multiprocessing (mp.spawn's)."""
    folder = os.path.dirname(importlib.import_module("torch.multiprocessing").__file__ or "")
    frame = sys._getframe(2)   # past this and route_start_processes: the trampoline
    level = 2
    while frame is not None and (frame.f_code.co_filename.startswith(folder + os.sep) or
                                 frame.f_code.co_filename == _FILE_NAME):
        frame, level = frame.f_back, level + 1
    return level


def route_start_processes(function: Any, *args: Any, **kwargs: Any) -> Any:
    """What ``torch.multiprocessing.start_processes`` runs while patched."""
    original = _start_processes
    if original is None:  # unpatched meanwhile by another thread: torch's own again
        import torch.multiprocessing as torch_mp
        return torch_mp.start_processes(function, *args, **kwargs)
    start_method = kwargs.get("start_method", args[4] if len(args) > 4 else "spawn")
    if start_method != "fork":
        if os.environ.get(ENVIRONMENT, "").strip().lower() not in _TRUE:
            warnings.warn(f"patch_torch_checkpoint() is in force but {ENVIRONMENT}="
                          f"{os.environ.get(ENVIRONMENT)!r}: the processes started with "
                          f"{start_method!r} run torch's checkpoint, not matepoint's",
                          UserWarning, stacklevel=_outside_torch_multiprocessing())
        else:
            function = _PatchedInChild(function)
    return original(function, *args, **kwargs)


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


_FILE_NAME = "<matepoint.patch_torch_checkpoint>"  # the trampolines' co_filename
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
        exec(compile(source, _FILE_NAME, "exec"),  # noqa: S102
             namespace)
    made = namespace["_factory"](*([None] * len(free)))
    if made.co_consts.count(_ROUTE) != 1:
        raise RuntimeError("matepoint.patch_torch_checkpoint: cannot build the trampoline")
    changes: Dict[str, Any] = {
        "co_name": code.co_name,
        "co_consts": tuple(route if const == _ROUTE else const for const in made.co_consts)}
    if hasattr(code, "co_qualname"):  # Python 3.11 and newer
        changes["co_qualname"] = code.co_qualname
    trampoline = made.replace(**changes)
    _skip_in_dynamo(trampoline)
    return trampoline


def _skip_in_dynamo(code: types.CodeType) -> None:
    """Dynamo runs ``code``, and all it calls, without tracing it.

    torch's checkpoint is ``torch._disable_dynamo``-d: when a compiled
    function calls it eagerly (Dynamo traces a region as its own op unless
    the region has a graph break), nothing below it is compiled. The
    trampoline must do the same: Dynamo would otherwise try to compile it as
    a frame of its own and fail on the route, a function held as a constant.
    Marking the code object needs only torch's C module, not torch._dynamo.
    """
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    action = getattr(eval_frame, "_FrameAction", None)
    if action is None or not hasattr(eval_frame, "set_code_exec_strategy"):
        return  # a torch without per-code strategies: without Dynamo's too
    strategy = eval_frame._FrameExecStrategy(action.SKIP, action.SKIP)
    eval_frame.set_code_exec_strategy(code, strategy)


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
    # the module, not the function torch.multiprocessing.spawn shadows it with
    torch_spawn = importlib.import_module("torch.multiprocessing.spawn")
    # optional: a torch without it, or one whose start_processes is no plain
    # function, keeps its own (children then need the environment variable)
    start = getattr(torch_spawn, "start_processes", None)
    if isinstance(start, types.FunctionType):
        found.append((start, route_start_processes))
    return found


def _copy_of(function: types.FunctionType) -> types.FunctionType:
    """A new function object running ``function``'s current code."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


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
# whether the first patch set MATEPOINT_PATCH_TORCH_CHECKPOINT (the last undo
# removes it); read and written under _lock, like _active and _saved
_environment_set = False
# the patch MATEPOINT_PATCH_TORCH_CHECKPOINT made; written only by
# patch_from_environment at import matepoint, under Python's import lock
_from_environment: Optional[TorchCheckpointPatch] = None


def patch_torch_checkpoint() -> TorchCheckpointPatch:
    """Make every call of torch's checkpoint run :func:`matepoint.checkpoint`.

    ``torch.utils.checkpoint.checkpoint`` and ``checkpoint_sequential`` run
    matepoint's versions, wherever the caller found them: libraries that
    imported them by name before this call (timm, diffusers, transformers,
    torchtitan, accelerate), ``functools.partial`` objects made earlier, and
    code imported later. Calls with ``use_reentrant=True`` get matepoint's
    non-reentrant result (warned once). Nested calls are counted; the original
    functions come back when the last patch is undone, by
    :func:`unpatch_torch_checkpoint` or leaving ``with patch_torch_checkpoint():``
    (compiled regions and spawned workers: see docs/guides/compile.md and docs/guides/distributed.md).
    """
    global _start_processes, _environment_set
    with _lock:
        if not _active:
            targets = _targets()
            trampolines = [_trampoline(function, route) for function, route in targets]
            for (function, route), code in zip(targets, trampolines):
                if route is route_start_processes:
                    _start_processes = _copy_of(function)
                _saved.append((function, function.__code__))
                function.__code__ = code
            # inherited by every child started from now on (spawned ones included)
            if ENVIRONMENT not in os.environ:
                os.environ[ENVIRONMENT] = "1"
                _environment_set = True
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
            _release_environment()
            log.debug("matepoint: torch.utils.checkpoint restored")


def _release_environment() -> None:
    """Children started from now on run torch's checkpoint again (_lock held)."""
    global _start_processes, _environment_set
    _start_processes = None
    if _environment_set:
        _environment_set = False
        if os.environ.get(ENVIRONMENT) == "1":
            del os.environ[ENVIRONMENT]


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


def patch_from_environment() -> None:
    """Patch now if MATEPOINT_PATCH_TORCH_CHECKPOINT is set to a true value.

    Called at ``import matepoint``: a process that inherits the variable (a
    spawned worker of a patched parent, or a job started with it set) runs
    matepoint's checkpoint wherever torch's is called, for its whole life
    (``unpatch_torch_checkpoint()`` undoes it). 1/true/yes/on patch,
    0/false/no/off or empty do not; anything else raises ValueError.
    """
    global _from_environment
    text = os.environ.get(ENVIRONMENT)
    if text is None:
        return
    lowered = text.strip().lower()
    if lowered in _FALSE or not lowered:
        return
    if lowered not in _TRUE:
        raise ValueError(f"{ENVIRONMENT}={text!r}: expected one of 1/0, true/false, yes/no, "
                         "on/off")
    if _from_environment is None or not _from_environment.active:
        _from_environment = patch_torch_checkpoint()
