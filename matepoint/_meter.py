"""Measurements shared by the planner and the benchmark: bytes autograd
saves, the peak memory of a stretch of code on one device, and the
device-host copy bandwidth.

On CUDA it reads the allocator's peak (matepoint's when installed, torch's
otherwise). On the CPU, where torch keeps no statistics, :class:`PeakMeter`
samples the C heap's bytes in use (glibc's mallinfo2) after every aten
operation, host pool buffers (which stand for pinned memory) left out: all
the memory a step costs there. The planner's figures come from
:class:`TensorMeter` instead, which counts the bytes of the tensors made
while it watches: the heap's figure moves run to run (by 1-2% for a small
model, once in a while by megabytes) with what else the heap holds, and a
budget named from one run must be met by the next.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import gc
import statistics
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from matepoint import _C
from matepoint._timing import time_call


def saved_tensor_bytes(run: Callable[[], Any], resident: Set[int]) -> Tuple[Any, int]:
    """Calls ``run()``; returns its result and the bytes of the distinct
    storages autograd saved for backward meanwhile, those whose data
    pointer is in ``resident`` (parameters, buffers) left out."""
    storages: Dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in resident:
            storages[storage.data_ptr()] = storage.nbytes()
        # a saved output handed back as itself would hold its own grad_fn:
        # a reference cycle through C++ that no collection frees
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return out, sum(storages.values())


@dataclasses.dataclass(frozen=True)
class CopyBandwidth:
    """Bytes per second of one copy each way between a device and host memory."""

    h2d: float
    d2h: float


def copy_bandwidth(device: torch.device, nbytes: int = 64 << 20, repeats: int = 5) -> CopyBandwidth:
    """Median bandwidth of ``repeats`` copies each way, after one warm-up copy.

    On CUDA the host side is pinned and each copy is timed with CUDA events
    on the current stream; on the CPU, by the wall clock."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    result = {}
    for name, dst, src in (("h2d", on_device, host), ("d2h", host, on_device)):
        copy = functools.partial(dst.copy_, src, non_blocking=cuda)
        seconds = time_call(copy, repeats, warmup=1, device=device, events=True)
        result[name] = nbytes / max(statistics.median(seconds), 1e-9)
    return CopyBandwidth(**result)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _load_mallinfo2() -> Optional[Any]:
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _Mallinfo2
    return function


_mallinfo2 = _load_mallinfo2()
_host_meter_works: Optional[bool] = None


def host_meter_available() -> bool:
    """True where CPU peaks can be measured: glibc 2.33 and newer, and its
    heap really in use (under AddressSanitizer mallinfo2 sees nothing)."""
    global _host_meter_works
    if _host_meter_works is None:
        _host_meter_works = False
        if _mallinfo2 is not None:
            before = _host_bytes_in_use()
            probe = torch.empty(4 << 20, dtype=torch.uint8)
            _host_meter_works = _host_bytes_in_use() - before >= probe.numel()
            del probe
    return _host_meter_works


def _host_bytes_in_use() -> int:
    info = _mallinfo2()
    # pool buffers come from the same heap but stand for pinned host memory
    return int(info.uordblks + info.hblkhd) - int(_C.pool_stats()["bytes_reserved"])


class _HostSampler(TorchDispatchMode):
    """Hands the heap's bytes in use to `on_sample` after every operation."""

    def __init__(self, on_sample: Callable[[int], None]) -> None:
        super().__init__()
        self.on_sample = on_sample

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.on_sample(_host_bytes_in_use())
        return out


_host_sampler_warm = False


def _warm_up_host_sampler() -> None:
    """The first dispatch through a Python mode builds caches: not ours to count."""
    global _host_sampler_warm
    if not _host_sampler_warm:
        with _HostSampler(lambda in_use: None):
            torch.ones(2).add(1)
        _host_sampler_warm = True


class PeakMeter:
    """``with PeakMeter(device) as m: ...``; then ``m.peak_bytes`` is the most
    memory in use on ``device`` above what was in use at entry, and on CUDA
    ``m.peak_allocated_bytes`` that most in all (the allocator's peak)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        if self.device.type == "cpu" and not host_meter_available():
            raise RuntimeError("measuring CPU memory needs glibc's mallinfo2 (Linux, glibc 2.33+)")
        self.peak_bytes = 0
        self.peak_allocated_bytes = 0
        self._base = 0
        self._sampler: Optional[_HostSampler] = None
        self._gc_was_enabled = False

    def _sample(self, in_use: int) -> None:
        self.peak_bytes = max(self.peak_bytes, in_use - self._base)

    def __enter__(self) -> "PeakMeter":
        self.peak_bytes = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = _cuda_allocated(self.device, reset_peak=True)
        else:
            _warm_up_host_sampler()
            # a collection in the middle would free unrelated memory and
            # hide the peak
            self._gc_was_enabled = gc.isenabled()
            gc.collect()
            gc.disable()
            self._sampler = _HostSampler(self._sample)
            self._base = _host_bytes_in_use()
            self._sampler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._sampler is not None:
            self._sampler.__exit__(*exc)
            self._sampler = None
            if self._gc_was_enabled:
                gc.enable()
            return
        torch.cuda.synchronize(self.device)
        self.peak_allocated_bytes = _cuda_allocated(self.device, peak=True)
        self._sample(self.peak_allocated_bytes)


def _storage_key(value: Any) -> Optional[int]:
    """The address of the storage behind a tensor or storage (views share
    it), or None where there is none (sparse, wrapper subclasses)."""
    if isinstance(value, torch.Tensor):
        try:
            value = value.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None
    return value._cdata if isinstance(value, torch.UntypedStorage) else None


class StorageCounter:
    """The bytes of the tensor storages on one device type that it saw
    made and that are still alive.

    Unlike the C heap's bytes in use, the figure is the same run to run:
    what else the heap holds (tensors' and autograd's own objects, Python
    objects, libraries' caches, allocator slack) follows the heap's
    history, and moved the planner's figures between fresh models of the
    same kind. Storages made before it saw them, and their release, are not
    counted. Not thread safe: one thread feeds it (a dispatch mode's)."""

    def __init__(self, device: torch.device) -> None:
        self.device_type = torch.device(device).type
        self._live: Dict[int, Tuple[StorageWeakRef, int]] = {}
        self.bytes = 0

    def count(self) -> int:
        """The bytes alive now, those released since last asked taken off."""
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            self.bytes -= self._live.pop(key)[1]
        return self.bytes

    def add_new(self, outputs: Any, inputs: Any = ()) -> None:
        """Counts the storages of the tensors in ``outputs`` not behind any
        tensor or storage in ``inputs`` (an operation's view or in-place
        result is not new memory)."""
        old = {_storage_key(leaf) for leaf in tree_leaves(inputs)}
        for leaf in tree_leaves(outputs):
            if not isinstance(leaf, torch.Tensor) or leaf.device.type != self.device_type:
                continue
            key = _storage_key(leaf)
            if key is None or key in old:
                continue
            storage = leaf.untyped_storage()
            nbytes = storage.nbytes()
            known = self._live.get(key)
            if known is not None:           # seen before, perhaps resized since
                self.bytes += nbytes - known[1]
                self._live[key] = (known[0], nbytes)
            elif nbytes:
                self._live[key] = (StorageWeakRef(storage), nbytes)
                self.bytes += nbytes


class _StorageSampler(TorchDispatchMode):
    """Feeds every operation's new outputs to a :class:`StorageCounter`
    and hands its count to ``on_sample`` after each."""

    def __init__(self, counter: StorageCounter, on_sample: Callable[[int], None]) -> None:
        super().__init__()
        self.counter = counter
        self.on_sample = on_sample

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.counter.count()
        self.counter.add_new(out, (args, kwargs))
        self.on_sample(self.counter.bytes)
        return out


class TensorMeter:
    """``with TensorMeter(device) as m: ...``; then ``m.peak_bytes`` is the
    most bytes of tensor storages on ``device`` made inside and alive at
    once, sampled after every aten operation (a :class:`StorageCounter`):
    the same figure every run. :meth:`restart` starts a new peak above what
    is alive then (a backward above its forward's leftovers).

    Only what the operations inside make counts: a region that frees
    tensors made before it reads higher than the heap would. The cyclic
    collector is held off inside, so when garbage goes does not move the
    figure."""

    def __init__(self, device: torch.device) -> None:
        self.counter = StorageCounter(device)
        self.peak_bytes = 0
        self._base = 0
        self._sampler: Optional[_StorageSampler] = None
        self._gc_was_enabled = False

    def _sample(self, in_use: int) -> None:
        self.peak_bytes = max(self.peak_bytes, in_use - self._base)

    def restart(self) -> None:
        """From now on, ``peak_bytes`` is above what is alive now."""
        self._base = self.counter.count()
        self.peak_bytes = 0

    def __enter__(self) -> "TensorMeter":
        self._gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        self._sampler = _StorageSampler(self.counter, self._sample)
        self._sampler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.__exit__(*exc)
        if self._gc_was_enabled:
            gc.enable()


def _cuda_allocated(device: torch.device, reset_peak: bool = False, peak: bool = False) -> int:
    from matepoint import _allocator
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _allocator.is_installed():
        if reset_peak:
            _allocator.reset_peak_memory_stats()
        stats = _allocator.memory_stats(index)
        return int(stats["peak_allocated_bytes" if peak else "allocated_bytes"])
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(index)
    return int(torch.cuda.max_memory_allocated(index) if peak
               else torch.cuda.memory_allocated(index))
