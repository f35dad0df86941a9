/* The offload runtime of a real GPU: libcudart for streams, events and
 * copies, torch's Python API for what only torch knows.
 *
 * Owns nothing (the table is constant). Floor `gpu`: reached by the
 * engine through offload_runtime.h's table, and by csrc/testing's runtime
 * for torch's answers; calls nothing of csrc/offload. */
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

int
offload_torch_may_hold_tensors(mp_state *st)
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

/* 0 when torch has `entry` (one of the state's CUDA entry points), else
 * -1 with an error: a CPU build of torch has none of them. */
static int
require(PyObject *entry, const char *what)
{
    if (entry != NULL)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "matepoint: this torch build has no CUDA (no %s)", what);
    return -1;
}

int
offload_torch_current_stream(mp_state *st, int device, void **stream)
{
    if (require(st->current_raw_stream, "torch._C._cuda_getCurrentRawStream") < 0)
        return -1;
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
    if (stream == NULL)
        return require(st->cuda_default_stream, "torch.cuda.default_stream") < 0
                   ? NULL : PyObject_CallFunction(st->cuda_default_stream, "i", device);
    if (require(st->cuda_external_stream, "torch.cuda.ExternalStream") < 0)
        return NULL;
    PyObject *args = Py_BuildValue("(N)", PyLong_FromVoidPtr(stream));
    PyObject *kwargs = args ? Py_BuildValue("{si}", "device", device) : NULL;
    PyObject *result = kwargs ? PyObject_Call(st->cuda_external_stream, args, kwargs) : NULL;
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    return result;
}

/* record_stream of a tensor viewing all of `storage`: torch records
 * tensors, not storages. The site matters to test builds only. */
int
offload_torch_record_stream(mp_state *st, offload_site site, PyObject *storage, int device,
                            void *stream)
{
    (void)site;
    if (require(st->tensor_record_stream, "torch.Tensor.record_stream") < 0)
        return -1;
    PyObject *stream_obj = stream_object(st, device, stream);
    PyObject *device_obj = stream_obj ? PyObject_GetAttr(storage, st->str_device) : NULL;
    PyObject *kwargs = device_obj ? Py_BuildValue("{sOsO}", "dtype", st->uint8_dtype, "device",
                                                  device_obj) : NULL;
    PyObject *args = kwargs ? Py_BuildValue("((i))", 0) : NULL;
    PyObject *empty = args ? PyObject_Call(st->torch_empty, args, kwargs) : NULL;
    PyObject *view = empty ? PyObject_CallMethod(empty, "set_", "O", storage) : NULL;
    PyObject *done = view ? PyObject_CallFunctionObjArgs(st->tensor_record_stream, view,
                                                         stream_obj, NULL) : NULL;
    Py_XDECREF(stream_obj);
    Py_XDECREF(device_obj);
    Py_XDECREF(kwargs);
    Py_XDECREF(args);
    Py_XDECREF(empty);
    Py_XDECREF(view);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

int
offload_torch_stream_wait_event(const cudart *rt, offload_site site, void *stream, void *event)
{
    (void)site;
    return rt->stream_wait_event(stream, event, 0);
}

int
offload_torch_has_context(mp_state *st, int device)
{
    if (require(st->has_primary_context, "torch._C._cuda_hasPrimaryContext") < 0)
        return -1;
    PyObject *answer = PyObject_CallFunction(st->has_primary_context, "i", device);
    if (answer == NULL)
        return -1;
    int has = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return has;
}

/* torch._C._cuda_maybeExchangeDevice(previous): with the thread on
 * another device and no context on `previous`, torch only sets its target
 * device index (with a context, found since, it makes `previous` current:
 * right too). Its answer, the device that was current, is not needed. */
int
offload_torch_keep_target_device(mp_state *st, int previous)
{
    if (require(st->maybe_exchange_device, "torch._C._cuda_maybeExchangeDevice") < 0)
        return -1;
    PyObject *answer = PyObject_CallFunction(st->maybe_exchange_device, "i", previous);
    if (answer == NULL)
        return -1;
    Py_DECREF(answer);
    return 0;
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
    .may_hold_tensors = offload_torch_may_hold_tensors,
    .tensor_device = torch_tensor_device,
    .current_stream = offload_torch_current_stream,
    .record_stream = offload_torch_record_stream,
    .stream_wait_event = offload_torch_stream_wait_event,
    .has_context = offload_torch_has_context,
    .keep_target_device = offload_torch_keep_target_device,
    .empty_bytes = torch_empty_bytes,
};
