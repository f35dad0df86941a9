"""Which C++ units install_allocator() would load for the running torch,
said before it runs and without compiling anything: the wheel's prebuilt
one, a build of an earlier run in the cache, a build at the first call
(a compiler and CUDA's headers are there), or none, with the reason and
the one thing that fixes it.

It walks the choice matepoint/_oom.py's load_unit() makes (prebuilt for
this key, else compile: the source, what the unit needs, the compiler, the
cache and an earlier failure recorded there), stopping short of the
compiler. Once install_allocator() ran, allocator_info() says what it
did instead, and this module reports that."""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Optional

import torch

from matepoint import _adapter, _allocator, _oom, _units

# what a unit would be, besides _units' PREBUILT and MISSING
CACHED = "compiled here"          # a build of an earlier run, in the cache
TO_COMPILE = "to compile"         # compiled at the first install_allocator()
NOT_APPLICABLE = "not applicable"

# the allocator's state as a whole
ADAPTER = "adapter"        # torch's memory API answers from matepoint's allocator
FALLBACK = "fallback"      # the plain pluggable allocator: torch's memory API raises
NO_CUDA = "no CUDA"        # install_allocator() cannot run with this torch


def _quiet(function: Callable[[], Any]) -> Any:
    """``function()`` with matepoint's log held below errors: _units.find
    warns about a refused prebuilt unit, which the outlook says itself."""
    logger = logging.getLogger("matepoint")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return function()
    finally:
        logger.setLevel(level)


def _entry(unit: str, state: str, path: Optional[str] = None, reason: str = "",
           fix: str = "") -> Dict[str, Any]:
    return {"unit": unit, "state": state, "key": _units.key(unit), "path": path,
            "reason": reason, "fix": fix}


def _cache_outlook(name: str, source: str, extras: _oom.UnitExtras,
                   why_not_prebuilt: str) -> Dict[str, Any]:
    """The unit to be compiled here: cached already, refused, or to build."""
    compiler = _oom._compiler()
    key = _oom.cache_key(source, compiler, extras)
    folder = os.path.realpath(_oom.cache_dir())
    target = os.path.join(folder, f"{name}-{key}.so")
    problem = None
    if os.path.isdir(folder):
        problem = _units.folder_problem(folder, "the cache folder", (os.geteuid(),))
    elif os.path.lexists(folder):
        problem = f"the cache folder {folder} cannot be used (not a directory)"
    if problem is None and os.path.lexists(target):
        problem = _units.file_problem(target, "the cached library", (os.geteuid(),))
        if problem is None:
            return _entry(name, CACHED, target, why_not_prebuilt)
    if problem is not None:
        return _entry(name, TO_COMPILE, None,
                      f"{why_not_prebuilt}; it is compiled at every start, in a private "
                      f"temporary folder, because {problem}",
                      "set MATEPOINT_CACHE_DIR to a folder only you can write")
    marker = os.path.join(folder, f"{name}-{key}.failed")
    if os.path.exists(marker) and _oom._recorded_failure(marker) is not None:
        return _entry(name, _units.MISSING, None,
                      f"{why_not_prebuilt}; and an earlier build failed, recorded in {marker}",
                      f"read {marker}, fix what it says, then delete it (or set "
                      f"MATEPOINT_BUILD_RETRY=1)")
    return _entry(name, TO_COMPILE, None,
                  f"{why_not_prebuilt}; the first install_allocator() compiles it (about "
                  f"10-30 s, once) into {folder}")


def unit_outlook(name: str, extras: Callable[[], _oom.UnitExtras] = _oom.UnitExtras
                 ) -> Dict[str, Any]:
    """Unit ``name``'s outlook: state (PREBUILT, CACHED, TO_COMPILE or
    MISSING), key, path, reason (why not prebuilt, why missing) and fix."""
    why_not_prebuilt = "MATEPOINT_PREBUILT=0 asks to compile it here"
    try:
        allowed = _oom.prebuilt_allowed()
    except ValueError as error:
        return _entry(name, _units.MISSING, None, str(error), "set MATEPOINT_PREBUILT to 1 or 0")
    if allowed:
        path, why_not_prebuilt = _quiet(lambda: _units.find(name))
        if path is not None:
            return _entry(name, _units.PREBUILT, path)
    try:
        source, _, unit_extras = _oom.unit_build_inputs(name, extras)
        return _cache_outlook(name, source, unit_extras, why_not_prebuilt)
    except (_oom.BuildError, OSError, ValueError) as error:
        return _entry(name, _units.MISSING, None,
                      f"{why_not_prebuilt}; and compiling it here would fail: {error}",
                      getattr(error, "fix", ""))


def _from_state(state: _units.UnitState) -> Dict[str, Any]:
    """What install_allocator() did with a unit, in the outlook's shape."""
    return {"unit": state.unit, "state": state.origin, "key": state.key, "path": state.path,
            "reason": state.reason, "fix": state.fix}


def allocator_outlook() -> Dict[str, Any]:
    """The allocator's state for this process: installed or not, and with
    the adapter or the fallback (what install_allocator() did, or would do
    for this torch), each unit's outlook, the reason and the fix."""
    info = _allocator.allocator_info()
    installed = info.installed
    cpu_build = torch.version.cuda is None
    no_cuda = f"torch {torch.__version__} is a CPU build: install_allocator() needs CUDA"
    if installed:
        adapter, oom = _from_state(info.adapter), _from_state(info.oom_unit)
    else:
        adapter = (_entry("torch_adapter", NOT_APPLICABLE, None, no_cuda) if cpu_build
                   else unit_outlook("torch_adapter", _adapter._compile_extras))
        oom = unit_outlook("oom_raise")
    entry: Dict[str, Any] = {"installed": installed, "prebuilt_for": info.prebuilt_for,
                             "adapter": adapter, "oom_unit": oom}
    if cpu_build:
        state, reason = NO_CUDA, no_cuda
        fix = "install a CUDA build of torch (https://pytorch.org/get-started/locally/)"
    elif adapter["state"] == _units.MISSING:
        state, reason, fix = FALLBACK, adapter["reason"], adapter["fix"]
    else:
        state, reason, fix = ADAPTER, "", ""
    entry.update(state=state, reason=reason, fix=fix,
                 oom_raises=oom["state"] != _units.MISSING)
    return entry
