"""The planner's C dynamic program against brute force over every plan."""
import itertools
import random

import pytest

from matepoint import _C

KEEP, RECOMPUTE, OFFLOAD, SELECTIVE, OFFLOAD_SELECTIVE, ATTENTION, OFFLOAD_ATTENTION = range(7)
CHOICES = 7
UNMEASURED_S = 1e30


def model_cost(blocks, choices, pipeline):
    """The cost model of csrc/planner/planner.h, written out plainly."""
    time, peak, held = 0.0, 0, 0
    for i, block in enumerate(blocks):
        fwd, bwd, copy, inp, act, keep_work, checkpoint_work, sel_s, sel, sel_copy = block[:10]
        recompute_s = block[10] if len(block) > 10 else 2 * fwd + bwd
        # attention: not measured in shorter tuples
        att_s, att, att_copy = block[11:14] if len(block) > 11 else (UNMEASURED_S, inp,
                                                                      UNMEASURED_S)
        # what each offloading choice leaves on the device: nothing in shorter tuples
        stays = dict(zip((OFFLOAD, OFFLOAD_SELECTIVE, OFFLOAD_ATTENTION),
                         block[14:] if len(block) > 14 else (0, 0, 0)))
        c = choices[i]
        work = keep_work if c == KEEP else checkpoint_work
        prefetch_from_next = pipeline and i > 0 and choices[i - 1] == OFFLOAD and c == OFFLOAD
        previous = blocks[i - 1]
        # what comes back of the previous input is what left the device
        prefetch = previous[3] - (previous[14] if len(previous) > 14 else 0) \
            if prefetch_from_next else 0
        peak = max(peak, held + work + prefetch)
        time += fwd + bwd if c == KEEP else sel_s if c in (SELECTIVE, OFFLOAD_SELECTIVE) \
            else att_s if c in (ATTENTION, OFFLOAD_ATTENTION) else recompute_s
        if c == OFFLOAD_SELECTIVE:   # out behind its forward, back with nothing to hide it
            time += max(0.0, sel_copy - fwd) + sel_copy
        if c == OFFLOAD_ATTENTION:
            time += max(0.0, att_copy - fwd) + att_copy
        if c == OFFLOAD:
            time += max(0.0, copy - fwd)
            if not pipeline or i == len(blocks) - 1 or choices[i + 1] != OFFLOAD:
                time += copy  # fetched when needed
            else:  # the next block's recompute and backward hide it
                time += max(0.0, copy - blocks[i + 1][0] - blocks[i + 1][1])
        held += {KEEP: act, RECOMPUTE: inp, SELECTIVE: sel, ATTENTION: att, **stays}[c]
    return time, peak


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
        block = (fwd, bwd, copy, inp, act,
                 act + rng.randint(0, 6), inp + act + rng.randint(0, 6), *policy(sel))
        # the recompute may stop early; one block in four leaves its time to
        # the solver's default, 2f+b, one in four its attention unmeasured,
        # and one in four says what offloads leave on the device (tensors too
        # small to move: none to all)
        recompute = (fwd * (1 + rng.uniform(0, 1)) + bwd,)
        stays = (rng.randint(0, inp), rng.randint(0, sel), rng.randint(0, att))
        chain.append(rng.choice([block, block + recompute, block + recompute + policy(att),
                                 block + recompute + policy(att) + stays]))
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
    with pytest.raises(TypeError, match="block 1"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0), (1.0, 1.0)], 10, True)
    with pytest.raises(ValueError, match="block 0: .*non-negative"):
        _C._plan_solve([(1.0, 1.0, 1.0, -1, 1, 2, 3, 2.0, 1, 1.0)], 10, True)
    with pytest.raises(OverflowError, match="larger unit"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1 << 50, 1, 2, 3, 2.0, 1, 1.0)], 10, True)
    with pytest.raises(ValueError, match="non-negative"):
        _C._plan_solve([(float("nan"), 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0)], 10, True)
    with pytest.raises(ValueError, match="non-negative"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, -2.0, 1, 1.0)], 10, True)
    with pytest.raises(OverflowError, match="larger unit"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1 << 50, 1.0)], 10, True)
    with pytest.raises(ValueError, match="non-negative"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, -1.0)], 10, True)
    with pytest.raises(ValueError, match="non-negative"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0, -3.0)], 10, True)
    with pytest.raises(TypeError, match="block 0: attention_s, attention_units and "
                                        "attention_copy_s come together"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0, 3.0, 1.0)], 10, True)
    with pytest.raises(TypeError, match="block 0: attention_s, attention_units and "
                                        "attention_copy_s come together"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0, 3.0, 1.0, 1)], 10, True)
    with pytest.raises(ValueError, match="block 0: times too large, they and their sum"):
        _C._plan_solve([(1e308, 1e308, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0, 1.0)], 10, True)
    full = (1.0, 1.0, 1.0, 2, 1, 2, 3, 2.0, 3, 1.0, 3.0, 1.0, 2, 1.0)
    for part in (1, 2):
        with pytest.raises(TypeError, match="block 0: offload_held_units, "
                                            "selective_offload_held_units and "
                                            "attention_offload_held_units come together"):
            _C._plan_solve([full + (0,) * part], 10, True)
    with pytest.raises(TypeError, match="block 0: .*attention_offload_held_units\\]\\]\\]\\)"):
        _C._plan_solve([full + (0, 0, 0, 5)], 10, True)
    for stays, name in (((3, 0, 0), "offload_held_units above input_units"),
                        ((0, 4, 0), "selective_offload_held_units above selective_units"),
                        ((0, 0, 3), "attention_offload_held_units above attention_units")):
        with pytest.raises(ValueError, match=f"block 0: {name}"):
            _C._plan_solve([full + stays], 10, True)
    with pytest.raises(ValueError, match="non-negative"):
        _C._plan_solve([full + (-1, 0, 0)], 10, True)
    assert _C._plan_solve([full + (2, 3, 2)], 10, True) is not None
    with pytest.raises(ValueError, match="non-negative"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0, 3.0, 1.0, -1, 1.0)], 10, True)
    with pytest.raises(ValueError, match="must be finite"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0, 3.0, 1.0, 1, float("inf"))],
                       10, True)
    with pytest.raises(OverflowError, match="larger unit"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0, 3.0, 1.0, 1 << 50, 1.0)],
                       10, True)
    with pytest.raises(TypeError, match="selective_units, selective_copy_s"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1)], 10, True)
    with pytest.raises(ValueError, match="3 choices for 1 blocks"):
        _C._plan_evaluate([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0)], bytes(3), True)
    with pytest.raises(ValueError, match="choice 7 .* not 0 to 6"):
        _C._plan_evaluate([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0)], bytes([7]), True)
    with pytest.raises(MemoryError, match="larger unit"):
        _C._plan_solve([(1.0, 1.0, 1.0, 1, 1, 2, 3, 2.0, 1, 1.0)] * 4, 1 << 62, True)


def test_empty_chain() -> None:
    assert _C._plan_solve([], 0, True) == (b"", 0.0, 0)
    assert _C._plan_min_budget([], True) == 0


def test_table_rows_add_up_to_the_header_copy_time_included() -> None:
    from matepoint._planner import BlockProfile, solve
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
