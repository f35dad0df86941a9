"""The ways a benchmark step can run, as the user would write each one."""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager, Optional

import torch

MODES = ["none", "torch", "torch+save_on_cpu", "matepoint", "matepoint+alloc", "matepoint+spill",
         "matepoint-auto"]
DESCRIPTIONS = {
    "none": "no checkpointing",
    "torch": "torch.utils.checkpoint (non-reentrant)",
    "torch+save_on_cpu": "torch checkpoint inside save_on_cpu(pin_memory=True)",
    "matepoint": "matepoint.checkpoint (inputs offloaded, prefetched)",
    "matepoint+alloc": "the same under matepoint's allocator",
    "matepoint+spill": "matepoint with host_limit_bytes at half the offloaded bytes (the disk tier)",
    "matepoint-auto": "matepoint.plan's choice per block under --budget-gib",
}


def uses_matepoint(mode: str) -> bool:
    return mode.startswith("matepoint")


def prepare(mode: str) -> None:
    """What must happen first in the process (the allocator swap)."""
    if mode == "matepoint+alloc":
        import matepoint
        matepoint.install_allocator()


def use_spill(host_limit_bytes: int) -> None:
    """The disk tier for a matepoint+spill run: spill_dir from
    MATEPOINT_SPILL_DIR, else a private temporary folder (left empty)."""
    import tempfile
    import matepoint
    folder = matepoint.options.spill_dir or tempfile.mkdtemp(prefix="matepoint-spill-")
    matepoint.set_options(spill_dir=folder, host_limit_bytes=host_limit_bytes)


def checkpoint_function(mode: str) -> Optional[Callable]:
    """checkpoint(fn, *args) for the mode; None when nothing is checkpointed."""
    if mode == "none":
        return None
    if mode.startswith("torch"):
        import torch.utils.checkpoint as tc
        return functools.partial(tc.checkpoint, use_reentrant=False)
    import matepoint
    return matepoint.checkpoint


def step_context(mode: str) -> ContextManager:
    if mode == "torch+save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    return contextlib.nullcontext()
