/* The planner's cost model (plan_evaluate) and its exact solver: a dynamic
 * program whose tables are swept once per block, the hot loops kept to a
 * few linear passes over the memory axis. */
#include "planner.h"

#include <math.h>
#include <stdlib.h>

/* infinite, so adding a block's time to it needs no check */
#define UNREACHABLE INFINITY

/* The saving policy a choice runs under, or NULL for keep, recompute and
 * offload. */
static const plan_policy *
policy_of(const plan_block *b, int choice)
{
    switch (choice) {
    case PLAN_SELECTIVE:
    case PLAN_OFFLOAD_SELECTIVE:
        return &b->selective;
    case PLAN_ATTENTION:
    case PLAN_OFFLOAD_ATTENTION:
        return &b->attention;
    default:
        return NULL;
    }
}

/* Whether a policy's saved outputs go to the host with its input. */
static int
offloads_saved(int choice)
{
    return choice == PLAN_OFFLOAD_SELECTIVE || choice == PLAN_OFFLOAD_ATTENTION;
}

static uint64_t
held_units(const plan_block *b, int choice)
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

static uint64_t
work_units(const plan_block *b, int choice)
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
static uint64_t
prefetch_units(const plan_block *previous, int previous_choice, int choice, int pipeline)
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
static double
own_time(const plan_block *b, int choice)
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
static double
copy_back_time(const plan_block *b, const plan_block *next, int next_choice, int pipeline)
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
    cost.peak_units = held + work_units(&blocks[i], choices[i]) +
                      prefetch_units(previous, i > 0 ? choices[i - 1] : -1, choices[i], pipeline);
    cost.time_s = own_time(&blocks[i], choices[i]);
    if (choices[i] == PLAN_OFFLOAD)
        cost.time_s += copy_back_time(&blocks[i], i + 1 < n ? &blocks[i + 1] : NULL,
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
        held += held_units(&blocks[i], choices[i]);
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
        held += held_units(&blocks[i], choices[i]);
    }
    return cost;
}

/* The DP's state after block i: units held so far, and whether block i
 * offloaded (all the next block needs to know of it: every other choice,
 * the offloaded policies' copies back being their own, looks alike from
 * there). best[row * width + s] is the least time of blocks 0..i ending
 * in that state; parent[i] tells, per state, block i's choice and the
 * previous row, packed as choice | row << CHOICE_BITS. */
enum { ROW_STAYED = 0, ROW_OFFLOADED = 1, ROWS = 2 };
enum { CHOICE_BITS = 3, CHOICE_MASK = (1 << CHOICE_BITS) - 1 };
_Static_assert(PLAN_CHOICES <= CHOICE_MASK + 1, "a parent byte holds the choice");

typedef struct {
    uint64_t width;             /* budget + 1 */
    uint64_t reach;             /* no state above this many units is reachable yet */
    double *best, *next;        /* ROWS * width each */
    double *merged;             /* width: the better row to keep or recompute from */
    uint8_t *merged_row;        /* width: which row that was */
    uint8_t *parent;            /* n * ROWS * width */
} dp_tables;

static int
row_of(int choice)
{
    return choice == PLAN_OFFLOAD ? ROW_OFFLOADED : ROW_STAYED;
}

static int
dp_alloc(dp_tables *t, int n, uint64_t budget)
{
    t->width = budget + 1;
    if (budget >= UINT64_MAX / 2 || t->width > SIZE_MAX / ROWS / sizeof(double) / (size_t)n)
        return -1;
    size_t cells = (size_t)ROWS * t->width;
    t->best = malloc(cells * sizeof(double));
    t->next = malloc(cells * sizeof(double));
    t->merged = malloc(t->width * sizeof(double));
    t->merged_row = malloc(t->width);
    t->parent = malloc((size_t)n * cells);
    if (!t->best || !t->next || !t->merged || !t->merged_row || !t->parent)
        return -1;
    for (size_t i = 0; i < cells; i++)
        t->best[i] = UNREACHABLE;
    t->reach = 0;
    return 0;
}

static void
dp_free(dp_tables *t)
{
    free(t->best);
    free(t->next);
    free(t->merged);
    free(t->merged_row);
    free(t->parent);
}

/* The most units that may be held before block i so that choice c fits,
 * or -1 when it never does; never above what is reachable. */
static int64_t
held_limit(const plan_block *b, int c, uint64_t prefetch, uint64_t budget, uint64_t reach)
{
    uint64_t need = work_units(b, c) + prefetch;
    uint64_t held = held_units(b, c);
    if (need > budget || held > budget)
        return -1;
    uint64_t limit = budget - need < budget - held ? budget - need : budget - held;
    return (int64_t)(limit < reach ? limit : reach);
}

/* Any choice but offload for block i looks the same from either row, but for
 * the previous block's copy back, which nothing hides then: take the
 * better row per state once. */
static void
dp_merge_rows(dp_tables *t, double copy_back)
{
    const double *stayed = t->best, *offloaded = t->best + t->width;
    for (uint64_t s = 0; s <= t->reach; s++) {
        double via_offload = offloaded[s] + copy_back;
        int take = via_offload < stayed[s];
        t->merged[s] = take ? via_offload : stayed[s];
        t->merged_row[s] = (uint8_t)take;
    }
}

/* Row ROW_STAYED of the next step: keep (shifted by its activations),
 * recompute (shifted by its input), selective and attention (shifted by
 * their input and saved outputs) and their offloaded forms (shifted by what
 * of those is too small to move) from the merged row. The hot loops. */
static void
dp_fill_stayed(dp_tables *t, uint8_t *parent, const plan_block *b, uint64_t budget,
               uint64_t reach)
{
    double *to = t->next;
    for (uint64_t s = 0; s <= reach; s++)
        to[s] = UNREACHABLE;
    static const int stayed[] = {PLAN_KEEP, PLAN_RECOMPUTE, PLAN_SELECTIVE, PLAN_OFFLOAD_SELECTIVE,
                                 PLAN_ATTENTION, PLAN_OFFLOAD_ATTENTION};
    for (int k = 0; k < (int)(sizeof stayed / sizeof stayed[0]); k++) {
        int c = stayed[k];
        int64_t limit = held_limit(b, c, 0, budget, t->reach);
        uint64_t shift = held_units(b, c);
        double extra = own_time(b, c);
        double *row = to + shift;
        uint8_t *row_parent = parent + shift;
        for (int64_t s = 0; s <= limit; s++) {
            /* selects, not branches, which the data would mispredict */
            double time = t->merged[s] + extra, old = row[s];
            uint8_t old_parent = row_parent[s];
            int better = time < old;
            row[s] = better ? time : old;
            row_parent[s] =
                better ? (uint8_t)(c | t->merged_row[s] << CHOICE_BITS) : old_parent;
        }
    }
}

/* Row ROW_OFFLOADED of the next step: offload holds only the part of its
 * input too small to move, so each state comes from the state that many
 * units below in either row. */
static void
dp_fill_offloaded(dp_tables *t, uint8_t *parent, const plan_block *b, const plan_block *previous,
                  uint64_t budget, uint64_t reach, int pipeline)
{
    const double *stayed = t->best, *offloaded = t->best + t->width;
    double *to = t->next + t->width;
    uint8_t *to_parent = parent + t->width;
    int64_t from_stayed = held_limit(b, PLAN_OFFLOAD, 0, budget, t->reach);
    int64_t from_offloaded = held_limit(
        b, PLAN_OFFLOAD, prefetch_units(previous, PLAN_OFFLOAD, PLAN_OFFLOAD, pipeline), budget,
        t->reach);
    uint64_t shift = held_units(b, PLAN_OFFLOAD);
    double extra = own_time(b, PLAN_OFFLOAD);
    double extra_offloaded = extra + copy_back_time(previous, b, PLAN_OFFLOAD, pipeline);
    for (uint64_t s = 0; s < shift && s <= reach; s++)
        to[s] = UNREACHABLE;
    for (uint64_t s = 0; s + shift <= reach; s++) {
        double a = (int64_t)s <= from_stayed ? stayed[s] + extra : UNREACHABLE;
        double o = (int64_t)s <= from_offloaded ? offloaded[s] + extra_offloaded : UNREACHABLE;
        int take = o < a;
        to[s + shift] = take ? o : a;
        to_parent[s + shift] = (uint8_t)(PLAN_OFFLOAD | take << CHOICE_BITS);
    }
}

/* Extends every state after block i-1 by each choice for block i. */
static void
dp_step(dp_tables *t, const plan_block *blocks, int i, uint64_t budget, int pipeline)
{
    const plan_block *b = &blocks[i], *previous = &blocks[i - 1];
    uint8_t *parent = t->parent + (size_t)i * ROWS * t->width;
    uint64_t most_held = 0;
    for (int c = 0; c < PLAN_CHOICES; c++)
        most_held = held_units(b, c) > most_held ? held_units(b, c) : most_held;
    uint64_t reach = t->reach + most_held < budget ? t->reach + most_held : budget;
    /* only offload prefetches the previous input: otherwise it comes back whole */
    dp_merge_rows(t, copy_back_time(previous, b, PLAN_KEEP, pipeline));
    dp_fill_stayed(t, parent, b, budget, reach);
    dp_fill_offloaded(t, parent, b, previous, budget, reach, pipeline);
    double *swap = t->best;
    t->best = t->next;
    t->next = swap;
    t->reach = reach;
}

static void
dp_first(dp_tables *t, const plan_block *b, uint64_t budget)
{
    for (int c = 0; c < PLAN_CHOICES; c++) {
        if (held_limit(b, c, 0, budget, budget) < 0)
            continue;
        uint64_t held = held_units(b, c);
        double *cell = &t->best[(size_t)row_of(c) * t->width + held];
        if (own_time(b, c) < *cell) {
            *cell = own_time(b, c);
            t->parent[(size_t)row_of(c) * t->width + held] = (uint8_t)c;
        }
        t->reach = held > t->reach ? held : t->reach;
    }
}

/* The cheapest final state; the last block's offloaded input comes back
 * with nothing to hide it. */
static int
dp_best_final(const dp_tables *t, const plan_block *last, int *row, uint64_t *held)
{
    double best = UNREACHABLE;
    *row = -1;
    for (int r = 0; r < ROWS; r++) {
        for (uint64_t s = 0; s <= t->reach; s++) {
            double time = t->best[(size_t)r * t->width + s];
            if (r == ROW_OFFLOADED)
                time += last->copy_s;
            if (time < best) {
                best = time;
                *row = r;
                *held = s;
            }
        }
    }
    return *row >= 0;
}

int
plan_solve(const plan_block *blocks, int n, uint64_t budget, int pipeline, uint8_t *choices,
           plan_cost *cost)
{
    if (n <= 0) {
        *cost = (plan_cost){0, 0};
        return 0;
    }
    dp_tables t = {0};
    if (dp_alloc(&t, n, budget) < 0) {
        dp_free(&t);
        return -1;
    }
    dp_first(&t, &blocks[0], budget);
    for (int i = 1; i < n; i++)
        dp_step(&t, blocks, i, budget, pipeline);
    int row;
    uint64_t held = 0;
    if (!dp_best_final(&t, &blocks[n - 1], &row, &held)) {
        dp_free(&t);
        return 1;
    }
    size_t cells = (size_t)ROWS * t.width;
    for (int i = n - 1; i >= 0; i--) {
        uint8_t packed = t.parent[(size_t)i * cells + (size_t)row * t.width + held];
        choices[i] = packed & CHOICE_MASK;
        held -= held_units(&blocks[i], choices[i]);
        row = packed >> CHOICE_BITS;
    }
    dp_free(&t);
    *cost = plan_evaluate(blocks, n, choices, pipeline);
    return 0;
}

/* Enough for any plan: everything kept at once, plus a prefetch. */
static uint64_t
plan_max_budget(const plan_block *blocks, int n)
{
    uint64_t total = 0;
    for (int i = 0; i < n; i++)
        total += blocks[i].input_units * 2 + blocks[i].activation_units +
                 blocks[i].selective.units + blocks[i].attention.units +
                 blocks[i].keep_work_units + blocks[i].checkpoint_work_units;
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

int
plan_frontier(const plan_block *blocks, int n, int pipeline, int max_points,
              plan_cost *points)
{
    uint8_t *choices = malloc((size_t)(n > 0 ? n : 1));
    uint64_t budget = plan_max_budget(blocks, n);
    int count = 0;
    if (choices == NULL)
        return -1;
    while (count < max_points) {
        plan_cost cost;
        int status = plan_solve(blocks, n, budget, pipeline, choices, &cost);
        if (status < 0) {
            free(choices);
            return -1;
        }
        if (status == 1)
            break;
        /* a plan as fast as the last one (to rounding) but smaller replaces it */
        if (count > 0 && cost.time_s <= points[count - 1].time_s * (1 + 1e-12))
            count--;
        points[count++] = cost;
        if (cost.peak_units == 0)
            break;
        budget = cost.peak_units - 1;
    }
    free(choices);
    return count;
}
