"""matepoint: activation checkpointing for PyTorch with a C core.

``from matepoint import checkpoint`` is a drop-in replacement for
``torch.utils.checkpoint.checkpoint`` (non-reentrant semantics) that also
moves each checkpoint's inputs to pinned host memory after the forward pass
and brings them back, prefetched, for the recompute in backward (on a GPU).

Classes, each on its own page (``help(matepoint.Plan)``): ``Plan`` (what :func:`plan` returns),
``PlanError`` (no plan fits), ``PlannedBlock`` (a plain callable ``Plan.apply`` checkpoints),
``Options`` (``matepoint.options``, changed with :func:`set_options`) and ``TorchCheckpointPatch``
(undoes :func:`patch_torch_checkpoint` as a context manager).
"""
from __future__ import annotations

# What `import matepoint` changes outside its own objects, each needed
# (tests/test_one_source.py checks that nothing else changes):
# - run from a source checkout with no built _C, this package's __path__
#   may point at an installed copy built from the same sources (_locate.py);
# - MATEPOINT_<OPTION> variables are applied to the C core (_options.py);
# - the package's module object gets a subclass of ModuleType (_Module,
#   below), the only way to give ``matepoint.NOPIPELINE = True`` an effect;
# - until torch._dynamo is imported, a finder waits for it at the head of
#   sys.meta_path, and leaves once it has marked checkpoint for Dynamo
#   (importing Dynamo ourselves would cost more than a second: _compile.py).
# torch's own modules, hooks and checkpoint are left as they are; the patch
# of torch.utils.checkpoint is only made on request (_patch.py): by a call,
# or by MATEPOINT_PATCH_TORCH_CHECKPOINT=1 in the environment at import,
# which a patched parent hands its spawned children.
import sys
import types
from typing import Any, Dict, List

import torch  # noqa: F401  (the C core looks torch up at import)

from matepoint._locate import locate_extension

locate_extension(__path__)  # a source checkout without a built _C: see _locate.py
from matepoint import _compile  # noqa: E402
from matepoint import _sac_offload  # noqa: E402,F401  (registers its adapter with _C)
from matepoint._C import _reserve_pool, checkpoint, is_recomputing
from matepoint._C import empty_pool as _empty_pool
from matepoint._C import pool_stats as _pool_stats
from matepoint._planning.autoplan import planned
from matepoint._allocator import (AllocatorInfo, allocator_info, empty_cache, install_allocator,
                                  memory_report, memory_stats, reset_peak_memory_stats)
from matepoint._composable import checkpoint_module, uncheckpoint_module
from matepoint._enable import apply, disable, enable
from matepoint._options import Options, settings as _settings
from matepoint._options import show_int as _show_int
from matepoint._patch import (TorchCheckpointPatch, patch_torch_checkpoint,
                              torch_checkpoint_patched, unpatch_torch_checkpoint)
from matepoint._patch import patch_from_environment as _patch_from_environment
from matepoint._planning.planner import Plan, PlanError, PlannedBlock, auto_checkpoint, plan
from matepoint._sequential import checkpoint_sequential

__all__ = ["checkpoint", "checkpoint_sequential", "enable", "disable", "is_recomputing",
           "set_options", "options", "pool_stats", "empty_pool", "reserve_pool",
           "install_allocator", "allocator_info", "memory_stats",
           "reset_peak_memory_stats", "empty_cache", "memory_report", "plan", "auto_checkpoint",
           "patch_torch_checkpoint", "unpatch_torch_checkpoint", "torch_checkpoint_patched",
           "checkpoint_module", "uncheckpoint_module", "apply", "planned"]
# The classes stay importable but out of __all__: help(matepoint) would print
# their inherited dataclass, exception and nn.Module pages (1,500 lines with
# PlannedBlock); the docstring above lists them.
_CLASSES = ["Plan", "PlanError", "PlannedBlock", "Options", "TorchCheckpointPatch",
            "AllocatorInfo"]
# the one place the version is written: pyproject.toml reads it from here
# (without importing the package), `python -m matepoint --version` and the
# bench's report show it
__version__ = "0.1.0"


def __dir__() -> List[str]:
    """dir(matepoint): the public names, not the modules and typing names the
    package itself uses (sys, torch, Dict, ...)."""
    return sorted(__all__ + _CLASSES + ["__version__"])


def set_options(**changes: Any) -> Options:
    """Change matepoint's settings; returns the new ``matepoint.options``.

    ``**changes`` are option names with their new values: offload, pipeline,
    prefetch_depth, offload_window, min_offload_bytes, pool_limit_bytes,
    host_limit_bytes, spill_dir (see ``help(matepoint.Options)``). An unknown
    name raises TypeError, a bad value TypeError or ValueError; nothing changes.
    """
    return _settings.update(**changes)


def pool_stats() -> Dict[str, Any]:
    """Counters of the host pool that offloaded inputs live in.

    bytes_in_use, bytes_requested, bytes_reserved, peak_bytes_in_use,
    host_allocations, host_frees (pinned buffers given back: cudaFreeHost), hits,
    misses, fallbacks (pageable memory used), failures,
    blocks_in_use, backend ("cuda-pinned", "host" or "none"); prefetched,
    fetched_at_need, used_in_place: spans copied back ahead of time, on demand,
    or used where backward found them (once each); device_bytes_in_flight,
    peak_device_bytes_in_flight: device memory of inputs held while their copy
    out may run (``offload_window``); spilled_bytes, peak_spilled_bytes,
    spill_writes, spill_reads, spill_read_stalls, spill_failures: the disk
    tier's (``spill_dir``; the first four are the current tier's, from 0
    again after ``spill_dir`` changes).
    """
    return _pool_stats()


def reserve_pool(buffer_bytes: int, count: int = 1) -> int:
    """Pin ``count`` host buffers for inputs of ``buffer_bytes`` bytes now.

    Pinning host memory is slow (milliseconds per buffer, far more for large
    ones): a deep model's first step would pay it for every offloaded input.
    Call this once before training, for example
    ``matepoint.reserve_pool(x.nbytes, count=len(model.blocks))``, and the
    first step finds its buffers ready. The GIL is released meanwhile, so a
    background thread can do it. Returns how many buffers were added; raises
    MemoryError naming the limit that had no room (``pool_limit_bytes`` or
    ``host_limit_bytes``), or saying the host refused to pin more (the ones
    pinned stay in the pool). ``buffer_bytes`` is an int from 1 to 2**63 - 1,
    ``count`` from 1 to 2**31 - 1, and their product at most 2**63 - 1.
    """
    # sizes stay within the pool's 64-bit arithmetic with room to round up;
    # 2**31 - 1 buffers is far past any real request
    for name, value, bits in (("buffer_bytes", buffer_bytes, 63), ("count", count, 31)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"matepoint.reserve_pool: {name} must be an int from 1 to "
                            f"2**{bits} - 1, got {value!r}")
        if not 0 < value < 1 << bits:
            raise ValueError(f"matepoint.reserve_pool: {name} must be positive (an int from 1 "
                             f"to 2**{bits} - 1), got {_show_int(value)}")
    if buffer_bytes * count > (1 << 63) - 1:
        raise ValueError(f"matepoint.reserve_pool: buffer_bytes * count must be at most "
                         f"2**63 - 1 bytes, got {buffer_bytes} * {count}")
    added: int = _reserve_pool(buffer_bytes, count)
    return added


def empty_pool() -> None:
    """Free the cached, unused buffers of the host pool (buffers holding an
    offloaded input stay)."""
    _empty_pool()


class _Module(types.ModuleType):
    """Module type giving ``options`` and the legacy ``NOPIPELINE`` flag."""

    @property
    def options(self) -> Options:
        return _settings.current

    @property
    def NOPIPELINE(self) -> bool:  # noqa: N802 (name kept from the original matepoint)
        return not _settings.current.pipeline

    @NOPIPELINE.setter
    def NOPIPELINE(self, value: bool) -> None:  # noqa: N802
        _settings.update(pipeline=not value)


# a module's attribute assignment cannot be intercepted otherwise (PEP 562's
# __getattr__ covers reads only)
sys.modules[__name__].__class__ = _Module
_compile.install()
_patch_from_environment()
