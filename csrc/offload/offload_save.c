/* The save direction: copying a region's eligible inputs out to pool
 * buffers and building the records autograd keeps in their place.
 *
 * Read top-down from offload_save_inputs (at the end): save_tensors
 * inspects each input (offload_inspect.c), offload_storages plans one span
 * per storage and offload_span copies it out (start_d2h: a pool buffer,
 * after the disk tier made room and returned buffers were polled; the
 * copy-out stream ordered after the producer; the copy joins the window),
 * make_records builds the records and the group, and end_regions lets the
 * window retire what it no longer allows.
 *
 * Owns nothing past the call: the copies, records and group it makes are
 * their owners' (offload_types.h). Floor `directions`: called by
 * csrc/checkpoint and the SAC entry points; calls every floor below but
 * restore. Raises the pageable-fallback warning of a copy out, where the
 * copy is made. GIL held. */
#include "base/hooks.h"
#include "offload_internal.h"
#include "streams.h"

#define SPAN_ALIGN 16   /* largest element size: keeps every view offset whole */

/* A pool buffer for the copy: a cached one with the GIL held, else one
 * pinned (milliseconds, and the pool may drop its cache: cudaFreeHost
 * synchronizes the device) with the GIL released. Buffers of dead copies
 * join the cache once their last copy is seen complete. 0, -1 when the pool
 * has no memory at all, -2 with an error (the disk tier could not start). */
static int
acquire_buffer(mp_state *st, StorageCopy *copy)
{
    offload_engine *engine = st->engine;
    /* with a disk tier, older spans go to disk first (offload_spill.c) */
    if (offload_spill_room(st, copy->nbytes) < 0)
        return -2;
    if (pool_acquire_cached(engine->pool, copy->nbytes, &copy->block) == 0)
        return 0;
    /* buffers of dead copies whose last copy completed serve first */
    if (offload_return_poll(engine, copy->device) > 0 &&
        pool_acquire_cached(engine->pool, copy->nbytes, &copy->block) == 0)
        return 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = pool_acquire(engine->pool, copy->nbytes, &copy->block);
    Py_END_ALLOW_THREADS
    return status;
}

/* Takes a pool buffer and queues the device-to-host copy of the span at
 * `src` into it on the copy-out stream, after the producer's work, with
 * the copy's device current (the producer may be its NULL stream; pinning
 * then runs in that device's context, which exists: its tensor lives
 * there). Once the copy is queued it may write the buffer at any time: if
 * its completion event cannot be recorded, the stream is drained before
 * the buffer can go back to the pool. 1 when started, 0 when the pool has
 * no memory at all, -1 with an error. */
static int
start_d2h(mp_state *st, StorageCopy *copy, uintptr_t src, PyObject *storage)
{
    offload_engine *engine = st->engine;
    const cudart *rt = engine->rt;
    offload_device *device = copy->device;
    void *producer;
    int previous;
    if (engine->fail_next_acquires > 0) {
        engine->fail_next_acquires--;
        return 0;
    }
    if (offload_engine_current_stream(st, device->index, &producer) < 0 ||
        offload_engine_enter_device(st, device->index, &previous) < 0)
        return -1;
    /* a stream being captured into a CUDA graph (or one that cannot say):
     * a copy out would become part of the graph, and the engine's event
     * queries would invalidate the capture; the span stays on the device */
    if (cudart_stream_capturing(rt, producer) != 0) {
        offload_engine_leave_device(st, device->index, previous);
        return 0;
    }
    int acquired = acquire_buffer(st, copy);
    if (acquired < 0) {
        offload_engine_leave_device(st, device->index, previous);
        return acquired == -2 ? -1 : 0;
    }
    int failed = offload_device_order(engine, device, OFFLOAD_SITE_COPY_OUT_AFTER_PRODUCER,
                                      device->copy_out, producer) < 0 ||
                 streams_memcpy(rt, copy->block.ptr, (const void *)src, (size_t)copy->nbytes,
                                CUDART_MEMCPY_DEVICE_TO_HOST, device->copy_out,
                                copy->block.fallback) < 0;
    if (!failed)
        copy_advance(copy, COPY_QUEUED);
    if (!failed && offload_device_record(engine, device, device->copy_out, &copy->d2h_done) < 0) {
        failed = 1;
        streams_wait_stream_quietly(rt, device->copy_out);
        copy_advance(copy, COPY_COMPLETED);
    }
    offload_engine_leave_device(st, device->index, previous);
    /* a failed copy has its error set, which a warning must not meet: the
     * warning waits for a copy into pageable memory that works */
    if (!failed && copy->block.fallback)
        offload_warn_fallback(engine, copy->nbytes, 0);
    if (failed || offload_window_add(engine, device, copy, storage, producer) < 0)
        return -1;
    return 1;
}

/* Copies one storage span out. Returns the copy, Py_None when the pool has
 * no memory at all (the inputs then stay on their device), NULL on error. */
static PyObject *
offload_span(mp_state *st, PyObject *module, input_info *first, uint64_t lo, uint64_t hi)
{
    offload_engine *engine = st->engine;
    offload_device *device = offload_engine_device(st, first->device_index);
    if (device == NULL || offload_engine_ensure_pool(engine) < 0)
        return NULL;
    StorageCopy *copy = storage_copy_new(st, module, device, first->device_obj, hi - lo);
    if (copy == NULL)
        return NULL;
    copy->source_offset = lo;       /* where backward finds the span, used in place */
    int started = start_d2h(st, copy, first->storage_ptr + (uintptr_t)lo, first->storage);
    if (started <= 0) {
        Py_DECREF(copy);
        return started < 0 ? NULL : Py_NewRef(Py_None);
    }
    return (PyObject *)copy;
}

/* Plans one copy per distinct storage among `infos` and starts them. */
static PyObject *
offload_storages(mp_state *st, PyObject *module, input_info *infos, Py_ssize_t n)
{
    PyObject *copies = PyList_New(0);
    if (copies == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!infos[i].storage || infos[i].copy_index != UNPLANNED)
            continue;
        if (infos[i].byte_extent == 0) {
            infos[i].copy_index = NO_DATA;
            continue;
        }
        uint64_t lo = infos[i].byte_offset, hi = lo + infos[i].byte_extent;
        for (Py_ssize_t j = i + 1; j < n; j++) {
            if (infos[j].storage && infos[j].byte_extent &&
                inspect_same_storage(&infos[i], &infos[j])) {
                lo = infos[j].byte_offset < lo ? infos[j].byte_offset : lo;
                uint64_t end = infos[j].byte_offset + infos[j].byte_extent;
                hi = end > hi ? end : hi;
            }
        }
        lo -= lo % SPAN_ALIGN;
        PyObject *copy = offload_span(st, module, &infos[i], lo, hi);
        if (copy == NULL || PyList_Append(copies, copy) < 0) {
            Py_XDECREF(copy);
            Py_DECREF(copies);
            return NULL;
        }
        Py_ssize_t index = copy == Py_None ? STAYS : PyList_GET_SIZE(copies) - 1;
        Py_DECREF(copy);
        for (Py_ssize_t j = i; j < n; j++) {
            if (infos[j].storage && infos[j].byte_extent &&
                inspect_same_storage(&infos[i], &infos[j])) {
                infos[j].copy_index = index;
                infos[j].byte_offset -= lo;
            }
        }
    }
    return copies;
}

/* Saves the records through torch's SavedTensor, so that torch keeps each
 * input's version counter; our packer hands it the prepared records. */
static int
save_records_as_saved_tensors(mp_state *st, PyObject *records, PyObject *tensors,
                              input_info *infos, PyObject *saved)
{
    PyObject *packer = packer_new(st, records);
    if (packer == NULL)
        return -1;
    int result = hooks_push(st, packer, st->offload_unpack);
    Py_DECREF(packer);
    if (result < 0)
        return -1;
    for (Py_ssize_t i = 0; result == 0 && i < PyList_GET_SIZE(tensors); i++) {
        if (infos[i].copy_index == UNPLANNED || infos[i].copy_index == STAYS)
            continue;
        PyObject *saved_tensor = hooks_save_tensor(st, PyList_GET_ITEM(tensors, i));
        if (saved_tensor == NULL || PyList_SetItem(saved, i, saved_tensor) < 0)
            result = -1;
    }
    return hooks_pop(st) < 0 ? -1 : result;
}

static PyObject *
make_records(mp_state *st, PyObject *tensors, input_info *infos, PyObject *copies,
             PyObject *group, PyObject *saved)
{
    PyObject *records = PyList_New(0);
    if (records == NULL)
        return NULL;
    int direct = st->make_saved_tensor == NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors); i++) {
        if (infos[i].copy_index == UNPLANNED || infos[i].copy_index == STAYS)
            continue;
        TensorRecord *record = record_new(st, &infos[i], copies, group,
                                          PyList_GET_ITEM(tensors, i), i);
        int failed = record == NULL || PyList_Append(records, (PyObject *)record) < 0 ||
                     (direct && PyList_SetItem(saved, i, Py_NewRef(record)) < 0);
        Py_XDECREF(record);
        if (failed) {
            Py_DECREF(records);
            return NULL;
        }
    }
    if (!direct && save_records_as_saved_tensors(st, records, tensors, infos, saved) < 0)
        Py_CLEAR(records);
    return records;
}

static int
copied_to(PyObject *copies, offload_device *device)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(copies); i++) {
        PyObject *item = PyList_GET_ITEM(copies, i);
        if (item != Py_None && ((StorageCopy *)item)->device == device)
            return 1;
    }
    return 0;
}

/* A region's inputs close the region on each device they went to: the
 * window then releases what it no longer allows, before the region's
 * function runs. A selectively checkpointed op's outputs close nothing
 * (the window counts regions, not ops): they join the region open on
 * their device, which the next region closes (its inputs, or its first
 * outputs when its inputs stayed). */
static int
end_regions(mp_state *st, PyObject *copies, int outputs)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        offload_device *device = st->engine->cuda[i];
        if (device == NULL || !copied_to(copies, device))
            continue;
        if (outputs) {
            device->outputs_open = 1;
        } else {
            device->outputs_open = 0;
            if (offload_window_end_region(st, device) < 0)
                return -1;
        }
    }
    return 0;
}

/* A region whose inputs closed no region offloads its first outputs:
 * the outputs of the region before, open on a device, end there. */
static int
close_open_outputs(mp_state *st)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        offload_device *device = st->engine->cuda[i];
        if (device == NULL || !device->outputs_open)
            continue;
        device->outputs_open = 0;
        if (offload_window_end_region(st, device) < 0)
            return -1;
    }
    return 0;
}

/* Offloading is torch's nesting rule in reverse: inside another
 * checkpoint's forward (or any saved-tensor hooks) inputs belong to the outer
 * hooks, so they are left alone. */
static int
hooks_active(mp_state *st)
{
    PyObject *top = PyObject_CallOneArg(st->top_hooks, Py_False);
    if (top == NULL)
        return -1;
    int active = top != Py_None;
    Py_DECREF(top);
    return active;
}

/* offload_save_inputs' work, or (`outputs`) offload_save_outputs': a
 * region's inputs are left alone under saved-tensor hooks around the call
 * (an outer checkpoint's); an op's outputs are saved under the region's own. */
static int
save_tensors(mp_state *st, PyObject *module, PyObject *function, PyObject *tensors, int enabled,
             int outputs, PyObject *saved, PyObject **group_out, PyObject **records_out)
{
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    *group_out = *records_out = NULL;
    /* the common CPU-only case asks nothing about the inputs */
    if (n == 0 || !enabled || !st->engine->runtime->may_hold_tensors(st))
        return 0;
    input_info *infos = PyMem_Calloc((size_t)n, sizeof(input_info));
    PyObject *buffers = NULL, *copies = NULL;
    int result = -1, candidates = 0;
    if (infos == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int eligible = inspect_input(st, function, PyList_GET_ITEM(tensors, i), &buffers,
                                     &infos[i]);
        if (eligible < 0)
            goto done;
        if (!eligible)
            input_info_clear(&infos[i]);
        candidates += eligible;
    }
    int active = candidates > 0 && !outputs ? hooks_active(st) : 0;
    result = active < 0 ? -1 : 0;
    if (candidates == 0 || active != 0)
        goto done;
    result = -1;
    copies = offload_storages(st, module, infos, n);
    if (copies == NULL)
        goto done;
    /* entries of Py_None stand for spans the pool could not take */
    PyObject *live = PyList_New(0);
    for (Py_ssize_t i = 0; live != NULL && i < PyList_GET_SIZE(copies); i++) {
        if (PyList_GET_ITEM(copies, i) != Py_None && PyList_Append(live, PyList_GET_ITEM(copies, i)) < 0)
            Py_CLEAR(live);
    }
    if (live == NULL)
        goto done;
    *group_out = group_new(st, module, live);
    Py_DECREF(live);
    if (*group_out != NULL)
        *records_out = make_records(st, tensors, infos, copies, *group_out, saved);
    if (*records_out == NULL) {
        Py_CLEAR(*group_out);
        goto done;
    }
    if (end_regions(st, copies, outputs) < 0) {
        Py_CLEAR(*records_out);
        Py_CLEAR(*group_out);
        goto done;
    }
    if (PyList_GET_SIZE(*records_out) == 0) {   /* everything stayed where it was */
        Py_CLEAR(*records_out);
        Py_CLEAR(*group_out);
    }
    result = 0;
done:
    for (Py_ssize_t i = 0; i < n; i++)
        input_info_clear(&infos[i]);
    PyMem_Free(infos);
    Py_XDECREF(buffers);
    Py_XDECREF(copies);
    return result;
}

int
offload_save_inputs(mp_state *st, PyObject *module, PyObject *function, PyObject *tensors,
                    int offload_override, PyObject *saved, PyObject **group_out,
                    PyObject **records_out)
{
    int enabled = offload_override < 0 ? st->engine->options.enabled : offload_override;
    return save_tensors(st, module, function, tensors, enabled, 0, saved, group_out, records_out);
}

/* A selectively checkpointed op's outputs are saved inside the region,
 * under the region's own hooks: those do not see them, so they move. */
int
offload_save_outputs(mp_state *st, PyObject *module, PyObject *tensors, int opens_region,
                     PyObject *saved, PyObject **group_out, PyObject **records_out)
{
    *group_out = *records_out = NULL;
    if (opens_region && close_open_outputs(st) < 0)
        return -1;
    return save_tensors(st, module, Py_None, tensors, st->engine->options.enabled, 1, saved,
                        group_out, records_out);
}

int
offload_check_forward(mp_state *st, PyObject *records)
{
    if (records == NULL)
        return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(records); i++) {
        TensorRecord *record = (TensorRecord *)PyList_GET_ITEM(records, i);
        /* the copy out may have raced the change: the data is unusable */
        int changed = offload_source_changed(st, record);
        if (changed < 0)
            return -1;
        record->modified_in_forward = changed;
    }
    return 0;
}
