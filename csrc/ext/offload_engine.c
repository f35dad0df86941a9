#include "offload_engine.h"
#include "offload_window.h"
#include "streams.h"
#include "cuda/cudart_sim.h"

offload_engine *
offload_engine_of(PyObject *module)
{
    return ((mp_state *)PyModule_GetState(module))->engine;
}

offload_engine *
offload_engine_new(void)
{
    offload_engine *engine = PyMem_Calloc(1, sizeof(*engine));
    if (engine == NULL)
        return NULL;
    engine->options = (offload_options){
        .enabled = 1, .pipeline = 1, .prefetch_depth = 1, .window = 2,
        .min_offload_bytes = 1 << 20,
    };
    engine->cpu.index = -1;
    return engine;
}

offload_options *
offload_engine_options(offload_engine *engine)
{
    return &engine->options;
}

/* Waits for the device's copies out and gives its streams back. */
static void
device_free(offload_engine *engine, offload_device *device)
{
    offload_window_drain(engine, device);
    (void)engine->rt->stream_destroy(device->copy_out);
    (void)engine->rt->stream_destroy(device->copy_in);
    PyMem_Free(device);
}

static void
free_cuda_devices(offload_engine *engine)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL)
            device_free(engine, engine->cuda[i]);
        engine->cuda[i] = NULL;
    }
}

void
offload_engine_free(offload_engine *engine)
{
    if (engine == NULL)
        return;
    free_cuda_devices(engine);
    Py_CLEAR(engine->cpu.in_flight);
    /* buffers still held by live copies are the process's until exit */
    if (engine->pool != NULL && pool_get_stats(engine->pool).blocks_in_use == 0)
        pool_destroy(engine->pool);
    else if (engine->pool != NULL)
        pool_empty(engine->pool);
    PyMem_Free(engine);
}

int
offload_engine_apply_limit(offload_engine *engine)
{
    if (engine->pool != NULL)
        pool_set_limit(engine->pool, engine->options.pool_limit_bytes);
    return 0;
}

static int
cuda_device_count(const cudart *rt)
{
    int count = 0;
    return rt->get_device_count(&count) == CUDART_SUCCESS ? count : 0;
}

/* Pinned memory when a CUDA runtime with a device is present, else plain. */
int
offload_engine_ensure_pool(offload_engine *engine)
{
    if (engine->pool != NULL)
        return 0;
    const cudart *rt = engine->simulated ? engine->rt : cudart_load();
    pool_backend backend = rt != NULL && cuda_device_count(rt) > 0
                               ? pool_cuda_backend(rt)
                               : pool_host_backend(&engine->host_ctx);
    engine->pool = pool_create(backend, engine->options.pool_limit_bytes);
    if (engine->pool == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

offload_device *
offload_engine_cuda_device(offload_engine *engine, int index)
{
    if (index < 0 || index >= MAX_CUDA_DEVICES) {
        PyErr_Format(PyExc_ValueError, "matepoint: CUDA device index %d out of range", index);
        return NULL;
    }
    if (engine->cuda[index] != NULL)
        return engine->cuda[index];
    if (engine->rt == NULL && (engine->rt = cudart_load()) == NULL) {
        PyErr_Format(PyExc_RuntimeError, "matepoint: cannot offload CUDA tensors: %s",
                     cudart_error());
        return NULL;
    }
    const cudart *rt = engine->rt;
    offload_device *device = PyMem_Calloc(1, sizeof(*device));
    int previous;
    if (device == NULL)
        return (offload_device *)PyErr_NoMemory();
    device->index = index;
    if (streams_enter_device(rt, index, &previous) < 0) {
        PyMem_Free(device);
        return NULL;
    }
    int failed =
        streams_check(rt, rt->stream_create(&device->copy_out, CUDART_STREAM_NON_BLOCKING),
                      "cudaStreamCreate") ||
        streams_check(rt, rt->stream_create(&device->copy_in, CUDART_STREAM_NON_BLOCKING),
                      "cudaStreamCreate");
    streams_leave_device(rt, previous);
    if (failed) {
        if (device->copy_out != NULL)
            (void)rt->stream_destroy(device->copy_out);
        PyMem_Free(device);
        return NULL;
    }
    engine->cuda[index] = device;
    return device;
}

int
offload_engine_current_stream(mp_state *st, int index, void **stream)
{
    if (st->engine->simulated) {
        *stream = cudart_sim_compute_stream();
        return 0;
    }
    if (st->current_raw_stream == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "matepoint: this torch build has no CUDA streams");
        return -1;
    }
    PyObject *raw = PyObject_CallFunction(st->current_raw_stream, "i", index);
    if (raw == NULL)
        return -1;
    *stream = PyLong_AsVoidPtr(raw);
    Py_DECREF(raw);
    return PyErr_Occurred() ? -1 : 0;
}

static int
has_live_copies(offload_engine *engine)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL && engine->cuda[i]->first != NULL)
            return 1;
    }
    return engine->cpu.first != NULL ||
           (engine->pool != NULL && pool_get_stats(engine->pool).blocks_in_use > 0);
}

int
offload_engine_simulate(offload_engine *engine, int on)
{
    if (has_live_copies(engine)) {
        PyErr_SetString(PyExc_RuntimeError, "matepoint: cannot switch the CUDA runtime while "
                                            "offloaded inputs are alive");
        return -1;
    }
    /* devices and pool belong to the runtime that made them */
    free_cuda_devices(engine);
    if (engine->pool != NULL) {
        pool_destroy(engine->pool);
        engine->pool = NULL;
    }
    engine->simulated = on;
    engine->rt = on ? cudart_sim() : NULL;
    engine->peak_device_bytes_in_flight = engine->device_bytes_in_flight;
    return 0;
}

/* ---- pool API ------------------------------------------------------------------- */

PyObject *
offload_pool_stats(mp_state *st)
{
    offload_engine *engine = st->engine;
    pool_stats stats = {0};
    if (offload_window_poll_all(engine) < 0)
        return NULL;
    if (engine->pool != NULL)
        stats = pool_get_stats(engine->pool);
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKss}", "prefetched", (unsigned long long)engine->prefetched,
        "fetched_at_need", (unsigned long long)engine->fetched_at_need, "bytes_in_use",
        stats.bytes_in_use, "bytes_requested", stats.bytes_requested, "bytes_reserved",
        stats.bytes_reserved, "peak_bytes_in_use", stats.peak_bytes_in_use, "host_allocations",
        stats.host_allocations, "hits", stats.hits, "misses", stats.misses, "fallbacks",
        stats.fallbacks, "failures", stats.failures, "blocks_in_use", stats.blocks_in_use,
        "device_bytes_in_flight", (unsigned long long)engine->device_bytes_in_flight,
        "peak_device_bytes_in_flight", (unsigned long long)engine->peak_device_bytes_in_flight,
        "backend", engine->pool == NULL ? "none" : pool_backend_name(engine->pool));
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
    Py_BEGIN_ALLOW_THREADS
    *added = pool_reserve(p, buffer_bytes, count);
    Py_END_ALLOW_THREADS
    return 0;
}

int
offload_empty_pool(mp_state *st)
{
    if (offload_window_poll_all(st->engine) < 0)
        return -1;
    if (st->engine->pool != NULL)
        pool_empty(st->engine->pool);
    return 0;
}
