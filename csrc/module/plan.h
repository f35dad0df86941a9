/* matepoint._C's planner functions (_plan_solve, _plan_evaluate,
 * _plan_min_budget, _plan_frontier) and constants (PLAN_CHOICES, ...): thin
 * argument conversion around planner/planner.h. Blocks are records (dicts
 * keyed by PLAN_BLOCK_FIELDS and PLAN_POLICIES); memory is counted in the
 * caller's units. */
#ifndef MATEPOINT_MODULE_PLAN_H
#define MATEPOINT_MODULE_PLAN_H

#include "base/compat.h"

/* (blocks, budget_units, pipeline) -> (choices: bytes, time_s, peak_units),
 * or None when no plan fits the budget. */
PyObject *plan_solve_py(PyObject *module, PyObject *args);
/* (blocks, choices, pipeline) -> (time_s, peak_units) */
PyObject *plan_evaluate_py(PyObject *module, PyObject *args);
/* (blocks, choices, pipeline) -> [(time_s, peak_units), ...], one per block */
PyObject *plan_evaluate_blocks_py(PyObject *module, PyObject *args);
#define PLAN_EVALUATE_BLOCKS_DOC                                                               \
    "_plan_evaluate_blocks($module, blocks, choices, pipeline, /)\n--\n\nPer block of the "  \
    "plan choices: (seconds, peak units while it runs); the seconds add up to\n"               \
    "_plan_evaluate's and its peak is their max."
/* (blocks, pipeline) -> the smallest budget any plan meets */
PyObject *plan_min_budget_py(PyObject *module, PyObject *args);
/* (blocks, pipeline, max_points) -> [(time_s, peak_units), ...], peak falling */
PyObject *plan_frontier_py(PyObject *module, PyObject *args);

/* Adds PLAN_CHOICES (per choice a dict: name, saves, policy, offloads),
 * PLAN_POLICIES, PLAN_BLOCK_FIELDS, PLAN_POLICY_FIELDS and
 * PLAN_UNMEASURED_S to the module; -1 with an exception. */
int plan_add_constants(PyObject *module);

#endif
