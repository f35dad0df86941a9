/* The planner's cost model (plan_evaluate), and the searches built on the
 * solver (solver.c): the smallest budget and the time-vs-memory frontier. */
#include "planner.h"

#include "model.h"

#include <math.h>
#include <stdlib.h>

/* The saving policy a choice runs under, or NULL for keep, recompute and
 * offload. */
static const plan_policy *
policy_of(const plan_block *b, int choice)
{
    return plan_block_policy(b, plan_choice_table[choice].policy);
}

/* Whether a policy's saved outputs go to the host with its input. */
static int
offloads_saved(int choice)
{
    return plan_choice_table[choice].offloads && plan_choice_table[choice].policy >= 0;
}

uint64_t
plan_held_units(const plan_block *b, int choice)
{
    if (choice == PLAN_KEEP)
        return b->activation_units;
    if (choice == PLAN_RECOMPUTE)
        return b->input_units;
    if (choice == PLAN_OFFLOAD)
        return b->offload_held_units;
    if (offloads_saved(choice))
        return policy_of(b, choice)->offload_held_units;
    return policy_of(b, choice)->units;
}

uint64_t
plan_work_units(const plan_block *b, int choice)
{
    return choice == PLAN_KEEP ? b->keep_work_units : b->checkpoint_work_units;
}

/* An offloaded input comes back ahead of time only when the block after
 * it offloaded too: that block's recompute starts the copy (planned
 * blocks let nothing else prefetch). */
static int
prefetched(int previous_choice, int choice, int pipeline)
{
    return pipeline && previous_choice == PLAN_OFFLOAD && choice == PLAN_OFFLOAD;
}

/* What comes back of a prefetched input: the part that left the device. */
uint64_t
plan_prefetch_units(const plan_block *previous, int previous_choice, int choice, int pipeline)
{
    if (previous == NULL || !prefetched(previous_choice, choice, pipeline) ||
        previous->offload_held_units >= previous->input_units)
        return 0;
    return previous->input_units - previous->offload_held_units;
}

static double
positive(double value)
{
    return value > 0 ? value : 0;
}

/* Compute time of a block plus its exposed copy out (and, for the
 * offloaded policies, their copy back, which nothing hides). */
double
plan_own_time(const plan_block *b, int choice)
{
    if (choice == PLAN_KEEP)
        return b->forward_s + b->backward_s;
    const plan_policy *policy = policy_of(b, choice);
    if (policy != NULL && offloads_saved(choice))
        return policy->time_s + positive(policy->copy_s - b->forward_s) + policy->copy_s;
    if (policy != NULL)
        return policy->time_s;
    double time = b->recompute_s;
    return choice == PLAN_OFFLOAD ? time + positive(b->copy_s - b->forward_s) : time;
}

/* Exposed copy back of an offloaded block, given the next block's choice
 * (next == NULL: it is the last block, backward starts with it). */
double
plan_copy_back_time(const plan_block *b, const plan_block *next, int next_choice, int pipeline)
{
    if (next == NULL || !prefetched(PLAN_OFFLOAD, next_choice, pipeline))
        return b->copy_s;
    return positive(b->copy_s - (next->forward_s + next->backward_s));
}

/* Block i's share of a plan: its time, copies it leaves exposed included,
 * and the peak while it runs over `held` units kept by the blocks before. */
static plan_cost
block_cost(const plan_block *blocks, int n, const uint8_t *choices, int i, int pipeline,
           uint64_t held)
{
    const plan_block *previous = i > 0 ? &blocks[i - 1] : NULL;
    plan_cost cost;
    cost.peak_units = held + plan_work_units(&blocks[i], choices[i]) +
                      plan_prefetch_units(previous, i > 0 ? choices[i - 1] : -1, choices[i],
                                          pipeline);
    cost.time_s = plan_own_time(&blocks[i], choices[i]);
    if (choices[i] == PLAN_OFFLOAD)
        cost.time_s += plan_copy_back_time(&blocks[i], i + 1 < n ? &blocks[i + 1] : NULL,
                                           i + 1 < n ? choices[i + 1] : -1, pipeline);
    return cost;
}

void
plan_evaluate_blocks(const plan_block *blocks, int n, const uint8_t *choices, int pipeline,
                     plan_cost *per_block)
{
    uint64_t held = 0;
    for (int i = 0; i < n; i++) {
        per_block[i] = block_cost(blocks, n, choices, i, pipeline, held);
        held += plan_held_units(&blocks[i], choices[i]);
    }
}

plan_cost
plan_evaluate(const plan_block *blocks, int n, const uint8_t *choices, int pipeline)
{
    plan_cost cost = {0, 0};
    uint64_t held = 0;
    for (int i = 0; i < n; i++) {
        plan_cost own = block_cost(blocks, n, choices, i, pipeline, held);
        cost.peak_units = own.peak_units > cost.peak_units ? own.peak_units : cost.peak_units;
        cost.time_s += own.time_s;
        held += plan_held_units(&blocks[i], choices[i]);
    }
    return cost;
}

/* The least time a block can take, in any memory. */
double
plan_least_time(const plan_block *b)
{
    double least = INFINITY;
    for (int c = 0; c < PLAN_CHOICES; c++)
        least = plan_own_time(b, c) < least ? plan_own_time(b, c) : least;
    return least;
}

/* Enough for any plan: everything kept at once, plus a prefetch. */
static uint64_t
plan_max_budget(const plan_block *blocks, int n)
{
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        total += blocks[i].input_units * 2 + blocks[i].activation_units +
                 blocks[i].keep_work_units + blocks[i].checkpoint_work_units;
        for (int p = 0; p < PLAN_POLICIES; p++)
            total += blocks[i].policies[p].units;
    }
    return total;
}

int
plan_min_budget(const plan_block *blocks, int n, int pipeline, uint64_t *budget)
{
    /* keeping nothing is not always smallest (prefetch needs room), so search */
    uint8_t *choices = malloc((size_t)(n > 0 ? n : 1));
    uint64_t low = 0, high = plan_max_budget(blocks, n);
    plan_cost cost;
    if (choices == NULL)
        return -1;
    while (low < high) {
        uint64_t mid = low + (high - low) / 2;
        int status = plan_solve(blocks, n, mid, pipeline, choices, &cost);
        if (status < 0) {
            free(choices);
            return -1;
        }
        if (status == 0)
            high = mid;
        else
            low = mid + 1;
    }
    free(choices);
    *budget = high;
    return 0;
}

/* The least budget every plan fits in: the most any choices can hold
 * before a block, plus its larger work and the most a prefetch brings.
 * Any budget from there up gives the same tables, so the same plan. */
static uint64_t
every_plan_fits(const plan_block *blocks, int n)
{
    uint64_t held = 0, top = 0;
    for (int i = 0; i < n; i++) {
        const plan_block *b = &blocks[i];
        uint64_t work = b->keep_work_units > b->checkpoint_work_units ? b->keep_work_units
                                                                      : b->checkpoint_work_units;
        uint64_t peak = held + work + (i > 0 ? blocks[i - 1].input_units : 0), most = 0;
        top = peak > top ? peak : top;
        for (int c = 0; c < PLAN_CHOICES; c++)
            most = plan_held_units(b, c) > most ? plan_held_units(b, c) : most;
        held += most;
    }
    return held > top ? held : top;
}

/* The fastest plan within `budget`, knowing it takes at least `least`
 * seconds: first pruned to plans within a little more (`gap`, growing
 * fourfold while none is found), unpruned once the gap passes `least`. */
static int
solve_from(const plan_block *blocks, int n, uint64_t budget, int pipeline, double least,
           double gap, uint8_t *choices, plan_cost *cost)
{
    for (; gap > 0 && gap <= least; gap *= 4) {
        int status = plan_solve_within(blocks, n, budget, pipeline, least + gap, choices, cost);
        if (status <= 0)
            return status;
    }
    return plan_solve(blocks, n, budget, pipeline, choices, cost);
}

int
plan_frontier(const plan_block *blocks, int n, int pipeline, int max_points,
              plan_cost *points)
{
    uint8_t *choices = malloc((size_t)(n > 0 ? n : 1));
    uint64_t budget = every_plan_fits(blocks, n);
    /* the fastest plan takes at least each block's fastest choice */
    double least = 0, gap = 0;
    int count = 0;
    if (choices == NULL)
        return -1;
    for (int i = 0; i < n; i++)
        least += plan_least_time(&blocks[i]);
    gap = least * 1e-6;
    while (count < max_points) {
        plan_cost cost;
        /* each point is slower than the last: look a little above it first */
        int status = solve_from(blocks, n, budget, pipeline, least, gap, choices, &cost);
        if (status < 0) {
            free(choices);
            return -1;
        }
        if (status == 1)
            break;
        double step = count > 0 ? cost.time_s - points[count - 1].time_s : 0;
        /* a plan as fast as the last one (to rounding) but smaller replaces it */
        if (count > 0 && cost.time_s <= points[count - 1].time_s * (1 + 1e-12))
            count--;
        points[count++] = cost;
        if (cost.peak_units == 0)
            break;
        budget = cost.peak_units - 1;
        least = cost.time_s;
        /* the next point is likely about as far again (a tie: 0, or one ahead) */
        gap = 2 * step > least * 1e-4 ? 2 * step : least * 1e-4;
    }
    free(choices);
    return count;
}
