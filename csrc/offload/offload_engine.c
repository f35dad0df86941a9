#include "offload_internal.h"
#include "base/compat.h"
#include "streams.h"

#include <stddef.h>
#include <string.h>

offload_engine *
offload_engine_of(PyObject *module)
{
    return mp_state_of(module)->engine;
}

offload_engine *
offload_engine_new(void)
{
    offload_engine *engine = PyMem_Calloc(1, sizeof(*engine));
    if (engine == NULL)
        return NULL;
    /* the options start at their defaults: module/options.c's table */
    engine->runtime = &offload_runtime_torch;
    return engine;
}

offload_options *
offload_engine_options(offload_engine *engine)
{
    return &engine->options;
}

/* Waits for the device's copies out and gives its streams and events back. */
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
static void
device_free(offload_engine *engine, offload_device *device, int keep_streams)
{
    const cudart *rt = engine->rt;
    offload_window_drain(engine, device);
    offload_return_drain(engine, device);
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

static void
free_devices(offload_engine *engine, int keep_streams)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL)
            device_free(engine, engine->cuda[i], keep_streams);
        engine->cuda[i] = NULL;
    }
}

void
offload_engine_free(offload_engine *engine)
{
    if (engine == NULL)
        return;
    free_devices(engine, 1);
#ifdef MATEPOINT_TESTING
    Py_CLEAR(engine->yield_hook);   /* no test code runs in a teardown */
#endif
    offload_spill_free(engine);
    /* buffers still held by live copies are the process's until exit */
    if (engine->pool != NULL && pool_get_stats(engine->pool).blocks_in_use == 0)
        pool_destroy(engine->pool);
    else if (engine->pool != NULL)
        pool_empty(engine->pool);
    PyMem_Free(engine);
}

/* Pool calls that may free pinned buffers (cudaFreeHost synchronizes the
 * device) run without the GIL. */
int
offload_engine_apply_limit(offload_engine *engine)
{
    pool *p = engine->pool;
    uint64_t limit = offload_spill_pool_limit(engine);
    /* buffers whose last copy completed join the cache the limit drops */
    offload_return_poll_all(engine);
    if (p != NULL) {
        Py_BEGIN_ALLOW_THREADS
        pool_set_limit(p, limit);
        Py_END_ALLOW_THREADS
    }
    return 0;
}

static void
destroy_pool(offload_engine *engine)
{
    pool *p = engine->pool;
    engine->pool = NULL;
    Py_BEGIN_ALLOW_THREADS
    pool_destroy(p);
    Py_END_ALLOW_THREADS
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

/* The runtime's table, loaded on first use. */
static const cudart *
engine_rt(offload_engine *engine)
{
    if (engine->rt == NULL)
        engine->rt = engine->runtime->load();
    return engine->rt;
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
    engine->pool = pool_create(backend, offload_spill_pool_limit(engine));
    if (engine->pool == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
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
    if (has > 0 && st->engine->rt->set_device(previous) != CUDART_SUCCESS)
        (void)st->engine->rt->get_last_error();
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

static int
has_live_groups(offload_engine *engine)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL && engine->cuda[i]->first != NULL)
            return 1;
    }
    return 0;
}

/* Copies of graphs already dropped may still be in flight, held by the
 * windows, and their buffers on their way back: a switch of runtime is
 * no hot path, so the host waits for them here. */
static void
drain_devices(offload_engine *engine)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL) {
            offload_window_drain(engine, engine->cuda[i]);
            offload_return_drain(engine, engine->cuda[i]);
        }
    }
}

int
offload_engine_use_runtime(offload_engine *engine, const offload_runtime *runtime)
{
    if (!has_live_groups(engine) && engine->rt != NULL)
        drain_devices(engine);
    if (has_live_groups(engine) ||
        (engine->pool != NULL && pool_get_stats(engine->pool).blocks_in_use > 0)) {
        PyErr_SetString(PyExc_RuntimeError, "matepoint: cannot switch the CUDA runtime while "
                                            "offloaded inputs are alive");
        return -1;
    }
    /* devices and pool belong to the runtime that made them */
    if (engine->rt != NULL)
        free_devices(engine, 0);
    if (engine->pool != NULL)
        destroy_pool(engine);
    engine->runtime = runtime;
    engine->rt = NULL;
    engine->devices_with_context = 0;
    engine->warned_fallback = 0;
    engine->warned_read_fallback = 0;
    engine->peak_device_bytes_in_flight = engine->device_bytes_in_flight;
    return 0;
}

const char *
offload_device_type(mp_state *st)
{
    return st->engine->runtime->device_type;
}

/* ---- pool API ------------------------------------------------------------------- */

/* The one list of pool_stats()'s counters (all uint64_t): from the pool's
 * stats or the engine itself. "backend" (a str) follows them. */
#define POOL_KEY(field) {#field, offsetof(pool_stats, field), 0}
#define ENGINE_KEY(field) {#field, offsetof(offload_engine, field), 1}
static const struct {
    const char *key;
    size_t offset;
    int of_engine;
} stats_keys[] = {
    ENGINE_KEY(prefetched), ENGINE_KEY(fetched_at_need), POOL_KEY(bytes_in_use),
    POOL_KEY(bytes_requested), POOL_KEY(bytes_reserved), POOL_KEY(peak_bytes_in_use),
    POOL_KEY(host_allocations), POOL_KEY(host_frees), POOL_KEY(hits), POOL_KEY(misses), POOL_KEY(fallbacks),
    POOL_KEY(failures), POOL_KEY(blocks_in_use), ENGINE_KEY(device_bytes_in_flight),
    ENGINE_KEY(peak_device_bytes_in_flight), ENGINE_KEY(used_in_place),
    ENGINE_KEY(spilled_bytes), ENGINE_KEY(peak_spilled_bytes), ENGINE_KEY(spill_writes),
    ENGINE_KEY(spill_reads), ENGINE_KEY(spill_read_stalls), ENGINE_KEY(spill_failures),
};
#undef POOL_KEY
#undef ENGINE_KEY
#define STATS_KEY_COUNT (sizeof(stats_keys) / sizeof(stats_keys[0]))

PyObject *
offload_pool_stats_keys(void)
{
    PyObject *keys = PyTuple_New((Py_ssize_t)STATS_KEY_COUNT + 1);
    for (size_t i = 0; keys != NULL && i <= STATS_KEY_COUNT; i++) {
        PyObject *key = PyUnicode_FromString(i < STATS_KEY_COUNT ? stats_keys[i].key : "backend");
        if (key == NULL)
            Py_CLEAR(keys);
        else
            PyTuple_SET_ITEM(keys, (Py_ssize_t)i, key);
    }
    return keys;
}

PyObject *
offload_pool_stats(mp_state *st)
{
    offload_engine *engine = st->engine;
    pool_stats stats = {0};
    if (offload_window_poll_all(st) < 0)
        return NULL;
    offload_return_poll_all(engine);
    offload_spill_poll(engine);
    if (engine->pool != NULL)
        stats = pool_get_stats(engine->pool);
    PyObject *dict = PyDict_New();
    for (size_t i = 0; dict != NULL && i < STATS_KEY_COUNT; i++) {
        const char *base = stats_keys[i].of_engine ? (const char *)engine : (const char *)&stats;
        uint64_t value;
        memcpy(&value, base + stats_keys[i].offset, sizeof(value));
        PyObject *number = PyLong_FromUnsignedLongLong(value);
        if (number == NULL || PyDict_SetItemString(dict, stats_keys[i].key, number) < 0)
            Py_CLEAR(dict);
        Py_XDECREF(number);
    }
    PyObject *backend = PyUnicode_FromString(engine->pool == NULL ? "none"
                                                                  : pool_backend_name(engine->pool));
    if (dict != NULL && (backend == NULL || PyDict_SetItemString(dict, "backend", backend) < 0))
        Py_CLEAR(dict);
    Py_XDECREF(backend);
    return dict;
}

void
offload_fail_next_acquires(mp_state *st, int count)
{
    st->engine->fail_next_acquires = count;
}

int
offload_reserve_pool(mp_state *st, uint64_t buffer_bytes, uint64_t count, uint64_t *added)
{
    offload_engine *engine = st->engine;
    if (offload_engine_ensure_pool(engine) < 0)
        return -1;
    pool *p = engine->pool;
    /* pinning runs in the current device's context: use one that exists,
     * or every rank would create one on device 0 (a new thread's) */
    int device = engine->rt != NULL ? offload_engine_pinning_device(st) : -1;
    int previous = device;
    if (PyErr_Occurred() ||
        (device >= 0 && offload_engine_enter_device(st, device, &previous) < 0))
        return -1;
    Py_BEGIN_ALLOW_THREADS
    *added = pool_reserve(p, buffer_bytes, count);
    Py_END_ALLOW_THREADS
    if (device >= 0)
        offload_engine_leave_device(st, device, previous);
    if (*added == count)
        return 0;
    const char *option = offload_limit_reached(engine, buffer_bytes);
    if (option != NULL)
        PyErr_Format(PyExc_MemoryError,
                     "matepoint.reserve_pool: pinned %llu of %llu buffers of %llu bytes; %s "
                     "(%llu bytes) has no room for the rest", (unsigned long long)*added,
                     (unsigned long long)count, (unsigned long long)buffer_bytes, option,
                     (unsigned long long)offload_spill_pool_limit(engine));
    else
        PyErr_Format(PyExc_MemoryError,
                     "matepoint.reserve_pool: pinned %llu of %llu buffers of %llu bytes; the "
                     "host refused to pin the rest (no limit was reached)",
                     (unsigned long long)*added, (unsigned long long)count,
                     (unsigned long long)buffer_bytes);
    return -1;
}

int
offload_empty_pool(mp_state *st)
{
    if (offload_window_poll_all(st) < 0)
        return -1;
    offload_return_poll_all(st->engine);
    pool *p = st->engine->pool;
    if (p != NULL) {
        Py_BEGIN_ALLOW_THREADS
        pool_empty(p);
        Py_END_ALLOW_THREADS
    }
    return 0;
}
