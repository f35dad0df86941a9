/* matepoint._C's test controls for kernels that lag in data and for
 * backward as on CUDA (testing.h): tests/sim.py's dispatch mode queues
 * every CPU kernel's results on its stream, and its backward worker orders
 * streams as torch's autograd engine does. GIL held. */
#include "testing.h"
#include "testing/cudart_sim.h"

#include <stdlib.h>

static int
stream_of(PyObject *handle, void **stream)
{
    *stream = handle == Py_None ? NULL : PyLong_AsVoidPtr(handle);
    return PyErr_Occurred() ? -1 : 0;
}

/* `flat` = [ptr0, bytes0, ptr1, bytes1, ...] as spans; *spans is
 * PyMem-allocated (NULL when there are none). */
static int
spans_of(PyObject *flat, cudart_sim_span **spans, size_t *count)
{
    PyObject *fast = PySequence_Fast(flat, "simulated GPU: spans must be a list");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    *spans = NULL;
    *count = 0;
    if (n % 2 != 0) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "simulated GPU: spans come as pointer, bytes pairs");
        return -1;
    }
    if (n > 0 && (*spans = PyMem_Calloc((size_t)n / 2, sizeof(**spans))) == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n / 2; i++) {
        (*spans)[i].ptr = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(fast, 2 * i));
        (*spans)[i].bytes = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, 2 * i + 1));
        if (PyErr_Occurred()) {
            Py_DECREF(fast);
            PyMem_Free(*spans);
            *spans = NULL;
            return -1;
        }
    }
    *count = (size_t)n / 2;
    Py_DECREF(fast);
    return 0;
}

static PyObject *
sim_kernel(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *device_obj, *handle, *writes_obj, *reads_obj;
    cudart_sim_span *writes = NULL, *reads = NULL;
    size_t n_writes = 0, n_reads = 0;
    int device;
    void *stream;
    if (!PyArg_ParseTuple(args, "OOOO:_sim_kernel", &device_obj, &handle, &writes_obj,
                          &reads_obj) ||
        testing_device_arg(device_obj, &device) < 0 || stream_of(handle, &stream) < 0 ||
        spans_of(writes_obj, &writes, &n_writes) < 0)
        return NULL;
    if (spans_of(reads_obj, &reads, &n_reads) < 0) {
        PyMem_Free(writes);
        return NULL;
    }
    int status = cudart_sim_queue_kernel(device, stream, writes, n_writes, reads, n_reads);
    PyMem_Free(writes);
    PyMem_Free(reads);
    if (status != CUDART_SUCCESS)
        return PyErr_Format(PyExc_RuntimeError, "simulated GPU: kernel not queued (%d)", status);
    Py_RETURN_NONE;
}

static PyObject *
sim_launch_for(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *device_obj, *handle, *spans_obj;
    cudart_sim_span *spans = NULL;
    size_t n_spans = 0;
    int device;
    void *stream;
    if (!PyArg_ParseTuple(args, "OOO:_sim_launch_for", &device_obj, &handle, &spans_obj) ||
        testing_device_arg(device_obj, &device) < 0 || stream_of(handle, &stream) < 0 ||
        spans_of(spans_obj, &spans, &n_spans) < 0)
        return NULL;
    int status = cudart_sim_launch_for(device, stream, spans, n_spans);
    PyMem_Free(spans);
    if (status != CUDART_SUCCESS)
        return PyErr_Format(PyExc_RuntimeError, "simulated GPU: launch failed (%d)", status);
    Py_RETURN_NONE;
}

static PyObject *
sim_order_streams(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *waiter_device_obj, *waiter_obj, *producer_device_obj, *producer_obj;
    int waiter_device, producer_device;
    void *waiter, *producer;
    if (!PyArg_ParseTuple(args, "OOOO:_sim_order_streams", &waiter_device_obj, &waiter_obj,
                          &producer_device_obj, &producer_obj) ||
        testing_device_arg(waiter_device_obj, &waiter_device) < 0 ||
        stream_of(waiter_obj, &waiter) < 0 ||
        testing_device_arg(producer_device_obj, &producer_device) < 0 ||
        stream_of(producer_obj, &producer) < 0)
        return NULL;
    int status = cudart_sim_order_streams(waiter_device, waiter, producer_device, producer);
    if (status != CUDART_SUCCESS)
        return PyErr_Format(PyExc_RuntimeError, "simulated GPU: streams not ordered (%d)",
                            status);
    Py_RETURN_NONE;
}

static PyObject *
sim_take_last_error(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromLong(cudart_sim()->get_last_error());
}

static PyObject *
sim_device_of(PyObject *module, PyObject *ptr)
{
    (void)module;
    void *address = PyLong_AsVoidPtr(ptr);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(cudart_sim_device_of(address));
}

/* Begins (`begin` true) or ends a graph capture on a created stream: the
 * end's CUDA status (0: the capture stayed valid, 901: invalidated). */
static PyObject *
sim_capture(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *device_obj, *handle;
    int device, begin;
    void *stream;
    if (!PyArg_ParseTuple(args, "OOp:_sim_capture", &device_obj, &handle, &begin) ||
        testing_device_arg(device_obj, &device) < 0 || stream_of(handle, &stream) < 0)
        return NULL;
    if (begin) {
        int status = cudart_sim_begin_capture(device, stream);
        if (status != CUDART_SUCCESS)
            return PyErr_Format(PyExc_RuntimeError, "simulated GPU: no capture begun (%d)",
                                status);
        return PyLong_FromLong(status);
    }
    int status = cudart_sim_end_capture(device, stream);
    if (status != CUDART_SUCCESS && status != CUDART_SIM_CAPTURE_INVALIDATED)
        return PyErr_Format(PyExc_RuntimeError, "simulated GPU: no capture to end (%d)", status);
    return PyLong_FromLong(status);
}

static PyMethodDef lag_methods[] = {
    {"_sim_capture", sim_capture, METH_VARARGS,
     "_sim_capture($module, device, handle, begin, /)\n--\n\n"
     "Begins (begin true) or ends a graph capture on a created stream, in CUDA's global mode; "
     "the end returns 0, or 901 when a forbidden call invalidated the capture."},
    {"_sim_device_of", sim_device_of, METH_O,
     "_sim_device_of($module, ptr, /)\n--\n\n"
     "The simulated device whose memory holds ptr, else -1."},
    {"_sim_kernel", sim_kernel, METH_VARARGS,
     "_sim_kernel($module, device, handle, writes, reads, /)\n--\n\n"
     "A CPU kernel that just ran on that stream: its writes (flat [ptr, bytes, ...]) read as "
     "poison until the stream reaches it, then land if its reads did not change."},
    {"_sim_launch_for", sim_launch_for, METH_VARARGS,
     "_sim_launch_for($module, device, handle, spans, /)\n--\n\n"
     "A CPU kernel using only spans (flat [ptr, bytes, ...]) about to run on that stream: what "
     "that memory depends on lands first, the rest of the queued work stays queued."},
    {"_sim_order_streams", sim_order_streams, METH_VARARGS,
     "_sim_order_streams($module, waiter_device, waiter, producer_device, producer, /)\n--\n\n"
     "Work queued on the waiter from now on runs after the producer's queued work."},
    {"_sim_take_last_error", sim_take_last_error, METH_NOARGS,
     "_sim_take_last_error($module, /)\n--\n\n"
     "The calling thread's CUDA last error, cleared (cudaGetLastError)."},
    {NULL, NULL, 0, NULL},
};

int
testing_add_lag_functions(PyObject *module)
{
    return PyModule_AddFunctions(module, lag_methods);
}
