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

from typing import Any, Callable, Dict, Optional

import torch

from matepoint import _adapter, _allocator, _oom, _units

# what a unit would be, besides _units' origins
CACHED = _units.COMPILED          # a build of an earlier run, in the cache
TO_COMPILE = _units.TO_COMPILE    # compiled at the first install_allocator()
NOT_APPLICABLE = "not applicable"

# the allocator's state as a whole
ADAPTER = "adapter"        # torch's memory API answers from matepoint's allocator
FALLBACK = "fallback"      # the plain pluggable allocator: torch's memory API raises
NO_CUDA = "no CUDA"        # install_allocator() cannot run with this torch


def _entry(unit: str, state: str, path: Optional[str] = None, reason: str = "",
           fix: str = "") -> Dict[str, Any]:
    return {"unit": unit, "state": state, "key": _units.key(unit), "path": path,
            "reason": reason, "fix": fix}


def unit_outlook(name: str, extras: Callable[[], _oom.UnitExtras] = _oom.UnitExtras
                 ) -> Dict[str, Any]:
    """Unit ``name``'s outlook (_oom.outlook, the choice load_unit makes,
    stopping short of loading or compiling): state (PREBUILT, CACHED,
    TO_COMPILE or MISSING), key, path, reason (why not prebuilt, why
    missing) and fix. A bad MATEPOINT_PREBUILT is MISSING, with its fix."""
    try:
        return _from_state(_oom.outlook(name, extras))
    except ValueError as error:
        return _entry(name, _units.MISSING, None, str(error), "set MATEPOINT_PREBUILT to 1 or 0")


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
