/* Budget planner: for a chain of blocks, choose per block whether to keep
 * its activations, checkpoint it keeping its input on the device, or
 * checkpoint it offloading its input, so that peak activation memory stays
 * within a budget at the least step time.
 *
 * A fourth choice, selective, checkpoints the block under a policy that saves
 * the outputs of its expensive operations (matmuls, attention) and
 * recomputes the rest. A fifth, offload+selective, also offloads its input
 * and those saved outputs (selective's policy with MUST_CPU_OFFLOAD). The
 * sixth and seventh, attention and offload+attention, do the same under a
 * policy that saves only the attention outputs: at long context attention
 * costs the most per byte it saves, the matmuls far less.
 *
 * Cost model (units of memory are the caller's quantum, times seconds):
 *   held (after its forward)   keep: act   recompute: in
 *                              offload: the part of in too small to move
 *                              selective, attention: their policy's units
 *                              (its input included)
 *                              offload+selective, offload+attention: the
 *                              part of their policy's units too small to move
 *   work (its own peak, over its forward, recompute and backward, on top
 *   of what blocks before it hold)   keep: keep_work   else: checkpoint_work
 *   while block i runs backward, block i-1's input is being prefetched when
 *   both offload (pipeline): + the part of in[i-1] that moved
 *   peak = max over i of (held by blocks before i) + work[i] + prefetch[i]
 *   time: keep f+b, recompute/offload recompute_s, selective and
 *   attention their policy's time_s
 *   (each its forward and backward measured together, checkpointed: a
 *   recompute stops at the last saved tensor, so it costs less than a
 *   second forward where ops follow it); an offload adds the part of its
 *   copy out its own forward does not hide, and the part of its copy back
 *   that the backward of the next block does not hide (all of it for the
 *   last block, or without pipeline). offload+selective: its policy's time_s
 *   plus the part of its copy out (copy_s: input and saved outputs)
 *   its forward does not hide, plus all of its copy back (it neither
 *   prefetches nor is prefetched: its outputs come back when the recompute
 *   reaches them). offload+attention: the same under its policy.
 *
 * plan_solve() is an exact dynamic program over (block, memory held so far,
 * previous choice): O(n * budget) time at most, n * budget * 2 bytes of
 * parents at most (only the states reached are touched). plan_frontier()
 * prunes each solve to plans just slower than the point before, which
 * gives the same plans as full solves. Pure computation: thread-safe, no
 * global state, no Python. */
#ifndef MATEPOINT_PLANNER_H
#define MATEPOINT_PLANNER_H

#include <stddef.h>
#include <stdint.h>

enum {
    PLAN_KEEP = 0,
    PLAN_RECOMPUTE = 1,
    PLAN_OFFLOAD = 2,
    PLAN_SELECTIVE = 3,
    PLAN_OFFLOAD_SELECTIVE = 4,
    PLAN_ATTENTION = 5,
    PLAN_OFFLOAD_ATTENTION = 6,
    PLAN_CHOICES = 7
};

/* The saving policies a block is measured under: indexes into
 * plan_block's `policies`. */
enum { PLAN_POLICY_SELECTIVE = 0, PLAN_POLICY_ATTENTION = 1, PLAN_POLICIES = 2 };

/* The time a policy not measured is given (a block without attention, a
 * plan saved before the policy existed): any plan using it costs more than
 * every plan without, so it is never chosen. */
#define PLAN_UNMEASURED_S 1e30

/* One choice as callers name it: the one table of choices (choices.c);
 * Python reads it as _C.PLAN_CHOICES. */
typedef struct {
    const char *name;   /* as plans name it: "keep", "offload+selective", ... */
    const char *saves;  /* what it keeps for backward, in the user's words */
    int policy;         /* PLAN_POLICY_* it runs under, or -1 */
    int offloads;       /* 1: its input (and saved outputs) go to host memory */
} plan_choice_info;

extern const plan_choice_info plan_choice_table[PLAN_CHOICES];
/* The policies' names, indexed by PLAN_POLICY_*. */
extern const char *const plan_policy_names[PLAN_POLICIES];

/* A checkpoint policy that saves some outputs and recomputes the rest. */
typedef struct {
    double time_s;                  /* forward + backward under the policy */
    uint64_t units;                 /* held after the forward: input and saved outputs */
    double copy_s;                  /* one-way copy of what of those moves */
    uint64_t offload_held_units;    /* of `units`, what stays on the device when
                                     * offloaded (tensors too small to move) */
} plan_policy;

typedef struct {
    double forward_s, backward_s;
    double recompute_s;             /* forward + backward checkpointed, recompute included */
    double copy_s;                  /* one-way copy of what of the input moves */
    uint64_t input_units, activation_units;
    uint64_t offload_held_units;    /* of the input, what stays on the device when
                                     * offloaded (tensors too small to move) */
    uint64_t keep_work_units, checkpoint_work_units;
    /* per PLAN_POLICY_*: selective saves matmul, convolution and attention
     * outputs; attention saves attention outputs only */
    plan_policy policies[PLAN_POLICIES];
} plan_block;

typedef struct {
    double time_s;
    uint64_t peak_units;
} plan_cost;

/* Block b's policy PLAN_POLICY_* (NULL for any other value: -1 is a
 * choice without one). */
static inline const plan_policy *
plan_block_policy(const plan_block *b, int policy)
{
    return policy >= 0 && policy < PLAN_POLICIES ? &b->policies[policy] : NULL;
}

/* The cost of a given plan under the model above. */
plan_cost plan_evaluate(const plan_block *blocks, int n, const uint8_t *choices, int pipeline);

/* Each block's share of that cost into per_block[0..n): its time (the
 * copies it leaves exposed included: the times add up to the plan's) and
 * the peak while it runs (the plan's peak is their max). */
void plan_evaluate_blocks(const plan_block *blocks, int n, const uint8_t *choices, int pipeline,
                          plan_cost *per_block);

/* 0: `choices` holds the fastest plan with peak <= budget_units; 1: no
 * plan fits the budget; -1: out of memory. */
int plan_solve(const plan_block *blocks, int n, uint64_t budget_units, int pipeline,
               uint8_t *choices, plan_cost *cost);

/* *budget receives the smallest budget any plan fits in. 0, or -1: out of
 * memory. */
int plan_min_budget(const plan_block *blocks, int n, int pipeline, uint64_t *budget);

/* The time-vs-memory frontier: the fastest plan at each peak where a
 * smaller budget costs time, from the fastest plan down to the smallest,
 * at most max_points of them, into `points` (peak falling, time rising).
 * Returns how many, or -1: out of memory. */
int plan_frontier(const plan_block *blocks, int n, int pipeline, int max_points,
                  plan_cost *points);

#endif
