/* Python face of the budget planner (planner/planner.h). Blocks arrive as a
 * sequence of (forward_s, backward_s, copy_s, input_units,
 * activation_units, keep_work_units, checkpoint_work_units, selective_s,
 * selective_units, selective_copy_s[, recompute_s[, attention_s,
 * attention_units, attention_copy_s[, offload_held_units,
 * selective_offload_held_units, attention_offload_held_units]]]) tuples:
 * recompute_s is 2 * forward_s + backward_s when left out, the attention
 * policy unmeasured (never chosen), and an offload moves everything;
 * choices as a bytes object of PLAN_* values. The solver runs without the
 * GIL. */
#include "plan.h"

#include "planner/planner.h"

#include <limits.h>
#include <math.h>

/* The time of a policy not measured: any plan using it costs more than
 * every plan without, as Python's planner gives its unmeasured ones. */
#define UNMEASURED_S 1e30

static const char block_fields[] =
    "(forward_s, backward_s, copy_s, input_units, activation_units, keep_work_units, "
    "checkpoint_work_units, selective_s, selective_units, selective_copy_s[, recompute_s[, "
    "attention_s, attention_units, attention_copy_s[, offload_held_units, "
    "selective_offload_held_units, attention_offload_held_units]]])";
/* units[] of a block tuple, in its order */
enum { INPUT, ACTIVATION, KEEP_WORK, CHECKPOINT_WORK, SELECTIVE, ATTENTION, OFFLOAD_HELD,
       SELECTIVE_OFFLOAD_HELD, ATTENTION_OFFLOAD_HELD, UNIT_FIELDS };

/* Fills in what a shorter tuple leaves out; -1 with an exception where it
 * gives a group of fields in part. */
static int
block_defaults(Py_ssize_t size, Py_ssize_t index, plan_block *block,
               long long units[UNIT_FIELDS])
{
    if (size == 12 || size == 13 || size == 15 || size == 16) {
        PyErr_Format(PyExc_TypeError, "block %zd: %s come together; expected %s", index,
                     size < 14 ? "attention_s, attention_units and attention_copy_s"
                               : "offload_held_units, selective_offload_held_units and "
                                 "attention_offload_held_units",
                     block_fields);
        return -1;
    }
    if (size < 11)
        block->recompute_s = 2 * block->forward_s + block->backward_s;
    if (size < 14) {
        block->attention.time_s = UNMEASURED_S;
        units[ATTENTION] = units[INPUT];
        block->attention.copy_s = UNMEASURED_S;
    }
    if (size < 17)
        units[OFFLOAD_HELD] = units[SELECTIVE_OFFLOAD_HELD] = units[ATTENTION_OFFLOAD_HELD] = 0;
    return 0;
}

/* -1 with an exception where what an offload leaves on the device is more
 * than it would hold kept. */
static int
check_offload_held(Py_ssize_t index, const long long units[UNIT_FIELDS])
{
    static const struct {
        int held, whole;
        const char *names;
    } pairs[] = {{OFFLOAD_HELD, INPUT, "offload_held_units above input_units"},
                 {SELECTIVE_OFFLOAD_HELD, SELECTIVE,
                  "selective_offload_held_units above selective_units"},
                 {ATTENTION_OFFLOAD_HELD, ATTENTION,
                  "attention_offload_held_units above attention_units"}};
    for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++) {
        if (units[pairs[k].held] > units[pairs[k].whole]) {
            PyErr_Format(PyExc_ValueError, "block %zd: %s", index, pairs[k].names);
            return -1;
        }
    }
    return 0;
}

static int
block_from_tuple(PyObject *item, Py_ssize_t index, plan_block *block)
{
    long long units[UNIT_FIELDS];
    if (!PyTuple_Check(item) ||
        !PyArg_ParseTuple(item, "dddLLLLdLd|ddLdLLL", &block->forward_s, &block->backward_s,
                          &block->copy_s, &units[INPUT], &units[ACTIVATION], &units[KEEP_WORK],
                          &units[CHECKPOINT_WORK], &block->selective.time_s, &units[SELECTIVE],
                          &block->selective.copy_s, &block->recompute_s,
                          &block->attention.time_s, &units[ATTENTION], &block->attention.copy_s,
                          &units[OFFLOAD_HELD], &units[SELECTIVE_OFFLOAD_HELD],
                          &units[ATTENTION_OFFLOAD_HELD])) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "block %zd: expected %s", index, block_fields);
        return -1;
    }
    if (block_defaults(PyTuple_GET_SIZE(item), index, block, units) < 0)
        return -1;
    double times[] = {block->forward_s, block->backward_s, block->copy_s, block->recompute_s,
                      block->selective.time_s, block->selective.copy_s,
                      block->attention.time_s, block->attention.copy_s};
    int negative = 0;
    double sum = 0;
    for (size_t k = 0; k < sizeof times / sizeof times[0]; k++) {
        negative |= !(times[k] >= 0);
        sum += times[k];
    }
    for (int k = 0; k < UNIT_FIELDS; k++) {
        negative |= units[k] < 0;
        /* sums of units over a chain must not wrap: keep each far below 2^64 */
        if (units[k] > (1LL << 42)) {
            PyErr_Format(PyExc_OverflowError, "block %zd: too many units; use a larger unit",
                         index);
            return -1;
        }
    }
    if (negative) {
        PyErr_Format(PyExc_ValueError, "block %zd: times and units must be non-negative numbers",
                     index);
        return -1;
    }
    if (check_offload_held(index, units) < 0)
        return -1;
    /* the solver adds a block's times together: their sum must stay finite */
    if (!isfinite(sum)) {
        PyErr_Format(PyExc_ValueError,
                     "block %zd: times too large, they and their sum must be finite", index);
        return -1;
    }
    block->input_units = (uint64_t)units[INPUT];
    block->activation_units = (uint64_t)units[ACTIVATION];
    block->keep_work_units = (uint64_t)units[KEEP_WORK];
    block->checkpoint_work_units = (uint64_t)units[CHECKPOINT_WORK];
    block->selective.units = (uint64_t)units[SELECTIVE];
    block->attention.units = (uint64_t)units[ATTENTION];
    block->offload_held_units = (uint64_t)units[OFFLOAD_HELD];
    block->selective.offload_held_units = (uint64_t)units[SELECTIVE_OFFLOAD_HELD];
    block->attention.offload_held_units = (uint64_t)units[ATTENTION_OFFLOAD_HELD];
    return 0;
}

/* A PyMem array of the blocks, *n set; NULL with an exception. */
static plan_block *
blocks_from_sequence(PyObject *sequence, int *n)
{
    PyObject *fast = PySequence_Fast(sequence, "blocks must be a sequence of tuples");
    if (fast == NULL)
        return NULL;
    Py_ssize_t size = PySequence_Fast_GET_SIZE(fast);
    plan_block *blocks = NULL;
    if (size > INT_MAX / 4) {
        PyErr_SetString(PyExc_OverflowError, "too many blocks");
        goto error;
    }
    blocks = PyMem_Calloc((size_t)(size > 0 ? size : 1), sizeof(plan_block));
    if (blocks == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        if (block_from_tuple(PySequence_Fast_GET_ITEM(fast, i), i, &blocks[i]) < 0)
            goto error;
    }
    Py_DECREF(fast);
    *n = (int)size;
    return blocks;
error:
    PyMem_Free(blocks);
    Py_DECREF(fast);
    return NULL;
}

static PyObject *
cost_tuple(plan_cost cost)
{
    return Py_BuildValue("(dK)", cost.time_s, (unsigned long long)cost.peak_units);
}

static PyObject *
cost_list(const plan_cost *costs, int n)
{
    PyObject *result = PyList_New(n);
    if (result == NULL)
        return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *item = cost_tuple(costs[i]);
        if (item == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyList_SET_ITEM(result, i, item);
    }
    return result;
}

PyObject *
plan_solve_py(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *sequence, *result = NULL;
    unsigned long long budget;
    int pipeline, n, status;
    if (!PyArg_ParseTuple(args, "OKp:_plan_solve", &sequence, &budget, &pipeline))
        return NULL;
    plan_block *blocks = blocks_from_sequence(sequence, &n);
    if (blocks == NULL)
        return NULL;
    uint8_t *choices = PyMem_Malloc((size_t)n + 1);
    plan_cost cost = {0, 0};
    if (choices == NULL) {
        PyMem_Free(blocks);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    status = plan_solve(blocks, n, budget, pipeline, choices, &cost);
    Py_END_ALLOW_THREADS
    if (status < 0)
        PyErr_Format(PyExc_MemoryError,
                     "the planner's tables for %d blocks and %llu units do not fit in memory; "
                     "use a larger unit",
                     n, budget);
    else if (status == 1)
        result = Py_NewRef(Py_None);
    else
        result = Py_BuildValue("(y#dK)", (const char *)choices, (Py_ssize_t)n, cost.time_s,
                               (unsigned long long)cost.peak_units);
    PyMem_Free(choices);
    PyMem_Free(blocks);
    return result;
}

/* The blocks of `sequence` and the validated `choices` buffer; -1 with an
 * exception (the buffer then released). */
static int
blocks_and_choices(PyObject *sequence, Py_buffer *choices, plan_block **blocks, int *n)
{
    *blocks = blocks_from_sequence(sequence, n);
    if (*blocks == NULL)
        goto error;
    if (choices->len != *n) {
        PyErr_Format(PyExc_ValueError, "%zd choices for %d blocks", choices->len, *n);
        goto error;
    }
    const uint8_t *values = choices->buf;
    for (int i = 0; i < *n; i++) {
        if (values[i] >= PLAN_CHOICES) {
            PyErr_Format(PyExc_ValueError, "choice %d of block %d is not 0 to %d", values[i], i,
                         PLAN_CHOICES - 1);
            goto error;
        }
    }
    return 0;
error:
    PyMem_Free(*blocks);
    *blocks = NULL;
    PyBuffer_Release(choices);
    return -1;
}

PyObject *
plan_evaluate_py(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *sequence;
    Py_buffer choices;
    plan_block *blocks;
    int pipeline, n;
    if (!PyArg_ParseTuple(args, "Oy*p:_plan_evaluate", &sequence, &choices, &pipeline))
        return NULL;
    if (blocks_and_choices(sequence, &choices, &blocks, &n) < 0)
        return NULL;
    PyObject *result = cost_tuple(plan_evaluate(blocks, n, choices.buf, pipeline));
    PyMem_Free(blocks);
    PyBuffer_Release(&choices);
    return result;
}

PyObject *
plan_evaluate_blocks_py(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *sequence, *result = NULL;
    Py_buffer choices;
    plan_block *blocks;
    int pipeline, n;
    if (!PyArg_ParseTuple(args, "Oy*p:_plan_evaluate_blocks", &sequence, &choices, &pipeline))
        return NULL;
    if (blocks_and_choices(sequence, &choices, &blocks, &n) < 0)
        return NULL;
    plan_cost *costs = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(plan_cost));
    if (costs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    plan_evaluate_blocks(blocks, n, choices.buf, pipeline, costs);
    result = cost_list(costs, n);
done:
    PyMem_Free(costs);
    PyMem_Free(blocks);
    PyBuffer_Release(&choices);
    return result;
}

PyObject *
plan_min_budget_py(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *sequence;
    int pipeline, n, status;
    uint64_t budget = 0;
    if (!PyArg_ParseTuple(args, "Op:_plan_min_budget", &sequence, &pipeline))
        return NULL;
    plan_block *blocks = blocks_from_sequence(sequence, &n);
    if (blocks == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    status = plan_min_budget(blocks, n, pipeline, &budget);
    Py_END_ALLOW_THREADS
    PyMem_Free(blocks);
    if (status < 0)
        return PyErr_NoMemory();
    return PyLong_FromUnsignedLongLong(budget);
}

PyObject *
plan_frontier_py(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *sequence, *result = NULL;
    int pipeline, max_points, n, count;
    if (!PyArg_ParseTuple(args, "Opi:_plan_frontier", &sequence, &pipeline, &max_points))
        return NULL;
    if (max_points < 1) {
        PyErr_SetString(PyExc_ValueError, "max_points must be at least 1");
        return NULL;
    }
    plan_block *blocks = blocks_from_sequence(sequence, &n);
    plan_cost *points = blocks ? PyMem_Calloc((size_t)max_points, sizeof(plan_cost)) : NULL;
    if (points == NULL) {
        if (blocks != NULL)
            PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    count = plan_frontier(blocks, n, pipeline, max_points, points);
    Py_END_ALLOW_THREADS
    if (count < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = cost_list(points, count);
done:
    PyMem_Free(points);
    PyMem_Free(blocks);
    return result;
}
