"""The device the checks run on. Every GPU check is written against a
Target, never against torch.cuda directly, so that the same function runs
on a CUDA GPU (CudaTarget, what ``python -m matepoint check`` uses) and, in
matepoint's own tests, on the simulated GPU of test builds (a Target made
of tests/sim.py's helpers, named by ``--target module:name``): the checks'
own logic is tested where no GPU is.

A Target gives a check its device and sizes, a session around it, a way to
make the GPU lag behind the CPU (so that every release and reuse happens
while copies are still in flight), side streams, the allocator installed,
memory history, a count of host waits, the copy bandwidth and a peak meter.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Tuple

import torch

from matepoint._meter import CopyBandwidth, PeakMeter, copy_bandwidth

# the runtime calls that make the host wait for the GPU (pinning and
# freeing memory synchronize the device too)
HOST_WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "cudaHostAlloc", "cudaFreeHost", "cudaFree")
# GPU cycles a held-back block sleeps: about 10 ms on a current GPU
SLEEP_CYCLES = 20_000_000


class Target:
    """Where the GPU checks run (the docstring above). The sizes are the
    training checks' model: ``depth`` blocks of ``width`` on ``batch`` rows."""
    name = "cuda:0"
    simulated = False
    # whether timings are a GPU's (speed floors apply): the simulated GPU's are not
    judges_speed = True
    index = 0
    width, batch, depth = 1024, 256, 8
    min_offload_bytes = 1 << 16
    # the deep stack: its depth, width and rows, and the link check's inputs
    deep_depth, deep_width, deep_batch = 48, 512, 8192
    link_bytes, link_inputs = 64 << 20, 16

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def describe(self) -> Dict[str, Any]:
        """The GPU's name, compute capability and memory."""
        properties = torch.cuda.get_device_properties(self.index)
        return {"name": properties.name,
                "capability": f"{properties.major}.{properties.minor}",
                "memory_total_bytes": int(properties.total_memory)}

    def unavailable(self, feature: str) -> Optional[str]:
        """Why ``feature`` (cudnn, cuda_graph, compile, mempool, ipc) cannot
        be checked on this target, or None."""
        return None

    def session(self, check: str) -> ContextManager[None]:
        """Around each check: everything it queued has run when it ends."""
        return self._settled()

    @contextlib.contextmanager
    def _settled(self) -> Iterator[None]:
        try:
            yield
        finally:
            torch.cuda.synchronize(self.index)

    def synchronize(self) -> None:
        """The host waits until the GPU ran everything queued."""
        torch.cuda.synchronize(self.index)

    def hold_back(self) -> None:
        """Queues work that keeps the GPU busy, so the CPU runs far ahead."""
        torch.cuda._sleep(SLEEP_CYCLES)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.index)

    @contextlib.contextmanager
    def on_stream(self, stream: Any) -> Iterator[None]:
        """torch.cuda.stream(stream) with the waits a correct program makes
        around a side stream, before and after."""
        current = torch.cuda.current_stream(self.index)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            yield
        current.wait_stream(stream)

    def install_allocator(self) -> bool:
        """matepoint.install_allocator(); whether out of memory raises."""
        import matepoint
        return matepoint.install_allocator()

    def record_history(self, enabled: bool) -> None:
        """torch's memory history on (with stacks) or off."""
        if enabled:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        else:
            torch.cuda.memory._record_memory_history(enabled=None)

    def count_host_waits(self, run: Callable[[], Any]) -> Tuple[Any, int]:
        """(``run()``'s result, the runtime calls meanwhile that made the
        host wait for the GPU), as torch's profiler traces the CUDA runtime:
        matepoint's own calls included."""
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as traced:
            result = run()
        return result, sum(1 for event in traced.events() if event.name in HOST_WAITS)

    def copy_bandwidth(self, nbytes: int) -> CopyBandwidth:
        """Pinned host<->device bytes per second (median of five copies)."""
        return copy_bandwidth(self.device, nbytes)

    def peak_meter(self) -> Any:
        """A context whose ``peak_bytes`` is the most device memory in use
        above what was in use at its entry."""
        return PeakMeter(self.device)

    def timing_device(self) -> Optional[torch.device]:
        """What _timing waits for around a timed call (None: nothing)."""
        return self.device


class CudaTarget(Target):
    """The first CUDA GPU of this process."""


def load_target(spec: str) -> Target:
    """The Target ``module:name`` names (a class or a function making one),
    imported from sys.path: matepoint's tests name their simulated GPU."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--target must be module:name, got {spec!r}")
    made = getattr(importlib.import_module(module_name), attribute)()
    if not isinstance(made, Target):
        raise TypeError(f"--target {spec} made a {type(made).__name__}, not a Target")
    return made


def default_target() -> Tuple[Optional[Target], str]:
    """(the CUDA target, '') where torch sees a GPU, else (None, why not)."""
    if torch.version.cuda is None:
        return None, f"needs a CUDA GPU: torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return None, "needs a CUDA GPU: torch.cuda.is_available() is False here"
    return CudaTarget(), ""
