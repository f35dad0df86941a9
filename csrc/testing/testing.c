#include "testing.h"
#include "offload_types.h"
#include "cuda/cudart_sim.h"

static int
count_arg(PyObject *arg, uint64_t *out)
{
    unsigned long long value = PyLong_AsUnsignedLongLong(arg);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = value;
    return 0;
}

PyObject *
testing_simulate_cuda(PyObject *module, PyObject *on)
{
    int enable = PyObject_IsTrue(on);
    if (enable < 0 || offload_engine_simulate(offload_engine_of(module), enable) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyObject *
testing_sim_advance(PyObject *module, PyObject *ops)
{
    (void)module;
    uint64_t count;
    if (count_arg(ops, &count) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(cudart_sim_advance(count));
}

PyObject *
testing_sim_set_progress(PyObject *module, PyObject *ops)
{
    (void)module;
    uint64_t count;
    if (count_arg(ops, &count) < 0)
        return NULL;
    cudart_sim_set_progress(count);
    Py_RETURN_NONE;
}

PyObject *
testing_sim_stats(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    cudart_sim_stats s = cudart_sim_get_stats();
    return Py_BuildValue("{sKsKsKsKsKsK}", "ops_queued", (unsigned long long)s.ops_queued,
                         "ops_run", (unsigned long long)s.ops_run, "copies_run",
                         (unsigned long long)s.copies_run, "streams_live",
                         (unsigned long long)s.streams_live, "events_live",
                         (unsigned long long)s.events_live, "host_bytes_live",
                         (unsigned long long)s.host_bytes_live);
}

static int
append_copy(offload_engine *engine, PyObject *list, StorageCopy *copy)
{
    int done = copy->d2h_done == NULL ||
               engine->rt->event_query(copy->d2h_done) == CUDART_SUCCESS;
    PyObject *row = Py_BuildValue("(KKOO)", (unsigned long long)copy->region,
                                  (unsigned long long)copy->nbytes,
                                  copy->source != NULL ? Py_True : Py_False,
                                  done ? Py_True : Py_False);
    int failed = row == NULL || PyList_Append(list, row) < 0;
    Py_XDECREF(row);
    return failed ? -1 : 0;
}

PyObject *
testing_offload_copies(PyObject *module, PyObject *unused)
{
    (void)unused;
    offload_engine *engine = offload_engine_of(module);
    PyObject *list = PyList_New(0);
    for (int i = 0; list != NULL && i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] == NULL)
            continue;
        for (OffloadGroup *g = engine->cuda[i]->first; list != NULL && g != NULL; g = g->next) {
            for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(g->copies); j++) {
                StorageCopy *copy = (StorageCopy *)PyTuple_GET_ITEM(g->copies, j);
                if (append_copy(engine, list, copy) < 0) {
                    Py_CLEAR(list);
                    break;
                }
            }
        }
    }
    return list;
}
