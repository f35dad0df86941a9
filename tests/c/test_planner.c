/* Planner unit tests: the dynamic program against brute force over every
 * plan of short random chains, the smallest budget, the frontier's order
 * and its points against full solves, the bounded solve's plans, and
 * refusal of budgets too large for memory. */
#include "check.h"
#include "planner/model.h"
#include "planner/planner.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;

static uint64_t
rng_next(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static double
rng_unit(void)
{
    return (double)(rng_next() >> 11) / (double)(1ULL << 53);
}

/* Of `units`, what an offload leaves on the device (tensors too small to
 * move): in half the chains nothing, else anything up to all of it. */
static uint64_t
random_stay(uint64_t units, int stays)
{
    return stays ? rng_next() % (units + 1) : 0;
}

static plan_policy
random_policy(double forward_s, double backward_s, double copy_s, uint64_t in, uint64_t units,
              int stays)
{
    return (plan_policy){
        .time_s = forward_s + backward_s + forward_s * rng_unit(),
        .units = units,
        .copy_s = in > 0 ? copy_s * (double)units / (double)in : rng_unit(),
        .offload_held_units = random_stay(units, stays),
    };
}

static void
random_chain(plan_block *blocks, int n)
{
    int stays = (int)(rng_next() % 2);
    for (int i = 0; i < n; i++) {
        uint64_t in = rng_next() % 7, act = rng_next() % 13;
        uint64_t selective = in + (act > 0 ? rng_next() % act : 0);
        uint64_t attention = in + (selective > in ? rng_next() % (selective - in) : 0);
        double forward_s = rng_unit(), backward_s = 2 * rng_unit(), copy_s = 3 * rng_unit();
        blocks[i] = (plan_block){
            .forward_s = forward_s, .backward_s = backward_s, .copy_s = copy_s,
            /* a second forward at most: the recompute may stop early */
            .recompute_s = forward_s * (1 + rng_unit()) + backward_s,
            .input_units = in, .activation_units = act,
            .keep_work_units = act + rng_next() % 7,
            .checkpoint_work_units = in + act + rng_next() % 7,
            /* between keep and recompute in both time and memory, as measured;
             * the copy's time grows with the bytes copied */
            .offload_held_units = random_stay(in, stays),
            .policies = {
                [PLAN_POLICY_SELECTIVE] = random_policy(forward_s, backward_s, copy_s, in,
                                                        selective, stays),
                [PLAN_POLICY_ATTENTION] = random_policy(forward_s, backward_s, copy_s, in,
                                                        attention, stays)},
        };
    }
}

/* The fastest plan's time within `budget` by trying all 7^n, or INFINITY;
 * *smallest receives the least peak of any plan. */
static double
brute_force(const plan_block *blocks, int n, uint64_t budget, int pipeline, uint64_t *smallest)
{
    uint8_t choices[16] = {0};
    double best = INFINITY;
    *smallest = UINT64_MAX;
    for (;;) {
        plan_cost cost = plan_evaluate(blocks, n, choices, pipeline);
        if (cost.peak_units < *smallest)
            *smallest = cost.peak_units;
        if (cost.peak_units <= budget && cost.time_s < best)
            best = cost.time_s;
        int i = 0;
        while (i < n && ++choices[i] == PLAN_CHOICES)
            choices[i++] = 0;
        if (i == n)
            return best;
    }
}

static void
test_against_brute_force(int n, int pipeline)
{
    plan_block blocks[16];
    uint8_t choices[16];
    plan_cost cost;
    random_chain(blocks, n);
    uint64_t smallest, found;
    brute_force(blocks, n, UINT64_MAX, pipeline, &smallest);
    CHECK(plan_min_budget(blocks, n, pipeline, &found) == 0 && found == smallest);
    if (smallest > 0)
        CHECK(plan_solve(blocks, n, smallest - 1, pipeline, choices, &cost) == 1);
    for (uint64_t budget = smallest; budget < smallest + 40; budget += 3) {
        double best = brute_force(blocks, n, budget, pipeline, &found);
        CHECK(plan_solve(blocks, n, budget, pipeline, choices, &cost) == 0);
        CHECK(cost.peak_units <= budget);
        CHECK(fabs(cost.time_s - best) <= 1e-9 * (1 + best));
    }
}

static void
test_frontier(void)
{
    plan_block blocks[8];
    plan_cost points[256];
    random_chain(blocks, 8);
    int count = plan_frontier(blocks, 8, 1, 256, points);
    CHECK(count > 0);
    for (int i = 1; i < count; i++) {
        CHECK(points[i].peak_units < points[i - 1].peak_units);
        CHECK(points[i].time_s > points[i - 1].time_s);
    }
    uint64_t smallest;
    CHECK(plan_min_budget(blocks, 8, 1, &smallest) == 0);
    CHECK(count == 256 || points[count - 1].peak_units == smallest);
    CHECK(plan_frontier(blocks, 8, 1, 1, points) == 1);
}

/* A bound at the best plan's time gives that plan, the same choices; a
 * bound just under it gives none; the plan a bound gives is never slower
 * than the bound. */
static void
test_bounded_solve_gives_the_same_plan(int n, int pipeline)
{
    plan_block blocks[16];
    uint8_t choices[16], bounded[16];
    plan_cost cost, bounded_cost;
    random_chain(blocks, n);
    uint64_t smallest;
    CHECK(plan_min_budget(blocks, n, pipeline, &smallest) == 0);
    for (uint64_t budget = smallest; budget < smallest + 30; budget += 4) {
        CHECK(plan_solve(blocks, n, budget, pipeline, choices, &cost) == 0);
        for (int k = 0; k < 3; k++) {
            double bound = k == 0 ? cost.time_s : cost.time_s * (1 + 0.3 * k);
            CHECK(plan_solve_within(blocks, n, budget, pipeline, bound, bounded,
                                    &bounded_cost) == 0);
            CHECK(memcmp(choices, bounded, (size_t)n) == 0);
            CHECK(bounded_cost.time_s == cost.time_s &&
                  bounded_cost.peak_units == cost.peak_units);
        }
        if (cost.time_s > 0)
            CHECK(plan_solve_within(blocks, n, budget, pipeline, cost.time_s * (1 - 1e-6),
                                    bounded, &bounded_cost) == 1);
    }
}

/* The frontier as it was first written: a full solve from a budget every
 * plan fits in, then from just under each point's peak. */
static int
frontier_by_full_solves(const plan_block *blocks, int n, int pipeline, int max_points,
                        plan_cost *points)
{
    uint8_t choices[16];
    uint64_t budget = 0;
    int count = 0;
    for (int i = 0; i < n; i++) {
        budget += blocks[i].input_units * 2 + blocks[i].activation_units +
                  blocks[i].keep_work_units + blocks[i].checkpoint_work_units;
        for (int p = 0; p < PLAN_POLICIES; p++)
            budget += blocks[i].policies[p].units;
    }
    while (count < max_points) {
        plan_cost cost;
        if (plan_solve(blocks, n, budget, pipeline, choices, &cost) != 0)
            break;
        if (count > 0 && cost.time_s <= points[count - 1].time_s * (1 + 1e-12))
            count--;
        points[count++] = cost;
        if (cost.peak_units == 0)
            break;
        budget = cost.peak_units - 1;
    }
    return count;
}

/* The frontier's pruned solves (each looks just above the last point's
 * time first) give the points full solves give, bit for bit. */
static void
test_frontier_matches_full_solves(int n, int pipeline)
{
    plan_block blocks[16];
    plan_cost points[512], expected[512];
    random_chain(blocks, n);
    for (int max_points = 1; max_points <= 512; max_points *= 8) {
        int count = plan_frontier(blocks, n, pipeline, max_points, points);
        CHECK(count == frontier_by_full_solves(blocks, n, pipeline, max_points, expected));
        for (int i = 0; i < count; i++)
            CHECK(points[i].time_s == expected[i].time_s &&
                  points[i].peak_units == expected[i].peak_units);
    }
}

/* Four alike blocks, forward 1 s, backward 2, selective 3.2; the times
 * of their copies (the input, the selective saves) as given; attention
 * not measured. */
static void
four_blocks(plan_block *blocks, double copy_s, double selective_copy_s)
{
    plan_block block = {.forward_s = 1, .backward_s = 2, .recompute_s = 4, .copy_s = copy_s,
                        .input_units = 1, .activation_units = 10, .keep_work_units = 10,
                        .checkpoint_work_units = 11,
                        .policies = {[PLAN_POLICY_SELECTIVE] = {.time_s = 3.2, .units = 4,
                                                                .copy_s = selective_copy_s},
                                     [PLAN_POLICY_ATTENTION] = {.time_s = 1e30, .units = 1,
                                                                .copy_s = 1e30}}};
    for (int i = 0; i < 4; i++)
        blocks[i] = block;
}

/* A chain where saving the expensive outputs is the best trade: selective
 * is chosen at a budget between all recomputed and all kept (the best plan
 * of keep and recompute alone, R R K K, takes 14 s). */
static void
test_selective_chosen(void)
{
    plan_block blocks[4];
    four_blocks(blocks, 1e30, 1e30);    /* offload costs too much to matter here */
    uint8_t choices[4];
    plan_cost cost;
    CHECK(plan_solve(blocks, 4, 3 * 4 + 11, 0, choices, &cost) == 0);
    /* the last block's activations fit over the others' saved outputs */
    for (int i = 0; i < 3; i++)
        CHECK(choices[i] == PLAN_SELECTIVE);
    CHECK(choices[3] == PLAN_KEEP);
    CHECK(fabs(cost.time_s - (3 * 3.2 + 3)) < 1e-12 && cost.peak_units == 22);
}

/* At a budget where a block's input at most can be held, offloading the
 * selective saves beats offloading whole blocks (O O O K takes 3 * 5 + 0.1
 * + 3 s), unless its copy costs more than the recompute it saves. */
static void
test_offload_selective_chosen(void)
{
    plan_block blocks[4];
    four_blocks(blocks, 0.1, 0.4);
    uint8_t choices[4];
    plan_cost cost;
    CHECK(plan_solve(blocks, 4, 12, 1, choices, &cost) == 0);
    for (int i = 0; i < 3; i++)
        CHECK(choices[i] == PLAN_OFFLOAD_SELECTIVE);
    CHECK(choices[3] == PLAN_KEEP);
    CHECK(fabs(cost.time_s - (3 * (3.2 + 0.4) + 3)) < 1e-12 && cost.peak_units == 11);
    for (int i = 0; i < 4; i++)
        blocks[i].policies[PLAN_POLICY_SELECTIVE].copy_s = 2.0;
    CHECK(plan_solve(blocks, 4, 12, 1, choices, &cost) == 0);
    for (int i = 0; i < 3; i++)
        CHECK(choices[i] == PLAN_OFFLOAD);
}

/* Where the budget holds little more than the inputs, saving only the
 * attention outputs (2 units a block, 3.5 s) beats recomputing whole
 * blocks (R R R K takes 15 s); where it holds none, offloading them beats
 * offloading the inputs alone (4 s a block) while their copy is cheap. */
static void
test_attention_chosen(void)
{
    plan_block blocks[4];
    four_blocks(blocks, 1e30, 1e30);
    for (int i = 0; i < 4; i++)
        blocks[i].policies[PLAN_POLICY_ATTENTION] =
            (plan_policy){.time_s = 3.5, .units = 2, .copy_s = 1e30};
    uint8_t choices[4];
    plan_cost cost;
    CHECK(plan_solve(blocks, 4, 16, 0, choices, &cost) == 0);
    for (int i = 0; i < 3; i++)
        CHECK(choices[i] == PLAN_ATTENTION);
    CHECK(choices[3] == PLAN_KEEP);
    CHECK(fabs(cost.time_s - (3 * 3.5 + 3)) < 1e-12 && cost.peak_units == 16);
    for (int i = 0; i < 4; i++) {
        blocks[i].copy_s = 0.1;
        blocks[i].policies[PLAN_POLICY_ATTENTION].copy_s = 0.2;
    }
    CHECK(plan_solve(blocks, 4, 11, 1, choices, &cost) == 0);
    for (int i = 0; i < 3; i++)
        CHECK(choices[i] == PLAN_OFFLOAD_ATTENTION);
    CHECK(fabs(cost.time_s - (3 * (3.5 + 0.2) + 3)) < 1e-12 && cost.peak_units == 11);
}

static void
test_edges(void)
{
    plan_block blocks[2] = {{.forward_s = 1, .backward_s = 1, .recompute_s = 3, .input_units = 1,
                             .activation_units = 1, .keep_work_units = 2,
                             .checkpoint_work_units = 3,
                             .policies = {[PLAN_POLICY_SELECTIVE] = {.time_s = 3, .units = 1},
                                          [PLAN_POLICY_ATTENTION] = {.time_s = 3, .units = 1}}}};
    blocks[1] = blocks[0];
    uint8_t choices[2];
    plan_cost cost;
    CHECK(plan_solve(blocks, 0, 0, 1, choices, &cost) == 0 && cost.peak_units == 0);
    /* tables far beyond memory are refused, not attempted */
    CHECK(plan_solve(blocks, 2, UINT64_MAX / 4, 1, choices, &cost) == -1);
    CHECK(plan_solve(blocks, 2, 1000, 1, choices, &cost) == 0);
    CHECK(choices[0] == PLAN_KEEP && choices[1] == PLAN_KEEP && cost.peak_units == 3);
}

/* Two offloaded blocks, backward pipelined: while the second runs, the
 * first holds the part of its input too small to move, and its prefetch
 * brings back only the rest (the brute force above checks the solver
 * against plan_evaluate, so the model itself is checked by hand here). */
static void
test_offload_held(void)
{
    plan_block blocks[2] = {{.forward_s = 1, .backward_s = 2, .recompute_s = 4, .copy_s = 0.5,
                             .input_units = 4, .activation_units = 20, .keep_work_units = 20,
                             .checkpoint_work_units = 10, .offload_held_units = 1,
                             .policies = {[PLAN_POLICY_SELECTIVE] = {.time_s = 9, .units = 20},
                                          [PLAN_POLICY_ATTENTION] = {.time_s = 9, .units = 20}}}};
    blocks[1] = blocks[0];
    uint8_t offloaded[2] = {PLAN_OFFLOAD, PLAN_OFFLOAD};
    /* block 1: 1 unit held by block 0, its own work 10, block 0's 3 moved units */
    CHECK(plan_evaluate(blocks, 2, offloaded, 1).peak_units == 14);
    /* unpipelined, nothing comes back early: the held unit and the work */
    CHECK(plan_evaluate(blocks, 2, offloaded, 0).peak_units == 11);
}

int
main(void)
{
    /* 7^6 plans a budget: six-block chains fewer times */
    for (int round = 0; round < 40; round++) {
        for (int n = 1; n <= (round < 4 ? 6 : 5); n++) {
            test_against_brute_force(n, 1);
            test_against_brute_force(n, 0);
        }
    }
    for (int round = 0; round < 20; round++) {
        test_bounded_solve_gives_the_same_plan(1 + round % 12, round % 2);
        test_frontier_matches_full_solves(1 + round % 16, round % 3 != 0);
    }
    test_frontier();
    test_selective_chosen();
    test_offload_selective_chosen();
    test_attention_chosen();
    test_edges();
    test_offload_held();
    return check_report("test_planner");
}
