"""What a test may leave behind that would break the tests after it.

tests/conftest.py takes a snapshot before every test and, after it, puts
back whatever changed and fails that test, naming each thing it left: a
test that fails half-way leaves nothing for the next one to trip on, and
a test that passes but leaves something is caught where it happened.

Each leftover below is a (name, read, put back) triple: `read` takes the
state, `put back` restores the state read before the test. Offloaded
inputs come first (the rest cannot change while they are alive: the
engine refuses to switch its runtime under them), the runtime last. Not
read: the simulated GPU's injected call failures (_C._sim_fail), which it
does not report; tests clear them in a finally."""
from __future__ import annotations

import gc
from dataclasses import asdict
from typing import Any, Callable, Dict, List, NamedTuple

import torch

import matepoint
from matepoint import _C, _patch


class Leftover(NamedTuple):
    name: str
    read: Callable[[], Any]
    put_back: Callable[[Any], None]


# a test build's controls, absent from a release build (the wheel's own
# tests run this file too): what they read is then left out
TEST_BUILD = bool(getattr(_C, "TEST_BUILD", 0))


def _held_inputs() -> Any:
    """Offloaded inputs still alive: the engine's copies and pool blocks."""
    copies = len(_C._offload_copies()) if TEST_BUILD else None
    return copies, matepoint.pool_stats()["blocks_in_use"]


def _release_inputs(before: Any) -> None:
    """Nothing can free them but their last reference going: the failed
    test's frames let go of theirs (conftest.py clears them), a cycle may
    hold the rest; copies still queued on the simulated GPU run first."""
    if _C._offload_device_type() == "cpu":
        _C._sim_advance(1 << 62)
    gc.collect()


def _saved_tensor_hooks() -> Any:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _pop_saved_tensor_hooks(before: Any) -> None:
    while _saved_tensor_hooks() is not None and _saved_tensor_hooks() != before:
        torch._C._autograd._pop_saved_tensors_default_hooks()


def _options() -> Dict[str, Any]:
    return asdict(matepoint.options)


def _set_options(before: Dict[str, Any]) -> None:
    matepoint.set_options(**before)


def _patches() -> int:
    return len(_patch._active)    # noqa: SLF001 (nested patches are counted)


def _unpatch(before: int) -> None:
    while _patches() > before:
        matepoint.unpatch_torch_checkpoint()


def _torch_cuda_entries() -> Dict[str, Any]:
    return _C._torch_cuda_entries({}) if TEST_BUILD else {}    # {}: reads, changes none


def _put_back_torch_cuda_entries(before: Dict[str, Any]) -> None:
    _C._torch_cuda_entries(before)


def _test_controls() -> Dict[str, Any]:
    """The test build's controls a test sets for itself (_C._test_controls):
    call sites dropped, copies back or pool acquires set to fail, the yield
    hook. {} in a build without them."""
    return _C._test_controls() if TEST_BUILD else {}


def _clear_test_controls(before: Dict[str, Any]) -> None:
    _C._sim_drop_site(before["dropped_sites"] or None)
    if before["failing_fetches"] == 0:
        _C._sim_fail_fetches(0, 0)
    _C._fail_pool_acquires(before["failing_pool_acquires"])
    _C._set_yield_hook(before["yield_hook"])


def _runtime() -> str:
    """'cpu' while a simulated GPU stands in for CUDA (tests/sim.py)."""
    return _C._offload_device_type()


def _switch_runtime(before: str) -> None:
    if before == "cuda":
        _C._simulate_cuda(False)


LEFTOVERS = [
    Leftover("offloaded inputs alive (copies, pool blocks)", _held_inputs, _release_inputs),
    Leftover("a saved-tensor hook installed", _saved_tensor_hooks, _pop_saved_tensor_hooks),
    Leftover("matepoint.options changed", _options, _set_options),
    Leftover("torch.utils.checkpoint patched", _patches, _unpatch),
    Leftover("torch's CUDA entry points replaced (_C._torch_cuda_entries)",
             _torch_cuda_entries, _put_back_torch_cuda_entries),
    Leftover("test controls left set (_C._test_controls)", _test_controls, _clear_test_controls),
    Leftover("the simulated CUDA runtime switched on", _runtime, _switch_runtime),
]


def snapshot() -> List[Any]:
    """The state of each leftover, before a test."""
    return [leftover.read() for leftover in LEFTOVERS]


def put_back(before: List[Any]) -> List[str]:
    """Restores what changed since `before`; returns what had changed,
    each with its state before and after, and what could not be put back."""
    left = []
    for leftover, was in zip(LEFTOVERS, before):
        now = leftover.read()
        if now == was:
            continue
        try:
            leftover.put_back(was)
        except Exception as error:  # noqa: BLE001 (reported with the rest)
            left.append(f"{leftover.name}: {_change(was, now)}, NOT put back ({error})")
            continue
        again = leftover.read()
        restored = "put back" if again == was else f"NOT put back (still {again!r})"
        left.append(f"{leftover.name}: {_change(was, now)}, {restored}")
    return left


def _change(was: Any, now: Any) -> str:
    """`was -> now`, of a dict only the keys that changed."""
    if isinstance(was, dict) and isinstance(now, dict):
        keys = [key for key in {**was, **now} if was.get(key) != now.get(key)]
        was = {key: was.get(key) for key in keys}
        now = {key: now.get(key) for key in keys}
    return f"{was!r} -> {now!r}"
