#include "planner.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* infinite, so adding a block's time to it needs no check */
#define UNREACHABLE INFINITY

static uint64_t
held_units(const plan_block *b, int choice)
{
    return choice == PLAN_KEEP ? b->activation_units
           : choice == PLAN_RECOMPUTE ? b->input_units : 0;
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

static uint64_t
prefetch_units(const plan_block *previous, int previous_choice, int choice, int pipeline)
{
    return previous != NULL && prefetched(previous_choice, choice, pipeline) ? previous->input_units
                                                                              : 0;
}

static double
positive(double value)
{
    return value > 0 ? value : 0;
}

/* Compute time of a block plus its exposed copy out. */
static double
own_time(const plan_block *b, int choice)
{
    if (choice == PLAN_KEEP)
        return b->forward_s + b->backward_s;
    double time = 2 * b->forward_s + b->backward_s;
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

plan_cost
plan_evaluate(const plan_block *blocks, int n, const uint8_t *choices, int pipeline)
{
    plan_cost cost = {0, 0};
    uint64_t held = 0;
    for (int i = 0; i < n; i++) {
        const plan_block *previous = i > 0 ? &blocks[i - 1] : NULL;
        uint64_t peak = held + work_units(&blocks[i], choices[i]) +
                        prefetch_units(previous, i > 0 ? choices[i - 1] : -1, choices[i], pipeline);
        cost.peak_units = peak > cost.peak_units ? peak : cost.peak_units;
        cost.time_s += own_time(&blocks[i], choices[i]);
        if (choices[i] == PLAN_OFFLOAD)
            cost.time_s += copy_back_time(&blocks[i], i + 1 < n ? &blocks[i + 1] : NULL,
                                          i + 1 < n ? choices[i + 1] : -1, pipeline);
        held += held_units(&blocks[i], choices[i]);
    }
    return cost;
}

/* The DP's state after block i: units held so far, and whether block i
 * offloaded (all the next block needs to know of it: keep and recompute
 * look alike from there). best[row * width + s] is the least time of
 * blocks 0..i ending in that state; parent[i] tells, per state, block i's
 * choice and the previous row, packed as choice | row << 2. */
enum { ROW_STAYED = 0, ROW_OFFLOADED = 1, ROWS = 2 };

typedef struct {
    uint64_t width;             /* budget + 1 */
    uint64_t reach;             /* no state above this many units is reachable yet */
    double *best, *next;        /* ROWS * width each */
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
    t->parent = malloc((size_t)n * cells);
    if (t->best == NULL || t->next == NULL || t->parent == NULL)
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
    free(t->parent);
}

/* The most units that may be held before block i so that choice c fits,
 * or -1 when it never does. */
static int64_t
held_limit(const plan_block *b, int c, uint64_t prefetch, uint64_t budget)
{
    uint64_t need = work_units(b, c) + prefetch;
    uint64_t held = held_units(b, c);
    if (need > budget || held > budget)
        return -1;
    uint64_t by_work = budget - need, by_held = budget - held;
    return (int64_t)(by_work < by_held ? by_work : by_held);
}

/* Relaxes next[row(c)][s + held(c)] from best[prev_row][s] for every s up
 * to `limit`: the hot loop, a shifted element-wise minimum. */
static void
dp_relax(dp_tables *t, uint8_t *parent, int prev_row, int c, uint64_t shift, int64_t limit,
         double extra)
{
    const double *from = t->best + (size_t)prev_row * t->width;
    size_t to_start = (size_t)row_of(c) * t->width + shift;
    double *to = t->next + to_start;
    uint8_t *to_parent = parent + to_start;
    uint8_t packed = (uint8_t)(c | prev_row << 2);
    for (int64_t s = 0; s <= limit; s++) {
        /* unreachable stays infinite; selects, not branches, which the
         * data would mispredict half the time */
        double time = from[s] + extra, old = to[s];
        uint8_t old_parent = to_parent[s];
        int better = time < old;
        to[s] = better ? time : old;
        to_parent[s] = better ? packed : old_parent;
    }
}

/* Extends every state after block i-1 by each choice for block i. */
static void
dp_step(dp_tables *t, const plan_block *blocks, int i, uint64_t budget, int pipeline)
{
    const plan_block *b = &blocks[i], *previous = &blocks[i - 1];
    size_t cells = (size_t)ROWS * t->width;
    uint8_t *parent = t->parent + (size_t)i * cells;
    uint64_t most_held = held_units(b, PLAN_KEEP) > held_units(b, PLAN_RECOMPUTE)
                             ? held_units(b, PLAN_KEEP)
                             : held_units(b, PLAN_RECOMPUTE);
    uint64_t reach = t->reach + most_held < budget ? t->reach + most_held : budget;
    for (int row = 0; row < ROWS; row++) {
        double *next = t->next + (size_t)row * t->width;
        for (uint64_t s = 0; s <= reach; s++)
            next[s] = UNREACHABLE;
    }
    for (int prev_row = 0; prev_row < ROWS; prev_row++) {
        int previous_choice = prev_row ? PLAN_OFFLOAD : PLAN_KEEP;
        for (int c = 0; c < PLAN_CHOICES; c++) {
            uint64_t prefetch = prefetch_units(previous, previous_choice, c, pipeline);
            int64_t limit = held_limit(b, c, prefetch, budget);
            if (limit < 0)
                continue;
            if ((uint64_t)limit > t->reach)
                limit = (int64_t)t->reach;
            double extra = own_time(b, c);
            if (prev_row == ROW_OFFLOADED)
                extra += copy_back_time(previous, b, c, pipeline);
            dp_relax(t, parent, prev_row, c, held_units(b, c), limit, extra);
        }
    }
    double *swap = t->best;
    t->best = t->next;
    t->next = swap;
    t->reach = reach;
}

static void
dp_first(dp_tables *t, const plan_block *b, uint64_t budget)
{
    for (int c = 0; c < PLAN_CHOICES; c++) {
        if (held_limit(b, c, 0, budget) < 0)
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
        choices[i] = packed & 3;
        held -= held_units(&blocks[i], choices[i]);
        row = packed >> 2;
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
