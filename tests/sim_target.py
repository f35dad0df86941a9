"""The simulated GPU of test builds (tests/sim.py) as a Target of
``python -m matepoint check`` (matepoint/_selfcheck/target.py), so that the
check's own GPU checks run here, as a user's GPU runs them:

    PYTHONPATH=tests python -m matepoint check --target sim_target:SimTarget

Each check runs in a session as tests/conftest.py's `simulated` fixture
sets one up: CPU tensors in the simulated device's memory, kernels that lag
in data, backward on a worker thread as on CUDA, and the GPU as far behind
the CPU as CUDA allows, so whatever the engine frees or reuses too early
shows up as wrong gradients.

SIMCHECK_FAULT="check:kind:argument" injects one fault into one check's
session, for the tests that prove each check fails for its own reason:
  drop:SITE        the simulator drops the engine's calls at SITE (_C._sim_drop_site)
  fail:CALL        every call of the CUDA runtime function CALL fails (_C._sim_fail)
  no_host_memory   no span finds host memory (_C._fail_pool_acquires): inputs stay put
  spill_writes     the disk tier's writes fail once it started (_C._spill_fail_writes)
  no_cuda_headers  no CUDA toolkit to compile the adapter against (with MATEPOINT_PREBUILT=0)
  exit:STATUS      the process ends at once, inside the check (a crash)
"""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

import sim
import sim_autograd
from matepoint import _adapter, _C, _oom
from matepoint._meter import CopyBandwidth, TensorMeter, copy_bandwidth
from matepoint.bench.selfcheck.outcome import CheckFailed, CheckSkipped
from matepoint.bench.selfcheck.target import HOST_WAITS, Target

FAULT_VARIABLE = "SIMCHECK_FAULT"
ALWAYS = 1 << 40          # _sim_fail's count: every call from now on
MEMORY_ALLOCATION = 2     # cudaErrorMemoryAllocation

# what the simulated GPU cannot stand in for, by Target.unavailable's feature
NOT_SIMULATED = {
    "cudnn": "cuDNN",
    "cuda_graph": "CUDA graph capture through torch.cuda.graph",
    "compile": "torch.compile's CUDA graphs",
    "mempool": "torch.cuda.MemPool (it asks the CUDA runtime for its device)",
    "ipc": "CUDA IPC between processes",
}


@contextlib.contextmanager
def _fault(kind: str, argument: str) -> Iterator[None]:
    if kind == "drop":
        _C._sim_drop_site(argument)
        undo: Callable[[], None] = lambda: _C._sim_drop_site(None)
    elif kind == "fail":
        _C._sim_fail(argument, 0, ALWAYS, MEMORY_ALLOCATION)
        undo = lambda: _C._sim_fail(argument, 0, 0, 0)
    elif kind == "no_host_memory":
        _C._fail_pool_acquires(1_000_000)
        undo = lambda: _C._fail_pool_acquires(0)
    elif kind == "spill_writes":
        # armed at the disk tier's first yield point: the tier starts lazily
        def arm(point: str) -> None:
            if point.startswith("spill."):
                _C._spill_fail_writes(1_000_000)
                _C._set_yield_hook(None)
        _C._set_yield_hook(arm)
        undo = lambda: _C._set_yield_hook(None)
    elif kind == "no_cuda_headers":
        undo = _hide_cuda_headers()
    elif kind == "exit":
        os._exit(int(argument))       # the process dies inside the check
    else:
        raise ValueError(f"{FAULT_VARIABLE}: unknown fault {kind!r}")
    try:
        yield
    finally:
        undo()


def _hide_cuda_headers() -> Callable[[], None]:
    """No CUDA toolkit for the adapter's compile (a user's machine without
    one: _adapter finds the headers under $CUDA_HOME, beside nvcc or in
    DEFAULT_CUDA_HOMES); the function that puts them back."""
    saved = (_adapter.DEFAULT_CUDA_HOMES, _adapter._nvcc_include, os.environ.get("CUDA_HOME"))
    _adapter.DEFAULT_CUDA_HOMES = ()
    _adapter._nvcc_include = lambda: None
    os.environ.pop("CUDA_HOME", None)

    def undo() -> None:
        _adapter.DEFAULT_CUDA_HOMES, _adapter._nvcc_include = saved[0], saved[1]
        if saved[2] is not None:
            os.environ["CUDA_HOME"] = saved[2]
    return undo


def _fault_for(check: str) -> Optional[Tuple[str, str]]:
    """The fault SIMCHECK_FAULT injects into ``check``, or None."""
    spec = os.environ.get(FAULT_VARIABLE, "")
    name, _, rest = spec.partition(":")
    if name != check:
        return None
    kind, _, argument = rest.partition(":")
    return kind, argument


class SimTarget(Target):
    """The simulated GPU (device 0) of a test build."""
    name = "the simulated GPU of a test build"
    simulated = True
    judges_speed = False
    width, batch, depth = 64, 64, 6
    min_offload_bytes = 0
    deep_depth, deep_width, deep_batch = 12, 32, 64
    link_bytes, link_inputs = 64 << 10, 4

    def __init__(self) -> None:
        self._streams = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")       # CPU tensors stand for the device's

    def describe(self) -> Dict[str, Any]:
        return {"name": self.name, "capability": None, "memory_total_bytes": None}

    def unavailable(self, feature: str) -> Optional[str]:
        if feature in NOT_SIMULATED:
            return f"the simulated GPU has no {NOT_SIMULATED[feature]}: checked on a CUDA GPU"
        return None

    @contextlib.contextmanager
    def session(self, check: str) -> Iterator[None]:
        """As tests/conftest.py's `simulated` fixture, the fault of
        SIMCHECK_FAULT for this check injected inside."""
        if not getattr(_C, "TEST_BUILD", 0):
            raise CheckSkipped("the simulated GPU needs a test build (MATEPOINT_TESTING=1)")
        fault = _fault_for(check)
        _C._simulate_cuda(True)
        _C._sim_set_progress(0)
        _C._sim_expandable(True)
        try:
            with sim.device_memory() as allocator:
                with sim.as_on_cuda(lag=True):
                    with _fault(*fault) if fault else contextlib.nullcontext():
                        yield
                sim.assert_no_cuda_error()
                sim.finish()
                gc.collect()
                allocator.matepoint_reset()
        finally:
            sim_autograd.take_workers_errors()
            _C._sim_set_progress(0)
            _C._sim_expandable(False)
            _C._simulate_cuda(False)
        if _C._sim_stats()["host_bytes_live"]:
            raise CheckFailed(f"{_C._sim_stats()['host_bytes_live']} bytes of pinned memory "
                              f"outlived the check")

    def synchronize(self) -> None:
        sim.finish()

    def hold_back(self) -> None:
        """Nothing: the simulated GPU runs nothing until something waits."""

    def new_stream(self) -> Any:
        stream = sim.side_streams()[self._streams % 2]
        self._streams += 1
        return stream

    def on_stream(self, stream: Any) -> Any:
        return sim.stream(0, stream)

    def install_allocator(self) -> bool:
        """The allocator made torch's CUDA allocator through the adapter,
        over the simulated GPU, and torch.cuda's Python checks answering
        "CUDA is up" (as tests/torch_api_cases.py's cuda_up does)."""
        if torch.version.cuda is None:
            raise CheckSkipped(f"torch {torch.__version__} is a CPU build: the adapter needs "
                               f"torch's CUDA libraries (a CUDA build runs it on the CPU)")
        try:
            sim.install_adapter()
        except _oom.BuildError:
            pass    # as install_allocator() falls back: allocator_info() says why
        for module in (torch.cuda, torch.cuda.memory):
            module.is_initialized = lambda: True
        torch.cuda.current_device = _C._sim_get_device
        return _oom.handler_state().attached

    def record_history(self, enabled: bool) -> None:
        _adapter.record_history(enabled, stacks=False, clear=enabled)

    def count_host_waits(self, run: Callable[[], Any]) -> Tuple[Any, int]:
        before = dict(_C._sim_stats()["calls"])
        result = run()
        after = _C._sim_stats()["calls"]
        return result, sum(after.get(name, 0) - before.get(name, 0) for name in HOST_WAITS)

    def copy_bandwidth(self, nbytes: int) -> CopyBandwidth:
        return copy_bandwidth(torch.device("cpu"), nbytes)

    def peak_meter(self) -> Any:
        return TensorMeter(torch.device("cpu"))

    def timing_device(self) -> Optional[torch.device]:
        return None
