#include "offload_window.h"
#include "streams.h"

int
offload_window_add(offload_engine *engine, offload_device *device, StorageCopy *copy,
                   PyObject *source, void *producer)
{
    if (device->in_flight == NULL && (device->in_flight = PyList_New(0)) == NULL)
        return -1;
    if (PyList_Append(device->in_flight, (PyObject *)copy) < 0)
        return -1;
    copy->source = Py_NewRef(source);
    copy->producer = producer;
    copy->region = device->regions;
    engine->device_bytes_in_flight += copy->nbytes;
    return 0;
}

/* Has the copy's D2H completed? 1, 0, or -1 with an error. A completed
 * event is destroyed: nothing needs to wait on it any more. */
static int
copy_completed(offload_engine *engine, StorageCopy *copy)
{
    if (copy->d2h_done == NULL)
        return 1;
    int status = engine->rt->event_query(copy->d2h_done);
    if (status == CUDART_ERROR_NOT_READY)
        return 0;
    if (streams_check(engine->rt, status, "device-to-host copy") < 0)
        return -1;
    (void)engine->rt->event_destroy(copy->d2h_done);
    copy->d2h_done = NULL;
    return 1;
}

/* Drops a source: at once when its copy completed, else after ordering
 * its producing stream behind the copy (the invariant in the header).
 * `force` 0 only drops completed ones. Returns 1 if dropped, 0 if kept,
 * -1 on error (kept: the source may still be read). */
static int
release_source(offload_engine *engine, StorageCopy *copy, int force)
{
    int completed = copy_completed(engine, copy);
    if (completed < 0 || (!completed && !force))
        return completed;
    if (!completed &&
        streams_check(engine->rt, engine->rt->stream_wait_event(copy->producer, copy->d2h_done, 0),
                      "cudaStreamWaitEvent (release after the copy out)") < 0)
        return -1;
    engine->device_bytes_in_flight -= copy->nbytes;
    Py_CLEAR(copy->source);
    return 1;
}

/* Releases the sources of the window's copies that completed, and of those
 * of regions before `force_below_region` in stream order. The copies kept
 * move to a fresh list, so no slot of the old one is released twice;
 * releasing may run code that comes back here, so the old list is held. */
static int
sweep(offload_engine *engine, offload_device *device, uint64_t force_below_region)
{
    if (device->in_flight == NULL || PyList_GET_SIZE(device->in_flight) == 0)
        return 0;  /* every recompute sweeps: the common case costs nothing */
    PyObject *kept = PyList_New(0);
    if (kept == NULL)
        return -1;
    PyObject *list = Py_NewRef(device->in_flight);
    int result = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        StorageCopy *copy = (StorageCopy *)PyList_GET_ITEM(list, i);
        int released = result < 0 ? 0
                                  : release_source(engine, copy, copy->region < force_below_region);
        if (released < 0)
            result = -1;
        if (released <= 0 && PyList_Append(kept, (PyObject *)copy) < 0) {
            Py_DECREF(kept);
            Py_DECREF(list);
            return -1;
        }
    }
    Py_SETREF(device->in_flight, kept);
    Py_DECREF(list);
    return result;
}

int
offload_window_end_region(offload_engine *engine, offload_device *device)
{
    uint64_t ended = device->regions++;
    uint64_t window = (uint64_t)engine->options.window;
    /* regions ended - window + 1 .. ended stay in flight */
    if (sweep(engine, device, ended + 1 >= window ? ended + 1 - window : 0) < 0)
        return -1;
    /* the peak as the GPU sees it: what is held while a region's function runs */
    if (engine->device_bytes_in_flight > engine->peak_device_bytes_in_flight)
        engine->peak_device_bytes_in_flight = engine->device_bytes_in_flight;
    return 0;
}

int
offload_window_release_all(offload_engine *engine, offload_device *device)
{
    return sweep(engine, device, UINT64_MAX);
}

int
offload_window_poll_all(offload_engine *engine)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL && sweep(engine, engine->cuda[i], 0) < 0)
            return -1;
    }
    return 0;
}

void
offload_window_drain(offload_engine *engine, offload_device *device)
{
    if (device->in_flight == NULL)
        return;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(device->in_flight); i++) {
        StorageCopy *copy = (StorageCopy *)PyList_GET_ITEM(device->in_flight, i);
        if (copy->d2h_done != NULL)
            (void)engine->rt->event_synchronize(copy->d2h_done);
        engine->device_bytes_in_flight -= copy->nbytes;
        Py_CLEAR(copy->source);
    }
    Py_CLEAR(device->in_flight);
}
