/* The device floor: the runtime's table, the host pool, and each device's
 * copy streams and events, with the calls every policy and direction makes
 * on a device: entering and leaving it, torch's current stream, ordering
 * one stream after another, recording and giving back completion events.
 *
 * Owns the engine's `rt` (loaded at the first device), `pool` (made on
 * first use), `devices_with_context`, and every offload_device's streams,
 * `ordering` event and spare events; a device's window and returning
 * buffers are the window's and return's (offload_engine.c drains them
 * before offload_device_free). Floor `device`: called by every floor
 * above; calls only limits and streams. GIL held. */
#include "offload_internal.h"
#include "base/compat.h"
#include "streams.h"

#include <stdio.h>

offload_engine *
offload_engine_of(PyObject *module)
{
    return mp_state_of(module)->engine;
}

/* The runtime's table, loaded on first use. */
static const cudart *
engine_rt(offload_engine *engine)
{
    if (engine->rt == NULL)
        engine->rt = engine->runtime->load();
    return engine->rt;
}

static int
device_count(const cudart *rt)
{
    int count = 0;
    if (rt->get_device_count(&count) == CUDART_SUCCESS)
        return count;
    (void)rt->get_last_error();
    return 0;
}

/* Pinned memory when the runtime has a device, else plain host memory. */
int
offload_engine_ensure_pool(offload_engine *engine)
{
    if (engine->pool != NULL)
        return 0;
    const cudart *rt = engine_rt(engine);
    if (rt == NULL)
        PyErr_Clear();   /* no GPU: a plain pool serves reserve_pool() */
    pool_backend backend = rt != NULL && device_count(rt) > 0
                               ? pool_cuda_backend(rt)
                               : pool_host_backend(&engine->host_ctx);
    engine->pool = pool_create(backend, offload_pool_limit(engine));
    if (engine->pool == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

int
offload_engine_current_stream(mp_state *st, int index, void **stream)
{
    return st->engine->runtime->current_stream(st, index, stream);
}

/* 1 when `device` has a context (asked once it is known to), 0 if not. */
static int
has_context(mp_state *st, int device)
{
    offload_engine *engine = st->engine;
    uint64_t bit = device < 64 ? (uint64_t)1 << device : 0;
    if (engine->devices_with_context & bit)
        return 1;
    int has = engine->runtime->has_context(st, device);
    if (has > 0)
        engine->devices_with_context |= bit;
    return has;
}

int
offload_engine_enter_device(mp_state *st, int index, int *previous)
{
    return streams_enter_device(st->engine->rt, index, previous);
}

/* torch's device guards warn when they cannot make the earlier device
 * current again; so does the engine. The thread stays on `index` (torch's
 * own calls set their device per operation), and the error must not stay
 * for torch's next kernel launch to raise as its own. */
static void
warn_device_left(mp_state *st, int index, int previous, int status)
{
    char what[48], failure[256];
    snprintf(what, sizeof(what), "cudaSetDevice(%d)", previous);
    cudart_describe_failure(st->engine->rt, status, what, failure, sizeof(failure));
    if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                         "matepoint: after work on CUDA device %d, %s: this thread's current "
                         "device stays %d", index, failure, index) < 0)
        PyErr_WriteUnraisable(NULL);   /* warnings made errors: nothing to raise into */
}

void
offload_engine_leave_device(mp_state *st, int index, int previous)
{
    if (previous == index)
        return;
    /* setting a device creates its context: a thread that started on a
     * device it never used (0, in a new thread) stays on `index` instead,
     * and torch is told `previous` is still its current device, as its own
     * guards leave it (else torch.cuda.current_device() would answer
     * `index`, and torch.empty(device="cuda") land there). Runs on error
     * paths too: a pending exception is kept. */
    PyObject *pending = mp_take_exception();
    int has = has_context(st, previous);
    if (has < 0 || (has == 0 && st->engine->runtime->keep_target_device(st, previous) < 0))
        PyErr_WriteUnraisable(NULL);
    int status = has > 0 ? st->engine->rt->set_device(previous) : CUDART_SUCCESS;
    if (status != CUDART_SUCCESS)
        warn_device_left(st, index, previous, status);
    if (pending != NULL)
        mp_restore_exception(pending);
}

int
offload_engine_pinning_device(mp_state *st)
{
    const cudart *rt = st->engine->rt;
    int current, count = device_count(rt);
    if (count <= 0)
        return -1;
    if (rt->get_device(&current) != CUDART_SUCCESS) {
        (void)rt->get_last_error();
        return -1;
    }
    for (int d = -1; d < count; d++) {
        int candidate = d < 0 ? current : d;
        if (d == current)
            continue;           /* asked first already */
        int has = has_context(st, candidate);
        if (has < 0)
            return -1;
        if (has)
            return candidate;
    }
    return -1;
}

offload_device *
offload_engine_device(mp_state *st, int index)
{
    offload_engine *engine = st->engine;
    if (index < 0 || index >= MAX_CUDA_DEVICES) {
        PyErr_Format(PyExc_ValueError, "matepoint: CUDA device index %d out of range", index);
        return NULL;
    }
    if (engine->cuda[index] != NULL)
        return engine->cuda[index];
    const cudart *rt = engine_rt(engine);
    if (rt == NULL)
        return NULL;
    offload_device *device = PyMem_Calloc(1, sizeof(*device));
    int previous;
    if (device == NULL)
        return (offload_device *)PyErr_NoMemory();
    device->index = index;
    if (offload_engine_enter_device(st, index, &previous) < 0) {
        PyMem_Free(device);
        return NULL;
    }
    int failed =
        streams_check(rt, rt->stream_create(&device->copy_out, CUDART_STREAM_NON_BLOCKING),
                      "cudaStreamCreate") ||
        streams_check(rt, rt->stream_create(&device->copy_in, CUDART_STREAM_NON_BLOCKING),
                      "cudaStreamCreate") ||
        streams_check(rt, rt->event_create(&device->ordering, CUDART_EVENT_DISABLE_TIMING),
                      "cudaEventCreate");
    offload_engine_leave_device(st, index, previous);
    if (failed) {
        if (device->copy_out != NULL)
            (void)rt->stream_destroy(device->copy_out);
        if (device->copy_in != NULL)
            (void)rt->stream_destroy(device->copy_in);
        PyMem_Free(device);
        return NULL;
    }
    engine->cuda[index] = device;
    return device;
}

/* A destroy that fails leaves nothing to undo: the handle is forgotten
 * either way. Its error must not stay as the last one, which torch would
 * raise from its next, unrelated kernel launch. */
static void
forget_failure(const cudart *rt, int status)
{
    if (status != CUDART_SUCCESS)
        (void)rt->get_last_error();
}

/* The device's events, and its copy streams unless `keep_streams`: at
 * module free they stay for the life of the process, as torch's own pool
 * streams do. Device memory retired with record_stream on a copy stream
 * may be freed after the module (at interpreter exit), and torch's
 * allocator then records an event on that stream; a destroyed one fails
 * that record inside a deleter, which ends the process. */
void
offload_device_free(offload_engine *engine, offload_device *device, int keep_streams)
{
    const cudart *rt = engine->rt;
    for (int i = 0; i < device->spare_count; i++)
        forget_failure(rt, rt->event_destroy(device->spare[i]));
    PyMem_Free(device->spare);
    if (device->ordering != NULL)
        forget_failure(rt, rt->event_destroy(device->ordering));
    if (!keep_streams) {
        forget_failure(rt, rt->stream_destroy(device->copy_out));
        forget_failure(rt, rt->stream_destroy(device->copy_in));
    }
    PyMem_Free(device);
}

int
offload_device_order(offload_engine *engine, offload_device *device, offload_site site,
                     void *waiter, void *producer)
{
    const cudart *rt = engine->rt;
    return streams_check(rt, rt->event_record(device->ordering, producer), "cudaEventRecord") ||
                   streams_wait_event(engine->runtime, rt, site, waiter, device->ordering)
               ? -1 : 0;
}

int
offload_device_record(offload_engine *engine, offload_device *device, void *stream,
                      void **event)
{
    const cudart *rt = engine->rt;
    *event = NULL;
    MP_ASSERT(device->spare_count >= 0 && device->spare_count <= device->spare_capacity);
    void *taken = device->spare_count > 0 ? device->spare[--device->spare_count] : NULL;
    if (streams_record_event(rt, stream, &taken) < 0) {
        /* a spare that failed to record goes back; a new one is already gone */
        if (taken != NULL)
            offload_device_give_event(engine, device, taken);
        return -1;
    }
    *event = taken;
    return 0;
}

void
offload_device_give_event(offload_engine *engine, offload_device *device, void *event)
{
    MP_ASSERT(event != NULL);
    MP_ASSERT(device->spare_count >= 0 && device->spare_count <= device->spare_capacity);
    if (device->spare_count == device->spare_capacity) {
        int capacity = device->spare_capacity ? 2 * device->spare_capacity : 16;
        void **grown = PyMem_Realloc(device->spare, (size_t)capacity * sizeof(void *));
        if (grown == NULL) {
            (void)engine->rt->event_destroy(event);
            return;
        }
        device->spare = grown;
        device->spare_capacity = capacity;
    }
    device->spare[device->spare_count++] = event;
}

int
offload_device_d2h_done(offload_engine *engine, StorageCopy *copy)
{
    MP_ASSERT((copy->state == COPY_QUEUED) == (copy->d2h_done != NULL));
    if (copy->state != COPY_QUEUED)
        return copy->state == COPY_COMPLETED;
    int done = streams_event_done(engine->rt, copy->d2h_done);
    if (done == 1) {
        offload_device_give_event(engine, copy->device, copy->d2h_done);
        copy->d2h_done = NULL;
        copy_advance(copy, COPY_COMPLETED);
    }
    return done;
}
