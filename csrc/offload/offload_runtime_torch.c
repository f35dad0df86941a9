/* The offload runtime of a real GPU: libcudart for streams, events and
 * copies, torch's Python API for what only torch knows. */
#include "offload_runtime.h"

static const cudart *
torch_load(void)
{
    const cudart *rt = cudart_load();
    if (rt == NULL)
        PyErr_Format(PyExc_RuntimeError, "matepoint: cannot offload CUDA tensors: %s",
                     cudart_error());
    return rt;
}

static int
torch_may_hold_tensors(mp_state *st)
{
    return st->current_raw_stream != NULL;
}

static int
torch_tensor_device(mp_state *st, PyObject *tensor, PyObject *device_obj, int *index)
{
    (void)tensor;
    PyObject *type = PyObject_GetAttr(device_obj, st->str_type);
    if (type == NULL)
        return -1;
    int is_cuda = PyUnicode_CompareWithASCIIString(type, "cuda") == 0;
    Py_DECREF(type);
    if (!is_cuda)
        return 0;
    PyObject *value = PyObject_GetAttr(device_obj, st->str_index);
    long number = value == NULL ? -1 : value == Py_None ? 0 : PyLong_AsLong(value);
    Py_XDECREF(value);
    if (number == -1 && PyErr_Occurred())
        return -1;
    *index = (int)number;
    return 1;
}

static int
torch_current_stream(mp_state *st, int device, void **stream)
{
    if (st->current_raw_stream == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "matepoint: this torch build has no CUDA streams");
        return -1;
    }
    PyObject *raw = PyObject_CallFunction(st->current_raw_stream, "i", device);
    if (raw == NULL)
        return -1;
    *stream = PyLong_AsVoidPtr(raw);
    Py_DECREF(raw);
    return PyErr_Occurred() ? -1 : 0;
}

/* torch.cuda.default_stream(device) for the NULL handle, else the handle
 * wrapped as torch.cuda.ExternalStream. */
static PyObject *
stream_object(mp_state *st, int device, void *stream)
{
    PyObject *cuda = PyObject_GetAttrString(st->torch_module, "cuda");
    if (cuda == NULL)
        return NULL;
    PyObject *result;
    if (stream == NULL) {
        result = PyObject_CallMethod(cuda, "default_stream", "i", device);
    } else {
        PyObject *external = PyObject_GetAttrString(cuda, "ExternalStream");
        PyObject *args = external ? Py_BuildValue("(N)", PyLong_FromVoidPtr(stream)) : NULL;
        PyObject *kwargs = args ? Py_BuildValue("{si}", "device", device) : NULL;
        result = kwargs ? PyObject_Call(external, args, kwargs) : NULL;
        Py_XDECREF(external);
        Py_XDECREF(args);
        Py_XDECREF(kwargs);
    }
    Py_DECREF(cuda);
    return result;
}

static int
torch_record_stream(mp_state *st, PyObject *storage, int device, void *stream)
{
    PyObject *stream_obj = stream_object(st, device, stream);
    PyObject *device_obj = stream_obj ? PyObject_GetAttr(storage, st->str_device) : NULL;
    PyObject *kwargs = device_obj ? Py_BuildValue("{sOsO}", "dtype", st->uint8_dtype, "device",
                                                  device_obj) : NULL;
    PyObject *args = kwargs ? Py_BuildValue("((i))", 0) : NULL;
    PyObject *empty = args ? PyObject_Call(st->torch_empty, args, kwargs) : NULL;
    PyObject *view = empty ? PyObject_CallMethod(empty, "set_", "O", storage) : NULL;
    PyObject *done = view ? PyObject_CallMethod(view, "record_stream", "O", stream_obj) : NULL;
    Py_XDECREF(stream_obj);
    Py_XDECREF(device_obj);
    Py_XDECREF(kwargs);
    Py_XDECREF(args);
    Py_XDECREF(empty);
    Py_XDECREF(view);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

static int
torch_has_context(mp_state *st, int device)
{
    PyObject *c = PyObject_GetAttrString(st->torch_module, "_C");
    PyObject *answer = c ? PyObject_CallMethod(c, "_cuda_hasPrimaryContext", "i", device) : NULL;
    Py_XDECREF(c);
    if (answer == NULL)
        return -1;
    int has = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return has;
}

static PyObject *
torch_empty_bytes(mp_state *st, int device, PyObject *device_obj, uint64_t nbytes)
{
    (void)device;
    PyObject *kwargs = Py_BuildValue("{sOsO}", "dtype", st->uint8_dtype, "device", device_obj);
    PyObject *args = kwargs ? Py_BuildValue("((K))", (unsigned long long)nbytes) : NULL;
    PyObject *tensor = args ? PyObject_Call(st->torch_empty, args, kwargs) : NULL;
    Py_XDECREF(kwargs);
    Py_XDECREF(args);
    return tensor;
}

const offload_runtime offload_runtime_torch = {
    .name = "cuda",
    .device_type = "cuda",
    .load = torch_load,
    .may_hold_tensors = torch_may_hold_tensors,
    .tensor_device = torch_tensor_device,
    .current_stream = torch_current_stream,
    .record_stream = torch_record_stream,
    .has_context = torch_has_context,
    .empty_bytes = torch_empty_bytes,
};
