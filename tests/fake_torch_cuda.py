"""A stand-in for the few calls of ``torch.cuda`` that matepoint's offload
adapter (csrc/offload/offload_runtime_torch.c) makes, over the simulated GPU
of test builds (tests/sim.py), so the adapter runs without a GPU:

- ``torch._C._cuda_getCurrentRawStream(device)``: the simulated current stream,
- ``torch.cuda.default_stream(device)`` and ``torch.cuda.ExternalStream(handle,
  device=)``: stream objects of simulated streams,
- ``torch.Tensor.record_stream(tensor, stream)``: what torch's caching
  allocator does, done by matepoint's allocator library that holds the
  simulated device memory,
- ``torch._C._cuda_hasPrimaryContext(device)``: the simulated contexts,
- ``torch._C._cuda_maybeExchangeDevice(device)``: torch's device exchange
  that creates no context (a device without one becomes torch's target
  device only, what ``torch.cuda.current_device()`` then answers: read it
  with ``_C._sim_torch_device()``).

Each is Python, as torch's are, so the GIL may change threads inside any of
them; each yields it once on purpose while other threads run, and a test can run code of its own
inside each call (:attr:`TorchCudaStandin.inside`), a call on another
thread included. The engine runs the adapter over the simulated GPU once
:func:`adapter_runtime` wraps a simulated-GPU fixture."""
from __future__ import annotations

import collections
import contextlib
import ctypes
import operator
import threading
import time
from typing import Callable, Dict, Iterator, Optional, Sequence

import torch

import sim
from matepoint import _C

DEVICES = 2   # CUDART_SIM_DEVICES


def _device_index(device: object, what: str) -> int:
    """torch's device argument: an int index of an existing device."""
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"{what}: device must be an int, got {device!r}")
    if not 0 <= device < DEVICES:
        raise ValueError(f"{what}: invalid device {device} (the simulated GPU has {DEVICES})")
    return device


def _exchange_index(device: object) -> int:
    """torch._C._cuda_maybeExchangeDevice's own argument checks
    (torch/csrc/cuda/Module.cpp): an integer but a bool, within DeviceIndex
    (int8_t), each refused with torch's RuntimeError."""
    try:
        if isinstance(device, bool):
            raise TypeError
        index = operator.index(device)
    except TypeError:
        raise RuntimeError("invalid argument to exchangeDevice") from None
    if not -128 <= index <= 127:
        raise RuntimeError("Overflow when unpacking DeviceIndex")
    return index


def _allocator_library() -> Optional[ctypes.CDLL]:
    """matepoint's allocator library once tests/sim.py put it over the
    simulated GPU (it then holds the simulated device memory), else None."""
    if sim._memory is None:       # noqa: SLF001 (sim attaches it once per process)
        return None
    library = sim._memory[0]      # noqa: SLF001
    library.matepoint_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    library.matepoint_record_stream.restype = None
    return library


class Stream:
    """A stream object as torch.cuda.Stream: its raw handle and device."""

    def __init__(self, handle: int, device: int) -> None:
        self.cuda_stream = handle
        self.device_index = device
        self.device = torch.device("cuda", device)

    def __repr__(self) -> str:
        return f"<fake torch.cuda.Stream device={self.device_index} cuda_stream={self.cuda_stream:#x}>"


class TorchCudaStandin:
    """The entry points, counting their calls by name in :attr:`calls`.

    :attr:`inside`, when set, is called inside every call with the entry
    point's name (after its arguments were checked, before its answer), as
    another thread could run there on a GPU."""

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        self.recorded: list = []        # (storage data_ptr, stream handle, device) per record
        self.inside: Optional[Callable[[str], None]] = None

    def _enter(self, name: str) -> None:
        self.calls[name] += 1
        if threading.active_count() > 1:
            time.sleep(0)  # torch's Python code may hand the GIL over here
        if self.inside is not None:
            self.inside(name)

    def _cuda_getCurrentRawStream(self, device: int) -> int:
        device = _device_index(device, "_cuda_getCurrentRawStream")
        self._enter("_cuda_getCurrentRawStream")
        return _C._sim_current_stream(device) or 0

    def _cuda_hasPrimaryContext(self, device: int) -> bool:
        device = _device_index(device, "_cuda_hasPrimaryContext")
        self._enter("_cuda_hasPrimaryContext")
        return bool(_C._sim_stats()["contexts"][device])

    def _cuda_maybeExchangeDevice(self, device: int) -> int:
        """As torch's: a negative index answers -1 and changes nothing, one
        the GPU lacks fails as torch's hasPrimaryContext does."""
        device = _exchange_index(device)
        if device < 0:
            return -1
        if device >= DEVICES:
            raise RuntimeError("hasPrimaryContext expects a valid device index, but got "
                               f"device_index={device}")
        self._enter("_cuda_maybeExchangeDevice")
        return _C._sim_maybe_exchange_device(device)

    def default_stream(self, device: int) -> Stream:
        device = _device_index(device, "default_stream")
        self._enter("default_stream")
        return Stream(0, device)

    def ExternalStream(self, stream_ptr: int, device: Optional[int] = None) -> Stream:
        """Wraps a stream made elsewhere; the handle must be a live stream of
        `device` (torch would use it on the wrong device otherwise)."""
        device = _device_index(device, "ExternalStream")
        if not isinstance(stream_ptr, int) or stream_ptr == 0:
            raise ValueError(f"ExternalStream: not a stream handle: {stream_ptr!r}")
        owner = _C._sim_stream_device(stream_ptr)
        if owner != device:
            raise ValueError(f"ExternalStream: stream {stream_ptr:#x} belongs to device {owner}, "
                             f"not {device}")
        self._enter("ExternalStream")
        return Stream(stream_ptr, device)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"record_stream: not a tensor: {tensor!r}")
        if not isinstance(stream, Stream):
            raise TypeError(f"record_stream(): argument 'stream' must be Stream, got {stream!r}")
        ptr = tensor.untyped_storage().data_ptr()
        self.recorded.append((ptr, stream.cuda_stream, stream.device_index))
        self._enter("record_stream")
        library = _allocator_library()
        if library is not None:
            library.matepoint_record_stream(ptr, stream.cuda_stream)

    def entries(self) -> Dict[str, Callable]:
        """By torch's name, for _C._torch_cuda_entries."""
        return {name: getattr(self, name) for name in (
            "_cuda_getCurrentRawStream", "_cuda_hasPrimaryContext", "_cuda_maybeExchangeDevice",
            "default_stream", "ExternalStream", "record_stream")}


@contextlib.contextmanager
def installed(standin: Optional[TorchCudaStandin] = None, torchs_own: Sequence[str] = ()
              ) -> Iterator[TorchCudaStandin]:
    """The adapter reaches `standin` instead of torch.cuda meanwhile, but
    for the entry points named in `torchs_own`, which stay torch's."""
    standin = standin if standin is not None else TorchCudaStandin()
    entries = {name: entry for name, entry in standin.entries().items() if name not in torchs_own}
    previous = _C._torch_cuda_entries(entries)
    try:
        yield standin
    finally:
        _C._torch_cuda_entries(previous)


def adapter_runtime(fixture: Iterator[None]) -> Iterator[TorchCudaStandin]:
    """Runs a simulated-GPU fixture generator (conftest's) with torch's
    adapter in place of the simulator's own answers: the stand-in is
    installed, the fixture sets the simulated GPU up, then the engine
    switches to the adapter over it; teardown in reverse, the fixture's
    checks included."""
    with installed() as standin:
        next(fixture)
        try:
            _C._simulate_torch_adapter(True)
        except BaseException:
            fixture.close()     # the fixture's own cleanup
            raise
        yield standin
        next(fixture, None)
