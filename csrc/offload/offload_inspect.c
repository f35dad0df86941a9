/* Which of a region's input tensors move: eligible ones (offload_internal.h,
 * the inspect section), their storage's byte span, and which share a
 * storage; and the planner's question, which tensors an offload would
 * leave on the device.
 *
 * Owns the input_info it fills until input_info_clear. Floor `inspect`:
 * called by the save direction, csrc/module (offload_left_on_device) and
 * csrc/testing; calls nothing of csrc/offload (the runtime's table says
 * where a tensor lives). GIL held. */
#include "offload_internal.h"
#include "base/pyvalue.h"

#include <string.h>

void
input_info_clear(input_info *info)
{
    Py_CLEAR(info->storage);
    Py_CLEAR(info->device_obj);
    Py_CLEAR(info->dtype);
    Py_CLEAR(info->size);
    Py_CLEAR(info->stride);
    Py_CLEAR(info->wrapper_type);
    Py_CLEAR(info->wrapper_spec);
}

/* Byte span [offset, offset + extent) of the storage that `tensor` reads:
 * views, non-contiguous and stride-0 tensors read less than their storage. */
static int
tensor_span(PyObject *tensor, input_info *info)
{
    int64_t storage_offset, numel;
    if (mp_call_int64(tensor, "storage_offset", &storage_offset) < 0 ||
        mp_call_int64(tensor, "element_size", &info->itemsize) < 0 ||
        mp_call_int64(tensor, "numel", &numel) < 0)
        return -1;
    info->byte_offset = (uint64_t)(storage_offset * info->itemsize);
    info->byte_extent = 0;
    if (numel == 0)
        return 0;
    int64_t last = 0;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(info->size); d++) {
        int64_t extent = PyLong_AsLongLong(PyTuple_GET_ITEM(info->size, d));
        int64_t step = PyLong_AsLongLong(PyTuple_GET_ITEM(info->stride, d));
        if (PyErr_Occurred())
            return -1;
        last += (extent - 1) * step;
    }
    info->byte_extent = (uint64_t)((last + 1) * info->itemsize);
    return 0;
}

static int
is_buffer_of(PyObject *buffers, PyObject *tensor)
{
    if (buffers == NULL)
        return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(buffers); i++) {
        if (PyList_GET_ITEM(buffers, i) == tensor)
            return 1;
    }
    return 0;
}

/* The module whose buffers stay: `function` itself, or the module a bound
 * method of it belongs to (`block.forward`, transformers' `layer.__call__`,
 * and checkpoint_module's call, bound to its module for this): a borrowed
 * reference, NULL without error for none. */
static PyObject *
module_of(mp_state *st, PyObject *function, int *error)
{
    PyObject *candidate = function;
    if (Py_IS_TYPE(function, (PyTypeObject *)st->method_type)) {
        /* a bound method holds its __self__: borrowed once the new
         * reference is given back, like PyMethod_GET_SELF's */
        candidate = PyObject_GetAttrString(function, "__self__");
        if (candidate == NULL) {
            *error = 1;
            return NULL;
        }
        Py_DECREF(candidate);
    }
    int is_module = PyObject_IsInstance(candidate, st->module_type);
    *error = is_module < 0;
    return is_module > 0 ? candidate : NULL;
}

PyObject *
inspect_module_buffers(mp_state *st, PyObject *function)
{
    int error;
    PyObject *module = module_of(st, function, &error);
    if (module == NULL)
        return error ? NULL : PyList_New(0);
    PyObject *iter = PyObject_CallMethod(module, "buffers", NULL);
    PyObject *list = iter ? PySequence_List(iter) : NULL;
    Py_XDECREF(iter);
    return list;
}

int
inspect_is_strided(mp_state *st, PyObject *tensor)
{
    PyObject *layout = PyObject_GetAttrString(tensor, "layout");
    PyObject *strided = layout ? PyObject_GetAttrString(st->torch_module, "strided") : NULL;
    int same = strided == NULL ? -1 : layout == strided;
    Py_XDECREF(layout);
    Py_XDECREF(strided);
    if (same <= 0)
        return same;
    PyObject *nested = PyObject_GetAttrString(tensor, "is_nested");
    int is_nested = nested == NULL ? -1 : PyObject_IsTrue(nested);
    Py_XDECREF(nested);
    return is_nested < 0 ? -1 : !is_nested;
}

/* A DTensor that is not a parameter: 1 with its local tensor (new
 * reference) and its type and spec in `info`, 0 for anything else. Asked
 * only of subclasses, and only once torch.distributed.tensor is imported
 * (a DTensor cannot exist before). */
static int
unwrap_dtensor(PyObject *tensor, input_info *info, PyObject **local)
{
    PyObject *name = PyUnicode_FromString("torch.distributed.tensor");
    PyObject *module = name ? PyImport_GetModule(name) : NULL;
    Py_XDECREF(name);
    if (module == NULL)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *dtensor = PyObject_GetAttrString(module, "DTensor");
    Py_DECREF(module);
    int is_dtensor = dtensor == NULL ? -1 : PyObject_IsInstance(tensor, dtensor);
    Py_XDECREF(dtensor);
    if (is_dtensor <= 0)
        return is_dtensor;
    PyObject *is_param = PyObject_GetAttrString(tensor, "_is_param");
    if (is_param == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
    }
    int parameter = is_param != NULL && PyObject_IsTrue(is_param) == 1;
    Py_XDECREF(is_param);
    if (parameter)
        return 0;
    *local = PyObject_GetAttrString(tensor, "_local_tensor");
    info->wrapper_spec = *local ? PyObject_GetAttrString(tensor, "_spec") : NULL;
    if (info->wrapper_spec == NULL)
        return -1;
    info->wrapper_type = Py_NewRef((PyObject *)Py_TYPE(tensor));
    return 1;
}

static int inspect_plain(mp_state *st, PyObject *function, PyObject *tensor,
                         PyObject **buffers, input_info *info);

int
inspect_input(mp_state *st, PyObject *function, PyObject *tensor, PyObject **buffers,
              input_info *info)
{
    info->copy_index = UNPLANNED;
    if (Py_IS_TYPE(tensor, (PyTypeObject *)st->tensor_class))
        return inspect_plain(st, function, tensor, buffers, info);
    if (PyObject_TypeCheck(tensor, (PyTypeObject *)st->parameter_type))
        return 0;
    PyObject *local = NULL;
    int wrapped = unwrap_dtensor(tensor, info, &local);
    if (wrapped <= 0)
        return wrapped;
    if ((*buffers == NULL && (*buffers = inspect_module_buffers(st, function)) == NULL) ||
        is_buffer_of(*buffers, tensor)) {
        Py_DECREF(local);
        return *buffers == NULL ? -1 : 0;
    }
    int eligible = Py_IS_TYPE(local, (PyTypeObject *)st->tensor_class)
                       ? inspect_plain(st, function, local, buffers, info) : 0;
    Py_DECREF(local);
    return eligible;
}

/* inspect_input for a plain torch.Tensor. */
static int
inspect_plain(mp_state *st, PyObject *function, PyObject *tensor, PyObject **buffers,
              input_info *info)
{
    offload_engine *engine = st->engine;
    /* the device first: on a CPU-only run nothing else is asked */
    info->device_obj = PyObject_GetAttr(tensor, st->str_device);
    if (info->device_obj == NULL)
        return -1;
    int on_device = engine->runtime->tensor_device(st, tensor, info->device_obj,
                                                   &info->device_index);
    if (on_device <= 0)
        return on_device;
    if (*buffers == NULL && (*buffers = inspect_module_buffers(st, function)) == NULL)
        return -1;
    if (is_buffer_of(*buffers, tensor))
        return 0;
    int strided = inspect_is_strided(st, tensor);
    if (strided <= 0)
        return strided;
    int64_t nbytes;
    if (mp_attr_int64(tensor, "nbytes", &nbytes) < 0)
        return -1;
    if (nbytes < engine->options.min_offload_bytes)
        return 0;
    int64_t ptr;
    info->dtype = PyObject_GetAttr(tensor, st->str_dtype);
    info->size = info->dtype ? PyObject_CallMethod(tensor, "size", NULL) : NULL;
    info->stride = info->size ? PyObject_CallMethod(tensor, "stride", NULL) : NULL;
    info->storage = info->stride ? PyObject_CallMethod(tensor, "untyped_storage", NULL) : NULL;
    if (info->storage == NULL || mp_call_int64(info->storage, "data_ptr", &ptr) < 0 ||
        tensor_span(tensor, info) < 0)
        return -1;
    info->storage_ptr = (uintptr_t)ptr;
    return 1;
}

int
inspect_same_storage(const input_info *a, const input_info *b)
{
    return a->device_index == b->device_index && a->storage_ptr == b->storage_ptr;
}

PyObject *
offload_left_on_device(mp_state *st, PyObject *function, PyObject *tensors)
{
    /* a tuple: Python code run by the questions cannot change its length */
    PyObject *items = PySequence_Tuple(tensors);
    PyObject *result = items ? PyList_New(PyTuple_GET_SIZE(items)) : NULL;
    PyObject *buffers = NULL;
    if (result == NULL)
        goto error;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
        input_info info;
        memset(&info, 0, sizeof info);
        int eligible = inspect_input(st, function, PyTuple_GET_ITEM(items, i), &buffers, &info);
        input_info_clear(&info);
        if (eligible < 0)
            goto error;
        PyList_SET_ITEM(result, i, Py_NewRef(eligible ? Py_False : Py_True));
    }
    Py_XDECREF(buffers);
    Py_DECREF(items);
    return result;
error:
    Py_XDECREF(buffers);
    Py_XDECREF(result);
    Py_XDECREF(items);
    return NULL;
}
