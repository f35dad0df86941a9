"""The disk tier under several threads (issue 43): each interleaving that
broke it is forced at the engine's own yield points (_C._set_yield_hook:
the hook runs another thread's work exactly where the engine lets the GIL
go), not left to the scheduler; then several threads train while another
changes options and pools, under a time bound. The Makefile's `sanitize`
target runs these under ASan, where a slot or tier used after it was freed
is reported, not merely a crash."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import warnings
from typing import Callable, List

import pytest
import torch

import matepoint
from matepoint import _C

from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step

WIDTH, BATCH, DEPTH = 64, 64, 12
INPUT_BYTES = WIDTH * BATCH * 4
LIMIT = DEPTH * INPUT_BYTES // 3          # offloaded bytes are 3x the limit
JOIN_S = 60                               # a hang fails the test instead of the run


class Interleave:
    """Runs `action` once, on another thread, the first time the engine
    reaches yield point `point`, and waits for it: the other thread's work
    lands exactly where the engine released the GIL."""

    def __init__(self, point: str, action: Callable[[], object], every: bool = False) -> None:
        self.point, self.action, self.every = point, action, every
        self.reached = 0
        self.errors: List[BaseException] = []
        self.hung = False

    def __call__(self, name: str) -> None:
        if name != self.point:
            return
        self.reached += 1
        if self.reached > 1 and not self.every:
            return
        thread = threading.Thread(target=self._run)
        thread.start()
        thread.join(JOIN_S)
        self.hung = thread.is_alive()

    def _run(self) -> None:
        try:
            self.action()
        except BaseException as error:  # noqa: BLE001 (reported by check())
            self.errors.append(error)

    def check(self) -> None:
        assert self.reached >= 1, f"the engine never reached {self.point}"
        assert not self.hung, f"the work forced at {self.point} never ended"
        if self.errors:
            raise self.errors[0]


@pytest.fixture
def spill_dir(tmp_path):
    path = str(tmp_path / "spill")
    yield path
    _C._set_yield_hook(None)
    matepoint.set_options(spill_dir=None, host_limit_bytes=None)


def model_and_input():
    torch.manual_seed(0)
    return MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)


def forced(point: str, action: Callable[[], object], step: Callable[[], object]) -> Interleave:
    hook = Interleave(point, action)
    _C._set_yield_hook(hook)
    try:
        result = step()
    finally:
        _C._set_yield_hook(None)
    hook.check()
    return result, hook


def test_a_span_read_back_is_not_spilled_again_before_its_copy_back(offload, spill_dir):
    # another thread's forward makes room between this thread's span coming
    # back from disk and its copy back being queued: the span must stay put
    model, x = model_and_input()
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    writes: list = []

    def other_forward() -> None:
        before = matepoint.pool_stats()["spill_writes"]
        _C._spill_room(LIMIT)       # room for a span as large as the limit
        _C._spill_settle()
        writes.append(matepoint.pool_stats()["spill_writes"] - before)

    (_, grads), _ = forced("restore.span_ready", other_forward,
                           lambda: train_step(model, x, matepoint.checkpoint))
    assert_bitwise_equal(grads, expected)
    assert writes and writes[0] > 0     # premise: the other thread did spill, right there
    assert matepoint.pool_stats()["spill_reads"] > 0


def test_a_read_waited_on_survives_another_thread_finishing_it(offload, spill_dir):
    # this thread waits on a read; another thread's poll finishes it and
    # frees its slot meanwhile: the wait must not touch freed memory
    model, x = model_and_input()
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    train_step(model, x, matepoint.checkpoint)      # the tier starts
    stalls = matepoint.pool_stats()["spill_read_stalls"]

    def other_poll() -> None:
        _C._spill_pause(False)
        _C._spill_settle()      # finishes the read this thread is about to wait on

    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    xg = x.detach().clone().requires_grad_(True)
    out = model(xg, matepoint.checkpoint)
    _C._spill_settle()
    _C._spill_pause(True)       # reads stay queued: backward has to wait on one
    try:
        _, hook = forced("spill.wait_request", other_poll,
                         lambda: (out.float() ** 2).mean().backward())
    finally:
        _C._spill_pause(False)
    grads = [xg.grad] + [p.grad for p in model.parameters()]
    assert_bitwise_equal(grads, expected)
    assert matepoint.pool_stats()["spill_read_stalls"] > stalls   # premise: it waited


IN_CHILD = "MATEPOINT_TEST_IN_CHILD"


def test_a_write_waited_on_survives_another_thread_freeing_its_slot() -> None:
    # failed writes count for the life of the engine (spill_failures, the
    # warning once): in a process of its own, so no later test sees them
    here = os.path.abspath(__file__)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{here}::test_failed_write_freed_while_waited_on"],
        # where this matepoint was imported from (a sanitized build's too)
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(matepoint.__file__))),
        env={**os.environ, IN_CHILD: "1"},
        capture_output=True, text=True, timeout=JOIN_S * 4)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "1 passed" in result.stdout


@pytest.mark.skipif(IN_CHILD not in os.environ, reason="run in a process of its own, above")
def test_failed_write_freed_while_waited_on(offload, spill_dir) -> None:
    # this thread waits for room on a write; another thread polls it, finds
    # it failed and frees its slot: the wait must not touch freed memory
    model, x = model_and_input()
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    train_step(model, x, matepoint.checkpoint)      # the tier starts
    failures = matepoint.pool_stats()["spill_failures"]
    _C._spill_fail_writes(10 ** 6)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)     # the failed write's warning
            (_, grads), _ = forced("spill.wait_for_room", _C._spill_settle,
                                   lambda: train_step(model, x, matepoint.checkpoint))
    finally:
        _C._spill_fail_writes(0)
    assert_bitwise_equal(grads, expected)
    assert matepoint.pool_stats()["spill_failures"] > failures     # premise: the slot went


def test_a_tier_being_retired_is_never_used_by_another_thread(offload, spill_dir, tmp_path):
    # set_options(spill_dir=...) stops the old tier with the GIL released;
    # another thread's forward running then must start a tier of the new
    # options, never submit to the one being destroyed
    model, x = model_and_input()
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    train_step(model, x, matepoint.checkpoint)      # the old tier starts, and goes idle
    other = str(tmp_path / "other")
    box: dict = {}

    def other_forward() -> None:
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        box["x"] = x.detach().clone().requires_grad_(True)
        box["out"] = model(box["x"], matepoint.checkpoint)
        _C._spill_settle()
        box["on_disk"] = matepoint.pool_stats()["spilled_bytes"]

    forced("spill.retire", other_forward, lambda: matepoint.set_options(spill_dir=other))
    assert box["on_disk"] > 0           # premise: the forward spilled while the tier went
    (box["out"].float() ** 2).mean().backward()
    grads = [box["x"].grad] + [p.grad for p in model.parameters()]
    assert_bitwise_equal(grads, expected)
    assert matepoint.options.spill_dir == other
    del box
    gc.collect()
    matepoint.set_options(spill_dir=spill_dir)      # the new tier is idle: it can go too


HOLD_S = 2.0     # how long a retire that does not wait for a hold gets to return


def test_a_tier_retired_under_a_held_slot_waits_for_the_hold(offload, spill_dir, tmp_path):
    # this thread holds a span's slot across the GIL, as the engine's wait
    # for a request does; backward reads the span back and its slot is
    # freed (the hold keeps the slot's memory); another thread then
    # retires the tier (set_options(spill_dir=...)): its spill_destroy must
    # not return while the hold is held, and does once it goes. (Forced at
    # spill.wait_request with the hook's join, the retire would wait for
    # the hook's own thread: a deadlock; so the hold is taken here.)
    # Not a timing assertion: with the wait the retire cannot return
    # before the hold goes; HOLD_S only bounds how long a retire that does
    # not wait is given to show it.
    model, x = model_and_input()
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    xg = x.detach().clone().requires_grad_(True)
    out = model(xg, matepoint.checkpoint)
    _C._spill_settle()
    held = _C._spill_hold()
    (out.float() ** 2).mean().backward()
    del out
    gc.collect()
    grads = [xg.grad] + [p.grad for p in model.parameters()]
    assert matepoint.pool_stats()["spilled_bytes"] == 0      # premise: nothing left on disk
    retired = threading.Event()
    errors: list = []

    def retire() -> None:
        try:
            matepoint.set_options(spill_dir=str(tmp_path / "other"))
        except BaseException as error:  # noqa: BLE001 (asserted below)
            errors.append(error)
        retired.set()

    thread = threading.Thread(target=retire)
    thread.start()
    returned_while_held = retired.wait(HOLD_S)
    if not returned_while_held:     # else the tier is gone: letting go would touch freed memory
        _C._spill_unhold(*held)
    thread.join(JOIN_S)
    assert not returned_while_held, "spill_destroy returned while another thread held a slot"
    assert not thread.is_alive() and not errors, errors
    assert matepoint.options.spill_dir == str(tmp_path / "other")
    assert_bitwise_equal(grads, expected)


@pytest.mark.parametrize("point", ["window.drain", "return.drain"])
def test_a_drain_survives_another_thread_polling_between_its_waits(simulated, point):
    # a runtime switch (or the engine going away) drains the windows and
    # the buffers on their way back, waiting on each: another thread's
    # pool_stats() polls both lists meanwhile
    model, x = model_and_input()
    out = model(x.requires_grad_(), matepoint.checkpoint)   # the GPU lags: copies in flight
    del out
    gc.collect()
    # premise: the window holds several copies of the dead graph
    assert matepoint.pool_stats()["device_bytes_in_flight"] >= 2 * INPUT_BYTES
    hook = Interleave(point, matepoint.pool_stats, every=True)
    _C._set_yield_hook(hook)
    try:
        _C._simulate_cuda(True)     # the same runtime again: drains first
    finally:
        _C._set_yield_hook(None)
    hook.check()
    assert hook.reached > 1                     # premise: polled between two waits
    assert matepoint.pool_stats()["device_bytes_in_flight"] == 0


def spill_files_open(*folders: str) -> List[str]:
    """This process's open files inside `folders` (the tier's unnamed files
    show as '<folder>/#<inode> (deleted)'), the folders themselves aside."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue        # closed meanwhile (listdir's own descriptor)
        found += [target for folder in folders if target.startswith(folder + os.sep)]
    return found


@pytest.mark.filterwarnings("ignore:matepoint. pinned host memory is at host_limit_bytes")
def test_threads_train_with_the_tier_while_another_changes_options(offload, tmp_path):
    # three threads train with the disk tier, prefetch and the window on,
    # while a fourth changes options (spill_dir included: refused while
    # spans are on disk, else the tier is retired under the trainers),
    # reads, empties and reserves the pool
    folders = [str(tmp_path / "a"), str(tmp_path / "b")]
    threads_n, steps = 3, 4
    models, inputs, expected = [], [], []
    for index in range(threads_n):
        torch.manual_seed(index)
        models.append(MLP(WIDTH, DEPTH))
        inputs.append(torch.randn(BATCH, WIDTH))
        expected.append(train_step(models[index], inputs[index], no_checkpoint)[1])
    matepoint.set_options(spill_dir=folders[0], host_limit_bytes=LIMIT, pipeline=True,
                          prefetch_depth=2, offload_window=2)
    results: list = [None] * threads_n
    errors: list = []
    running = threading.Event()
    running.set()
    seen = {"peak_spilled": 0, "dir_changes": 0, "refused": 0, "rounds": 0}

    def trainer(index: int) -> None:
        try:
            for _ in range(steps):
                results[index] = train_step(models[index], inputs[index],
                                            matepoint.checkpoint)[1]
        except BaseException as error:  # noqa: BLE001 (asserted below)
            errors.append(error)

    def meddler() -> None:
        import random
        rng = random.Random(0)
        try:
            while running.is_set():
                seen["rounds"] += 1
                matepoint.set_options(prefetch_depth=rng.randint(0, 3),
                                      offload_window=rng.randint(1, 3),
                                      pipeline=rng.random() < 0.7)
                try:
                    matepoint.set_options(spill_dir=folders[seen["rounds"] % 2])
                    seen["dir_changes"] += 1
                except RuntimeError as error:
                    assert "cannot change" in str(error)
                    seen["refused"] += 1
                stats = matepoint.pool_stats()
                seen["peak_spilled"] = max(seen["peak_spilled"], stats["peak_spilled_bytes"])
                matepoint.empty_pool()
                try:
                    matepoint.reserve_pool(INPUT_BYTES, 1)
                except MemoryError:
                    pass        # at the limit: the trainers hold it
        except BaseException as error:  # noqa: BLE001 (asserted below)
            errors.append(error)

    workers = [threading.Thread(target=trainer, args=(i,)) for i in range(threads_n)]
    other = threading.Thread(target=meddler)
    for thread in workers + [other]:
        thread.start()
    for thread in workers:
        thread.join(JOIN_S)
    running.clear()
    other.join(JOIN_S)
    assert not any(thread.is_alive() for thread in workers + [other]), "a thread hung"
    assert not errors, errors
    for got, want in zip(results, expected):
        assert_bitwise_equal(got, want)
    # premises: spans went to disk, the options changed under the trainers
    assert seen["peak_spilled"] > 0 and seen["rounds"] > 1
    assert seen["dir_changes"] + seen["refused"] == seen["rounds"]
    gc.collect()
    _C._spill_settle()
    stats = matepoint.pool_stats()
    assert stats["bytes_in_use"] == 0 and stats["spilled_bytes"] == 0, stats
    assert stats["prefetched"] > 0
    matepoint.set_options(spill_dir=None, host_limit_bytes=None)    # the tier stops
    assert spill_files_open(*folders) == []
    assert all(os.listdir(folder) == [] for folder in folders if os.path.exists(folder))
