/* The planner's own interface between its files: the cost model's figures
 * per block and choice (planner.c, the model planner.h states) and the
 * solver's bounded form (solver.c). Units are the caller's quantum, times
 * seconds; pure functions, thread-safe. */
#ifndef MATEPOINT_PLANNER_MODEL_H
#define MATEPOINT_PLANNER_MODEL_H

#include "planner.h"

#include <stdint.h>

/* What block b holds on the device after its forward under `choice`. */
uint64_t plan_held_units(const plan_block *b, int choice);

/* Its own peak over its forward, recompute and backward. */
uint64_t plan_work_units(const plan_block *b, int choice);

/* What comes back early of the previous block's input while this one runs
 * (previous == NULL: none). */
uint64_t plan_prefetch_units(const plan_block *previous, int previous_choice, int choice,
                             int pipeline);

/* Its compute time plus the copies of its own nothing hides. */
double plan_own_time(const plan_block *b, int choice);

/* The exposed copy back of offloaded block b, given the next block's
 * choice (next == NULL: b is the last). */
double plan_copy_back_time(const plan_block *b, const plan_block *next, int next_choice,
                           int pipeline);

/* The least time block b can take under any choice, in any memory. */
double plan_least_time(const plan_block *b);

/* plan_solve, told that no plan slower than `bound` seconds is wanted
 * (INFINITY: any): 0 with the plan plan_solve gives when that plan takes
 * at most `bound` (to rounding: a billionth of it); 1 when it does not (or
 * no plan fits); -1: out of memory. A finite bound prunes the states no
 * plan within it goes through. */
int plan_solve_within(const plan_block *blocks, int n, uint64_t budget, int pipeline,
                      double bound, uint8_t *choices, plan_cost *cost);

#endif
