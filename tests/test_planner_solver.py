"""The planner's C dynamic program against brute force over every plan."""
import itertools
import random

import pytest

from matepoint import _C

# the one table of choices, read from C (csrc/planner/choices.c)
NAMES = [choice["name"] for choice in _C.PLAN_CHOICES]
KEEP, RECOMPUTE, OFFLOAD, SELECTIVE, OFFLOAD_SELECTIVE, ATTENTION, OFFLOAD_ATTENTION = (
    NAMES.index(name) for name in ("keep", "recompute", "offload", "selective",
                                   "offload+selective", "attention", "offload+attention"))
CHOICES = len(_C.PLAN_CHOICES)
UNMEASURED_S = _C.PLAN_UNMEASURED_S


def model_cost(blocks, choices, pipeline):
    """The cost model of csrc/planner/planner.h, written out plainly."""
    time, peak, held = 0.0, 0, 0
    for i, b in enumerate(blocks):
        c = choices[i]
        info = _C.PLAN_CHOICES[c]
        policy = b[info["policy"]] if info["policy"] else None
        work = b["keep_work_units"] if c == KEEP else b["checkpoint_work_units"]
        prefetch_from_next = pipeline and i > 0 and choices[i - 1] == OFFLOAD and c == OFFLOAD
        previous = blocks[i - 1]
        # what comes back of the previous input is what left the device
        prefetch = previous["input_units"] - previous["offload_held_units"] \
            if prefetch_from_next else 0
        peak = max(peak, held + work + prefetch)
        time += b["forward_s"] + b["backward_s"] if c == KEEP else \
            policy["time_s"] if policy else b["recompute_s"]
        if policy and info["offloads"]:   # out behind its forward, back with nothing to hide it
            time += max(0.0, policy["copy_s"] - b["forward_s"]) + policy["copy_s"]
        if c == OFFLOAD:
            copy = b["copy_s"]
            time += max(0.0, copy - b["forward_s"])
            if not pipeline or i == len(blocks) - 1 or choices[i + 1] != OFFLOAD:
                time += copy  # fetched when needed
            else:  # the next block's recompute and backward hide it
                time += max(0.0, copy - blocks[i + 1]["forward_s"] - blocks[i + 1]["backward_s"])
        held += b["activation_units"] if c == KEEP else b["input_units"] if c == RECOMPUTE \
            else b["offload_held_units"] if c == OFFLOAD \
            else policy["offload_held_units"] if info["offloads"] else policy["units"]
    return time, peak


def record(fwd, bwd, copy, inp, act, keep_work, checkpoint_work, recompute_s=None,
           selective=None, attention=None, stays=(0, 0, 0)):
    """One block record; a policy left out is unmeasured (never chosen,
    holding what recompute holds), recompute_s left out is 2f+b."""
    def policy(figures, stay):
        if figures is None:
            return {"time_s": UNMEASURED_S, "units": inp, "copy_s": UNMEASURED_S,
                    "offload_held_units": 0}
        time_s, units, copy_s = figures
        return {"time_s": time_s, "units": units, "copy_s": copy_s, "offload_held_units": stay}
    return {"forward_s": fwd, "backward_s": bwd,
            "recompute_s": 2 * fwd + bwd if recompute_s is None else recompute_s,
            "copy_s": copy, "input_units": inp, "activation_units": act,
            "offload_held_units": stays[0], "keep_work_units": keep_work,
            "checkpoint_work_units": checkpoint_work,
            "selective": policy(selective, stays[1]), "attention": policy(attention, stays[2])}


def random_chain(rng, length):
    chain = []
    for _ in range(length):
        inp, act = rng.randint(0, 6), rng.randint(0, 12)
        fwd, bwd, copy = rng.uniform(0, 1), rng.uniform(0, 2), rng.uniform(0, 3)
        sel = inp + rng.randint(0, act)
        att = inp + rng.randint(0, sel - inp)

        def policy(held):
            """selective or attention: between keep and recompute in time and
            memory, as measured; its copy grows with the bytes copied"""
            return (fwd + bwd + rng.uniform(0, fwd), held,
                    copy * held / inp if inp else rng.uniform(0, 3))
        base = (fwd, bwd, copy, inp, act, act + rng.randint(0, 6), inp + act + rng.randint(0, 6))
        selective = policy(sel)
        # the recompute may stop early; one block in four leaves its time to
        # the default, 2f+b, one in four its attention unmeasured, and one in
        # four says what offloads leave on the device (tensors too small to
        # move: none to all)
        recompute = fwd * (1 + rng.uniform(0, 1)) + bwd
        stays = (rng.randint(0, inp), rng.randint(0, sel), rng.randint(0, att))
        kind = rng.randrange(4)
        chain.append(record(*base, recompute_s=recompute if kind else None, selective=selective,
                            attention=policy(att) if kind > 1 else None,
                            stays=stays if kind == 3 else (0, 0, 0)))
    return chain


def all_plans(blocks, pipeline):
    for choices in itertools.product(range(CHOICES), repeat=len(blocks)):
        yield choices, model_cost(blocks, choices, pipeline)


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 6])
def test_solver_matches_brute_force(length: int, pipeline: bool) -> None:
    rng = random.Random(length * 2 + pipeline)
    for _ in range(6 if length < 6 else 1):
        blocks = random_chain(rng, length)
        plans = list(all_plans(blocks, pipeline))
        smallest = min(peak for _, (_, peak) in plans)
        assert _C._plan_min_budget(blocks, pipeline) == smallest
        assert _C._plan_solve(blocks, smallest - 1, pipeline) is None if smallest else True
        largest = max(peak for _, (_, peak) in plans)
        for budget in sorted({smallest, (smallest + largest) // 2, largest, rng.randint(smallest, largest)}):
            choices, time, peak = _C._plan_solve(blocks, budget, pipeline)
            fastest = min(t for _, (t, p) in plans if p <= budget)
            assert time == pytest.approx(fastest, rel=1e-9, abs=1e-12)
            assert (time, peak) == pytest.approx(model_cost(blocks, list(choices), pipeline))
            assert peak <= budget


@pytest.mark.parametrize("pipeline", [True, False])
def test_frontier_is_the_pareto_set(pipeline: bool) -> None:
    rng = random.Random(7 + pipeline)
    for length in (1, 4, 5, 6):
        blocks = random_chain(rng, length)
        points = sorted({(p, t) for _, (t, p) in all_plans(blocks, pipeline)})
        pareto, best = [], float("inf")
        for peak, time in points:   # rising peak: keep those faster than all smaller ones
            if time < best * (1 - 1e-12):
                pareto.append((peak, time))
                best = time
        frontier = _C._plan_frontier(blocks, pipeline, 10_000)
        got = sorted((peak, time) for time, peak in frontier)
        assert [p for p, _ in got] == [p for p, _ in pareto]
        assert [t for _, t in got] == pytest.approx([t for _, t in pareto], rel=1e-9)


def test_evaluate_matches_the_written_out_model() -> None:
    rng = random.Random(3)
    for _ in range(200):
        blocks = random_chain(rng, rng.randint(1, 12))
        choices = [rng.randrange(CHOICES) for _ in blocks]
        pipeline = rng.random() < 0.5
        got = _C._plan_evaluate(blocks, bytes(choices), pipeline)
        assert got == pytest.approx(model_cost(blocks, choices, pipeline))


def test_bad_blocks_are_refused() -> None:
    good = record(1.0, 1.0, 1.0, 2, 1, 2, 3, 3.0, (2.0, 3, 1.0), (1.0, 2, 1.0))
    assert _C._plan_solve([good], 10, True) is not None

    def changed(**fields):
        block = {**good, "selective": dict(good["selective"]),
                 "attention": dict(good["attention"])}
        for key, value in fields.items():
            policy, _, name = key.partition("__")
            if name:
                block[policy][name] = value
            else:
                block[key] = value
        return block

    with pytest.raises(TypeError, match="block 1: block must be a dict, got tuple"):
        _C._plan_solve([good, (1.0, 1.0)], 10, True)
    with pytest.raises(TypeError, match="block 0: block must have exactly the keys"):
        _C._plan_solve([{**good, "extra": 1}], 10, True)
    missing = dict(good)
    del missing["copy_s"]
    missing["typo_s"] = 1.0
    with pytest.raises(TypeError, match="block 0: block has no copy_s"):
        _C._plan_solve([missing], 10, True)
    with pytest.raises(TypeError, match="block 0: attention must be a dict"):
        _C._plan_solve([changed(attention=None)], 10, True)
    with pytest.raises(TypeError, match="block 0: selective must have exactly the keys"):
        _C._plan_solve([{**good, "selective": {**good["selective"], "x": 1}}], 10, True)
    for key in ("input_units", "selective__units", "attention__offload_held_units"):
        with pytest.raises(ValueError, match="block 0: .* must be an int from 0"):
            _C._plan_solve([changed(**{key: -1})], 10, True)
        with pytest.raises(OverflowError, match="larger unit"):
            _C._plan_solve([changed(**{key: 1 << 50})], 10, True)
        with pytest.raises(ValueError, match="must be an int"):
            _C._plan_solve([changed(**{key: 1.0})], 10, True)
    for key in ("forward_s", "recompute_s", "selective__time_s", "attention__copy_s"):
        for bad in (float("nan"), -2.0):
            with pytest.raises(ValueError, match=f"block 0: .*{key.rpartition('_')[2]} must "
                                                 f"be a number >= 0"):
                _C._plan_solve([changed(**{key: bad})], 10, True)
        with pytest.raises(ValueError, match="must be finite"):
            _C._plan_solve([changed(**{key: float("inf")})], 10, True)
        with pytest.raises(TypeError):
            _C._plan_solve([changed(**{key: "1"})], 10, True)
    with pytest.raises(ValueError, match="block 0: times too large, they and their sum"):
        _C._plan_solve([changed(forward_s=1e308, backward_s=1e308)], 10, True)
    for key, name in (("offload_held_units", "offload_held_units above input_units"),
                      ("selective__offload_held_units",
                       "selective's offload_held_units above its units"),
                      ("attention__offload_held_units",
                       "attention's offload_held_units above its units")):
        with pytest.raises(ValueError, match=f"block 0: {name}"):
            _C._plan_solve([changed(**{key: 4})], 10, True)
    with pytest.raises(ValueError, match="3 choices for 1 blocks"):
        _C._plan_evaluate([good], bytes(3), True)
    with pytest.raises(ValueError, match=f"choice {CHOICES} .* not 0 to {CHOICES - 1}"):
        _C._plan_evaluate([good], bytes([CHOICES]), True)
    with pytest.raises(MemoryError, match="larger unit"):
        _C._plan_solve([good] * 4, 1 << 62, True)


def test_choice_table_is_the_one_python_reads() -> None:
    """C's table names every choice once, says what each saves, and the
    planner's Python reads it (no copy of its own)."""
    from matepoint._planning import (block_profile as _block_profile, choices as _choices,
                                     plan_record as _plan_record)
    assert _choices.CHOICES == tuple(NAMES) and len(set(NAMES)) == CHOICES
    assert all(choice["saves"] and isinstance(choice["offloads"], bool)
               and choice["policy"] in (None, *_C.PLAN_POLICIES) for choice in _C.PLAN_CHOICES)
    assert [i for i, c in enumerate(_C.PLAN_CHOICES) if c["offloads"]] == \
        sorted(_choices._OFFLOADING)
    assert _block_profile._UNMEASURED_S == UNMEASURED_S
    assert set(_choices._CONTEXTS) == {c["name"] for c in _C.PLAN_CHOICES if c["policy"]}
    # plan-1 files named each policy's figures: only policies C still has
    assert set(_plan_record._PLAN_1_POLICY_FIELDS) <= set(_C.PLAN_POLICIES)
    profile = _block_profile.BlockProfile(1, 1, 1, 1, 1, 1, 1, 1)
    record_keys = set(_block_profile._records([profile], 1)[0])
    assert record_keys == set(_C.PLAN_BLOCK_FIELDS) | set(_C.PLAN_POLICIES)


def test_empty_chain() -> None:
    assert _C._plan_solve([], 0, True) == (b"", 0.0, 0)
    assert _C._plan_min_budget([], True) == 0


def test_table_rows_add_up_to_the_header_copy_time_included() -> None:
    from matepoint._planning.planner import BlockProfile, solve
    mib = 1 << 20
    # copy-bound: each copy (4 ms) is far longer than the compute hiding it
    profiles = [BlockProfile(1e-3, 2e-3, 4e-3, 8 * mib, 32 * mib, 8 * mib, 32 * mib, 16 * mib)
                for _ in range(5)]
    plan = solve(profiles, 72 * mib, mib, True)
    assert plan.choices.count("offload") >= 2, plan.choices
    rows = plan.rows()
    assert sum(seconds for seconds, _ in rows) == pytest.approx(plan.predicted_time_s, rel=1e-12)
    assert max(peak for _, peak in rows) == plan.predicted_peak_bytes
    table = plan.table().splitlines()
    assert f"step {plan.predicted_time_s * 1e3:.2f} ms" in table[0]
    printed = [float(line.split()[-1]) for line in table[2:]]
    assert sum(printed) == pytest.approx(plan.predicted_time_s * 1e3, abs=0.01)
    # an offloaded block's row carries its exposed copies, beyond its compute
    offloaded = [seconds for (seconds, _), c in zip(rows, plan.choices) if c == "offload"]
    assert all(seconds > 2 * 1e-3 + 2e-3 for seconds in offloaded)
