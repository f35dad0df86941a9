/* Python face of the budget planner (planner/planner.h). Each block
 * arrives as one record, a dict with every field of PLAN_BLOCK_FIELDS and,
 * per policy of PLAN_POLICIES, a dict of PLAN_POLICY_FIELDS: named, fixed,
 * no defaults (what a block did not measure is Python's to fill in, from
 * PLAN_UNMEASURED_S). Choices cross as a bytes object of indexes into
 * PLAN_CHOICES. The solver runs without the GIL. */
#include "plan.h"

#include "planner/planner.h"

#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

/* One figure of a record: its key, whether it counts units (an int) or
 * seconds (a number), and where it goes. */
typedef struct {
    const char *name;
    int units;
    size_t offset;
} record_field;

static const record_field block_fields[] = {
    {"forward_s", 0, offsetof(plan_block, forward_s)},
    {"backward_s", 0, offsetof(plan_block, backward_s)},
    {"recompute_s", 0, offsetof(plan_block, recompute_s)},
    {"copy_s", 0, offsetof(plan_block, copy_s)},
    {"input_units", 1, offsetof(plan_block, input_units)},
    {"activation_units", 1, offsetof(plan_block, activation_units)},
    {"offload_held_units", 1, offsetof(plan_block, offload_held_units)},
    {"keep_work_units", 1, offsetof(plan_block, keep_work_units)},
    {"checkpoint_work_units", 1, offsetof(plan_block, checkpoint_work_units)},
};
#define BLOCK_FIELDS (sizeof block_fields / sizeof block_fields[0])

static const record_field policy_fields[] = {
    {"time_s", 0, offsetof(plan_policy, time_s)},
    {"units", 1, offsetof(plan_policy, units)},
    {"copy_s", 0, offsetof(plan_policy, copy_s)},
    {"offload_held_units", 1, offsetof(plan_policy, offload_held_units)},
};
#define POLICY_FIELDS (sizeof policy_fields / sizeof policy_fields[0])

/* sums of units over a chain must not wrap: keep each far below 2^64 */
#define MAX_UNITS (1LL << 42)

/* Reads the fields of `table` from dict `record` into `out`; -1 with an
 * exception naming block `index` (and `policy`, NULL for the block's own)
 * where one is missing, extra or out of range. *sum gains the times. */
static int
read_fields(PyObject *record, const record_field *table, size_t count, Py_ssize_t extra,
            Py_ssize_t index, const char *policy, char *out, double *sum)
{
    const char *where = policy ? policy : "block";
    if (!PyDict_Check(record)) {
        PyObject *type_name = mp_type_name(record);
        PyErr_Format(PyExc_TypeError, "block %zd: %s must be a dict, got %.100V", index, where,
                     type_name, "?");
        Py_XDECREF(type_name);
        return -1;
    }
    if (PyDict_GET_SIZE(record) != (Py_ssize_t)count + extra) {
        PyErr_Format(PyExc_TypeError, "block %zd: %s must have exactly the keys of %s", index,
                     where, policy ? "PLAN_POLICY_FIELDS" : "PLAN_BLOCK_FIELDS and PLAN_POLICIES");
        return -1;
    }
    for (size_t k = 0; k < count; k++) {
        PyObject *value = PyDict_GetItemString(record, table[k].name);
        if (value == NULL) {
            PyErr_Format(PyExc_TypeError, "block %zd: %s has no %s", index, where,
                         table[k].name);
            return -1;
        }
        if (table[k].units) {
            long long units = PyLong_Check(value) ? PyLong_AsLongLong(value) : -1;
            if (units == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                units = MAX_UNITS + 1;
            }
            if (!PyLong_Check(value) || units < 0 || units > MAX_UNITS) {
                PyErr_Format(units > MAX_UNITS ? PyExc_OverflowError : PyExc_ValueError,
                             "block %zd: %s's %s must be an int from 0 to 2**42 (use a larger "
                             "unit)", index, where, table[k].name);
                return -1;
            }
            uint64_t stored = (uint64_t)units;
            memcpy(out + table[k].offset, &stored, sizeof stored);
        } else {
            double seconds = PyFloat_AsDouble(value);
            if (seconds == -1.0 && PyErr_Occurred())
                return -1;
            if (!(seconds >= 0)) {
                PyErr_Format(PyExc_ValueError, "block %zd: %s's %s must be a number >= 0",
                             index, where, table[k].name);
                return -1;
            }
            memcpy(out + table[k].offset, &seconds, sizeof seconds);
            *sum += seconds;
        }
    }
    return 0;
}

/* -1 with an exception where what an offload leaves on the device is more
 * than it would hold kept. */
static int
check_offload_held(Py_ssize_t index, const plan_block *block)
{
    if (block->offload_held_units > block->input_units) {
        PyErr_Format(PyExc_ValueError, "block %zd: offload_held_units above input_units", index);
        return -1;
    }
    for (int p = 0; p < PLAN_POLICIES; p++) {
        const plan_policy *policy = &block->policies[p];
        if (policy->offload_held_units > policy->units) {
            PyErr_Format(PyExc_ValueError, "block %zd: %s's offload_held_units above its units",
                         index, plan_policy_names[p]);
            return -1;
        }
    }
    return 0;
}

static int
block_from_record(PyObject *record, Py_ssize_t index, plan_block *block)
{
    double sum = 0;
    if (read_fields(record, block_fields, BLOCK_FIELDS, PLAN_POLICIES, index, NULL,
                    (char *)block, &sum) < 0)
        return -1;
    for (int p = 0; p < PLAN_POLICIES; p++) {
        PyObject *policy = PyDict_GetItemString(record, plan_policy_names[p]);
        if (policy == NULL) {
            PyErr_Format(PyExc_TypeError, "block %zd: block has no %s", index,
                         plan_policy_names[p]);
            return -1;
        }
        if (read_fields(policy, policy_fields, POLICY_FIELDS, 0, index, plan_policy_names[p],
                        (char *)&block->policies[p], &sum) < 0)
            return -1;
    }
    if (check_offload_held(index, block) < 0)
        return -1;
    /* the solver adds a block's times together: their sum must stay finite */
    if (!isfinite(sum)) {
        PyErr_Format(PyExc_ValueError,
                     "block %zd: times too large, they and their sum must be finite", index);
        return -1;
    }
    return 0;
}

/* A PyMem array of the blocks, *n set; NULL with an exception. */
static plan_block *
blocks_from_sequence(PyObject *sequence, int *n)
{
    PyObject *fast = PySequence_Fast(sequence, "blocks must be a sequence of block records");
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
        if (block_from_record(PySequence_Fast_GET_ITEM(fast, i), i, &blocks[i]) < 0)
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

/* The bytes of a `choices` argument (read with "y#": the limited API of
 * 3.10 has no Py_buffer), borrowed from the call's arguments. */
typedef struct {
    const char *buf;
    Py_ssize_t len;
} plan_choices;

/* The blocks of `sequence` and the validated `choices`; -1 with an
 * exception. */
static int
blocks_and_choices(PyObject *sequence, const plan_choices *choices, plan_block **blocks, int *n)
{
    *blocks = blocks_from_sequence(sequence, n);
    if (*blocks == NULL)
        goto error;
    if (choices->len != *n) {
        PyErr_Format(PyExc_ValueError, "%zd choices for %d blocks", choices->len, *n);
        goto error;
    }
    const uint8_t *values = (const uint8_t *)choices->buf;
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
    return -1;
}

PyObject *
plan_evaluate_py(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *sequence;
    plan_choices choices;
    plan_block *blocks;
    int pipeline, n;
    if (!PyArg_ParseTuple(args, "Oy#p:_plan_evaluate", &sequence, &choices.buf, &choices.len,
                          &pipeline))
        return NULL;
    if (blocks_and_choices(sequence, &choices, &blocks, &n) < 0)
        return NULL;
    PyObject *result = cost_tuple(plan_evaluate(blocks, n, (const uint8_t *)choices.buf, pipeline));
    PyMem_Free(blocks);
    return result;
}

PyObject *
plan_evaluate_blocks_py(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *sequence, *result = NULL;
    plan_choices choices;
    plan_block *blocks;
    int pipeline, n;
    if (!PyArg_ParseTuple(args, "Oy#p:_plan_evaluate_blocks", &sequence, &choices.buf,
                          &choices.len, &pipeline))
        return NULL;
    if (blocks_and_choices(sequence, &choices, &blocks, &n) < 0)
        return NULL;
    plan_cost *costs = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(plan_cost));
    if (costs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    plan_evaluate_blocks(blocks, n, (const uint8_t *)choices.buf, pipeline, costs);
    result = cost_list(costs, n);
done:
    PyMem_Free(costs);
    PyMem_Free(blocks);
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

/* A tuple of the names in `table`; NULL with an exception. */
static PyObject *
field_names(const record_field *table, size_t count)
{
    PyObject *names = PyTuple_New((Py_ssize_t)count);
    for (size_t k = 0; names != NULL && k < count; k++) {
        PyObject *name = PyUnicode_FromString(table[k].name);
        if (name == NULL)
            Py_CLEAR(names);
        else
            PyTuple_SET_ITEM(names, (Py_ssize_t)k, name);
    }
    return names;
}

/* PLAN_CHOICES: one dict per choice, in PLAN_* order. */
static PyObject *
choice_table(void)
{
    PyObject *table = PyTuple_New(PLAN_CHOICES);
    for (int c = 0; table != NULL && c < PLAN_CHOICES; c++) {
        const plan_choice_info *info = &plan_choice_table[c];
        PyObject *entry = Py_BuildValue(
            "{s:s, s:s, s:z, s:O}", "name", info->name, "saves", info->saves, "policy",
            info->policy >= 0 ? plan_policy_names[info->policy] : NULL, "offloads",
            info->offloads ? Py_True : Py_False);
        if (entry == NULL)
            Py_CLEAR(table);
        else
            PyTuple_SET_ITEM(table, c, entry);
    }
    return table;
}

static PyObject *
policy_names(void)
{
    PyObject *names = PyTuple_New(PLAN_POLICIES);
    for (int p = 0; names != NULL && p < PLAN_POLICIES; p++) {
        PyObject *name = PyUnicode_FromString(plan_policy_names[p]);
        if (name == NULL)
            Py_CLEAR(names);
        else
            PyTuple_SET_ITEM(names, p, name);
    }
    return names;
}

/* Adds `value` (a new reference, or NULL with an error set) as `name`. */
static int
add_new(PyObject *module, const char *name, PyObject *value)
{
    int status = value != NULL ? PyModule_AddObjectRef(module, name, value) : -1;
    Py_XDECREF(value);
    return status;
}

int
plan_add_constants(PyObject *module)
{
    if (add_new(module, "PLAN_CHOICES", choice_table()) < 0 ||
        add_new(module, "PLAN_POLICIES", policy_names()) < 0 ||
        add_new(module, "PLAN_BLOCK_FIELDS", field_names(block_fields, BLOCK_FIELDS)) < 0 ||
        add_new(module, "PLAN_POLICY_FIELDS", field_names(policy_fields, POLICY_FIELDS)) < 0)
        return -1;
    return add_new(module, "PLAN_UNMEASURED_S", PyFloat_FromDouble(PLAN_UNMEASURED_S));
}
