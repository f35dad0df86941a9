"""Every wait and record_stream the offload engine issues is needed, proven
by data on the simulated GPU, call site by call site.

Each call names its site (csrc/offload/offload_sites.h, the one list:
_C.OFFLOAD_SITES); the test build's runtime counts each site's calls and
drops a chosen site's (they succeed and do nothing). For every site, PROOFS
names a case and an adversary where dropping that site's calls changes the
data: gradients that differ bit for bit from a run without offload, or a
tensor read through a prefetched buffer; or where no one reads the bytes
at stake, a fault a GPU would raise (memory unmapped under queued work,
_sim_stats()["unmap_faults"]: an illegal address, the context lost), which
counts as wrong in every case. The case must have issued the site
(its count, in the run that is exact: the premise), so a proof cannot go
vacuous when the engine changes. A site in the table with no proof fails
the test (the day it is added); a site found redundant is removed from the
engine, the reason kept in REMOVED.

Two adversaries, since a missing wait shows under one or the other: a GPU
far behind (copies run only when something waits for them: a reader not
ordered after a copy reads what was there before), and a copy engine that
keeps up while kernels lag (sim_kernels.py: a copy not ordered after its
producer reads poison; a buffer reused under a reader's queued kernel
poisons that kernel's results)."""
from __future__ import annotations

import gc
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn

import fake_torch_cuda
import matepoint
import sim
from matepoint import _C

from conftest import MLP, assert_bitwise_equal, no_checkpoint, train_step

WIDTH, BATCH, DEPTH = 32, 16, 5
FAR_BEHIND, KEEPS_UP = "GPU far behind", "copies keep up"
ADVERSARIES = {FAR_BEHIND: 0, KEEPS_UP: sim.EVERYTHING}
SITES: Dict[str, str] = dict(_C.OFFLOAD_SITES) if hasattr(_C, "OFFLOAD_SITES") else {}

def plain(fn, x):
    return matepoint.checkpoint(fn, x)


def on_alternate_streams() -> Callable:
    """Regions alternate between two side streams: each input was made on
    the other stream, so its memory returns to a pool that never waited
    for the copy out unless the engine records it there."""
    streams = sim.side_streams()
    calls = [0]

    def wrap(fn, x):
        stream = streams[calls[0] % 2]
        calls[0] += 1
        with sim.stream(0, stream):
            return matepoint.checkpoint(fn, x)
    return wrap


def inputs_from_a_branch(checkpointed: bool = True) -> Callable:
    """Regions run on the current stream, each on an input made on a side
    stream (the branch). Inside each region, after its first kernel, the
    branch makes a scratch tensor on its own, ordered after nothing the
    region did (the region then waits for it): that allocation may reuse
    the memory of an input the engine just retired, and only the engine's
    record_stream on the region's (producer) stream orders that reuse
    after the copy out. Not `checkpointed`: the same computation, for
    reference."""
    branch = sim.side_streams()[0]

    def scaled_by_scratch(x):
        previous = _C._sim_current_stream(0)
        _C._sim_set_stream(0, branch)           # the branch's own work: waits for nothing
        try:
            scratch = torch.ones(x.shape)
        finally:
            _C._sim_set_stream(0, previous)
        _C._sim_order_streams(0, previous, 0, branch)
        sim.record_stream(scratch, 0, previous)     # used here: freed in stream order
        return x * scratch

    def wrap(layer, x):
        with sim.stream(0, branch):
            made = x * 1.0

        def region(y):
            return layer[1](scaled_by_scratch(layer[0](y)))
        return matepoint.checkpoint(region, made) if checkpointed else region(made)
    return wrap


@dataclass
class Scenario:
    name: str
    options: dict
    wrap: Callable[[], Callable]
    backwards: int = 1          # backward passes over one graph (retain_graph)
    reference: Callable[[], Callable] = lambda: no_checkpoint


SCENARIOS = {s.name: s for s in [
    Scenario("prefetch", dict(offload_window=2, prefetch_depth=1), lambda: plain),
    # more regions copied back: the last offload_window are used in place
    Scenario("prefetch, window 1", dict(offload_window=1, prefetch_depth=1), lambda: plain),
    Scenario("no pipeline, window 1", dict(offload_window=1, pipeline=False), lambda: plain),
    Scenario("side streams", dict(offload_window=1), on_alternate_streams),
    Scenario("two backwards", dict(offload_window=2), lambda: plain, backwards=2),
    Scenario("inputs from a branch", dict(offload_window=1), inputs_from_a_branch,
             reference=lambda: inputs_from_a_branch(checkpointed=False)),
]}


def step(model: nn.Module, x: torch.Tensor, wrap: Callable, backwards: int
         ) -> List[torch.Tensor]:
    """train_step with `backwards` backward passes over one graph: the
    gradients of the last one."""
    if backwards == 1:
        return train_step(model, x, wrap)[1]
    torch.manual_seed(0)
    leaf = x.detach().clone().requires_grad_(True)
    loss = (model(leaf, wrap).float() ** 2).mean()
    for index in range(backwards):
        model.zero_grad(set_to_none=True)
        leaf.grad = None
        loss.backward(retain_graph=index + 1 < backwards)
    return [leaf.grad] + [p.grad for p in model.parameters()]


def run(scenario: Scenario, model: nn.Module, x: torch.Tensor) -> Optional[List]:
    """One offloaded step into fresh pinned buffers (a cached one would
    still hold the last run's bytes, the very bytes a copy reading it too
    early should miss; the simulator hands new ones out full of poison):
    its gradients, None when it raised."""
    matepoint.empty_pool()
    assert matepoint.pool_stats()["bytes_reserved"] == 0, "a pinned buffer outlived its run"
    try:
        grads = step(model, x, scenario.wrap(), scenario.backwards)
        grads = [g.detach().clone() if g is not None else None for g in grads]
    except RuntimeError:
        grads = None
    sim.finish()
    gc.collect()
    return grads


def same(grads, expected) -> bool:
    if grads is None:
        return False
    try:
        assert_bitwise_equal(grads, expected)
    except AssertionError:
        return False
    return True


def training_case(scenario: Scenario) -> Callable[[], Callable[[], bool]]:
    """A training step of `scenario`: its reference gradients, then a run
    whose gradients are compared with them bit for bit."""
    def prepare() -> Callable[[], bool]:
        matepoint.set_options(**scenario.options)
        torch.manual_seed(0)
        model, x = MLP(WIDTH, DEPTH), torch.randn(BATCH, WIDTH)
        expected = [g.detach().clone()
                    for g in step(model, x, scenario.reference(), scenario.backwards)]
        return lambda: same(run(scenario, model, x), expected)
    return prepare


def offloaded_and_retired(source: torch.Tensor):
    """source offloaded through the engine's selective-checkpoint entry
    points, its copy out run and its source retired from the window (so a
    prefetch copies it back rather than using it in place)."""
    group, saved = _C._sac_offload([source])
    sim.finish()
    matepoint.pool_stats()                  # the window retires what completed
    assert [row for row in _C._offload_copies() if row[2]] == [], "a source is still held"
    return group, saved


def read_on_another_stream() -> Callable[[], bool]:
    """A span prefetched while stream `a` is current (its buffer comes from
    a's allocator; the copy-in stream writes it) is read by a kernel on
    stream `b`, which lags; the buffer goes back to a's allocator, and a
    allocates again with b never waited for. Only the record of the buffer
    on its reader (await_h2d) keeps a from reusing it under b's kernel,
    whose result is then poison. Premise: one span really prefetched (its
    source retired before), none used in place."""
    def once() -> bool:
        a, b = sim.side_streams()
        torch.manual_seed(0)
        source = torch.randn(64, 64)
        expected = source * 2
        group, saved = offloaded_and_retired(source)
        del source
        before = matepoint.pool_stats()
        try:
            _C._sim_set_stream(0, a)
            _C._sac_prefetch(group)
            _C._sim_set_stream(0, b)
            (restored,) = _C._sac_restore(group, saved)
            doubled = restored * 2              # b's kernel, lagging
            _C._sim_set_stream(0, None)
            after = matepoint.pool_stats()
            del restored, group, saved          # back to a's allocator
            gc.collect()
            _C._sim_set_stream(0, a)
            taken = [torch.full((64, 64), 3.0) for _ in range(4)]
        finally:
            _C._sim_set_stream(0, None)
        sim.finish()
        assert after["prefetched"] - before["prefetched"] == 1, "nothing was prefetched"
        assert after["used_in_place"] == before["used_in_place"], "the span was used in place"
        del taken
        return torch.equal(doubled, expected)
    return once


def prefetched_over_a_lagging_reader() -> Callable[[], bool]:
    """Stream `a` reads a tensor in a kernel that lags, then frees it: its
    block goes back to a's allocator in a's order, so a's next allocation
    may take it at once. A prefetch while `a` is current takes that block
    for its destination, and the copy-in stream writes it: only its wait
    for `a` (start_h2d) keeps the copy after the lagging kernel, which
    otherwise finds its input changed and writes poison. Premise: one span
    really prefetched, into the very block the kernel reads."""
    def once() -> bool:
        a, _ = sim.side_streams()
        torch.manual_seed(0)
        source = torch.randn(64, 64)
        expected = source.clone()
        group, saved = offloaded_and_retired(source)
        del source
        before = matepoint.pool_stats()
        try:
            _C._sim_set_stream(0, a)
            read = torch.full((64, 64), 3.0)
            doubled = read * 2                  # a's kernel, lagging
            block = read.data_ptr()
            del read                            # back to a's allocator
            _C._sac_prefetch(group)
            (restored,) = _C._sac_restore(group, saved)
        finally:
            _C._sim_set_stream(0, None)
        after = matepoint.pool_stats()
        sim.finish()
        assert after["prefetched"] - before["prefetched"] == 1, "nothing was prefetched"
        assert after["used_in_place"] == before["used_in_place"], "the span was used in place"
        assert restored.data_ptr() == block, "the prefetch took another block"
        right = torch.equal(restored, expected) and bool((doubled == 6.0).all())
        del restored, group, saved
        gc.collect()
        return right
    return once


def prefetched_and_never_read() -> Callable[[], bool]:
    """A span prefetched and never read (backward stopped before its
    region: its group dies unrestored). Its buffer, from the compute
    stream's allocator, goes back unread while the copy back may still
    write it (the GPU far behind): the next tensors made there must hold
    what their kernels wrote. Only the record of a prefetched buffer on the
    copy-in stream (fetch_copy) orders that reuse after the copy. The case
    places the memory it needs: the span's size (24 KiB) is its own, and as
    many tensors of it are made after as take every free block of that
    size, the buffer's among them, whatever else the engine did. Premise:
    prefetched, its copy back still queued when its buffer went."""
    def once() -> bool:
        torch.manual_seed(0)
        group, saved = offloaded_and_retired(torch.randn(96, 64))
        before = matepoint.pool_stats()["prefetched"]
        copies_run = _C._sim_stats()["copies_run"]
        _C._sac_prefetch(group)
        assert matepoint.pool_stats()["prefetched"] - before == 1, "nothing was prefetched"
        del group, saved                        # its buffer goes back unread
        gc.collect()
        results = [torch.zeros(96 * 64) + 1.0 for _ in range(4)]
        assert _C._sim_stats()["copies_run"] == copies_run, "the copy back ran before"
        sim.finish()
        return all(bool((result == 1.0).all()) for result in results)
    return once


def prefetch_beaten() -> Callable[[], bool]:
    """Two prefetches of one span at once, as two threads may (torch's
    Python code inside a fetch hands the GIL over): the second starts and
    finishes inside the first's question for the current stream (the
    torch.cuda stand-in of fake_torch_cuda.py runs it there). The first's
    buffer, which its copy back may still write, goes back to the compute
    stream's allocator unread: only the compute stream's wait for that copy
    (drop_beaten) orders the next tensors made there after it."""
    def once() -> bool:
        with fake_torch_cuda.installed() as standin:
            _C._simulate_torch_adapter(True)
            try:
                return beaten_once(standin)
            finally:
                _C._simulate_torch_adapter(False)
    return once


def beaten_once(standin: fake_torch_cuda.TorchCudaStandin) -> bool:
    torch.manual_seed(0)
    group, saved = offloaded_and_retired(torch.randn(64, 64))
    armed = [True]

    def inside(name: str) -> None:
        if name == "_cuda_getCurrentRawStream" and armed[0]:
            armed[0] = False
            _C._sac_prefetch(group)             # the other thread, first back
    standin.inside = inside
    try:
        _C._sac_prefetch(group)
    finally:
        standin.inside = None
    assert not armed[0], "the second prefetch never ran"
    kept = [torch.full((64, 64), 3.0) for _ in range(4)]
    doubled = [t * 2 for t in kept]
    sim.finish()
    right = all(bool((t == 3.0).all()) for t in kept) and all(bool((t == 6.0).all()) for t in doubled)
    _C._sac_discard(group)
    del group, saved, kept, doubled
    gc.collect()
    sim.finish()                                # nothing of the copy outlives the runtime switch
    return right


def copied_back_twice() -> Callable[[], bool]:
    """A span copied back twice, on two streams: prefetched (the copy-in
    stream, behind a kernel of stream `a` that lags) and read on `b`, then
    copied back again at need on the legacy stream. Its host buffer goes
    back to the pool once the second copy's event completed; only the
    second copy's wait for the first (start_h2d) keeps that after the
    first copy read it. Without it the legacy stream catches up, the host
    buffer takes another span's copy out, and the first copy, still
    queued, brings those bytes to what `b` read (offloaded again here: a
    copy, which reads what is there when it runs)."""
    def once() -> bool:
        a, b = sim.side_streams()
        matepoint.empty_pool()                  # one host buffer: the one reused
        torch.manual_seed(0)
        source = torch.randn(64, 64)
        expected, other = source.clone(), torch.full((64, 64), 5.0)
        group, saved = offloaded_and_retired(source)
        del source
        try:
            _C._sim_set_stream(0, a)
            lagging = torch.ones(64, 64)
            # the copy-in stream waits for a's lagging kernel (as the
            # prefetch itself does: copy_in_after_compute, not relied on)
            _C._sim_order_streams(0, _C._offload_streams()[0]["copy_in"], 0, a)
            _C._sac_prefetch(group)
            _C._sim_set_stream(0, b)
            (first,) = _C._sac_restore(group, saved)
            _C._sim_set_stream(0, None)
            (second,) = _C._sac_restore(group, saved)
            del second, group, saved            # the host buffer goes back after copy 2
            gc.collect()
            _C._sim_launch(0, None)             # the legacy stream catches up
            hits = matepoint.pool_stats()["hits"]
            group2, saved2 = _C._sac_offload([other])
            assert matepoint.pool_stats()["hits"] == hits + 1, "the host buffer was not reused"
            _C._sim_set_stream(0, b)
            group3, saved3 = _C._sac_offload([first])
        finally:
            _C._sim_set_stream(0, None)
        del first, lagging
        sim.finish()
        matepoint.pool_stats()                  # the window retires the sources
        (again,) = _C._sac_restore(group3, saved3)
        right = torch.equal(again, expected)
        del again, group2, saved2, group3, saved3
        gc.collect()
        return right
    return once


def in_place_under_expandable_segments() -> Callable[[], bool]:
    """A source still in the window when its restore begins is used in
    place while its copy out is queued (the GPU far behind), and the
    restore's reader drops it: its memory goes back with the D2H still
    queued. torch's allocator with expandable segments then unmaps the
    freed pages (empty_cache()) after syncing only their own stream. What
    the late D2H reads lands in a host buffer nobody reads, so the wrong
    outcome here is not data but the D2H reading unmapped memory: an unmap
    fault (run_check). Only the record of a kept source on the copy-out
    stream (sweep) holds its memory past the D2H. The case places the
    memory it needs: the source fills a segment of its own (12 MiB: the
    allocator gives requests of 10 MiB and more their own segment, rounded
    to 2 MiB, so no other tensor shares it), and nothing is allocated
    between its going and the cache being emptied, so its whole segment is
    free then whatever else the engine did. Premise:
    the source used in place, its copy out still queued when the cache is
    emptied."""
    def once() -> bool:
        _C._sim_expandable(True)    # the fixture's mode too: said here, this case's premise
        torch.manual_seed(0)
        expected = torch.randn(1536, 2048)          # 12 MiB
        source = expected.clone()
        copies_run = _C._sim_stats()["copies_run"]
        group, saved = _C._sac_offload([source])    # its copy out queued, not run
        del source
        before = matepoint.pool_stats()["used_in_place"]
        (restored,) = _C._sac_restore(group, saved)
        right = torch.equal(restored, expected)
        assert matepoint.pool_stats()["used_in_place"] - before == 1, "not used in place"
        del restored, group, saved                  # the source's memory goes back
        gc.collect()
        assert _C._sim_stats()["copies_run"] == copies_run, "the copy out ran before"
        sim.empty_device_cache()                    # the allocator unmaps what is free
        sim.finish()
        assert _C._sim_stats()["copies_run"] == copies_run + 1
        return right
    return once


CASES: Dict[str, Callable[[], Callable[[], bool]]] = {
    **{name: training_case(scenario) for name, scenario in SCENARIOS.items()},
    "read on another stream": read_on_another_stream,
    "prefetched over a lagging reader": prefetched_over_a_lagging_reader,
    "prefetched and never read": prefetched_and_never_read,
    "prefetch beaten": prefetch_beaten,
    "copied back twice": copied_back_twice,
    "in place under expandable segments": in_place_under_expandable_segments,
}

# site -> (case, adversary) where dropping the site's calls changes the data
PROOFS: Dict[str, Tuple[str, str]] = {
    "copy_out_after_producer": ("prefetch", KEEPS_UP),
    "copy_in_after_compute": ("prefetched over a lagging reader", KEEPS_UP),
    "copy_in_after_copy_out": ("side streams", FAR_BEHIND),
    "reader_after_copy_in": ("prefetch", FAR_BEHIND),
    "producer_after_copy_out": ("no pipeline, window 1", FAR_BEHIND),
    # shows only because a launch or a handout lands just what its memory
    # depends on: landing all the work queued on their stream, waits
    # included, ran the copy out at the region's next kernel, and the
    # branch's reuse came too late
    "source_on_producer": ("inputs from a branch", FAR_BEHIND),
    "source_on_copy_out": ("side streams", FAR_BEHIND),
    "fetched_on_copy_in": ("prefetched and never read", FAR_BEHIND),
    "fetched_on_reader": ("read on another stream", KEEPS_UP),
    "beaten_after_copy_in": ("prefetch beaten", FAR_BEHIND),
    # shows only since a wait waits for the record it captured: the engine
    # re-records one ordering event on several streams, and the simulated
    # GPU took a later record that ran for an earlier one still queued
    "copy_in_after_copy_in": ("copied back twice", FAR_BEHIND),
    # the one site shown by a fault rather than data (the D2H's bytes
    # are never read): memory unmapped under a queued copy
    "kept_on_copy_out": ("in place under expandable segments", FAR_BEHIND),
}

# Sites taken out of the engine as redundant, with the reason (none yet).
REMOVED: Dict[str, str] = {}


def run_case(case: str, adversary: str, drop: Optional[str]) -> Tuple[bool, Dict[str, int]]:
    """Runs CASES[case] under `adversary` with the calls at site `drop`
    (None: none) dropped: whether its data came out right, and each site's
    calls."""
    return run_check(CASES[case], adversary, drop)


def run_check(prepare: Callable[[], Callable[[], bool]], adversary: str, drop: Optional[str]
              ) -> Tuple[bool, Dict[str, int]]:
    """run_case for a case not in CASES."""
    check = prepare()
    faults = _C._sim_stats()["unmap_faults"]
    _C._sim_set_progress(ADVERSARIES[adversary])
    _C._sim_drop_site(drop)
    try:
        with sim.unmap_faults_judged():
            right = check()
        counts = _C._sim_site_counts()
    finally:
        _C._sim_drop_site(None)
        _C._sim_set_progress(0)
    # a fault is wrong as wrong data is: on a GPU, an illegal address
    return right and _C._sim_stats()["unmap_faults"] == faults, counts


def test_every_site_is_proven_or_named() -> None:
    """The sites come from the engine's table: each one has a proof; none
    removed as redundant is still there."""
    sim.require_test_build()
    assert SITES, "the test build exports no call site"
    assert set(PROOFS) == set(SITES), (
        f"sites without a proof: {sorted(set(SITES) - set(PROOFS))}; "
        f"proofs of no site: {sorted(set(PROOFS) - set(SITES))}")
    assert not set(REMOVED) & set(SITES), "a site listed as removed is still in the engine"
    assert all(case in CASES and adversary in ADVERSARIES for case, adversary in PROOFS.values())


def test_the_engine_orders_streams_only_through_its_sites() -> None:
    """A wait or record made around the site table would escape this check:
    in csrc/offload, only the runtime seam calls cudaStreamWaitEvent, and
    every record_stream names a site."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "csrc", "offload")
    seam = {"offload_runtime_torch.c"}
    for name in sorted(os.listdir(root)):
        if not name.endswith(".c"):
            continue
        with open(os.path.join(root, name), encoding="utf-8") as source:
            text = source.read()
        if name not in seam:
            assert "rt->stream_wait_event(" not in text, f"{name}: a wait without its site"
        for call in re.findall(r"->record_stream\(st,\s*([A-Za-z_]+)", text):
            assert call.startswith("OFFLOAD_SITE_"), f"{name}: a record_stream without its site"


@pytest.mark.parametrize("site", sorted(PROOFS))
def test_each_site_is_needed_by_data(simulated, site: str) -> None:
    """The site's proof: its case is exact and issues the site (the
    premise), and is not once the site's calls are dropped."""
    case, adversary = PROOFS[site]
    right, counts = run_case(case, adversary, None)
    assert right, f"{case}, {adversary}: not exact with every wait and record"
    assert counts[site] > 0, f"{case}, {adversary}: the engine never reached {site}"
    right, counts = run_case(case, adversary, site)
    assert counts[site] > 0
    assert not right, f"dropping {site} in {case}, {adversary} changed no data"


@pytest.mark.parametrize("adversary", sorted(ADVERSARIES))
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_is_exact(simulated, name: str, adversary: str) -> None:
    """Each training scenario, with every wait and record, is exact under
    both adversaries and orders streams at all."""
    right, counts = run_case(name, adversary, None)
    assert right
    assert sum(counts.values()) > 0


@pytest.mark.parametrize("site", sorted(PROOFS))
def test_no_proof_rests_on_another_site(simulated, site: str) -> None:
    """A site's proof holds with another site's calls gone as well (as if
    deleted from the engine): it shows that site's own effect, not a
    layout or an order the other site made. Only the sites the proof's case
    issues can change it; one the case cannot do without (gone, the case
    is not exact) is passed over: its own proof fails then."""
    case, adversary = PROOFS[site]
    right, counts = run_case(case, adversary, None)
    assert right, f"{case}, {adversary}: not exact with every wait and record"
    others = sorted(name for name, count in counts.items() if count and name != site)
    for other in others:
        if not run_case(case, adversary, other)[0]:
            continue
        right, counts = run_case(case, adversary, [other, site])
        assert not right, (f"with {other} dropped, dropping {site} in {case}, {adversary} "
                           f"changed no data ({site} issued {counts[site]} times)")
