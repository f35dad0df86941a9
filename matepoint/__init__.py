"""matepoint: activation checkpointing for PyTorch with a C core.

``from matepoint import checkpoint`` is a drop-in replacement for
``torch.utils.checkpoint.checkpoint`` (non-reentrant semantics).
"""
from __future__ import annotations

import torch  # noqa: F401  (the C core looks torch up at import)

from matepoint._C import checkpoint, is_recomputing
from matepoint._sequential import checkpoint_sequential

__all__ = ["checkpoint", "checkpoint_sequential", "is_recomputing"]
__version__ = "0.1.0"
