"""One torch's compatibility with an installed matepoint wheel, on a
machine without a GPU, as a user's machine without a compiler or CUDA
toolkit sees it (benchmarks/torch_compat.py runs it in a venv per torch).

Prints one JSON object: torch's version and CUDA, the units taken (each must
be the wheel's prebuilt one for this torch), what torch's allocator calls
answered once the adapter is torch's CUDA allocator (each answer comes from
an override of the adapter: a unit built against another torch's headers
would call the wrong slot of torch's allocator class), and whether a
checkpointed step's gradients equal torch's checkpoint bit for bit.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict

import torch


def _hide_tools() -> Dict[str, Any]:
    """No compiler, nvcc or CUDA toolkit in matepoint's sight."""
    from matepoint import _adapter
    os.environ["PATH"] = tempfile.mkdtemp(prefix="no-tools-")
    for name in ("CXX", "CUDA_HOME"):
        os.environ.pop(name, None)
    _adapter.DEFAULT_CUDA_HOMES = ()
    return {"compiler": shutil.which("c++"), "nvcc": shutil.which("nvcc"),
            "cuda_headers": _adapter.cuda_include_dirs()}


def _answer(call: Callable[[], Any]) -> Dict[str, str]:
    """What a call answered, and whose answer it is: matepoint's adapter
    answers or raises naming matepoint; torch's base class raises "does not
    yet support" (the override was not reached)."""
    try:
        return {"answer": repr(call())[:120], "by": "matepoint"}
    except Exception as error:
        text = str(error).splitlines()[0][:200]
        return {"answer": f"raised: {text}", "by": "matepoint" if "matepoint" in text else "torch"}


def _allocator_calls() -> Dict[str, Dict[str, str]]:
    """torch's entries that reach the current allocator without a GPU."""
    from matepoint import _adapter
    calls = {
        "backend name": lambda: torch._C._cuda_getAllocatorBackend() == "matepoint" or 1 / 0,
        "memory_stats": lambda: torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"],
        "reset peaks": lambda: torch._C._cuda_resetPeakMemoryStats(0),
        "record history": lambda: _adapter.record_history(True, stacks=False, max_entries=16),
        "snapshot": lambda: len(torch._C._cuda_memorySnapshot(None)["segments"]),
    }
    return {name: _answer(call) for name, call in calls.items()}


def _checkpoint_equals_torch() -> bool:
    import matepoint
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
                                 for _ in range(4))
    grads = []
    for run in (matepoint.checkpoint, torch.utils.checkpoint.checkpoint):
        x = torch.randn(8, 32, requires_grad=True, generator=torch.Generator().manual_seed(1))
        h = x
        for block in blocks:
            h = run(block, h, use_reentrant=False)
        h.square().sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()])
        blocks.zero_grad()
    return all(torch.equal(a, b) for a, b in zip(*grads))


def main() -> int:
    import matepoint
    from matepoint import _adapter, _oom, _units
    from matepoint._allocator import allocator_path
    report: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                              "matepoint": matepoint.__file__, "premise": _hide_tools()}
    library = ctypes.CDLL(allocator_path())
    started = time.perf_counter()
    report["oom_raises"] = _oom.attach_oom_handler(library)
    try:
        _adapter.install(library)
        report["adapter_installed"] = True
    except (RuntimeError, OSError) as error:
        report["adapter_installed"] = f"no: {error}"
    # install_allocator()'s part past torch's own: both units loaded and installed
    report["units_seconds"] = round(time.perf_counter() - started, 3)
    report["units"] = {name: _units.state(name).as_dict() for name in ("torch_adapter",
                                                                        "oom_raise")}
    report["calls"] = _allocator_calls() if report["adapter_installed"] is True else {}
    report["checkpoint_equals_torch"] = _checkpoint_equals_torch()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
