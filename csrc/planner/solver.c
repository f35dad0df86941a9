/* The planner's exact solver: a dynamic program whose tables are swept
 * once per block, each state by one pass over the choices that can reach
 * it, over the span of states still live. */
#include "planner.h"

#include "common/mp_assert.h"
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* infinite, so adding a block's time to it needs no check */
#define UNREACHABLE INFINITY

/* The DP's state after block i: units held so far, and whether block i
 * offloaded (all the next block needs to know of it: every other choice,
 * the offloaded policies' copies back being their own, looks alike from
 * there). best[row * width + s] is the least time of blocks 0..i ending
 * in that state. Live states lie in one span [lo, hi] of both rows: cells
 * outside it are unreachable, or pruned (a state whose time so far plus
 * the least the blocks after it can take exceeds a bound the caller knows
 * is met: it lies on no plan within the bound). Step i's parents cover the
 * span it wrote, per state block i's choice and the previous row, packed
 * as choice | row << CHOICE_BITS. */
enum { ROW_STAYED = 0, ROW_OFFLOADED = 1, ROWS = 2 };
enum { CHOICE_BITS = 3, CHOICE_MASK = (1 << CHOICE_BITS) - 1 };
_Static_assert(PLAN_CHOICES <= CHOICE_MASK + 1, "a parent byte holds the choice");

/* A choice for one block: `held` more units for `time` more seconds, from
 * states holding at most `limit` units (below `lo`: from none). */
typedef struct {
    int choice;
    uint64_t held;
    int64_t limit;
    double time;
} dp_move;

typedef struct {
    uint64_t budget, width;     /* width: budget + 1 */
    double bound;               /* INFINITY: prune nothing */
    double *least_after;        /* n + 1: the least time blocks i.. can take in any memory */
    uint64_t lo, hi;            /* span of live states after the last step */
    double *best, *next;        /* ROWS * width each, meaningful within the span */
    uint8_t *parent;            /* per step, ROWS rows over the span it wrote */
    size_t *parent_at;          /* n: where step i's parents start */
    uint64_t *span_lo, *span_hi;    /* n: the span step i wrote */
} dp_tables;

static int
row_of(int choice)
{
    return choice == PLAN_OFFLOAD ? ROW_OFFLOADED : ROW_STAYED;
}

/* The tables are sized for every state; only the cells the spans touch are
 * written, so the pages of the rest are never faulted in. */
static int
dp_alloc(dp_tables *t, const plan_block *blocks, int n, uint64_t budget, double bound)
{
    t->budget = budget;
    t->width = budget + 1;
    t->bound = bound;
    if (budget >= UINT64_MAX / 2 || t->width > SIZE_MAX / ROWS / sizeof(double) / (size_t)n)
        return -1;
    size_t cells = (size_t)ROWS * t->width;
    t->best = malloc(cells * sizeof(double));
    t->next = malloc(cells * sizeof(double));
    t->parent = malloc((size_t)n * cells);
    t->parent_at = malloc((size_t)n * sizeof(size_t));
    t->span_lo = malloc((size_t)n * sizeof(uint64_t));
    t->span_hi = malloc((size_t)n * sizeof(uint64_t));
    t->least_after = malloc(((size_t)n + 1) * sizeof(double));
    if (!t->best || !t->next || !t->parent || !t->parent_at ||
        !t->span_lo || !t->span_hi || !t->least_after)
        return -1;
    t->least_after[n] = 0;
    for (int i = n - 1; i >= 0; i--)
        t->least_after[i] = t->least_after[i + 1] + plan_least_time(&blocks[i]);
    return 0;
}

static void
dp_free(dp_tables *t)
{
    free(t->best);
    free(t->next);
    free(t->parent);
    free(t->parent_at);
    free(t->span_lo);
    free(t->span_hi);
    free(t->least_after);
}

/* The most units that may be held before block i so that choice c fits,
 * or -1 when it never does; never above what is reachable. */
static int64_t
held_limit(const plan_block *b, int c, uint64_t prefetch, uint64_t budget, uint64_t reach)
{
    uint64_t need = plan_work_units(b, c) + prefetch;
    uint64_t held = plan_held_units(b, c);
    if (need > budget || held > budget)
        return -1;
    uint64_t limit = budget - need < budget - held ? budget - need : budget - held;
    return (int64_t)(limit < reach ? limit : reach);
}

/* Whether a choice of block b taking `time` puts every plan through it
 * over the bound, whatever the other blocks choose. */
static int
too_slow(const dp_tables *t, const plan_block *b, double time)
{
    return t->least_after[0] - plan_least_time(b) + time > t->bound;
}

/* The moves into row ROW_STAYED, in the order ties go to, less those that
 * never fit, those too slow for the bound, and those an earlier one beats
 * in held units, working units and time alike (no best plan takes them,
 * and on a tie the earlier one won anyway). Returns how many. */
static int
stayed_moves(const dp_tables *t, const plan_block *b, dp_move *moves)
{
    static const int order[] = {PLAN_KEEP, PLAN_RECOMPUTE, PLAN_SELECTIVE, PLAN_OFFLOAD_SELECTIVE,
                                PLAN_ATTENTION, PLAN_OFFLOAD_ATTENTION};
    int count = 0;
    for (size_t k = 0; k < sizeof order / sizeof order[0]; k++) {
        int c = order[k], beaten = 0;
        dp_move move = {c, plan_held_units(b, c), held_limit(b, c, 0, t->budget, t->hi),
                        plan_own_time(b, c)};
        for (int j = 0; j < count; j++)
            beaten |= moves[j].held <= move.held &&
                      plan_work_units(b, moves[j].choice) <= plan_work_units(b, c) &&
                      moves[j].time <= move.time;
        if (move.limit >= (int64_t)t->lo && !beaten && !too_slow(t, b, move.time))
            moves[count++] = move;
    }
    return count;
}

/* The better row to take state s from for any choice but offload, which
 * looks the same from either but for the previous block's copy back,
 * coming whole then (only offload prefetches the previous input): its
 * time, and that row << CHOICE_BITS into *row. Ties go to the stayed row. */
static inline double
merged(const dp_tables *t, uint64_t s, double copy_back, uint8_t *row)
{
    double stayed = t->best[s], via_offload = t->best[t->width + s] + copy_back;
    int take = via_offload < stayed;
    *row = (uint8_t)(take << CHOICE_BITS);
    return take ? via_offload : stayed;
}

/* States [from, to) of row ROW_STAYED, each the best of `count` moves
 * from the merged rows (each reaches every state in the range): held[k]
 * units for time[k] seconds as choice code[k]. Inlined with a constant
 * count, the loop over the moves unrolls. */
static inline void
fill_stayed_moves(int count, const dp_tables *t, double copy_back, const uint64_t *held,
                  const double *time, const uint8_t *code, uint64_t from, uint64_t to,
                  double *row, uint8_t *parent)
{
    for (uint64_t x = from; x < to; x++) {
        uint8_t packed, merged_row;
        double best = merged(t, x - held[0], copy_back, &packed) + time[0];
        packed = (uint8_t)(packed | code[0]);
        /* in order, strictly better only: ties go to the earlier choice */
        for (int k = 1; k < count; k++) {
            double candidate = merged(t, x - held[k], copy_back, &merged_row) + time[k];
            int better = candidate < best;
            packed = better ? (uint8_t)(merged_row | code[k]) : packed;
            best = better ? candidate : best;
        }
        row[x] = best;
        parent[x - from] = packed;
    }
}

static void
fill_stayed_range(const dp_tables *t, double copy_back, const dp_move *moves, int count,
                  uint64_t from, uint64_t to, double *row, uint8_t *parent)
{
    uint64_t held[PLAN_CHOICES];
    double time[PLAN_CHOICES];
    uint8_t code[PLAN_CHOICES];
    for (int k = 0; k < count; k++) {
        held[k] = moves[k].held;
        time[k] = moves[k].time;
        code[k] = (uint8_t)moves[k].choice;
    }
    switch (count) {
    case 0:
        for (uint64_t x = from; x < to; x++)
            row[x] = UNREACHABLE;
        break;
    case 1:
        fill_stayed_moves(1, t, copy_back, held, time, code, from, to, row, parent);
        break;
    case 2:
        fill_stayed_moves(2, t, copy_back, held, time, code, from, to, row, parent);
        break;
    case 3:
        fill_stayed_moves(3, t, copy_back, held, time, code, from, to, row, parent);
        break;
    default:
        fill_stayed_moves(count, t, copy_back, held, time, code, from, to, row, parent);
        break;
    }
}

/* Row ROW_STAYED over [lo, hi]: keep (shifted by its activations),
 * recompute (by its input), selective and attention (by their input and
 * saved outputs) and their offloaded forms (by what of those is too small
 * to move) from the merged row, cut where the set of moves that reach a
 * state changes. parent[0] is state lo's. */
static void
dp_fill_stayed(dp_tables *t, double copy_back, const dp_move *moves, int count, uint64_t lo,
               uint64_t hi, uint8_t *parent)
{
    uint64_t cuts[2 * PLAN_CHOICES + 2], first[PLAN_CHOICES], end[PLAN_CHOICES];
    int ncuts = 0;
    cuts[ncuts++] = lo;
    cuts[ncuts++] = hi + 1;
    for (int k = 0; k < count; k++) {
        uint64_t top = (uint64_t)moves[k].limit < t->hi ? (uint64_t)moves[k].limit : t->hi;
        first[k] = t->lo + moves[k].held;
        end[k] = top + moves[k].held + 1;
        cuts[ncuts++] = first[k];
        cuts[ncuts++] = end[k];
    }
    for (int a = 1; a < ncuts; a++)     /* a handful: insertion sort */
        for (int b = a; b > 0 && cuts[b - 1] > cuts[b]; b--) {
            uint64_t swap = cuts[b];
            cuts[b] = cuts[b - 1];
            cuts[b - 1] = swap;
        }
    for (int c = 0; c + 1 < ncuts; c++) {
        uint64_t from = cuts[c] > lo ? cuts[c] : lo;
        uint64_t to = cuts[c + 1] < hi + 1 ? cuts[c + 1] : hi + 1;
        if (from >= to)
            continue;
        dp_move active[PLAN_CHOICES];
        int nactive = 0;
        for (int k = 0; k < count; k++)
            if (first[k] <= from && to <= end[k])
                active[nactive++] = moves[k];
        fill_stayed_range(t, copy_back, active, nactive, from, to, t->next,
                          parent + (from - lo));
    }
}

/* The most units held before block i from which offload fits, from either
 * row (from the offloaded one its prefetch needs room); -1 where it never
 * does, or is too slow for the bound. */
static void
offload_limits(const dp_tables *t, const plan_block *b, const plan_block *previous,
               int pipeline, int64_t *from_stayed, int64_t *from_offloaded)
{
    uint64_t prefetch = plan_prefetch_units(previous, PLAN_OFFLOAD, PLAN_OFFLOAD, pipeline);
    int slow = too_slow(t, b, plan_own_time(b, PLAN_OFFLOAD));
    *from_stayed = slow ? -1 : held_limit(b, PLAN_OFFLOAD, 0, t->budget, t->hi);
    *from_offloaded = slow ? -1 : held_limit(b, PLAN_OFFLOAD, prefetch, t->budget, t->hi);
}

/* `count` states of row ROW_OFFLOADED from both rows: their times into
 * `row`, then their parents (the same comparison again: a loop that mixes
 * times and bytes does not vectorize, two loops do). */
static void
fill_offloaded_both(const double *restrict stayed, const double *restrict offloaded,
                    double extra, double extra_offloaded, size_t count, double *restrict row,
                    uint8_t *restrict parent)
{
    for (size_t k = 0; k < count; k++) {
        double a = stayed[k] + extra, o = offloaded[k] + extra_offloaded;
        row[k] = o < a ? o : a;
    }
    for (size_t k = 0; k < count; k++)
        parent[k] = (uint8_t)(PLAN_OFFLOAD |
                              (offloaded[k] + extra_offloaded < stayed[k] + extra) << CHOICE_BITS);
}

/* Row ROW_OFFLOADED over [lo, hi]: offload holds only the part of its
 * input too small to move, so each state comes from the state that many
 * units below in either row, from the stayed one up to `from_stayed` and
 * the offloaded one up to `from_offloaded` (where the prefetch fits).
 * parent[0] is state lo's. */
static void
dp_fill_offloaded(dp_tables *t, const plan_block *b, const plan_block *previous, int pipeline,
                  uint64_t lo, uint64_t hi, uint8_t *parent)
{
    const double *stayed = t->best, *offloaded = t->best + t->width;
    double *to = t->next + t->width;
    int64_t from_stayed, from_offloaded;
    offload_limits(t, b, previous, pipeline, &from_stayed, &from_offloaded);
    uint64_t shift = plan_held_units(b, PLAN_OFFLOAD);
    double extra = plan_own_time(b, PLAN_OFFLOAD);
    double extra_offloaded = extra + plan_copy_back_time(previous, b, PLAN_OFFLOAD, pipeline);
    /* states below the first source, and from both rows (the hot loop) */
    uint64_t x = lo, both = (uint64_t)(from_stayed < from_offloaded ? from_stayed : from_offloaded);
    for (; x <= hi && x < t->lo + shift; x++)
        to[x] = UNREACHABLE;
    uint64_t end = both + shift < hi ? both + shift + 1 : hi + 1;
    if (from_stayed >= (int64_t)t->lo && from_offloaded >= (int64_t)t->lo && x < end) {
        fill_offloaded_both(stayed + (x - shift), offloaded + (x - shift), extra,
                            extra_offloaded, end - x, to + x, parent + (x - lo));
        x = end;
    }
    if (from_stayed < (int64_t)t->lo && from_offloaded < (int64_t)t->lo)
        for (; x <= hi; x++)
            to[x] = UNREACHABLE;
    for (; x <= hi; x++) {
        int64_t s = (int64_t)(x - shift);
        double a = s <= from_stayed ? stayed[s] + extra : UNREACHABLE;
        double o = s <= from_offloaded ? offloaded[s] + extra_offloaded : UNREACHABLE;
        int take = o < a;
        to[x] = take ? o : a;
        parent[x - lo] = (uint8_t)(PLAN_OFFLOAD | take << CHOICE_BITS);
    }
}

/* Whether no plan within the bound goes through state s of both rows
 * after block i. */
static int
dp_dead(const dp_tables *t, int i, uint64_t s)
{
    double after = t->least_after[i + 1];
    for (int r = 0; r < ROWS; r++) {
        double time = t->best[(size_t)r * t->width + s];
        if (time != UNREACHABLE && time + after <= t->bound)
            return 0;
    }
    return 1;
}

/* Sets step i's span to [lo, hi], its parents next in the table, and
 * narrows it to its live states once filled: 1 when none is left. */
static uint8_t *
dp_open_span(dp_tables *t, int i, uint64_t lo, uint64_t hi)
{
    size_t at = i == 0 ? 0 : t->parent_at[i - 1] +
                             ROWS * (size_t)(t->span_hi[i - 1] - t->span_lo[i - 1] + 1);
    t->parent_at[i] = at;
    t->span_lo[i] = lo;
    t->span_hi[i] = hi;
    return t->parent + at;
}

static int
dp_close_span(dp_tables *t, int i, uint64_t lo, uint64_t hi)
{
    while (lo <= hi && dp_dead(t, i, lo))
        lo++;
    while (hi > lo && dp_dead(t, i, hi))
        hi--;
    t->lo = lo;
    t->hi = hi;
    return lo > hi;
}

/* Extends every live state after block i-1 by each choice for block i;
 * 1 when no state is left. */
static int
dp_step(dp_tables *t, const plan_block *blocks, int i, int pipeline)
{
    const plan_block *b = &blocks[i], *previous = &blocks[i - 1];
    dp_move moves[PLAN_CHOICES];
    int count = stayed_moves(t, b, moves);
    /* the reach of the offloaded row's moves, as one more move */
    int64_t from_stayed, from_offloaded;
    offload_limits(t, b, previous, pipeline, &from_stayed, &from_offloaded);
    dp_move offload = {PLAN_OFFLOAD, plan_held_units(b, PLAN_OFFLOAD),
                       from_stayed > from_offloaded ? from_stayed : from_offloaded, 0};
    uint64_t lo = UINT64_MAX, hi = 0;
    for (int k = 0; k <= count; k++) {
        const dp_move *m = k < count ? &moves[k] : &offload;
        if (m->limit < (int64_t)t->lo)
            continue;
        uint64_t top = (uint64_t)m->limit < t->hi ? (uint64_t)m->limit : t->hi;
        lo = t->lo + m->held < lo ? t->lo + m->held : lo;
        hi = top + m->held > hi ? top + m->held : hi;
    }
    if (lo > hi)
        return 1;
    uint8_t *parent = dp_open_span(t, i, lo, hi);
    double copy_back = plan_copy_back_time(previous, b, PLAN_KEEP, pipeline);
    dp_fill_stayed(t, copy_back, moves, count, lo, hi, parent);
    dp_fill_offloaded(t, b, previous, pipeline, lo, hi, parent + (hi - lo + 1));
    double *swap = t->best;
    t->best = t->next;
    t->next = swap;
    return dp_close_span(t, i, lo, hi);
}

/* Block 0's states: each choice that fits from nothing held. */
static int
dp_first(dp_tables *t, const plan_block *b)
{
    uint64_t lo = UINT64_MAX, hi = 0;
    for (int c = 0; c < PLAN_CHOICES; c++) {
        if (held_limit(b, c, 0, t->budget, t->budget) < 0)
            continue;
        lo = plan_held_units(b, c) < lo ? plan_held_units(b, c) : lo;
        hi = plan_held_units(b, c) > hi ? plan_held_units(b, c) : hi;
    }
    if (lo > hi)
        return 1;
    uint8_t *parent = dp_open_span(t, 0, lo, hi);
    for (int r = 0; r < ROWS; r++)
        for (uint64_t s = lo; s <= hi; s++)
            t->best[(size_t)r * t->width + s] = UNREACHABLE;
    for (int c = 0; c < PLAN_CHOICES; c++) {
        if (held_limit(b, c, 0, t->budget, t->budget) < 0)
            continue;
        uint64_t held = plan_held_units(b, c);
        double *cell = &t->best[(size_t)row_of(c) * t->width + held];
        if (plan_own_time(b, c) < *cell) {
            *cell = plan_own_time(b, c);
            parent[(size_t)row_of(c) * (hi - lo + 1) + held - lo] = (uint8_t)c;
        }
    }
    return dp_close_span(t, 0, lo, hi);
}

/* The cheapest final state; the last block's offloaded input comes back
 * with nothing to hide it. 0 when there is none. */
static int
dp_best_final(const dp_tables *t, const plan_block *last, int *row, uint64_t *held,
              double *time)
{
    double best = UNREACHABLE;
    *row = -1;
    for (int r = 0; r < ROWS; r++) {
        for (uint64_t s = t->lo; s <= t->hi; s++) {
            double cell = t->best[(size_t)r * t->width + s];
            if (r == ROW_OFFLOADED)
                cell += last->copy_s;
            if (cell < best) {
                best = cell;
                *row = r;
                *held = s;
            }
        }
    }
    *time = best;
    return *row >= 0;
}

/* Follows the parents back from the final state into choices[0..n). */
static void
dp_backtrack(const dp_tables *t, const plan_block *blocks, int n, int row, uint64_t held,
             uint8_t *choices)
{
    for (int i = n - 1; i >= 0; i--) {
        MP_ASSERT(held >= t->span_lo[i] && held <= t->span_hi[i]);
        uint64_t span = t->span_hi[i] - t->span_lo[i] + 1;
        uint8_t packed = t->parent[t->parent_at[i] + (size_t)row * span + (held - t->span_lo[i])];
        choices[i] = packed & CHOICE_MASK;
        held -= plan_held_units(&blocks[i], choices[i]);
        row = packed >> CHOICE_BITS;
    }
}

/* Why pruning gives the same plan: a state on the plan the unpruned DP
 * gives is never pruned while that plan is within the bound, and pruning
 * others only takes candidates away from states (their times can only
 * rise), never the one that won on that plan's path: the same winners, the
 * same first cheapest final state, the same plan. */
int
plan_solve_within(const plan_block *blocks, int n, uint64_t budget, int pipeline, double bound,
                  uint8_t *choices, plan_cost *cost)
{
    if (n <= 0) {
        *cost = (plan_cost){0, 0};
        return 0;
    }
    dp_tables t = {0};
    /* a margin far above the rounding of a sum of n times, far below a
     * time: a plan found within bound + margin was never pruned, at bound
     * + 2 margins */
    double margin = bound * 1e-9;
    if (dp_alloc(&t, blocks, n, budget, bound + 2 * margin) < 0) {
        dp_free(&t);
        return -1;
    }
    int none = dp_first(&t, &blocks[0]);
    for (int i = 1; i < n && !none; i++)
        none = dp_step(&t, blocks, i, pipeline);
    int row = -1;
    uint64_t held = 0;
    double time = UNREACHABLE;
    if (none || !dp_best_final(&t, &blocks[n - 1], &row, &held, &time) ||
        !(time <= bound + margin)) {
        dp_free(&t);
        return 1;
    }
    dp_backtrack(&t, blocks, n, row, held, choices);
    dp_free(&t);
    *cost = plan_evaluate(blocks, n, choices, pipeline);
    return 0;
}

/* The fastest of the plans that make one choice for every block, of those
 * that fit: a bound the best plan meets (INFINITY where none fits). */
static double
uniform_bound(const plan_block *blocks, int n, uint64_t budget, int pipeline, uint8_t *choices)
{
    double bound = UNREACHABLE;
    for (int c = 0; c < PLAN_CHOICES; c++) {
        memset(choices, c, (size_t)n);
        plan_cost cost = plan_evaluate(blocks, n, choices, pipeline);
        bound = cost.peak_units <= budget && cost.time_s < bound ? cost.time_s : bound;
    }
    return bound;
}

int
plan_solve(const plan_block *blocks, int n, uint64_t budget, int pipeline, uint8_t *choices,
           plan_cost *cost)
{
    /* a bound prunes the choices no plan within it takes (those never
     * measured, offload where it cannot run) and the states far from it */
    double bound = n > 0 ? uniform_bound(blocks, n, budget, pipeline, choices) : UNREACHABLE;
    int status = plan_solve_within(blocks, n, budget, pipeline, bound, choices, cost);
    if (status == 1 && bound < UNREACHABLE)     /* only rounding could miss it: never seen */
        status = plan_solve_within(blocks, n, budget, pipeline, UNREACHABLE, choices, cost);
    return status;
}
