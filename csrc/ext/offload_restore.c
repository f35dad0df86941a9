/* The restore direction: copying offloaded spans back for a recompute,
 * prefetching the regions backward reaches next, and rebuilding each input
 * as a view of its span. */
#include "offload.h"
#include "errors.h"
#include "offload_types.h"
#include "offload_window.h"
#include "streams.h"

#include <string.h>

static PyObject *
empty_bytes(mp_state *st, uint64_t nbytes, PyObject *device_obj)
{
    PyObject *kwargs = Py_BuildValue("{sOsO}", "dtype", st->uint8_dtype, "device", device_obj);
    PyObject *args = kwargs ? Py_BuildValue("((K))", (unsigned long long)nbytes) : NULL;
    PyObject *tensor = args ? PyObject_Call(st->torch_empty, args, kwargs) : NULL;
    Py_XDECREF(kwargs);
    Py_XDECREF(args);
    return tensor;
}

static int
tensor_ptr(PyObject *tensor, void **ptr)
{
    int64_t value;
    if (inspect_call_int64(tensor, "data_ptr", &value) < 0)
        return -1;
    *ptr = (void *)(uintptr_t)value;
    return 0;
}

/* Host to device, on the copy-in stream (prefetch) or the current one. */
static int
start_h2d(mp_state *st, StorageCopy *copy, void *dst, int on_copy_stream)
{
    const cudart *rt = st->engine->rt;
    offload_device *device = copy->device;
    void *compute, *stream;
    int previous;
    if (offload_engine_current_stream(st, device->index, &compute) < 0 ||
        streams_enter_device(rt, device->index, &previous) < 0)
        return -1;
    stream = on_copy_stream ? device->copy_in : compute;
    /* the destination came from the compute stream's allocator: copy after
     * its queued work, and after the offload's own D2H if still pending */
    int failed = (on_copy_stream && streams_wait_stream(rt, stream, compute) < 0) ||
                 (copy->d2h_done != NULL &&
                  streams_check(rt, rt->stream_wait_event(stream, copy->d2h_done, 0),
                              "cudaStreamWaitEvent"));
    if (!failed && copy->h2d_done != NULL) {
        (void)rt->event_destroy(copy->h2d_done);
        copy->h2d_done = NULL;
    }
    failed = failed ||
             streams_check(rt, rt->memcpy_async(dst, copy->block.ptr, (size_t)copy->nbytes,
                                              CUDART_MEMCPY_HOST_TO_DEVICE, stream),
                         "cudaMemcpyAsync (host to device)") ||
             streams_record_new_event(rt, stream, &copy->h2d_done) < 0;
    streams_leave_device(rt, previous);
    return failed ? -1 : 0;
}

/* Allocating the destination lets other threads run: the copy is held
 * meanwhile, and one fetched by them in that window is taken as is. */
static int
fetch_copy(mp_state *st, StorageCopy *copy, int on_copy_stream)
{
    if (copy->fetched != NULL)
        return 0;
    Py_INCREF(copy);
    PyObject *fetched = empty_bytes(st, copy->nbytes, copy->device_obj);
    void *dst;
    int failed = fetched == NULL || tensor_ptr(fetched, &dst) < 0;
    if (!failed && copy->fetched == NULL) {
        failed = copy->device->index < 0
                     ? (memcpy(dst, copy->block.ptr, (size_t)copy->nbytes), 0)
                     : start_h2d(st, copy, dst, on_copy_stream);
        if (!failed) {
            copy->fetched = Py_NewRef(fetched);
            if (on_copy_stream)
                st->engine->prefetched++;
            else
                st->engine->fetched_at_need++;
        }
    }
    Py_XDECREF(fetched);
    Py_DECREF(copy);
    return failed ? -1 : 0;
}

static int
fetch_group(mp_state *st, OffloadGroup *group, int on_copy_stream)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(group->copies); i++) {
        if (fetch_copy(st, (StorageCopy *)PyTuple_GET_ITEM(group->copies, i), on_copy_stream) < 0)
            return -1;
    }
    return 0;
}

int
offload_group_begin_restore(mp_state *st, PyObject *group_obj, int prefetch_ahead)
{
    OffloadGroup *group = (OffloadGroup *)group_obj;
    offload_options *opts = &st->engine->options;
    if (group == NULL || group->device == NULL)
        return 0;
    /* backward has begun on this device: nothing it copied out stays */
    if (group->device->index >= 0 && offload_window_release_all(st->engine, group->device) < 0)
        return -1;
    if (fetch_group(st, group, 0) < 0)
        return -1;
    if (!opts->pipeline || !prefetch_ahead)
        return 0;
    /* backward runs this thread's frames in reverse creation order: fetch
     * those ahead. Fetching lets other threads run and free groups, so the
     * walk holds the group it stands on. */
    int fetched = 0, failed = 0;
    OffloadGroup *ahead = group->linked ? group->prev : NULL;
    Py_XINCREF(ahead);
    while (ahead != NULL && fetched < opts->prefetch_depth && !failed) {
        if (ahead->thread == group->thread) {
            failed = fetch_group(st, ahead, 1) < 0;
            fetched++;
        }
        OffloadGroup *next = ahead->linked ? ahead->prev : NULL;
        Py_XINCREF(next);
        Py_SETREF(ahead, next);
    }
    Py_XDECREF(ahead);
    return failed ? -1 : 0;
}

void
offload_group_end_restore(PyObject *group_obj)
{
    OffloadGroup *group = (OffloadGroup *)group_obj;
    if (group == NULL)
        return;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(group->copies); i++)
        Py_CLEAR(((StorageCopy *)PyTuple_GET_ITEM(group->copies, i))->fetched);
}

int
offload_is_record(mp_state *st, PyObject *obj)
{
    return Py_IS_TYPE(obj, st->tensor_record_type);
}

static PyObject *
view_of_copy(mp_state *st, TensorRecord *record)
{
    StorageCopy *copy = record->copy;
    PyObject *kwargs = Py_BuildValue("{sOsO}", "dtype", record->dtype, "device",
                                     record->device_obj);
    if (kwargs == NULL)
        return NULL;
    PyObject *result = NULL;
    if (copy == NULL) {
        PyObject *args = PyTuple_Pack(2, record->size, record->stride);
        result = args ? PyObject_Call(st->torch_empty_strided, args, kwargs) : NULL;
        Py_XDECREF(args);
        Py_DECREF(kwargs);
        return result;
    }
    PyObject *args = Py_BuildValue("((i))", 0);
    PyObject *empty = args ? PyObject_Call(st->torch_empty, args, kwargs) : NULL;
    PyObject *storage = empty ? PyObject_CallMethod(copy->fetched, "untyped_storage", NULL) : NULL;
    if (storage != NULL)
        result = PyObject_CallMethod(empty, "set_", "OLOO", storage, (long long)record->offset,
                                     record->size, record->stride);
    Py_XDECREF(args);
    Py_XDECREF(empty);
    Py_XDECREF(storage);
    Py_DECREF(kwargs);
    return result;
}

/* A restored input must require grad as it did in the forward pass, or the
 * recompute would save other tensors. SavedTensor does this itself. */
static PyObject *
with_requires_grad(PyObject *tensor, int requires_grad)
{
    if (tensor == NULL || !requires_grad)
        return tensor;
    PyObject *done = PyObject_CallMethod(tensor, "requires_grad_", "O", Py_True);
    Py_DECREF(tensor);
    return done;
}

PyObject *
offload_restore(mp_state *st, PyObject *record_obj)
{
    TensorRecord *record = (TensorRecord *)record_obj;
    StorageCopy *copy = record->copy;
    int changed = record->modified_in_forward ? 1 : offload_source_changed(st, record);
    if (changed != 0) {
        if (changed > 0)
            checkpoint_raise_modified_input(record->input_index);
        return NULL;
    }
    if (copy != NULL) {
        /* fetched already by the group, unless unpacked on its own */
        if (copy->fetched == NULL && fetch_copy(st, copy, 0) < 0)
            return NULL;
        if (copy->device->index >= 0 && copy->h2d_done != NULL) {
            const cudart *rt = st->engine->rt;
            void *compute;
            if (offload_engine_current_stream(st, copy->device->index, &compute) < 0 ||
                streams_check(rt, rt->stream_wait_event(compute, copy->h2d_done, 0),
                            "cudaStreamWaitEvent"))
                return NULL;
        }
    }
    PyObject *view = view_of_copy(st, record);
    return st->make_saved_tensor == NULL ? with_requires_grad(view, record->requires_grad) : view;
}

PyObject *
offload_unpack_hook(PyObject *module, PyObject *record)
{
    mp_state *st = PyModule_GetState(module);
    if (!offload_is_record(st, record)) {
        PyErr_SetString(PyExc_TypeError, "matepoint: offload unpack hook got a foreign object");
        return NULL;
    }
    return offload_restore(st, record);
}
