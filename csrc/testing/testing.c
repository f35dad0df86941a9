#include "testing.h"
#include "testing/cudart_sim.h"
#include "offload/offload_internal.h"

#include <stdatomic.h>
#include <string.h>

/* Host synchronizations made with the GIL held, per runtime entry point:
 * written by any thread through the simulator's observer, hence atomic. */
static _Atomic uint64_t synchronized_under_gil[SIM_ENTRY_COUNT];

#ifdef Py_LIMITED_API
/* Not in the limited API, yet exported by every CPython 3.x libpython: a
 * test build never ships (matepoint/_build_layout.py refuses a release
 * build with MATEPOINT_TESTING), so it may call it. */
PyAPI_FUNC(int) PyGILState_Check(void);
#endif

static void
note_sync(cudart_sim_entry entry)
{
    if (PyGILState_Check())
        atomic_fetch_add(&synchronized_under_gil[entry], 1);
}

static int
count_arg(PyObject *arg, uint64_t *out)
{
    unsigned long long value = PyLong_AsUnsignedLongLong(arg);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = value;
    return 0;
}

int
testing_device_arg(PyObject *arg, int *device)
{
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value < 0 || value >= CUDART_SIM_DEVICES) {
        PyErr_Format(PyExc_ValueError, "simulated GPU: no device %ld (it has %d)", value,
                     CUDART_SIM_DEVICES);
        return -1;
    }
    *device = (int)value;
    return 0;
}

static PyObject *
simulate_cuda(PyObject *module, PyObject *on)
{
    int enable = PyObject_IsTrue(on);
    const offload_runtime *runtime = enable ? &offload_runtime_sim : &offload_runtime_torch;
    if (enable < 0 || offload_engine_use_runtime(offload_engine_of(module), runtime) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
sim_advance(PyObject *module, PyObject *ops)
{
    (void)module;
    uint64_t count;
    if (count_arg(ops, &count) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(cudart_sim_advance(count));
}

static PyObject *
sim_expandable(PyObject *module, PyObject *on)
{
    (void)module;
    int flag = PyObject_IsTrue(on);
    if (flag < 0)
        return NULL;
    cudart_sim_set_expandable(flag);
    Py_RETURN_NONE;
}

static PyObject *
sim_set_progress(PyObject *module, PyObject *ops)
{
    (void)module;
    uint64_t count;
    if (count_arg(ops, &count) < 0)
        return NULL;
    cudart_sim_set_progress(count);
    Py_RETURN_NONE;
}

static PyObject *
per_device_list(const uint64_t *values, const int *flags)
{
    PyObject *list = PyList_New(CUDART_SIM_DEVICES);
    for (int d = 0; list != NULL && d < CUDART_SIM_DEVICES; d++) {
        PyObject *item = values ? PyLong_FromUnsignedLongLong(values[d])
                                : PyBool_FromLong(flags[d]);
        if (item == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, d, item);
    }
    return list;
}

static PyObject *
calls_dict(const uint64_t *counts)
{
    PyObject *calls = PyDict_New();
    for (int e = 0; calls != NULL && e < SIM_ENTRY_COUNT; e++) {
        PyObject *count = PyLong_FromUnsignedLongLong(counts[e]);
        if (count == NULL || PyDict_SetItemString(calls, cudart_sim_entry_name(e), count) < 0)
            Py_CLEAR(calls);
        Py_XDECREF(count);
    }
    return calls;
}

static PyObject *
sim_stats(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    cudart_sim_stats s = cudart_sim_get_stats();
    uint64_t under_gil[SIM_ENTRY_COUNT];
    for (int e = 0; e < SIM_ENTRY_COUNT; e++)
        under_gil[e] = atomic_load(&synchronized_under_gil[e]);
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsNsNsNsN}", "ops_queued", (unsigned long long)s.ops_queued,
        "unmap_faults", (unsigned long long)s.unmap_faults,
        "kernels_queued", (unsigned long long)s.kernels_queued, "kernels_run",
        (unsigned long long)s.kernels_run, "kernels_poisoned",
        (unsigned long long)s.kernels_poisoned, "ops_run",
        (unsigned long long)s.ops_run, "copies_run", (unsigned long long)s.copies_run,
        "pageable_copies", (unsigned long long)s.pageable_copies, "launch_errors",
        (unsigned long long)s.launch_errors, "streams_live",
        (unsigned long long)s.streams_live, "events_live", (unsigned long long)s.events_live,
        "host_bytes_live", (unsigned long long)s.host_bytes_live, "device_bytes_live",
        per_device_list(s.device_bytes_live, NULL), "contexts",
        per_device_list(NULL, s.has_context), "calls", calls_dict(s.calls),
        "synchronized_under_gil", calls_dict(under_gil));
}

static PyObject *
sim_set_device(PyObject *module, PyObject *arg)
{
    (void)module;
    int device;
    if (testing_device_arg(arg, &device) < 0)
        return NULL;
    (void)sim_runtime_torch_set_device(device);
    Py_RETURN_NONE;
}

static PyObject *
sim_get_device(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromLong(cudart_sim_current_device());
}

static PyObject *
sim_stream_create(PyObject *module, PyObject *arg)
{
    (void)module;
    int device, previous = cudart_sim_current_device();
    void *stream = NULL;
    if (testing_device_arg(arg, &device) < 0)
        return NULL;
    const cudart *rt = cudart_sim();
    (void)cudart_sim_set_current_device(device);
    int status = rt->stream_create(&stream, CUDART_STREAM_NON_BLOCKING);
    (void)cudart_sim_set_current_device(previous);
    if (status != CUDART_SUCCESS) {
        (void)rt->get_last_error();
        return PyErr_Format(PyExc_RuntimeError, "simulated GPU: stream creation failed (%d)",
                            status);
    }
    return PyLong_FromVoidPtr(stream);
}

static PyObject *
sim_stream_destroy(PyObject *module, PyObject *arg)
{
    (void)module;
    void *stream = PyLong_AsVoidPtr(arg);
    if (PyErr_Occurred())
        return NULL;
    if (cudart_sim()->stream_destroy(stream) != CUDART_SUCCESS) {
        (void)cudart_sim()->get_last_error();
        PyErr_SetString(PyExc_ValueError, "simulated GPU: no such stream");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
sim_set_stream(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *device_obj, *handle;
    int device;
    if (!PyArg_ParseTuple(args, "OO:_sim_set_stream", &device_obj, &handle) ||
        testing_device_arg(device_obj, &device) < 0)
        return NULL;
    void *stream = handle == Py_None ? NULL : PyLong_AsVoidPtr(handle);
    if (PyErr_Occurred())
        return NULL;
    /* cudaStreamLegacy and cudaStreamPerThread name a stream of every device */
    int special = stream == CUDART_STREAM_LEGACY || stream == CUDART_STREAM_PER_THREAD;
    if (stream != NULL && !special && cudart_sim_stream_device(stream) != device) {
        PyErr_Format(PyExc_ValueError, "simulated GPU: that stream is not device %d's", device);
        return NULL;
    }
    cudart_sim_set_current_stream(device, stream);
    Py_RETURN_NONE;
}

static PyObject *
sim_current_stream(PyObject *module, PyObject *arg)
{
    (void)module;
    int device;
    if (testing_device_arg(arg, &device) < 0)
        return NULL;
    void *stream = cudart_sim_current_stream(device);
    return stream == NULL ? Py_NewRef(Py_None) : PyLong_FromVoidPtr(stream);
}

static PyObject *
sim_launch(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *device_obj, *handle;
    int device;
    if (!PyArg_ParseTuple(args, "OO:_sim_launch", &device_obj, &handle) ||
        testing_device_arg(device_obj, &device) < 0)
        return NULL;
    void *stream = handle == Py_None ? NULL : PyLong_AsVoidPtr(handle);
    if (PyErr_Occurred())
        return NULL;
    int status = cudart_sim_launch(device, stream);
    if (status != CUDART_SUCCESS)
        return PyErr_Format(PyExc_RuntimeError, "simulated GPU: launch failed (%d)", status);
    Py_RETURN_NONE;
}

static PyObject *
sim_peek_last_error(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromLong(cudart_sim_peek_last_error());
}

static PyObject *
sim_fail(PyObject *module, PyObject *args)
{
    (void)module;
    const char *name;
    unsigned long long skip, count;
    int status;
    if (!PyArg_ParseTuple(args, "sKKi:_sim_fail", &name, &skip, &count, &status))
        return NULL;
    for (int e = 0; e < SIM_ENTRY_COUNT; e++) {
        if (strcmp(cudart_sim_entry_name(e), name) == 0) {
            cudart_sim_fail((cudart_sim_entry)e, skip, count, status);
            Py_RETURN_NONE;
        }
    }
    return PyErr_Format(PyExc_ValueError, "simulated GPU: no runtime call named %s", name);
}

static PyObject *
sim_log_waits(PyObject *module, PyObject *on)
{
    (void)module;
    int enable = PyObject_IsTrue(on);
    if (enable < 0)
        return NULL;
    cudart_sim_log_waits(enable);
    Py_RETURN_NONE;
}

static PyObject *
handle_or_none(void *handle)
{
    return handle == NULL ? Py_NewRef(Py_None) : PyLong_FromVoidPtr(handle);
}

static PyObject *
sim_wait_log(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    size_t count = cudart_sim_wait_log(NULL, 0);
    cudart_sim_wait *waits = PyMem_Calloc(count ? count : 1, sizeof(*waits));
    if (waits == NULL)
        return PyErr_NoMemory();
    size_t held = cudart_sim_wait_log(waits, count);   /* the log may have grown since */
    if (held < count)
        count = held;
    PyObject *list = PyList_New(0);
    for (size_t i = 0; list != NULL && i < count; i++) {
        PyObject *row = Py_BuildValue("{sisNsisN}", "waiter_device", waits[i].waiter_device,
                                      "waiter", handle_or_none(waits[i].waiter),
                                      "source_device", waits[i].source_device, "source",
                                      handle_or_none(waits[i].source));
        if (row == NULL || PyList_Append(list, row) < 0)
            Py_CLEAR(list);
        Py_XDECREF(row);
    }
    PyMem_Free(waits);
    return list;
}

static PyObject *
offload_streams(PyObject *module, PyObject *unused)
{
    (void)unused;
    offload_engine *engine = offload_engine_of(module);
    PyObject *streams = PyDict_New();
    for (int i = 0; streams != NULL && i < MAX_CUDA_DEVICES; i++) {
        offload_device *device = engine->cuda[i];
        if (device == NULL)
            continue;
        PyObject *pair = Py_BuildValue("{sNsN}", "copy_out", handle_or_none(device->copy_out),
                                       "copy_in", handle_or_none(device->copy_in));
        PyObject *key = pair ? PyLong_FromLong(i) : NULL;
        if (key == NULL || PyDict_SetItem(streams, key, pair) < 0)
            Py_CLEAR(streams);
        Py_XDECREF(key);
        Py_XDECREF(pair);
    }
    return streams;
}

static PyObject *
sim_fail_fetches(PyObject *module, PyObject *args)
{
    (void)module;
    unsigned long long skip, count;
    if (!PyArg_ParseTuple(args, "KK:_sim_fail_fetches", &skip, &count))
        return NULL;
    sim_runtime_fail_fetches(skip, count);
    Py_RETURN_NONE;
}

static PyObject *
sim_forget_contexts(PyObject *module, PyObject *unused)
{
    (void)unused;
    offload_engine_of(module)->devices_with_context = 0;
    cudart_sim_forget_contexts();
    Py_RETURN_NONE;
}

static PyObject *
sim_attach_allocator(PyObject *module, PyObject *path)
{
    (void)module;
    if (sim_runtime_attach_allocator(path) < 0)
        return NULL;
    return PyLong_FromVoidPtr((void *)(uintptr_t)sim_runtime_where);
}

static int
append_copy(offload_engine *engine, PyObject *list, StorageCopy *copy)
{
    int done = copy->d2h_done == NULL || cudart_sim_event_done(copy->d2h_done);
    (void)engine;
    PyObject *row = Py_BuildValue("(KKOOi)", (unsigned long long)copy->region,
                                  (unsigned long long)copy->nbytes,
                                  copy->source != NULL ? Py_True : Py_False,
                                  done ? Py_True : Py_False, copy->device->index);
    int failed = row == NULL || PyList_Append(list, row) < 0;
    Py_XDECREF(row);
    return failed ? -1 : 0;
}

static PyObject *
offload_copies(PyObject *module, PyObject *unused)
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

static PyObject *
fail_pool_acquires(PyObject *module, PyObject *arg)
{
    long count = PyLong_AsLong(arg);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    if (count < 0 || count > 1000000) {
        PyErr_SetString(PyExc_ValueError, "matepoint: count out of range");
        return NULL;
    }
    offload_fail_next_acquires(mp_state_of(module), (int)count);
    Py_RETURN_NONE;
}

static PyMethodDef testing_methods[] = {
    {"_simulate_cuda", simulate_cuda, METH_O,
     "_simulate_cuda($module, on, /)\n--\n\n"
     "Run the offload engine over the simulated GPU (on=True) or torch's CUDA again."},
    {"_sim_advance", sim_advance, METH_O,
     "_sim_advance($module, ops, /)\n--\n\n"
     "Let the simulated GPU run up to ops queued operations; returns how many ran."},
    {"_sim_expandable", sim_expandable, METH_O,
     "_sim_expandable($module, on, /)\n--\n\n"
     "cudaFree as torch's expandable segments unmap: after syncing only the memory's own\n"
     "stream; work of other streams still on it counts in _sim_stats()['unmap_faults']."},
    {"_sim_set_progress", sim_set_progress, METH_O,
     "_sim_set_progress($module, ops, /)\n--\n\n"
     "Operations the simulated GPU runs at every runtime call."},
    {"_sim_stats", sim_stats, METH_NOARGS,
     "_sim_stats($module, /)\n--\n\n"
     "Counters of the simulated GPU, as a dict."},
    {"_sim_set_device", sim_set_device, METH_O,
     "_sim_set_device($module, device, /)\n--\n\n"
     "The calling thread's current device, as torch.cuda.set_device (cudaSetDevice; torch's "
     "target device cleared)."},
    {"_sim_get_device", sim_get_device, METH_NOARGS,
     "_sim_get_device($module, /)\n--\n\n"
     "The calling thread's current device."},
    {"_sim_stream_create", sim_stream_create, METH_O,
     "_sim_stream_create($module, device, /)\n--\n\n"
     "A new stream of device; returns its handle."},
    {"_sim_stream_destroy", sim_stream_destroy, METH_O,
     "_sim_stream_destroy($module, handle, /)\n--\n\n"
     "Destroy a stream made by _sim_stream_create."},
    {"_sim_set_stream", sim_set_stream, METH_VARARGS,
     "_sim_set_stream($module, device, handle, /)\n--\n\n"
     "torch's current stream of device on this thread (None: the legacy stream)."},
    {"_sim_current_stream", sim_current_stream, METH_O,
     "_sim_current_stream($module, device, /)\n--\n\n"
     "torch's current stream of device on this thread, None for the legacy one."},
    {"_sim_launch", sim_launch, METH_VARARGS,
     "_sim_launch($module, device, handle, /)\n--\n\n"
     "A CPU kernel on that stream: the stream catches up first."},
    {"_sim_peek_last_error", sim_peek_last_error, METH_NOARGS,
     "_sim_peek_last_error($module, /)\n--\n\n"
     "The calling thread's CUDA last error, left in place."},
    {"_sim_fail", sim_fail, METH_VARARGS,
     "_sim_fail($module, name, skip, count, status, /)\n--\n\n"
     "The next skip calls of the runtime call name succeed, the count after them fail with "
     "status."},
    {"_sim_log_waits", sim_log_waits, METH_O,
     "_sim_log_waits($module, on, /)\n--\n\n"
     "Start (clearing it) or stop the log of every cudaStreamWaitEvent."},
    {"_sim_wait_log", sim_wait_log, METH_NOARGS,
     "_sim_wait_log($module, /)\n--\n\n"
     "Each logged wait: waiter_device, waiter, source_device, source (handles; None for a "
     "legacy stream; source_device -1 for an event never recorded)."},
    {"_offload_streams", offload_streams, METH_NOARGS,
     "_offload_streams($module, /)\n--\n\n"
     "The engine's copy_out and copy_in stream handles, per device it copied on."},
    {"_sim_fail_fetches", sim_fail_fetches, METH_VARARGS,
     "_sim_fail_fetches($module, skip, count, /)\n--\n\n"
     "The next skip copies back find device memory, the count after them raise "
     "OutOfMemoryError."},
    {"_sim_forget_contexts", sim_forget_contexts, METH_NOARGS,
     "_sim_forget_contexts($module, /)\n--\n\n"
     "No device has a context, as in a new process."},
    {"_sim_attach_allocator", sim_attach_allocator, METH_O,
     "_sim_attach_allocator($module, path, /)\n--\n\n"
     "Run the allocator library at path over the simulated GPU; returns the harness's "
     "placement function address."},
    {"_offload_copies", offload_copies, METH_NOARGS,
     "_offload_copies($module, /)\n--\n\n"
     "(region, nbytes, source_held, copy_out_done, device) of every live copy."},
    {"_fail_pool_acquires", fail_pool_acquires, METH_O,
     "_fail_pool_acquires($module, count, /)\n--\n\n"
     "The next count spans find no host memory at all (0 <= count <= 1000000)."},
    {NULL, NULL, 0, NULL},
};

int
testing_add_functions(PyObject *module)
{
    cudart_sim_set_sync_observer(note_sync);
    if (testing_torch_add_functions(module) < 0 ||
        PyModule_AddFunctions(module, testing_methods) < 0 ||
        testing_add_site_functions(module) < 0)
        return -1;
    if (testing_add_spill_functions(module) < 0)
        return -1;
    return testing_add_lag_functions(module);
}
