"""matepoint's CUDA caching allocator: install it, read its statistics."""
from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
from typing import Any, Callable, Dict, Union

import torch

from matepoint import _adapter, _C, _oom, _units
from matepoint._errors import type_error, value_error
from matepoint._options import show_int

# the library's entry points by role: their names are defined once, in C
_SYMBOLS = _C.ALLOCATOR_SYMBOLS
# hooks torch's CUDAPluggableAllocator lets us register, by role; all but
# record_stream are optional (see _hook_setters)
_HOOKS = {
    "set_init_fn": "init",
    "set_reset_fn": "reset",
    "set_record_stream_fn": "record_stream",
    "set_memory_fraction_fn": "set_memory_fraction",
    # CUDA IPC: the segment a tensor's block is carved from, not the block
    "set_base_alloc_fn": "base_allocation",
}
_REQUIRED_HOOK = "set_record_stream_fn"
_installed = False


def allocator_path() -> str:
    """Path of the allocator's shared library inside the installed package."""
    here = os.path.dirname(os.path.abspath(__file__))
    matches = sorted(glob.glob(os.path.join(here, "_alloc*.so")))
    if not matches:
        raise RuntimeError(f"matepoint was built without its allocator library (no _alloc*.so in {here})")
    return matches[0]


def _hook_setters(pluggable: Any) -> Dict[str, Callable[[int], None]]:
    """The hook registrations torch's binding offers, by setter name.

    Without set_record_stream_fn torch would ignore every
    ``Tensor.record_stream`` under a pluggable allocator, without a word,
    and memory read on another stream (matepoint's own offload copies
    included) could be handed out while that stream still uses it: such a
    torch is refused, before anything is installed."""
    binding = pluggable._allocator
    setters = {name: getattr(binding, name, None) for name in _HOOKS}
    if setters[_REQUIRED_HOOK] is None:
        raise RuntimeError(
            "matepoint.install_allocator: this torch's CUDAPluggableAllocator cannot register a "
            "record_stream hook (it has no set_record_stream_fn): under it Tensor.record_stream "
            "would be silently ignored and memory still used by another stream could be "
            "handed out, corrupting data. Nothing was installed: keep torch's allocator, or "
            "use a torch whose pluggable allocator has set_record_stream_fn")
    return {name: setter for name, setter in setters.items() if setter is not None}


def install_allocator() -> bool:
    """Make matepoint's allocator torch's CUDA allocator for this process.

    Call it at program start, before CUDA is used. torch's memory API
    (memory_stats, snapshots, out-of-memory observers, ...) answers from it
    through a C++ adapter, and out of memory raises torch.OutOfMemoryError
    through another C++ unit, both prebuilt for the torch releases the wheel
    names (else compiled and cached at the first call). Returns whether out
    of memory raises; a missing unit is warned about with its fix (also in
    allocator_info()). RuntimeError where torch would ignore record_stream.
    """
    global _installed
    if _installed:
        return _oom.handler_state().attached
    if not torch.cuda.is_available():
        raise RuntimeError("matepoint.install_allocator: CUDA is not available in this process")
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "matepoint.install_allocator must run before CUDA is first used: CUDA is already "
            "initialized here, so torch's own allocator may hold memory")
    path = allocator_path()
    library = ctypes.CDLL(path)
    try:
        _adapter.install(library)
    except (OSError, AttributeError, _oom.BuildError, RuntimeError) as error:
        fix = getattr(error, "fix", "")
        raises = _install_plain(path, library, str(error) + (f". To fix: {fix}" if fix else ""))
    else:
        raises = _oom.attach_oom_handler(library)
    _C._attach_allocator(path)
    _installed = True
    return raises


def _install_plain(path: str, library: ctypes.CDLL, reason: str) -> bool:
    """torch's plain CUDAPluggableAllocator over the library, where the
    adapter cannot be had: torch's memory functions then raise an error
    naming matepoint's allocator when called (warned once, here)."""
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(path, _SYMBOLS["malloc"],
                                                          _SYMBOLS["free"])
    setters = _hook_setters(pluggable)
    raises = _oom.attach_oom_handler(library)
    for setter, register in setters.items():
        register(ctypes.cast(getattr(library, _SYMBOLS[_HOOKS[setter]]), ctypes.c_void_p).value)
    torch.cuda.memory.change_current_allocator(pluggable)
    _adapter.guard_torch_memory_api(reason)
    # one warning: where the OOM unit failed to build too, its warning named
    # the build's problem already (and each guarded call repeats it); a CPU
    # build of torch has no CUDA memory to report at all
    if not raises or torch.version.cuda is None:
        return raises
    _oom._warn("matepoint: torch's memory API (torch.cuda.memory_stats, max_memory_allocated, "
               "memory snapshots, out-of-memory observers) will raise under matepoint's "
               "allocator, because the C++ adapter that answers it could not be built here: "
               f"{reason}. matepoint.memory_stats() and memory_report() still work.")
    return raises


@dataclasses.dataclass(frozen=True)
class AllocatorInfo:
    """What install_allocator() gave this process: whether it ran
    (``installed``), and the state of each C++ unit it loads into torch,
    ``adapter`` (torch's memory API, snapshots, cudnn.benchmark, CUDA
    graphs) and ``oom_unit`` (out of memory as torch.OutOfMemoryError):
    where each came from ("prebuilt", "compiled here", "missing", "not
    loaded"), its file, the reason it is missing and the fix."""
    installed: bool
    adapter: _units.UnitState
    oom_unit: _units.UnitState
    prebuilt_for: str

    def as_dict(self) -> Dict[str, Any]:
        """The same as plain values (JSON)."""
        return dataclasses.asdict(self)


def allocator_info() -> AllocatorInfo:
    """Each allocator unit's origin, or why it is missing and the fix."""
    return AllocatorInfo(_installed, _units.state("torch_adapter"), _units.state("oom_raise"),
                         _units.carried_torches())


def is_installed() -> bool:
    """True once install_allocator() made matepoint's allocator torch's."""
    return _installed


def _device_index(where: str, device: Any) -> int:
    """``device`` as a CUDA device index: an int, or what torch's own
    ``torch.cuda.memory_stats`` takes besides (a ``torch.device`` or a
    string such as ``"cuda:1"``; one without an index is the current device)."""
    accepted = ("a CUDA device index (an int from 0 to the number of devices - 1), "
                "a torch.device or a string such as 'cuda:0'")
    if isinstance(device, (str, torch.device)):
        try:
            parsed = torch.device(device)
        except RuntimeError:   # not a device's name at all ("0", "gpu")
            raise type_error(where, "device", accepted, device) from None
        if parsed.type != "cuda":
            raise value_error(where, "device", accepted, device)
        if parsed.index is None:
            return torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        return parsed.index
    if isinstance(device, bool) or not isinstance(device, int):
        raise type_error(where, "device", accepted, device)
    if not 0 <= device < 1 << 31:
        raise value_error(where, "device", accepted, device)
    return device


def memory_stats(device: Union[int, str, torch.device] = 0) -> Dict[str, Any]:
    """Memory of matepoint's allocator on ``device`` (int, torch.device or "cuda:N").

    allocated/reserved bytes (current and peak), counts of mallocs, frees, cache hits, and
    torch.cuda.memory_stats()'s keys and figures ("allocated_bytes.all.current", ...),
    ``tags``: live and peak bytes per checkpointed region and phase (region 0: outside any
    checkpoint), and ``oom_raises``: whether running out of memory raises
    torch.OutOfMemoryError (False: it stops the process; install_allocator() warned why).
    Before install_allocator() it raises RuntimeError.
    """
    device = _device_index("matepoint.memory_stats", device)
    per_device = _C._allocator_stats()
    if device >= len(per_device):
        raise ValueError(f"matepoint.memory_stats: device must be an int from 0 to "
                         f"{len(per_device) - 1} (the CUDA devices), got {show_int(device)}")
    stats = dict(per_device[device])
    stats["oom_raises"] = _oom.handler_state().attached
    return stats


def reset_peak_memory_stats() -> None:
    """Restart peak counts (device and per tag) from now; RuntimeError before install_allocator."""
    _C._allocator_reset_peaks()


def empty_cache() -> None:
    """Give cached, unused segments back to the device; RuntimeError before install_allocator."""
    _C._allocator_empty_cache()


def memory_report(device: Union[int, str, torch.device] = 0) -> str:
    """A table of memory per checkpointed region of CUDA device ``device``
    (as for :func:`memory_stats`): peak bytes in forward and recompute, bytes
    live, totals first. Needs :func:`install_allocator` (RuntimeError)."""
    device = _device_index("matepoint.memory_report", device)
    stats = memory_stats(device)
    mib = 1 << 20
    lines = [
        f"matepoint allocator, device {device}: allocated {stats['allocated_bytes'] / mib:.1f} MiB "
        f"(peak {stats['peak_allocated_bytes'] / mib:.1f}), reserved "
        f"{stats['reserved_bytes'] / mib:.1f} MiB (peak {stats['peak_reserved_bytes'] / mib:.1f}), "
        f"{stats['cache_hits']}/{stats['mallocs']} cache hits, {stats['oom_retries']} OOM retries",
        f"{'region':>8} {'phase':>10} {'peak MiB':>10} {'live MiB':>10} {'allocs':>8}",
    ]
    for row in stats["tags"]:
        name = "outside" if row["region"] == 0 else str(row["region"])
        lines.append(f"{name:>8} {row['phase']:>10} {row['peak_bytes'] / mib:>10.2f} "
                     f"{row['live_bytes'] / mib:>10.2f} {row['allocations']:>8}")
    return "\n".join(lines)
