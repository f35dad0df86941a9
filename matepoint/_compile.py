"""torch.compile and matepoint: a checkpointed region always runs eagerly.

Dynamo cannot trace into ``matepoint.checkpoint`` (C code that installs
saved-tensor hooks and replays the region in backward), so a compiled
function that calls it breaks its graph there; the blocks inside can still
be compiled on their own. Left alone, Dynamo says so with a multi-line
warning asking the user to file a bug. Here the break is made deliberate:
Dynamo is told to trace a small stand-in that calls a
``torch.compiler.disable``-d function, which it skips without a warning.
The region itself runs without Dynamo in the forward and in the recompute
alike whoever calls it (csrc/checkpoint/no_dynamo.c says why).

Importing torch._dynamo costs more than a second, so nothing here imports
it: the stand-in is registered when something else imports it (as
torch.compile does), or at once if that already happened.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from typing import Any, Optional, Sequence

from matepoint import _C

log = logging.getLogger("matepoint")
_DYNAMO = "torch._dynamo"


def _register_with_dynamo() -> None:
    import torch
    import torch._dynamo

    @torch.compiler.disable(reason="matepoint.checkpoint runs its region eagerly")
    def run_eagerly(function: Any, *args: Any, **kwargs: Any) -> Any:
        return _C.checkpoint(function, *args, **kwargs)

    def traced_instead(function: Any, *args: Any, **kwargs: Any) -> Any:
        return run_eagerly(function, *args, **kwargs)

    torch._dynamo.substitute_in_graph(_C.checkpoint, skip_signature_check=True)(traced_instead)


def _register_or_log() -> None:
    # never break the user's import of torch._dynamo: without the stand-in
    # the graph still breaks at a checkpoint, only with Dynamo's warning
    try:
        _register_with_dynamo()
    except Exception as error:  # noqa: BLE001 (any failure leaves the old behaviour)
        log.debug("matepoint: cannot mark checkpoint for torch.compile: %s", error)


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Registers the stand-in right after torch._dynamo has been imported."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Any = None) -> Any:
        if fullname != _DYNAMO:
            return None
        # a new list, not one changed in place: another thread may be
        # iterating the old one for its own import, and would skip a finder
        sys.meta_path = [finder for finder in sys.meta_path if finder is not self]
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _register_or_log()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Marks matepoint.checkpoint for Dynamo now or once Dynamo is imported."""
    if _DYNAMO in sys.modules:
        _register_or_log()
    elif not any(isinstance(finder, _AfterDynamoImport) for finder in sys.meta_path):
        sys.meta_path = [_AfterDynamoImport()] + sys.meta_path
