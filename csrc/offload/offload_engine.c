/* The engine as the module sees it: made and freed with the module, its
 * options, the runtime it runs over, and the pool's Python API (counters,
 * reserve, empty).
 *
 * Owns the engine itself and its devices' lifetime: teardown and a switch
 * of runtime drain each device's window and returning buffers (the waits
 * are here, at the top) before the device floor frees it. Polls the
 * window, the returning buffers and the disk tier before it reports or
 * drops the pool's buffers. Floor `entry`: called by csrc/module and
 * csrc/testing only; calls every floor below but the directions. GIL
 * held. */
#include "offload_internal.h"

#include <stddef.h>
#include <string.h>

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

/* Copies of graphs already dropped may still be in flight, held by the
 * window, and their buffers on their way back: the host waits for them
 * (a teardown or a switch of runtime is no hot path). */
static void
drain_device(offload_engine *engine, offload_device *device)
{
    offload_window_drain(engine, device);
    offload_return_drain(engine, device);
}

static void
free_devices(offload_engine *engine, int keep_streams)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL) {
            drain_device(engine, engine->cuda[i]);
            offload_device_free(engine, engine->cuda[i], keep_streams);
        }
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
    uint64_t limit = offload_pool_limit(engine);
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
has_live_groups(offload_engine *engine)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL && engine->cuda[i]->first != NULL)
            return 1;
    }
    return 0;
}

static void
drain_devices(offload_engine *engine)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL)
            drain_device(engine, engine->cuda[i]);
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
                     (unsigned long long)offload_pool_limit(engine));
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
