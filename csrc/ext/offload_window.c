#include "offload_window.h"
#include "streams.h"

int
offload_window_add(offload_device *device, StorageCopy *copy, PyObject *source)
{
    if (device->in_flight == NULL && (device->in_flight = PyList_New(0)) == NULL)
        return -1;
    if (PyList_Append(device->in_flight, (PyObject *)copy) < 0)
        return -1;
    copy->source = Py_NewRef(source);
    return 0;
}

/* Drops the sources of device-to-host copies that have completed. The
 * copies still running move to a fresh list, so no slot of the old one is
 * released twice. */
int
offload_window_poll(offload_engine *engine, offload_device *device)
{
    if (device->in_flight == NULL)
        return 0;
    PyObject *running = PyList_New(0);
    if (running == NULL)
        return -1;
    /* releasing a source may run code that polls again: hold the list */
    PyObject *list = Py_NewRef(device->in_flight);
    int result = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        StorageCopy *copy = (StorageCopy *)PyList_GET_ITEM(list, i);
        if (copy->d2h_done == NULL)
            continue;  /* finished by an earlier poll that then failed */
        int status = result < 0 ? CUDART_ERROR_NOT_READY : engine->rt->event_query(copy->d2h_done);
        if (status != CUDART_SUCCESS && status != CUDART_ERROR_NOT_READY) {
            streams_check(engine->rt, status, "device-to-host copy");
            result = -1;
            status = CUDART_ERROR_NOT_READY;  /* keep it: its source may still be read */
        }
        if (status == CUDART_ERROR_NOT_READY) {
            if (PyList_Append(running, (PyObject *)copy) < 0) {
                Py_DECREF(running);
                Py_DECREF(list);
                return -1;
            }
            continue;
        }
        (void)engine->rt->event_destroy(copy->d2h_done);
        copy->d2h_done = NULL;
        Py_CLEAR(copy->source);
    }
    Py_SETREF(device->in_flight, running);
    Py_DECREF(list);
    return result;
}

int
offload_window_poll_all(offload_engine *engine)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL && offload_window_poll(engine, engine->cuda[i]) < 0)
            return -1;
    }
    return 0;
}

void
offload_window_drain(offload_engine *engine, offload_device *device)
{
    if (device->in_flight != NULL) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(device->in_flight); i++) {
            StorageCopy *copy = (StorageCopy *)PyList_GET_ITEM(device->in_flight, i);
            if (copy->d2h_done != NULL)
                (void)engine->rt->event_synchronize(copy->d2h_done);
        }
        Py_CLEAR(device->in_flight);
    }
}
