/* The restore direction: copying offloaded spans back for a recompute,
 * prefetching the regions backward reaches next, and rebuilding each input
 * as a view of its span.
 *
 * Two entry points, read top-down from the end of the file: the region's
 * restore (offload_restore_group: begin_restore tells the window backward
 * began and the disk tier to read ahead, fetch_group copies the spans back
 * on the current stream and prefetch_walk those of the regions next on the
 * copy-in stream; then the caller unpacks, and discard_restored drops the
 * copies back) and the unpack hook of one record (restore_record: a copy
 * back if none was made, await_h2d orders the reading stream after it,
 * view_of_copy rebuilds the input).
 *
 * Owns each copy's restored data while a recompute uses it (`fetched`, the
 * h2d_* fields, `restoring`) and the engine's prefetch counters. Floor
 * `directions`: called by csrc/checkpoint, csrc/module (the unpack hook)
 * and the SAC entry points; calls window, spill, records, device and
 * streams. GIL held; torch's ops and the waits release it. */
#include "base/compat.h"
#include "base/modified_input.h"
#include "base/pyvalue.h"
#include "offload_internal.h"
#include "streams.h"

static int
tensor_ptr(PyObject *tensor, void **ptr)
{
    int64_t value;
    if (mp_call_int64(tensor, "data_ptr", &value) < 0)
        return -1;
    *ptr = (void *)(uintptr_t)value;
    return 0;
}

/* Host to device into `dst`, on the copy-in stream (prefetch) or the
 * current one, with the copy's device current. The destination came from
 * the compute stream's allocator: the copy runs after its queued work,
 * after the offload's own D2H if still pending, and after the previous copy
 * back (the new event then covers both: the host buffer is free once it
 * completed). Queued copies may write `dst` at any time: if the event
 * cannot be recorded, the stream is drained before returning. *compute
 * receives the compute stream, *done the copy's completion event, which
 * the caller publishes (fetch_copy). */
static int
start_h2d(mp_state *st, StorageCopy *copy, void *dst, int on_copy_stream, void **compute,
          void **done)
{
    offload_engine *engine = st->engine;
    const cudart *rt = engine->rt;
    offload_device *device = copy->device;
    void *stream;
    int previous;
    *done = NULL;
    if (offload_engine_current_stream(st, device->index, compute) < 0 ||
        offload_engine_enter_device(st, device->index, &previous) < 0)
        return -1;
    stream = on_copy_stream ? device->copy_in : *compute;
    /* the compute stream, when it is the producer that waited on the copy
     * out, orders this copy after it already */
    int after_d2h = copy->d2h_done == NULL ||
                    (copy->producer_waited && streams_same(*compute, copy->producer));
    /* the previous copy back reads the same host buffer: this copy's event
     * must cover it too, for the buffer is returned once that completes;
     * on its own stream it does already */
    int after_h2d = copy->h2d_done == NULL || streams_same(copy->h2d_stream, stream);
    const offload_runtime *runtime = engine->runtime;
    int failed = (on_copy_stream &&
                  offload_device_order(engine, device, OFFLOAD_SITE_COPY_IN_AFTER_COMPUTE, stream,
                                       *compute) < 0) ||
                 (!after_d2h && streams_wait_event(runtime, rt, OFFLOAD_SITE_COPY_IN_AFTER_COPY_OUT,
                                                   stream, copy->d2h_done) < 0) ||
                 (!after_h2d && streams_wait_event(runtime, rt, OFFLOAD_SITE_COPY_IN_AFTER_COPY_IN,
                                                   stream, copy->h2d_done) < 0) ||
                 streams_memcpy(rt, dst, copy->block.ptr, (size_t)copy->nbytes,
                                CUDART_MEMCPY_HOST_TO_DEVICE, stream, copy->block.fallback) < 0;
    if (!failed && offload_device_record(engine, device, stream, done) < 0) {
        failed = 1;
        streams_wait_stream_quietly(rt, stream);
    }
    offload_engine_leave_device(st, device->index, previous);
    return failed ? -1 : 0;
}

/* Makes `fetched`, copied back by the copy that `done` completes, the
 * copy's restored copy. A prefetch's buffer came from the compute stream
 * current then (`compute`) and the copy-in stream writes it: whatever
 * stream reads it waits for `done` and, when it is another one, marks it
 * used (await_h2d), and so does the stream current when it is discarded
 * unread (discard_restored): it is never freed to `compute`'s allocator
 * with the copy unordered. */
static void
publish_fetched(mp_state *st, StorageCopy *copy, PyObject *fetched, void *done, void *compute,
                int on_copy_stream)
{
    offload_engine *engine = st->engine;
    offload_device *device = copy->device;
    if (copy->h2d_done != NULL)
        offload_device_give_event(engine, device, copy->h2d_done);
    copy->h2d_done = done;
    copy->h2d_stream = on_copy_stream ? device->copy_in : compute;
    copy->fetched = Py_NewRef(fetched);
    copy->fetched_on = compute;
    /* on the compute stream itself, what reads the span is queued after it */
    copy->h2d_awaited = !on_copy_stream;
    copy->h2d_awaited_on = compute;
    if (on_copy_stream)
        engine->prefetched++;
    else
        engine->fetched_at_need++;
}

/* A copy back another thread beat, or whose buffer could not be marked
 * used by the copy-in stream (fetch_copy): its buffer goes unread, to the
 * allocator of `compute`, which made it; that stream is ordered after the
 * copy first (a pageable copy may still be writing). */
static int
drop_beaten(mp_state *st, StorageCopy *copy, void *done, void *compute)
{
    const cudart *rt = st->engine->rt;
    int index = copy->device->index, previous;
    int failed = offload_engine_enter_device(st, index, &previous) < 0;
    if (!failed) {
        failed = streams_wait_event(st->engine->runtime, rt, OFFLOAD_SITE_BEATEN_AFTER_COPY_IN,
                                    compute, done);
        offload_engine_leave_device(st, index, previous);
    }
    offload_device_give_event(st->engine, copy->device, done);
    return failed ? -1 : 0;
}

/* Allocating the destination, and a pageable copy, let other threads run:
 * the copy is held meanwhile. One fetched by another thread meanwhile is
 * taken as is, and ours goes (drop_beaten; a pageable copy has read the
 * host buffer before it returned, so the host buffer needs no wait). */
static int
fetch_copy(mp_state *st, StorageCopy *copy, int on_copy_stream)
{
    if (copy->fetched != NULL)
        return 0;
    Py_INCREF(copy);
    /* a span in the disk tier comes back to its host buffer first, and
     * stays there (pinned) until the copy back is queued: allocating
     * `fetched` lets another thread's forward run, which spills */
    copy->spill_pins++;
    if (offload_spill_ready(st, copy) < 0) {
        copy->spill_pins--;
        Py_DECREF(copy);
        return -1;
    }
    OFFLOAD_YIELD(st->engine, "restore.span_ready");
    PyObject *fetched = st->engine->runtime->empty_bytes(st, copy->device->index,
                                                         copy->device_obj, copy->nbytes);
    void *dst, *compute = NULL, *done = NULL;
    int failed = fetched == NULL || tensor_ptr(fetched, &dst) < 0;
    if (!failed && copy->fetched == NULL)
        failed = start_h2d(st, copy, dst, on_copy_stream, &compute, &done) < 0;
    /* the copy-in stream writes memory of the compute stream's pool: it
     * goes back to that pool only once the copy-in stream passed the copy,
     * whoever drops it, read or not (a copy dying prefetched) */
    if (!failed && done != NULL && copy->fetched == NULL && on_copy_stream)
        failed = st->engine->runtime->record_stream(st, OFFLOAD_SITE_FETCHED_ON_COPY_IN, fetched,
                                                    copy->device->index,
                                                    copy->device->copy_in) < 0;
    if (!failed && done != NULL && copy->fetched == NULL)
        publish_fetched(st, copy, fetched, done, compute, on_copy_stream);
    else if (done != NULL && drop_beaten(st, copy, done, compute) < 0)
        failed = 1;
    MP_ASSERT(copy->spill_pins > 0);
    copy->spill_pins--;
    Py_XDECREF(fetched);
    Py_DECREF(copy);
    return failed ? -1 : 0;
}

/* The compute stream of the copy's device waits for its last copy back:
 * what reads the restored span is queued after that. Every stream reading
 * it waits (a span restored once may be read on several); only the stream
 * that waited last is known to be ordered already. */
static int
await_h2d(mp_state *st, StorageCopy *copy)
{
    if (copy->h2d_done == NULL)
        return 0;
    const cudart *rt = st->engine->rt;
    void *compute;
    int index = copy->device->index, previous;
    if (offload_engine_current_stream(st, index, &compute) < 0)
        return -1;
    /* a key, compared with the flag: the legacy stream's handle is NULL */
    if (copy->h2d_awaited && streams_same(compute, copy->h2d_awaited_on))
        return 0;
    if (offload_engine_enter_device(st, index, &previous) < 0)
        return -1;
    int failed = streams_wait_event(st->engine->runtime, rt, OFFLOAD_SITE_READER_AFTER_COPY_IN,
                                    compute, copy->h2d_done);
    offload_engine_leave_device(st, index, previous);
    if (failed)
        return -1;
    copy->h2d_awaited = 1;
    copy->h2d_awaited_on = compute;
    /* read on another stream than the one whose allocator it came from
     * (a prefetch made while the region after it ran): that allocator
     * reuses it only once this stream passed what it queues now */
    if (copy->fetched != NULL && !streams_same(compute, copy->fetched_on))
        return st->engine->runtime->record_stream(st, OFFLOAD_SITE_FETCHED_ON_READER,
                                                  copy->fetched, index, compute);
    return 0;
}

/* Discards the restored copy (the span copied back). Its memory returns to the compute stream's
 * pool, so that stream must be ordered after the copy writing it first
 * (not yet so when a restore failed before using it); failing that, the
 * host waits for the copy. Keeps any pending exception. */
static void
discard_restored(mp_state *st, StorageCopy *copy)
{
    /* used in place: the only copy of the span there is */
    if (copy->fetched == NULL || copy->in_place)
        return;
    if (copy->restoring > 0) {      /* another thread takes a view of it: it discards */
        copy->discard_pending = 1;
        return;
    }
    copy->discard_pending = 0;
    PyObject *pending = mp_take_exception();
    if (await_h2d(st, copy) < 0) {
        PyErr_Clear();
        streams_wait_event_quietly(st->engine->rt, copy->h2d_done);
    }
    Py_CLEAR(copy->fetched);
    if (pending != NULL)
        mp_restore_exception(pending);
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

/* Prefetches, on the copy-in stream, the groups of `thread` from `from`
 * on: walking `prev`, until `regions` inputs groups were fetched (the
 * outputs groups met on the way belong to those regions); else walking
 * `next`, the outputs groups up to the next inputs group. Fetching lets
 * other threads run and free groups, so the walk holds the group it
 * stands on. */
static int
prefetch_walk(mp_state *st, OffloadGroup *from, unsigned long thread, int backwards, int regions)
{
    int fetched = 0, failed = 0;
    OffloadGroup *at = (OffloadGroup *)Py_XNewRef(from);
    while (at != NULL && !failed && (backwards ? fetched < regions : at->outputs)) {
        if (at->thread == thread && !at->handed_back) {
            failed = fetch_group(st, at, 1) < 0;
            fetched += !at->outputs;
        }
        OffloadGroup *next = at->linked ? (backwards ? at->prev : at->next) : NULL;
        Py_XINCREF(next);
        Py_SETREF(at, next);
    }
    Py_XDECREF(at);
    return failed ? -1 : 0;
}

/* The last region backward reaches with `group`: that of its copies and
 * of the outputs groups linked right after it (selective checkpointing's,
 * restored with it). */
static uint64_t
last_region(OffloadGroup *group)
{
    uint64_t last = 0;
    for (OffloadGroup *g = group; g != NULL && (g == group || g->outputs);
         g = g->linked ? g->next : NULL) {
        for (Py_ssize_t i = 0; g->thread == group->thread && i < PyTuple_GET_SIZE(g->copies); i++) {
            uint64_t region = ((StorageCopy *)PyTuple_GET_ITEM(g->copies, i))->region;
            last = region > last ? region : last;
        }
    }
    return last;
}

/* Fetches the group's spans and, when the options pipeline, the outputs
 * selective checkpointing offloaded in its region (linked right after it:
 * its recompute needs them next); when prefetch_ahead too, the groups
 * backward reaches next (the regions before it, with their outputs). */
static int
begin_restore(mp_state *st, OffloadGroup *group, int prefetch_ahead)
{
    offload_options *opts = &st->engine->options;
    if (group->device == NULL)
        return 0;
    /* backward has begun on this device: nothing it copied out stays in
     * flight, and what it reaches from here on while still there is used
     * in place (fetching skips it) */
    if (offload_window_backward(st, group->device, group->thread, last_region(group)) < 0 ||
        offload_spill_readahead(st, group) < 0)
        return -1;
    if (fetch_group(st, group, 0) < 0)
        return -1;
    if (!opts->pipeline || group->outputs)
        return 0;
    if (prefetch_walk(st, group->next, group->thread, 0, 0) < 0)
        return -1;
    /* backward runs this thread's frames in reverse creation order */
    return prefetch_ahead ? prefetch_walk(st, group->prev, group->thread, 1, opts->prefetch_depth)
                          : 0;
}

int
offload_restore_group(mp_state *st, PyObject *group_obj, int prefetch_ahead,
                      int (*unpack_inputs)(void *ctx), void *ctx)
{
    OffloadGroup *group = (OffloadGroup *)group_obj;
    if (group == NULL)
        return unpack_inputs(ctx);
    int result = begin_restore(st, group, prefetch_ahead) < 0 ? -1 : unpack_inputs(ctx);
    /* every view taken holds the restored storage itself; on an error,
     * what was fetched goes as well */
    offload_discard_group(st, group_obj);
    return result;
}

int
offload_prefetch_group(mp_state *st, PyObject *group_obj)
{
    OffloadGroup *group = (OffloadGroup *)group_obj;
    if (!st->engine->options.pipeline || group->device == NULL || group->handed_back)
        return 0;
    if (offload_window_backward(st, group->device, group->thread, last_region(group)) < 0)
        return -1;
    return fetch_group(st, group, 1);
}

void
offload_discard_group(mp_state *st, PyObject *group_obj)
{
    OffloadGroup *group = (OffloadGroup *)group_obj;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(group->copies); i++)
        discard_restored(st, (StorageCopy *)PyTuple_GET_ITEM(group->copies, i));
}

/* The record's offset in elements from the start of its source storage,
 * for a copy used in place (its offset counts from the span's start, a
 * whole number of elements from the storage's: spans start aligned). */
static int
in_place_offset(TensorRecord *record, int64_t *offset)
{
    int64_t itemsize;
    if (mp_attr_int64(record->dtype, "itemsize", &itemsize) < 0)
        return -1;
    uint64_t span = record->copy->source_offset;
    MP_ASSERT(itemsize > 0 && span % (uint64_t)itemsize == 0);
    *offset = record->offset + (int64_t)(span / (uint64_t)itemsize);
    return 0;
}

/* A view of `fetched` (the record's restored copy, NULL for an empty
 * tensor) as the record's tensor. torch's ops release the GIL: `fetched`
 * stays the copy's meanwhile because the caller counts itself among the
 * copy's restoring threads (a discard then waits for the last of them). */
static PyObject *
view_of_copy(mp_state *st, TensorRecord *record, PyObject *fetched)
{
    PyObject *kwargs = Py_BuildValue("{sOsO}", "dtype", record->dtype, "device",
                                     record->device_obj);
    if (kwargs == NULL)
        return NULL;
    PyObject *result = NULL;
    if (fetched == NULL) {
        PyObject *args = PyTuple_Pack(2, record->size, record->stride);
        result = args ? PyObject_Call(st->torch_empty_strided, args, kwargs) : NULL;
        Py_XDECREF(args);
        Py_DECREF(kwargs);
        return result;
    }
    int64_t offset = record->offset;
    if (record->copy->in_place && in_place_offset(record, &offset) < 0) {
        Py_DECREF(kwargs);
        return NULL;
    }
    PyObject *args = Py_BuildValue("((i))", 0);
    PyObject *empty = args ? PyObject_Call(st->torch_empty, args, kwargs) : NULL;
    PyObject *storage = empty == NULL ? NULL
                        : record->copy->in_place
                            ? Py_NewRef(fetched)
                            : PyObject_CallMethod(fetched, "untyped_storage", NULL);
    if (storage != NULL)
        result = PyObject_CallMethod(empty, "set_", "OLOO", storage, (long long)offset,
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

/* A DTensor input: its local tensor, restored, under its spec again. */
static PyObject *
rewrap(TensorRecord *record, PyObject *local)
{
    if (local == NULL)
        return NULL;
    PyObject *args = PyTuple_Pack(2, local, record->wrapper_spec);
    PyObject *kwargs = args ? Py_BuildValue("{sO}", "requires_grad",
                                            record->requires_grad ? Py_True : Py_False) : NULL;
    PyObject *wrapped = kwargs ? PyObject_Call(record->wrapper_type, args, kwargs) : NULL;
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_DECREF(local);
    return wrapped;
}

static PyObject *finish_restore(mp_state *st, TensorRecord *record, PyObject *view);

/* Restores one record's tensor (the unpack hook's work); raises when the
 * input was changed in place since it was saved. */
static PyObject *
restore_record(mp_state *st, PyObject *record_obj)
{
    TensorRecord *record = (TensorRecord *)record_obj;
    StorageCopy *copy = record->copy;
    int changed = record->modified_in_forward ? 1 : offload_source_changed(st, record);
    if (changed != 0) {
        if (changed > 0)
            raise_modified_input(record->input_index);
        return NULL;
    }
    if (copy == NULL)
        return finish_restore(st, record, view_of_copy(st, record, NULL));
    /* fetching, waiting and taking the view let other threads run (torch's
     * ops release the GIL): one discarding the copy meanwhile leaves that
     * to the last thread taking a view of it */
    Py_INCREF(copy);
    copy->restoring++;
    /* fetched already by the group, unless unpacked on its own */
    int failed = (copy->fetched == NULL && fetch_copy(st, copy, 0) < 0) ||
                 await_h2d(st, copy) < 0;
    MP_ASSERT(failed || copy->fetched != NULL);
    PyObject *view = failed ? NULL : view_of_copy(st, record, copy->fetched);
    /* a span used where it was, once: the copy back it saved */
    if (view != NULL && copy->in_place && !copy->in_place_used) {
        copy->in_place_used = 1;
        st->engine->used_in_place++;
    }
    MP_ASSERT(copy->restoring > 0);
    if (--copy->restoring == 0 && copy->discard_pending)
        discard_restored(st, copy);
    Py_DECREF(copy);
    return finish_restore(st, record, view);
}

/* The restored view as the record's tensor: a DTensor again, or requiring
 * grad as in the forward pass. */
static PyObject *
finish_restore(mp_state *st, TensorRecord *record, PyObject *view)
{
    if (record->wrapper_type != NULL)
        return rewrap(record, view);
    return st->make_saved_tensor == NULL ? with_requires_grad(view, record->requires_grad) : view;
}

PyObject *
offload_unpack_hook(PyObject *module, PyObject *record)
{
    mp_state *st = mp_state_of(module);
    if (!Py_IS_TYPE(record, st->tensor_record_type)) {
        PyErr_SetString(PyExc_TypeError, "matepoint: offload unpack hook got a foreign object");
        return NULL;
    }
    return restore_record(st, record);
}
