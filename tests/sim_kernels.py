"""Kernels that lag in data on the simulated GPU (csrc/testing/cudart_sim.h).

Every aten op on CPU tensors (which stand for device tensors) is a kernel
on the current stream of its device: the stream catches up (what the
kernel reads was written by earlier work on it, or by work it waits for),
the real op runs, and then what it wrote reads as poison (NaN bytes) until
the stream reaches the kernel. When it does, the results land, unless
something wrote what the kernel read since its launch: then the kernel
read other data, and its outputs stay poison. A copy or kernel on another
stream that is not ordered after the producer therefore reads poison, and
a buffer reused while a queued kernel still reads it poisons that kernel's
results: wrong gradients, compared bit for bit with a run without offload.

Not lagged: views (no kernel on a GPU), factory ops that leave memory
uninitialized, tensor subclasses (DTensor and the like: their local ops run
inside their own dispatch, below this mode) and tensors outside the
simulated devices' memory (meta, sparse)."""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from matepoint import _C

aten = torch.ops.aten

# No data written, no kernel launched on a GPU: memory handed out as is,
# or a tensor's metadata changed in place (set_, as_strided_, resize_: their
# schemas mark `self` written, yet no byte of its storage changes; as
# kernels they would poison memory a copy is still reading).
_UNINITIALIZED = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default,
    aten.set_.source_Storage, aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor, aten.set_.default, aten.as_strided_.default,
    aten.resize_.default,
}
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Schema:
    """What an op's schema says: the arguments it writes (by position and
    name) and whether it is a pure view (every output aliases an input,
    nothing written)."""

    def __init__(self, func) -> None:
        schema = func._schema
        self.written: List[Tuple[int, str]] = [
            (index, argument.name) for index, argument in enumerate(schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write]
        self.view = (not self.written and len(schema.returns) > 0 and
                     all(ret.alias_info is not None for ret in schema.returns))
        self.no_kernel = func in _UNINITIALIZED or self.view


_schemas: Dict[object, _Schema] = {}


def _schema_of(func) -> _Schema:
    found = _schemas.get(func)
    if found is None:
        found = _schemas[func] = _Schema(func)
    return found


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _on_device(tensor: torch.Tensor) -> bool:
    # a nested tensor says strided, but has no plain span of bytes
    return tensor.device.type == "cpu" and tensor.layout == torch.strided and \
        not tensor.is_nested


def _span(tensor: torch.Tensor, spans: List[int]) -> None:
    """The bytes `tensor` covers, from its first element to its last, when
    they lie in a simulated device's memory. Memory torch's own allocator
    handed out (a tensor made before the fixture) is host memory here: a
    kernel neither lags on it nor checks it when it lands, which could be
    after torch freed it."""
    if tensor.numel() == 0 or _C._sim_device_of(tensor.data_ptr()) < 0:
        return
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    spans.extend((tensor.data_ptr(), extent * tensor.element_size()))


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _written_arguments(schema: _Schema, args: Sequence, kwargs: dict) -> List[torch.Tensor]:
    written: List[torch.Tensor] = []
    for index, name in schema.written:
        value = args[index] if index < len(args) else kwargs.get(name)
        written.extend(_tensors(value))
    return written


def _where(inputs: List[torch.Tensor]) -> Tuple[int, Optional[int]]:
    """The device the kernel runs on (the current one: the test models run
    each device's work under sim.device, as torch's device guard would) and
    that device's current stream. An input in another device's memory came
    through a copy between devices (x.to(device)), which torch orders after
    the work queued on both devices' current streams: so is the kernel."""
    device = _C._sim_get_device()
    stream = _C._sim_current_stream(device)
    others = set()
    for tensor in inputs:
        if tensor.numel() > 0:
            other = _C._sim_device_of(tensor.data_ptr())
            if other >= 0 and other != device:
                others.add(other)
    for other in others:
        _C._sim_order_streams(device, stream, other, _C._sim_current_stream(other))
    return device, stream


class LaggingKernels(TorchDispatchMode):
    """While active (tests/conftest.py's simulated-GPU fixtures, and the
    backward worker of sim_autograd.py), aten ops are kernels whose results
    lag on their stream (the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = _schema_of(func)
        if schema.no_kernel:
            return func(*args, **kwargs)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        if any(type(tensor) not in _PLAIN or not _on_device(tensor) for tensor in inputs):
            return func(*args, **kwargs)
        device, stream = _where(inputs)
        # what it reads or writes in place is there now; work it does not
        # depend on keeps lagging (new outputs: the allocator's handout)
        used: List[int] = []
        for tensor in inputs:
            _span(tensor, used)
        _C._sim_launch_for(device, stream, used)
        out = func(*args, **kwargs)
        written = _written_arguments(schema, args, kwargs)
        input_storages: Set[int] = {_storage(tensor) for tensor in inputs}
        # outputs that alias no input are new memory the kernel wrote
        written.extend(tensor for tensor in _tensors(out)
                       if _on_device(tensor) and _storage(tensor) not in input_storages)
        if not written:
            return out
        writes: List[int] = []
        for tensor in written:
            _span(tensor, writes)
        written_storages = {_storage(tensor) for tensor in written}
        reads: List[int] = []
        for tensor in inputs:
            if _storage(tensor) not in written_storages:
                _span(tensor, reads)
        _C._sim_kernel(device, stream, writes, reads)
        return out
