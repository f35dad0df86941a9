"""A process forked after a forward (os.fork, a fork-started DataLoader
worker): the child has none of the disk tier's threads and shares the
parent's spill files. Backward in the child must not hang nor touch the
parent's files: spans the child's memory holds come back, spans only on
the parent's disk raise a RuntimeError naming the fork. The parent's step
is untouched. Each case runs in a fresh interpreter (tests/sim.py's
simulated GPU, backward on the calling thread): a process that forks
must not have run the simulator's backward worker threads, which a child
lacks, and the child exits through os._exit with a status checked here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import sim
from package_under_test import PACKAGE_PARENT

FORK_SCRIPT = r"""
import gc, json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch, matepoint, sim
from matepoint import _C
from conftest import MLP, no_checkpoint, train_step
case, spill_dir = sys.argv[2], sys.argv[3]
WIDTH, BATCH, DEPTH = 64, 64, 24
INPUT_BYTES = WIDTH * BATCH * 4
matepoint.set_options(min_offload_bytes=0)
if case.startswith("spill"):
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=8 * INPUT_BYTES)
_C._simulate_cuda(True)
_C._sim_set_progress(sim.EVERYTHING)


def grads_of(x, model):
    return [x.grad] + [p.grad for p in model.parameters()]


def spill_fds():
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link == spill_dir or link.startswith(spill_dir + "/"):
            found.append(link)
    return found


def child(model, x, graph):
    torch.set_num_threads(1)    # torch's intra-op threads are the parent's
    out = graph.pop("out")      # the child's copy of the graph: gone with `out`
    result = {"fds_at_fork": spill_fds()}
    try:
        if case == "spill-free":
            raise RuntimeError("no backward")   # the graph only goes
        out.sum().backward()
        got = grads_of(x, model)
        model.zero_grad(set_to_none=True)
        x.grad = None
        model(x, no_checkpoint).sum().backward()
        result["backward"] = "exact" if all(
            torch.equal(a, b) for a, b in zip(got, grads_of(x, model))) else "wrong"
    except RuntimeError as error:
        result["backward"] = str(error)
    del out
    gc.collect()                # the graph goes: the parent's slots leave with it
    # a step of the child's own: its own tier, when it spills
    fresh, y = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(fresh, y, no_checkpoint)
    _, grads = train_step(fresh, y, matepoint.checkpoint)
    result["own_step_exact"] = all(torch.equal(a, b) for a, b in zip(grads, expected))
    gc.collect()
    result["stats"] = matepoint.pool_stats()
    # the child's own tier keeps its directory open, no file
    result["files_at_end"] = [link for link in spill_fds() if link != spill_dir]
    print("child " + json.dumps(result), flush=True)


with sim.device_memory(False):
    torch.manual_seed(0)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH, requires_grad=True)
    graph = {"out": model(x, matepoint.checkpoint)}
    deadline = time.monotonic() + 30
    while case.startswith("spill") and matepoint.pool_stats()["spill_writes"] < DEPTH // 2 and \
            time.monotonic() < deadline:
        time.sleep(0.01)        # the writes past the limit reach the disk
    before = matepoint.pool_stats()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            child(model, x, graph)
            status = 0
        finally:
            os._exit(status)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not done:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        status = "hung"
    # the parent's step, after the child ran and left
    graph["out"].sum().backward()
    got = grads_of(x, model)
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x, no_checkpoint).sum().backward()
    exact = all(torch.equal(a, b) for a, b in zip(got, grads_of(x, model)))
    del graph["out"]
    gc.collect()
    after = matepoint.pool_stats()
    print("parent " + json.dumps({"child_status": status, "exact": exact, "before": before,
                                  "after": after, "entries": os.listdir(spill_dir)}),
          flush=True)
"""


def run_script(script: str, *args: str) -> tuple:
    """Runs a fork script with the tests' folder and `args`: its two
    reports, the child's (None when it printed none) and the parent's."""
    sim.require_test_build()
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", script, tests, *args],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    reports = {}
    for line in run.stdout.splitlines():
        who, _, report = line.partition(" ")
        if who in ("child", "parent"):
            reports[who] = json.loads(report)
    assert "parent" in reports, run.stdout + run.stderr
    return reports.get("child"), reports["parent"]


def run_forked(case: str, spill_dir: str) -> tuple:
    """FORK_SCRIPT's two reports for `case`."""
    return run_script(FORK_SCRIPT, case, spill_dir)


@pytest.mark.parametrize("case", ["spill", "spill-free"], ids=["backward", "graph-freed"])
def test_a_child_forked_after_a_spilling_forward_raises_naming_fork(tmp_path, case):
    """The child's backward raises (or the child lets the graph go without
    one), exits by itself, holds none of the parent's files, spills a step
    of its own exactly; the parent's backward reads every file back."""
    spill_dir = str(tmp_path / "spill")
    child, parent = run_forked(case, spill_dir)
    assert parent["before"]["spilled_bytes"] > 0, parent     # spans were on disk at the fork
    assert parent["child_status"] == 0, parent                # exited by itself, no hang
    assert child is not None
    # the parent's spans on disk cannot come back in the child: a clear error
    if case == "spill":
        assert "forked" in child["backward"] and "spill_dir" in child["backward"], child
        assert "spawn" in child["backward"]
    # the child closed its copies of the parent's files at the fork
    assert child["fds_at_fork"] == [] and child["files_at_end"] == [], child
    # and spilled a step of its own through a tier of its own, exactly
    assert child["own_step_exact"], child
    assert child["stats"]["spill_writes"] > 0 and child["stats"]["spill_failures"] == 0
    assert child["stats"]["bytes_in_use"] == 0 and child["stats"]["spilled_bytes"] == 0
    # the parent's files were not touched: its backward reads them all back, exact
    assert parent["exact"], parent
    assert parent["after"]["spill_reads"] >= parent["before"]["spill_writes"] > 0
    assert parent["after"]["bytes_in_use"] == 0 and parent["after"]["spilled_bytes"] == 0
    assert parent["entries"] == []


def test_a_child_forked_after_a_pinned_pool_forward_trains_exactly(tmp_path):
    """Without a disk tier every span is in the child's own copy of the
    pool: the child's backward works, exactly, and so does the parent's."""
    child, parent = run_forked("pool", str(tmp_path))
    assert parent["child_status"] == 0, parent
    assert child is not None and child["backward"] == "exact", child
    assert child["own_step_exact"] and child["stats"]["bytes_in_use"] == 0, child
    assert parent["exact"] and parent["after"]["bytes_in_use"] == 0, parent


WRITING_AT_FORK_SCRIPT = r"""
import json, os, sys, warnings
sys.path.insert(0, sys.argv[1])
import torch, matepoint, sim
from matepoint import _C
from conftest import MLP
WIDTH, BATCH, DEPTH = 64, 64, 12
INPUT_BYTES = WIDTH * BATCH * 4
LIMIT = 8 * INPUT_BYTES
matepoint.set_options(min_offload_bytes=0, spill_dir=sys.argv[2], host_limit_bytes=LIMIT)
_C._simulate_cuda(True)
_C._sim_set_progress(sim.EVERYTHING)


def forward(model, x, paused_from):
    # the first input's write fails: it stays in host memory, first of all;
    # the tier takes no request from region `paused_from` on: those inputs
    # are being written when the process forks
    for index, layer in enumerate(model.layers):
        if index == paused_from:
            _C._spill_settle()
            _C._spill_pause(True)
        x = matepoint.checkpoint(layer, x)
    return x


def child():
    torch.set_num_threads(1)    # torch's intra-op threads are the parent's
    failures = matepoint.pool_stats()["spill_failures"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = MLP(WIDTH, DEPTH)(torch.randn(BATCH, WIDTH, requires_grad=True), matepoint.checkpoint)
        _C._spill_settle()
    stats = matepoint.pool_stats()
    print("child " + json.dumps({"failures_at_fork": failures, "stats": stats,
                                 "warnings": [str(w.message) for w in caught]}), flush=True)


with sim.device_memory(False):
    _C._spill_room(0)           # the tier starts
    _C._spill_fail_writes(1)
    torch.manual_seed(0)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH, requires_grad=True)
    out = forward(model, x, DEPTH - 2)
    before = matepoint.pool_stats()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            child()
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    _C._spill_pause(False)
    _C._spill_settle()
    writes = matepoint.pool_stats()["spill_writes"]
    out.sum().backward()
    got = [x.grad] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x, lambda fn, *args: fn(*args)).sum().backward()
    exact = all(torch.equal(a, b) for a, b in zip(got, [x.grad] + [p.grad for p in model.parameters()]))
    print("parent " + json.dumps({"child_status": status, "exact": exact, "before": before,
                                  "writes_after_fork": writes}), flush=True)
"""


def test_a_child_keeps_the_inputs_being_written_at_the_fork_in_memory(tmp_path):
    """Inputs the parent's disk tier was still writing at the fork are in
    the child's memory: the child counts them in host memory, no write of
    them failed, and its own forward spills ahead counting them, down to
    half host_limit_bytes and no further, as it would in the parent; the
    parent's step is untouched. (A failed write, earlier, left the first
    input in host memory ahead of them.)"""
    child, parent = run_script(WRITING_AT_FORK_SCRIPT, str(tmp_path / "spill"))
    assert child is not None, parent
    # premises: one write failed before the fork, two were queued at it
    assert parent["before"]["spill_failures"] == 1 == child["failures_at_fork"]
    assert parent["writes_after_fork"] == parent["before"]["spill_writes"] + 2
    assert parent["child_status"] == 0 and parent["exact"], parent
    stats, input_bytes = child["stats"], 64 * 64 * 4      # the script's spans, and its
    limit = 8 * input_bytes                                  # host_limit_bytes
    assert stats["spill_failures"] == 1 and child["warnings"] == [], child
    assert stats["spill_writes"] > 0 and stats["fallbacks"] == 0, stats
    assert limit // 2 - input_bytes < stats["bytes_in_use"] <= limit // 2, stats
