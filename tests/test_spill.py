"""The disk tier under the pinned pool (issue 37): with host_limit_bytes and
spill_dir, offloaded inputs past the limit go to unnamed files and come back
ahead of their recompute, gradients exact, pinned memory within the limit."""
from __future__ import annotations

import gc
import os
import signal
import stat
import subprocess
import warnings
import sys
import time

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import matepoint

from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step

WIDTH, BATCH, DEPTH = 64, 64, 24
INPUT_BYTES = WIDTH * BATCH * 4            # one region's offloaded input (a pool class size)
LIMIT = DEPTH * INPUT_BYTES // 3          # offloaded bytes are 3x the limit


class Watched(nn.Module):
    """Checks the pool after the layer ran: in the forward and in its
    recompute alike."""

    def __init__(self, inner: nn.Module, limit: int, seen: list) -> None:
        super().__init__()
        self.inner, self.limit, self.seen = inner, limit, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        stats = matepoint.pool_stats()
        assert stats["bytes_reserved"] <= self.limit, stats
        self.seen.append(stats["bytes_reserved"])
        return out


def watched_model(limit: int, seen: list) -> MLP:
    torch.manual_seed(0)
    model = MLP(WIDTH, DEPTH)
    model.layers = nn.ModuleList(Watched(layer, limit, seen) for layer in model.layers)
    return model


def entries(path: str) -> list:
    return sorted(os.listdir(path))


@pytest.fixture
def spill_dir(tmp_path):
    path = str(tmp_path / "spill")
    yield path
    matepoint.set_options(spill_dir=None, host_limit_bytes=None)


def checked_step(spill_dir: str, limit: int):
    seen: list = []
    model, x = watched_model(limit, seen), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=limit)
    _, grads = train_step(model, x, matepoint.checkpoint)
    assert_bitwise_equal(grads, expected)
    return seen


@pytest.mark.parametrize("fixture", ["simulated", "offload"])
def test_three_times_the_limit_trains_bit_identically(request, fixture, spill_dir):
    request.getfixturevalue(fixture)
    seen = checked_step(spill_dir, LIMIT)
    stats = matepoint.pool_stats()
    assert len(seen) == 2 * DEPTH                # every op of forward and recompute checked
    assert max(seen) <= LIMIT and stats["bytes_reserved"] <= LIMIT
    assert stats["fallbacks"] == 0 and stats["spill_failures"] == 0
    assert stats["spill_writes"] >= DEPTH // 2   # the spans past the limit went to disk
    assert stats["spill_reads"] == stats["spill_writes"]
    assert stats["peak_spilled_bytes"] >= DEPTH * INPUT_BYTES - LIMIT
    assert stats["spilled_bytes"] == 0
    assert entries(spill_dir) == []


def test_a_span_larger_than_the_limit_is_never_pinned(simulated, spill_dir):
    """Nothing can make room for it: it goes to pageable memory (the pool's
    fallback), and pinned memory still stays within the limit."""
    with pytest.warns(RuntimeWarning, match="pageable"):
        seen = checked_step(spill_dir, INPUT_BYTES // 2)
    stats = matepoint.pool_stats()
    assert max(seen) <= INPUT_BYTES // 2 and stats["fallbacks"] >= DEPTH
    assert entries(spill_dir) == []


@pytest.mark.parametrize("pool_limit, host_limit, named", [
    (INPUT_BYTES // 2, None, "pool_limit_bytes"),
    (None, INPUT_BYTES // 2, "host_limit_bytes"),
    (INPUT_BYTES // 2, 4 * INPUT_BYTES, "pool_limit_bytes"),
    (4 * INPUT_BYTES, INPUT_BYTES // 2, "host_limit_bytes"),
], ids=["pool-limit", "host-limit", "pool-limit-below-host", "host-limit-below-pool"])
def test_the_fallback_warning_names_the_limit_it_hit(simulated, spill_dir, pool_limit,
                                                     host_limit, named):
    """Every span is larger than the smaller limit: the one warning names
    that option, its value, and what to do about it."""
    model, x = MLP(WIDTH, 4), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(pool_limit_bytes=pool_limit, host_limit_bytes=host_limit,
                          spill_dir=spill_dir if host_limit else None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, grads = train_step(model, x, matepoint.checkpoint)
    finally:
        matepoint.set_options(pool_limit_bytes=None)
    assert_bitwise_equal(grads, expected)
    messages = [str(w.message) for w in caught if "pageable" in str(w.message)]
    assert len(messages) == 1, messages
    other = ({"pool_limit_bytes", "host_limit_bytes"} - {named}).pop()
    assert f"at {named} ({INPUT_BYTES // 2} bytes)" in messages[0]
    assert other not in messages[0].split(";")[0]
    assert f"raise {named}" in messages[0]
    if named == "pool_limit_bytes":
        assert "set spill_dir" in messages[0]
    assert matepoint.pool_stats()["fallbacks"] >= 4


def test_the_fallback_warning_says_when_pinning_failed_under_no_limit(simulated, spill_dir):
    """No limit was hit (the system refused to pin): the warning names no
    option's limit."""
    import sim
    from matepoint import _C
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=64 * INPUT_BYTES)
    _C._sim_fail("cudaHostAlloc", 0, 1 << 40, 2)   # cudaErrorMemoryAllocation
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_step(MLP(WIDTH, 4), torch.randn(BATCH, WIDTH), matepoint.checkpoint)
    finally:
        _C._sim_fail("cudaHostAlloc", 0, 0, 0)
    sim.assert_no_cuda_error()
    messages = [str(w.message) for w in caught if "pageable" in str(w.message)]
    assert len(messages) == 1 and "pinning host memory failed" in messages[0], messages
    assert "limit_bytes" not in messages[0]


class PinnedWithin(TorchDispatchMode):
    """Checks the pool after every aten operator: in the forward, and on
    backward's threads (autograd carries the mode there)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.checked = limit, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        reserved = matepoint.pool_stats()["bytes_reserved"]
        assert reserved <= self.limit, (func, reserved)
        self.checked += 1
        return out


def test_pinned_bytes_stay_within_the_limit_after_every_operator(simulated, spill_dir):
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    mode = PinnedWithin(LIMIT)
    with mode:
        _, grads = train_step(model, x, matepoint.checkpoint)
    assert_bitwise_equal(grads, expected)
    assert mode.checked > 4 * DEPTH and matepoint.pool_stats()["spill_reads"] >= DEPTH // 2


def test_spill_dir_must_be_private(tmp_path, spill_dir):
    before = matepoint.options
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"spill_dir: .*shared can be written by others"):
        matepoint.set_options(spill_dir=str(shared), host_limit_bytes=LIMIT)
    shared.chmod(0o730)
    with pytest.raises(ValueError, match="can be written by others"):
        matepoint.set_options(spill_dir=shared, host_limit_bytes=LIMIT)
    assert matepoint.options == before       # nothing changed
    if os.geteuid() == 0:                    # only root can give a directory away
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 4242, 4242)
        with pytest.raises(ValueError, match=r"theirs belongs to uid 4242, not this user"):
            matepoint.set_options(spill_dir=str(theirs), host_limit_bytes=LIMIT)
    with pytest.raises(ValueError, match="host_limit_bytes needs spill_dir"):
        matepoint.set_options(host_limit_bytes=LIMIT)
    with pytest.raises(TypeError, match="spill_dir must be a directory path"):
        matepoint.set_options(spill_dir=3)
    made = matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    assert made.spill_dir == spill_dir
    assert stat.S_IMODE(os.stat(spill_dir).st_mode) == 0o700   # created private


def test_a_spill_dir_that_stopped_being_a_folder_is_named(simulated, spill_dir):
    """spill_dir is checked when it is set; should it be gone or replaced by
    the time the disk tier starts (the first input past host_limit_bytes),
    the step raises OSError naming it and why, and holds nothing (the
    fixture checks the pool and the window)."""
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    os.rmdir(spill_dir)
    open(spill_dir, "w").close()        # a file where the folder was
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    try:
        with pytest.raises(OSError, match="disk tier cannot start: .*is not a directory"):
            train_step(model, x, matepoint.checkpoint)
    finally:
        os.remove(spill_dir)
    assert matepoint.pool_stats()["spill_writes"] == 0


def test_spill_options_from_the_environment(tmp_path):
    from matepoint._options import options_from_env
    options = options_from_env({"MATEPOINT_SPILL_DIR": str(tmp_path),
                                "MATEPOINT_HOST_LIMIT_BYTES": "0x100000"})
    assert options.spill_dir == str(tmp_path) and options.host_limit_bytes == 1 << 20
    assert options_from_env({"MATEPOINT_SPILL_DIR": ""}).spill_dir is None


def test_spill_dir_cannot_change_while_inputs_are_on_disk(simulated, spill_dir, tmp_path):
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH, requires_grad=True)
    out = model(x, matepoint.checkpoint)
    assert matepoint.pool_stats()["spilled_bytes"] > 0
    with pytest.raises(RuntimeError, match="spill_dir cannot change, nor the disk tier stop"):
        matepoint.set_options(spill_dir=str(tmp_path / "other"))
    with pytest.raises(RuntimeError, match="nor the disk tier stop"):
        matepoint.set_options(spill_dir=None, host_limit_bytes=None)
    out.sum().backward()
    matepoint.set_options(spill_dir=str(tmp_path / "other"))


FULL_DISK_SCRIPT = r"""
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
import torch, matepoint, sim
from matepoint import _C
from conftest import MLP, no_checkpoint, train_step
matepoint.set_options(min_offload_bytes=0)
_C._simulate_cuda(True)
_C._sim_set_progress(sim.EVERYTHING)
with sim.device_memory(False), sim.as_on_cuda(lag=False):
    model, x = MLP(64, 24), torch.randn(64, 64)
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(spill_dir=sys.argv[3], host_limit_bytes=int(sys.argv[2]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, grads = train_step(model, x, matepoint.checkpoint)
    stats = matepoint.pool_stats()
    print(json.dumps({"exact": all(torch.equal(a, b) for a, b in zip(grads, expected)),
                      "warnings": [str(w.message) for w in caught], "stats": stats}))
"""


def in_private_tmpfs(size: str, path: str, command: list) -> subprocess.CompletedProcess:
    """Runs `command` followed by `path`, with a tmpfs of `size` mounted
    on `path` in a mount namespace of its own (root only): the mount ends
    with the process, however it ends."""
    script = 'mount -t tmpfs -o size=$0,mode=0700 tmpfs "$1" && shift && exec "$@"'
    run = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                          size, path] + command + [path], capture_output=True, text=True,
                         timeout=300)
    if run.returncode != 0 and "mount" in run.stderr and "Traceback" not in run.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {run.stderr.strip()}")
    return run


def test_a_full_disk_keeps_inputs_in_host_memory(tmp_path):
    """A 64 KiB tmpfs fills up mid-step: the inputs that do not fit stay in
    host memory (one warning), gradients exact."""
    import json
    tests = os.path.dirname(os.path.abspath(__file__))
    env_path = os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])
    tiny = tmp_path / "tiny"
    tiny.mkdir(mode=0o700)
    run = in_private_tmpfs("64k", str(tiny), ["env", f"PYTHONPATH={env_path}", sys.executable, "-c",
                                   FULL_DISK_SCRIPT, tests, str(LIMIT)])
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    stats = result["stats"]
    assert result["exact"], result
    assert any("failed (No space left on device)" in w for w in result["warnings"]), result
    assert stats["spill_failures"] > 0 and stats["spill_writes"] > 0, stats
    assert stats["bytes_reserved"] <= LIMIT and stats["spilled_bytes"] == 0, stats


CRASH_SCRIPT = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import torch, matepoint, sim
from matepoint import _C
from conftest import MLP
matepoint.set_options(min_offload_bytes=0, spill_dir=sys.argv[2], host_limit_bytes=int(sys.argv[3]))
_C._simulate_cuda(True)
_C._sim_set_progress(sim.EVERYTHING)
with sim.device_memory(False), sim.as_on_cuda(lag=False):
    model, x = MLP(64, 24), torch.randn(64, 64, requires_grad=True)
    out = model(x, matepoint.checkpoint)       # the step stops after its forward
    print(matepoint.pool_stats()["spilled_bytes"], flush=True)
    time.sleep(120)
"""


def test_no_file_outlives_a_killed_process(tmp_path):
    spill = str(tmp_path / "spill")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, tests, spill, str(LIMIT)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line.strip().isdigit() and int(line) > 0, line + child.stderr.read()
        fd_dir = f"/proc/{child.pid}/fd"
        targets = [os.readlink(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir)]
        files = [t for t in targets if t.startswith(spill + "/")]
        assert files and all(t.endswith("(deleted)") for t in files), targets
        assert entries(spill) == []              # open, but never in the directory
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert entries(spill) == []


@pytest.mark.parametrize("pipeline,depth", [(False, 1), (True, 0), (True, 4)])
def test_spilled_inputs_come_back_however_backward_fetches(simulated, spill_dir, pipeline, depth):
    """Each restore reads the spilled inputs backward reaches next, with
    prefetch or without, as far as the limit allows."""
    matepoint.set_options(pipeline=pipeline, prefetch_depth=depth)
    try:
        seen = checked_step(spill_dir, LIMIT)
        stats = matepoint.pool_stats()
    finally:
        matepoint.set_options(pipeline=True, prefetch_depth=1)
    assert max(seen) <= LIMIT and stats["fallbacks"] == 0
    assert stats["spill_reads"] == stats["spill_writes"] > 0


def test_selectively_offloaded_outputs_spill_too(simulated, spill_dir):
    """An op's outputs that selective checkpointing offloads are spans of
    the pool like the inputs: they spill and come back, gradients exact."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    mm = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_CPU_OFFLOAD if func in mm else CheckpointPolicy.PREFER_RECOMPUTE

    def sac(fn, x):
        return matepoint.checkpoint(fn, x, context_fn=lambda: create_selective_checkpoint_contexts(
            policy))

    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
    _, expected = train_step(model, x, no_checkpoint)
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    _, grads = train_step(model, x, sac)
    assert_bitwise_equal(grads, expected)
    stats = matepoint.pool_stats()
    assert stats["spill_writes"] > DEPTH and stats["spill_reads"] == stats["spill_writes"]
    assert stats["bytes_reserved"] <= LIMIT and stats["fallbacks"] == 0


def test_a_limit_of_two_inputs_reads_ahead_within_it(simulated, spill_dir):
    """Room for two inputs only, the last regions' inputs used in place with
    their host buffers waiting on copies out: read-ahead waits for those
    copies rather than read into pageable memory, and keeps within the
    limit (reading at need is the one-input case below); grads exact."""
    seen = checked_step(spill_dir, 2 * INPUT_BYTES)
    stats = matepoint.pool_stats()
    assert max(seen) <= 2 * INPUT_BYTES and stats["fallbacks"] == 0
    assert stats["spill_reads"] == stats["spill_writes"] > 0
    assert stats["used_in_place"] > 0


def test_a_limit_of_one_input_reads_each_at_need(simulated, spill_dir):
    """Room for one input: nothing can be read ahead while the region after
    still holds its buffer, so each copy back reads its input itself
    (pageable memory past the limit, as the pool falls back); pinned
    memory within the limit, grads exact."""
    stalls = matepoint.pool_stats()["spill_read_stalls"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the pageable fallback's
        seen = checked_step(spill_dir, INPUT_BYTES)
    stats = matepoint.pool_stats()
    assert max(seen) <= INPUT_BYTES and stats["spill_reads"] == stats["spill_writes"] > 0
    assert stats["spill_read_stalls"] - stalls >= DEPTH // 2


def test_the_bench_latent_case_has_a_run_with_the_host_limit_at_half(spill_dir, monkeypatch):
    """matepoint+spill (GPU runs of `python -m matepoint.bench`): the latent
    case sets host_limit_bytes to half its offloaded bytes, spill_dir from
    the options (MATEPOINT_SPILL_DIR); the CPU configuration leaves it out."""
    from matepoint.bench import cli
    from matepoint.bench.cases import latent
    matepoint.set_options(spill_dir=spill_dir)
    spec = {"size": latent.sizes(None, cuda=False), "depth": 6}
    work = latent.build(spec, "matepoint+spill", torch.device("cpu"))
    assert matepoint.options.host_limit_bytes == work.extra["input_bytes"] * 6 // 2
    assert matepoint.options.spill_dir == spill_dir
    work.run_step()
    args = cli.parse_args(["--cases", "latent"])
    assert "matepoint+spill" in latent.MODES
    assert "matepoint+spill" not in cli.configuration(args, cuda=False)["cases"]["latent"]["modes"]


def test_a_miss_at_the_host_limit_unpins_only_the_room_it_needs(offload, spill_dir):
    # the tier bounds the bytes in use, not the cache: a span of a class
    # the cache lacks, at the limit, must unpin as few cached buffers as
    # make room for it (each cudaFreeHost waits for the device, and what it
    # unpinned is pinned again later), not the whole cache
    torch.manual_seed(0)
    layer, x = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), torch.randn(BATCH, WIDTH)
    expected = torch.autograd.grad(layer(x).sum(), list(layer.parameters()))
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    small = INPUT_BYTES // 2
    assert matepoint.reserve_pool(small, LIMIT // small) == LIMIT // small
    before = matepoint.pool_stats()
    assert before["bytes_reserved"] == LIMIT        # premise: the cache fills the limit
    out = matepoint.checkpoint(layer, x)
    after = matepoint.pool_stats()
    assert after["misses"] == before["misses"] + 1  # premise: the span's class was not cached
    assert after["host_allocations"] == before["host_allocations"] + 1
    assert after["host_frees"] == before["host_frees"] + 2     # two halves make its room
    assert after["bytes_reserved"] == LIMIT and after["fallbacks"] == 0
    grads = torch.autograd.grad(out.sum(), list(layer.parameters()))
    assert_bitwise_equal(grads, expected)
    assert matepoint.pool_stats()["peak_spilled_bytes"] == 0   # nothing spilled: room was made
    matepoint.empty_pool()


def test_a_spill_file_changed_behind_the_tier_fails_backward_clearly(simulated, spill_dir):
    # the same user can write a spill file through /proc/<pid>/fd (or a
    # disk can corrupt it): its read back must fail, never give gradients
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    torch.manual_seed(0)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH, requires_grad=True)
    out = model(x, matepoint.checkpoint)
    matepoint._C._spill_settle()
    changed = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(spill_dir + os.sep):
            writer = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
            try:
                os.pwrite(writer, b"\x7f" * 64, 0)
            finally:
                os.close(writer)
            changed += 1
    assert changed > 0                  # premise: spans were on disk, in files of the tier
    with pytest.raises(RuntimeError, match="does not match what was written") as raised:
        (out ** 2).mean().backward()
    del out, raised     # the graph, and the traceback that holds its frames
    gc.collect()
    matepoint._C._spill_settle()
    assert matepoint.pool_stats()["spilled_bytes"] == 0


def test_the_tier_figures_are_the_current_tiers(simulated, spill_dir, tmp_path):
    """pool_stats()' spill figures describe the tier in use: once spill_dir
    changes they read 0 until the new tier works, never the old tier's (a
    count taken before a step would otherwise exceed the one after it)."""
    checked_step(spill_dir, LIMIT)
    assert matepoint.pool_stats()["spill_writes"] >= DEPTH // 2   # premise: it spilled
    matepoint.set_options(spill_dir=str(tmp_path / "other"))
    stats = matepoint.pool_stats()
    assert (stats["spill_writes"], stats["spill_reads"], stats["spilled_bytes"]) == (0, 0, 0)
    checked_step(str(tmp_path / "other"), LIMIT)
    assert matepoint.pool_stats()["spill_writes"] >= DEPTH // 2


def widths_model(widths: list) -> MLP:
    """An MLP whose regions take inputs of the given widths, in order."""
    torch.manual_seed(0)
    model = MLP(WIDTH, 1)
    model.layers = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.Tanh())
                                 for a, b in zip(widths, widths[1:]))
    return model


@pytest.mark.parametrize("widths", [
    [WIDTH] * (DEPTH - 1) + [2 * WIDTH, WIDTH],     # the last input twice the others
    [2 * WIDTH] * (DEPTH - 1) + [WIDTH, WIDTH],     # the last input half the others
], ids=["widening", "narrowing"])
def test_the_forward_spills_ahead_to_half_the_limit_and_no_further(offload, spill_dir, widths):
    """However large the input just saved is next to those resident, the
    forward leaves host memory holding at most half host_limit_bytes (the
    other half is backward's, to read back into), and keeps resident every
    input that fits there: it writes no more to disk than it must."""
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    model = widths_model(widths)
    x = torch.randn(BATCH, widths[0], requires_grad=True)
    out = model(x, matepoint.checkpoint)
    matepoint._C._spill_settle()
    stats = matepoint.pool_stats()
    assert stats["spill_writes"] > DEPTH // 2 and stats["fallbacks"] == 0   # premise: it spilled
    largest = 2 * INPUT_BYTES
    assert LIMIT // 2 - largest < stats["bytes_in_use"] <= LIMIT // 2, stats
    (out ** 2).mean().backward()
    assert matepoint.pool_stats()["spill_reads"] == stats["spill_writes"]


def spill_files_written(path: str, count: int, nbytes: int) -> bool:
    """Waits (at most 30 s) until this process has `count` files in `path`
    of `nbytes` each: the tier's writes went through, seen without asking
    matepoint (pool_stats() would poll the tier)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sizes = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith(path + os.sep):
                    sizes.append(os.stat(f"/proc/self/fd/{fd}").st_size)
            except OSError:
                continue        # closed meanwhile (listdir's own descriptor)
        if sizes.count(nbytes) >= count:
            return True
        time.sleep(0.01)
    return False


def test_backward_lets_go_of_the_inputs_written_while_the_forward_ended(offload, spill_dir):
    """The forward's last spills are still being written when it returns;
    backward, though nothing asks pool_stats() during the step, sees that
    those writes finished, gives their pinned buffers back and reads those
    inputs back from disk like every other: each input written is read."""
    matepoint.set_options(spill_dir=spill_dir, host_limit_bytes=LIMIT)
    torch.manual_seed(0)
    model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH, requires_grad=True)
    _, expected = train_step(model, x, no_checkpoint)
    model.zero_grad(set_to_none=True)
    out = model(x, matepoint.checkpoint)
    spilled = DEPTH - LIMIT // 2 // INPUT_BYTES      # all but half the limit's worth
    assert spill_files_written(spill_dir, spilled, INPUT_BYTES)
    (out.float() ** 2).mean().backward()
    stats = matepoint.pool_stats()
    assert_bitwise_equal([x.grad] + [p.grad for p in model.parameters()], expected)
    assert stats["spill_writes"] == spilled        # premise: as many went to disk
    assert stats["spill_reads"] == spilled

