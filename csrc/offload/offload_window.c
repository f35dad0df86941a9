/* The in-flight window of each device: the sources of copies out still
 * held, retired once their copy completed or, when the window no longer
 * allows them, in stream order; and backward's use of a source still held
 * in place (the contract and its invariant: offload_internal.h, the window
 * section).
 *
 * Owns each device's `in_flight` list and `regions` count, each copy's
 * `source`, `producer` and `region` while its window holds it, and the
 * engine's device_bytes_in_flight and its peak. Floor `window`: called by
 * the save and restore directions and the engine (polls, drains); calls
 * return, device and streams. GIL held. */
#include "offload_internal.h"
#include "base/compat.h"
#include "streams.h"

int
offload_window_add(offload_engine *engine, offload_device *device, StorageCopy *copy,
                   PyObject *source, void *producer)
{
    if (device->in_flight == NULL && (device->in_flight = PyList_New(0)) == NULL)
        return -1;
    if (PyList_Append(device->in_flight, (PyObject *)copy) < 0)
        return -1;
    MP_ASSERT(copy->source == NULL);
    MP_ASSERT((copy->state == COPY_QUEUED) == (copy->d2h_done != NULL));
    copy->source = Py_NewRef(source);
    copy->producer = producer;
    copy->region = device->regions;
    engine->device_bytes_in_flight += copy->nbytes;
    return 0;
}

/* Orders the reuse of a source's memory after its copy out, using live
 * streams only: the producer handle is a key, never used once the call
 * that queued the copy returned (an ExternalStream may be destroyed by
 * then, as csrc/alloc treats its streams). When the producer is the
 * device's current stream, that stream waits for the copy (on the copy's
 * device: a NULL stream is that device's only while it is current) and the
 * source is marked used by it (the header's invariant): memory is reused
 * in stream order. Otherwise the source is marked used by the copy-out
 * stream, which ran the copy: whichever stream allocated it reuses it
 * once the copy-out stream passed it. */
static int
order_producer_after_copy(mp_state *st, StorageCopy *copy)
{
    const cudart *rt = st->engine->rt;
    int index = copy->device->index, previous;
    void *current;
    if (offload_engine_current_stream(st, index, &current) < 0)
        return -1;
    if (!streams_same(current, copy->producer))
        return st->engine->runtime->record_stream(st, OFFLOAD_SITE_SOURCE_ON_COPY_OUT,
                                                  copy->source, index, copy->device->copy_out);
    if (offload_engine_enter_device(st, index, &previous) < 0)
        return -1;
    int failed = streams_wait_event(st->engine->runtime, rt,
                                    OFFLOAD_SITE_PRODUCER_AFTER_COPY_OUT, current,
                                    copy->d2h_done);
    offload_engine_leave_device(st, index, previous);
    if (failed)
        return -1;
    copy->producer_waited = 1;
    return st->engine->runtime->record_stream(st, OFFLOAD_SITE_SOURCE_ON_PRODUCER,
                                              copy->source, index, current);
}

/* Retires a source: at once when its copy completed, else in stream order.
 * `force` 0 only drops completed ones; `ask` 0 takes the copy as not
 * completed without asking. Returns 1 if dropped, 0 if kept, -1 on error
 * (kept: the source may still be read). Idempotent: a copy retired
 * already, before or while its producer was ordered (record_stream runs
 * Python, which may sweep), is dropped and counted once. */
static int
retire_source(mp_state *st, StorageCopy *copy, int force, int ask)
{
    offload_engine *engine = st->engine;
    if (copy->source == NULL)
        return 1;
    int completed = ask ? offload_device_d2h_done(engine, copy) : copy->d2h_done == NULL;
    if (completed < 0 || (!completed && !force))
        return completed;
    if (!completed && order_producer_after_copy(st, copy) < 0)
        return -1;
    if (copy->source == NULL)
        return 1;
    MP_ASSERT(engine->device_bytes_in_flight >= copy->nbytes);
    engine->device_bytes_in_flight -= copy->nbytes;
    Py_CLEAR(copy->source);
    return 1;
}

/* Backward reached the copy's region with its source still held: the
 * source becomes the copy's restored data (in place, for as long as the
 * copy lives) and the host buffer goes back to the pool, after the D2H
 * that may still write it (the window section says why nothing else waits
 * for that D2H). Moves references only: runs no Python code. Counted in
 * used_in_place only once a restore takes it (restore_record): a copy
 * nobody asks for again (a selective-checkpoint output let go after the
 * forward) is kept here too, but saved no copy back. */
static void
keep_in_place(offload_engine *engine, StorageCopy *copy)
{
    MP_ASSERT(copy->source != NULL && copy->fetched == NULL && copy->h2d_done == NULL);
    MP_ASSERT(copy->block.ptr != NULL && copy->state != COPY_EMPTY);
    MP_ASSERT(copy->spill_phase == SPILL_RESIDENT && copy->spill == NULL);
    MP_ASSERT(engine->device_bytes_in_flight >= copy->nbytes);
    engine->device_bytes_in_flight -= copy->nbytes;
    copy->fetched = copy->source;       /* the window's reference, now the copy's */
    copy->source = NULL;
    copy->in_place = 1;
    if (copy->d2h_done != NULL)
        offload_return_after(engine, copy->device, &copy->block, copy->d2h_done,
                             copy->device->copy_out);
    else
        pool_release(engine->pool, &copy->block);
    copy->d2h_done = NULL;
    copy_advance(copy, COPY_RETURNED);
}

/* May the backward of `thread`'s graph use the copy's source in place
 * (keep_in_place)? Only a copy that thread made: regions count per device,
 * across threads, and another thread's backward may come much later (its
 * source would stay on the device until then). Not a copy fetched while
 * held (unpacked outside a restore), which keeps its copy back, nor one
 * the disk tier took (its block is the tier's until its request finished:
 * offload_spill_forget). */
static int
keepable(const StorageCopy *copy, unsigned long thread, uint64_t keep_through_region)
{
    return copy->thread == thread && copy->region <= keep_through_region &&
           copy->source != NULL &&
           copy->fetched == NULL && copy->h2d_done == NULL &&
           copy->spill_phase == SPILL_RESIDENT && copy->spill == NULL;
}

static Py_ssize_t
count_held(PyObject *list)
{
    Py_ssize_t held = 0;
    for (Py_ssize_t i = 0; list != NULL && i < PyList_GET_SIZE(list); i++)
        held += ((StorageCopy *)PyList_GET_ITEM(list, i))->source != NULL;
    return held;
}

/* The copies of `walked` still held, and those of `added` (NULL: none),
 * in region order: each list is in that order (the order the copies were
 * queued), so a stable merge keeps it. A new list, or NULL with an error;
 * runs no Python code. */
static PyObject *
merge_held(PyObject *walked, PyObject *added)
{
    PyObject *merged = PyList_New(count_held(walked) + count_held(added));
    Py_ssize_t i = 0, j = 0, out = 0, n = PyList_GET_SIZE(walked);
    Py_ssize_t m = added != NULL ? PyList_GET_SIZE(added) : 0;
    while (merged != NULL && (i < n || j < m)) {
        StorageCopy *a = i < n ? (StorageCopy *)PyList_GET_ITEM(walked, i) : NULL;
        StorageCopy *b = j < m ? (StorageCopy *)PyList_GET_ITEM(added, j) : NULL;
        StorageCopy *next = b == NULL || (a != NULL && a->region <= b->region) ? a : b;
        if (next == a)
            i++;
        else
            j++;
        if (next->source != NULL)
            PyList_SET_ITEM(merged, out++, Py_NewRef((PyObject *)next));
    }
    MP_ASSERT(merged == NULL || out == PyList_GET_SIZE(merged));
    return merged;
}

/* A sweep takes the window's list off the device before it walks it:
 * retiring in stream order calls record_stream, which on a GPU runs
 * torch's Python code, and another sweep of this window may run inside it
 * (a second thread training on the device, a thread calling pool_stats(),
 * or this thread again). The inner sweep then sees only copies added
 * since, no copy is walked by two sweeps, and what is kept is merged back
 * with whatever the window holds by then (put_back). (Were the list walked
 * in place, the same copy would be retired twice and one sweep's list
 * would overwrite the other's, losing a copy from the window.) */

/* Gives the window back the copies of `walked` still held (the sweep's
 * reference, taken), merged with those added meanwhile. An error stays
 * pending: the merge runs no Python code. 0, or -1 out of memory: the
 * walked list then goes back whole (retiring is idempotent), followed by
 * the copies added meanwhile; should that fail too, those are lost from
 * the window (their sources stay held until their copies die) and the
 * first MemoryError is reported. */
static int
put_back(offload_device *device, PyObject *walked)
{
    PyObject *merged = merge_held(walked, device->in_flight);
    if (merged != NULL) {
        Py_XSETREF(device->in_flight, merged);
        Py_DECREF(walked);
        return 0;
    }
    PyObject *added = device->in_flight;
    device->in_flight = walked;
    if (added != NULL) {
        PyObject *pending = mp_take_exception();
        if (PyList_SetSlice(walked, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, added) < 0)
            PyErr_Clear();
        if (pending != NULL)
            mp_restore_exception(pending);
        Py_DECREF(added);
    }
    return -1;
}

/* Retires the sources of the window's copies that completed, and of those
 * of regions before `force_below_region` in stream order. */
static int
sweep(mp_state *st, offload_device *device, uint64_t force_below_region)
{
    if (device->in_flight == NULL || PyList_GET_SIZE(device->in_flight) == 0)
        return 0;  /* every recompute sweeps: the common case costs nothing */
    PyObject *list = device->in_flight;     /* the window's reference, now ours */
    device->in_flight = NULL;               /* offload_window_add makes a new one */
    int result = 0, ask = 1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list) && result == 0; i++) {
        StorageCopy *copy = (StorageCopy *)PyList_GET_ITEM(list, i);
        int forced = copy->region < force_below_region;
        /* the copy-out stream runs copies in the order of this list: once one
         * has not completed, the later ones have not either (as torch's
         * allocator stops at the first event not ready of a stream). A copy
         * that must go is not asked: ordering its producer costs one stream
         * wait, as the query would, and never blocks; without its answer the
         * later ones are not asked either (with the GPU lagging, the query
         * fails every time: 2 calls a span saved) */
        if (forced)
            ask = 0;
        int released = retire_source(st, copy, forced, ask);
        if (released == 0)          /* kept: its copy has not completed */
            ask = 0;
        if (released < 0)
            result = -1;
    }
    return put_back(device, list) < 0 ? -1 : result;
}

int
offload_window_end_region(mp_state *st, offload_device *device)
{
    offload_engine *engine = st->engine;
    uint64_t ended = device->regions++;
    uint64_t window = (uint64_t)engine->options.window;
    /* regions ended - window + 1 .. ended stay in flight */
    if (sweep(st, device, ended + 1 >= window ? ended + 1 - window : 0) < 0)
        return -1;
    /* the peak as the GPU sees it: what is held while a region's function runs */
    if (engine->device_bytes_in_flight > engine->peak_device_bytes_in_flight)
        engine->peak_device_bytes_in_flight = engine->device_bytes_in_flight;
    return 0;
}

/* Backward's sweep: every source still held goes, the ones `thread` made
 * of regions up to `last_region` used in place (keep_in_place: its
 * backward reaches them next), the others retired in stream order (no copy
 * is asked: each must go). */
int
offload_window_backward(mp_state *st, offload_device *device, unsigned long thread,
                        uint64_t last_region)
{
    if (device->in_flight == NULL || PyList_GET_SIZE(device->in_flight) == 0)
        return 0;
    PyObject *list = device->in_flight;     /* the window's reference, now ours */
    device->in_flight = NULL;
    int result = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list) && result == 0; i++) {
        StorageCopy *copy = (StorageCopy *)PyList_GET_ITEM(list, i);
        if (keepable(copy, thread, last_region)) {
            /* backward now owns the source and drops it when it is done,
             * maybe before the copy out read it: the copy-out stream must
             * hold its memory (record_stream runs Python: ask again) */
            if (copy->d2h_done != NULL &&
                st->engine->runtime->record_stream(st, OFFLOAD_SITE_KEPT_ON_COPY_OUT,
                                                   copy->source, device->index,
                                                   device->copy_out) < 0) {
                result = -1;        /* kept held: retired later */
                continue;
            }
            if (keepable(copy, thread, last_region)) {
                keep_in_place(st->engine, copy);
                continue;
            }
        }
        if (retire_source(st, copy, 1, 0) < 0)
            result = -1;
    }
    return put_back(device, list) < 0 ? -1 : result;
}

int
offload_window_poll_all(mp_state *st)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (st->engine->cuda[i] != NULL && sweep(st, st->engine->cuda[i], 0) < 0)
            return -1;
    }
    return 0;
}

void
offload_window_drain(offload_engine *engine, offload_device *device)
{
    /* each wait lets other threads run, which sweep the window or add to
     * it: the list is taken off the device first, so this walk is the
     * only one over it; what was added meanwhile is drained next turn */
    while (device->in_flight != NULL) {
        PyObject *list = device->in_flight;     /* the window's reference, now ours */
        device->in_flight = NULL;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
            StorageCopy *copy = (StorageCopy *)PyList_GET_ITEM(list, i);
            OFFLOAD_YIELD(engine, "window.drain");
            /* nothing is left to undo: the source goes either way */
            if (copy->d2h_done != NULL)
                streams_wait_event_quietly(engine->rt, copy->d2h_done);
            MP_ASSERT(copy->source != NULL);
            MP_ASSERT(engine->device_bytes_in_flight >= copy->nbytes);
            engine->device_bytes_in_flight -= copy->nbytes;
            Py_CLEAR(copy->source);
        }
        Py_DECREF(list);
    }
}
