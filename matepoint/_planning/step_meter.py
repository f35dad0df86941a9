"""What a training step holds outside its planned blocks (:class:`Outside`):
what the model made before the first block (masks, rotary tables), what its
head leaves until backward, and the head's own peak, measured beside the
blocks in the first training step (:class:`_OutsideMeter`, on a
:class:`_Gauge` of the device's bytes in use) and reduced over the ranks."""
from __future__ import annotations

import dataclasses
import gc
import threading
from typing import Any, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import (_get_current_dispatch_mode,
                                          _get_current_dispatch_mode_stack, _pop_mode, _push_mode)

from matepoint._meter import StorageCounter, _cuda_allocated, _StorageSampler
from matepoint._planning.arguments import _tensors_in
from matepoint._planning.profiling import _storage_bytes
from matepoint._planning.ranks import reduce_max

# a head's autograd graph is a few nodes; a walk this long went into the blocks
_MAX_HEAD_NODES = 10_000


@dataclasses.dataclass(frozen=True)
class Outside:
    """What a measured step held outside its planned blocks.

    ``held_bytes``: held while every block runs (what the model made before
    the first block, such as masks and rotary tables, and what its head
    leaves until backward is done); ``head_bytes``: the peak after the last
    block (the head, the loss and their backward) above what the blocks hold
    and ``held_bytes``."""

    held_bytes: int = 0
    head_bytes: int = 0


class _Gauge:
    """Bytes in use on the device of a step that may be measured, from the
    step's start: on CUDA the allocator's; on the CPU the tensors made since
    (a :class:`StorageCounter` fed every operation of the model's forward
    and, in backward, the gradients handed to :meth:`in_use`). Not the
    heap's: its figure moves run to run with what else it holds.

    On the CPU the forward runs without the cyclic collector (when garbage
    goes must not move the figures) until :meth:`stop_watching`, and under a
    dispatch mode except while a block runs (:meth:`pause`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counter: Optional[StorageCounter] = None
        self.sampler: Optional[_StorageSampler] = None
        self.window: Optional[int] = None       # the peak since open_window
        self.gc_was_enabled = False
        self.paused = False
        # the mode stack is per thread: only the step's own thread enters and
        # leaves ours (DataParallel runs replicas' blocks in other threads)
        self.thread = threading.get_ident()
        if device.type == "cuda":
            self.start = _cuda_allocated(device)
            return
        self.start = 0
        self.counter = StorageCounter(device)
        self.gc_was_enabled = gc.isenabled()
        gc.disable()
        self.sampler = _StorageSampler(self.counter, self._sample)
        self.sampler.__enter__()

    def _sample(self, in_use: int) -> None:
        if self.window is not None:
            self.window = max(self.window, in_use)

    def in_use(self, tensors: Any = ()) -> int:
        """Bytes in use now; on the CPU, the tensors in ``tensors`` (made
        where no operation was watched) counted first."""
        if self.counter is None:
            return _cuda_allocated(self.device)
        self.counter.count()
        self.counter.add_new(tensors)
        return self.counter.bytes

    def open_window(self) -> None:
        """Starts watching for the peak that :meth:`close_window` returns."""
        self.window = self.in_use()
        if self.counter is None:
            _cuda_allocated(self.device, reset_peak=True)

    def close_window(self) -> int:
        """The most bytes in use since :meth:`open_window` (on the CPU,
        after each operation)."""
        peak, self.window = self.window or 0, None
        if self.counter is None:
            peak = max(peak, _cuda_allocated(self.device, peak=True))
        return peak

    def pause(self) -> None:
        """A block runs: neither its profiling nor its checkpoint is watched
        (a Python mode around them would slow what profiling times); its
        output comes to :meth:`resume`. Where ours is not the innermost
        mode, watching stops instead."""
        if self.sampler is None or self.paused or threading.get_ident() != self.thread:
            return
        if _get_current_dispatch_mode() is not self.sampler:
            self.stop_watching()
            return
        self.sampler.__exit__(None, None, None)
        self.paused = True

    def resume(self, out: Any) -> None:
        """The block returned ``out``: counted, and the forward watched again."""
        self.in_use(out)
        if self.paused and self.sampler is not None and threading.get_ident() == self.thread:
            self.paused = False
            self.sampler.__enter__()

    def stop_watching(self) -> None:
        """The forward is over (or is not measured): no more dispatch mode,
        the collector as it was. Modes entered after ours and still on
        (none, in well-nested code) stay, in their order."""
        if self.sampler is None or threading.get_ident() != self.thread:
            return
        sampler, self.sampler = self.sampler, None
        self.paused = False
        if sampler in _get_current_dispatch_mode_stack():
            above = []
            while _get_current_dispatch_mode() is not sampler:
                above.append(_pop_mode())
            sampler.__exit__(None, None, None)
            for mode in reversed(above):
                _push_mode(mode)
        if self.gc_was_enabled:
            gc.enable()


class _OutsideMeter:
    """Measures :class:`Outside` in a measured step, beside the blocks.

    The head's forward is sampled from the last block's return to the end
    of the model's forward; its backward at the boundaries of its autograd
    nodes (between the model's outputs and the last block's output), until
    the gradient reaches the last block. Only the model's own forward and
    backward are seen: a loss computed outside it counts by what it leaves."""

    def __init__(self, gauge: _Gauge, gradless: List[torch.Tensor]) -> None:
        self.gauge = gauge
        self.gradless = gradless
        self.before: Optional[int] = None
        self.records = 0            # what the checkpointed blocks left beyond their outputs
        self.ready = 0              # in use as the latest block's checkpoint starts
        self.held_after = 0         # in use after the latest block, its output aside
        self.head = 0
        self.leftover = 0
        self.forward = False        # the head's forward may be running (a window open)
        self.stops: set = set()     # the blocks' outputs' autograd nodes
        self.handles: List[Any] = []
        self.reached = False

    def block_starts(self, args: Tuple[Any, ...]) -> None:
        if self.forward:
            self.gauge.close_window()
            self.forward = False
        if self.before is None:
            inputs = _storage_bytes(_tensors_in(args))
            self.before = max(0, self.gauge.in_use() - self.gauge.start - inputs)
        self.gauge.pause()

    def block_measured(self) -> None:
        """The block was profiled; its checkpoint in the step starts now."""
        self.ready = self.gauge.in_use()

    def block_ended(self, out: Any) -> None:
        self.gauge.resume(out)
        tensors = _tensors_in(out)
        output_bytes = _storage_bytes(tensors)
        self.held_after = self.gauge.in_use() - output_bytes
        self.records += max(0, self.held_after - self.ready)
        self.head = output_bytes
        for tensor in tensors:
            if tensor.requires_grad and tensor.grad_fn is not None:
                self.stops.add(tensor.grad_fn)
                tensor.register_hook(self._backward_reached)
        self.gauge.open_window()
        self.forward = True

    def forward_ended(self, output: Any) -> None:
        """The model's forward returned ``output``: the head's forward is
        done; watch its backward."""
        if not self.forward:
            return
        self.head = max(self.head, self.gauge.close_window() - self.held_after)
        self.forward = False
        for node in _nodes_between(_tensors_in(output), self.stops):
            self.handles.append(node.register_prehook(self._sample))
            self.handles.append(node.register_hook(self._sample))

    def _sample(self, *gradients: Any) -> None:
        # on the CPU no operation of backward is watched: the gradients the
        # head's nodes hand on are what its backward makes
        self.head = max(self.head, self.gauge.in_use(gradients) - self.held_after)

    def _backward_reached(self, gradient: torch.Tensor) -> None:
        if self.reached:
            return
        self.reached = True
        # what the head still holds now stays through every block's backward;
        # the gradient that arrived is the block's to count, new parameter
        # gradients are nobody's activations
        grads = [p.grad for p in self.gradless if p.grad is not None]
        self._sample(gradient, grads)
        waiting = _storage_bytes([gradient]) + _storage_bytes(grads)
        self.leftover = max(0, self.gauge.in_use() - self.held_after - waiting)
        self._release()

    def _release(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.stops = set()

    def finish(self) -> Outside:
        """The figures measured (zeros for what the step never reached)."""
        if self.forward:
            self.gauge.close_window()
            self.forward = False
        self.gauge.stop_watching()
        self._release()
        # what the blocks' forwards keep beyond their inputs (autograd's graph,
        # the checkpoints' own records: on CUDA, device memory) grows to
        # `records` by the last block and stays through the head
        held = (self.before or 0) + self.records + self.leftover
        return Outside(held, max(0, self.head - self.leftover))


def _nodes_between(outputs: List[torch.Tensor], stops: set) -> List[Any]:
    """The autograd nodes from ``outputs`` back to (not into) ``stops``,
    parameters' gradient accumulators left out."""
    nodes: List[Any] = []
    seen: set = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack and len(nodes) < _MAX_HEAD_NODES:
        node = stack.pop()
        if node in seen or node in stops:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(following for following, _ in node.next_functions
                     if following is not None and type(following).__name__ != "AccumulateGrad")
    return nodes


def _reduce_outside(outside: Outside, where: str, group: Optional[Any] = None) -> Outside:
    """The max of each figure over the ranks of ``group`` (as
    :func:`reduce_profiles`; every rank of it must call)."""
    (held, head), = reduce_max([[float(outside.held_bytes), float(outside.head_bytes)]], where,
                               group)
    return Outside(int(held), int(head))
