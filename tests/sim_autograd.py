"""Backward on the simulated GPU as on CUDA (csrc/testing/cudart_sim.h).

On a GPU, autograd runs backward on one worker thread per device, not the
caller's; each node runs with the device and stream that were current when
it was created in forward; a gradient passed to a node on another stream is
ordered after its producer (an event); the graph's roots wait for the
caller's current stream, and the caller's current stream waits for the
streams backward used. Here:

- StreamTags, a TorchFunctionMode active during forward, writes into every
  new autograd node's `metadata` the device and stream current when it was
  created, and hooks it; autograd.Function.apply (which __torch_function__
  does not see) is wrapped to do the same. Nodes it never saw (made outside it, or by code
  below __torch_function__) are tagged when a later node's walk back
  through `next_functions` reaches them, with that later node's place. A
  node still untagged runs on the stream the node before it set on the
  worker (the root's, at first).
- torch.autograd.backward / grad (Tensor.backward calls the former) run on
  a worker thread per device (the root's device), with the caller's grad
  mode and torch modes (the lagging kernels of sim_kernels.py included).
  A backward started on the worker (a nested one) runs there at once.
- A node's pre-hook makes its device and stream current on the worker;
  its post-hook orders the streams of the nodes it passes gradients to
  after its own (torch's InputBuffer does this with an event) and records
  each gradient on its consumer's stream (InputBuffer's record_stream)."""
from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from matepoint import _C

TAG = "matepoint_sim_stream"
Place = Tuple[int, Optional[int]]      # (device, stream handle; None: the legacy stream)

_worker_state = threading.local()      # on a worker: `used`, the places backward ran on


def _current_place() -> Place:
    device = _C._sim_get_device()
    return device, _C._sim_current_stream(device)


def _on_worker() -> bool:
    return getattr(_worker_state, "used", None) is not None


def _enter_node(grad_outputs):
    """Pre-hook: the node's device and stream are current for its work
    (the saved tensors it unpacks included)."""
    if not _on_worker():
        return None
    node = torch._C._current_autograd_node()
    place = node.metadata.get(TAG) if node is not None else None
    if place is not None:
        device, stream = place
        _C._sim_set_device(device)
        _C._sim_set_stream(device, stream)
        _worker_state.used.add(place)
    return None


def _record_on(grad, place: Place) -> None:
    """torch's InputBuffer::add: a gradient handed to a node on another
    stream of its device is recorded on that stream (record_stream), so the
    producer's stream, which allocated it, reuses its memory only once the
    consumer's kernels ran."""
    if type(grad) is not torch.Tensor or grad.layout != torch.strided or grad.is_nested or \
            grad.numel() == 0:
        return
    ptr = grad.untyped_storage().data_ptr()
    library = _allocator_library()
    if library is not None and _C._sim_device_of(ptr) == place[0]:
        library.matepoint_record_stream(ptr, place[1])


def _allocator_library():
    """matepoint's allocator library over the simulated GPU (tests/sim.py
    attaches it once per process), else None."""
    import sim      # sim imports this module
    if sim._memory is None:     # noqa: SLF001
        return None
    library = sim._memory[0]    # noqa: SLF001
    library.matepoint_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    library.matepoint_record_stream.restype = None
    return library


def _leave_node(grad_inputs, grad_outputs):
    """Post-hook: each node this one passes a gradient to runs after it,
    and the gradient is marked used by that node's stream."""
    if not _on_worker():
        return None
    node = torch._C._current_autograd_node()
    here = node.metadata.get(TAG) if node is not None else None
    if here is None:
        return None
    for (following, _), grad in zip(node.next_functions, grad_inputs):
        there = following.metadata.get(TAG) if following is not None else None
        if there is not None and there != here:
            _C._sim_order_streams(there[0], there[1], here[0], here[1])
            _record_on(grad, there)
    return None


def _tag_graph(node, place: Place) -> None:
    """Tags `node` and the untagged nodes behind it with `place`."""
    pending = [node]
    while pending:
        node = pending.pop()
        if node is None or TAG in node.metadata:
            continue
        node.metadata[TAG] = place
        node.register_prehook(_enter_node)
        node.register_hook(_leave_node)
        pending.extend(following for following, _ in node.next_functions)


def _tag_outputs(value, place: Place) -> None:
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            _tag_graph(value.grad_fn, place)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tag_outputs(item, place)


class StreamTags(TorchFunctionMode):
    """Tags the autograd nodes made under it with the current device and
    stream (the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            _tag_outputs(out, _current_place())
        return out


def _root_place(tensors) -> Optional[Place]:
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    for tensor in tensors or ():
        if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
            place = tensor.grad_fn.metadata.get(TAG)
            if place is not None:
                return place
    return None


class _Worker:
    """One device's backward thread: runs one job at a time, in order."""

    def __init__(self, device: int) -> None:
        self.jobs: "queue.Queue[Tuple[Callable[[], None], threading.Event]]" = queue.Queue()
        self.last_error = 0        # the thread's CUDA last error after its last job
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"simulated-gpu-{device}-backward")
        self.thread.simulated_gpu_worker = True   # its modes are each caller's
        self.thread.start()

    def _serve(self) -> None:
        while True:
            job, done = self.jobs.get()
            try:
                job()
            finally:
                self.last_error = _C._sim_peek_last_error()
                # the job holds the caller's tensors (its graph): not one
                # moment longer than the caller
                del job
                done.set()
                del done

    def call(self, function: Callable[[], object]) -> object:
        result: Dict[str, object] = {}

        def job() -> None:
            try:
                result["value"] = function()
            except BaseException as error:  # noqa: BLE001 (re-raised on the caller's thread)
                result["error"] = error

        done = threading.Event()
        self.jobs.put((job, done))
        done.wait()
        if "error" in result:
            raise result["error"]  # type: ignore[misc]
        return result.get("value")


_workers: Dict[int, _Worker] = {}
_workers_lock = threading.Lock()


def _worker(device: int) -> _Worker:
    with _workers_lock:
        if device not in _workers:
            _workers[device] = _Worker(device)
        return _workers[device]


def workers_last_errors() -> Dict[int, int]:
    """Each backward thread's CUDA last error after its last backward."""
    return {device: worker.last_error for device, worker in _workers.items()}


def take_workers_errors() -> Dict[int, int]:
    """Clears the backward threads' last errors (as a cudaGetLastError on
    each); returns those that were set."""
    left = {}
    for device, worker in list(_workers.items()):
        error = worker.call(_C._sim_take_last_error)
        worker.last_error = 0
        if error:
            left[device] = error
    return left


def _on_worker_thread(original: Callable, roots) -> Callable:
    def run(*args, **kwargs):
        if _on_worker():
            return original(*args, **kwargs)
        caller = _current_place()
        root = _root_place(roots(args, kwargs)) or caller
        grad_enabled = torch.is_grad_enabled()
        dispatch_modes = _get_current_dispatch_mode_stack()
        function_modes = _get_current_function_mode_stack()

        def job():
            _worker_state.used = {root}
            try:
                for device in range(2):
                    _C._sim_set_stream(device, None)
                _C._sim_set_device(root[0])
                _C._sim_set_stream(root[0], root[1])
                _C._sim_order_streams(root[0], root[1], caller[0], caller[1])
                with contextlib.ExitStack() as stack:
                    stack.enter_context(torch.set_grad_enabled(grad_enabled))
                    for mode in function_modes:
                        stack.enter_context(mode)
                    for mode in dispatch_modes:
                        stack.enter_context(mode)
                    return original(*args, **kwargs)
            finally:
                # torch's engine: the caller's stream waits for backward's
                for device, stream in _worker_state.used:
                    _C._sim_order_streams(caller[0], caller[1], device, stream)
                _worker_state.used = None

        return _worker(root[0]).call(job)

    run.__wrapped__ = original  # type: ignore[attr-defined]
    return run


def _backward_roots(args, kwargs):
    return args[0] if args else kwargs.get("tensors")


def _grad_roots(args, kwargs):
    return args[0] if args else kwargs.get("outputs")


def _tagging_apply(original) -> classmethod:
    """autograd.Function.apply (a classmethod, or a C classmethod
    descriptor in newer torch), which __torch_function__ does not see,
    tagging the node it makes."""
    def apply(cls, *args, **kwargs):
        out = original.__get__(None, cls)(*args, **kwargs)
        if torch.is_grad_enabled():
            _tag_outputs(out, _current_place())
        return out
    return classmethod(apply)


@contextlib.contextmanager
def backward_as_on_cuda() -> Iterator[None]:
    """Nodes tagged in forward, backward on the devices' worker threads."""
    backward, grad = torch.autograd.backward, torch.autograd.grad
    apply = torch.autograd.Function.__dict__["apply"]
    torch.autograd.backward = _on_worker_thread(backward, _backward_roots)
    torch.autograd.grad = _on_worker_thread(grad, _grad_roots)
    torch.autograd.Function.apply = _tagging_apply(apply)
    try:
        with StreamTags():
            yield
    finally:
        torch.autograd.backward, torch.autograd.grad = backward, grad
        torch.autograd.Function.apply = apply
