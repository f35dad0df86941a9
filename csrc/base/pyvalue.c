#include "pyvalue.h"

int
mp_call_int64(PyObject *obj, const char *method, int64_t *out)
{
    PyObject *value = PyObject_CallMethod(obj, method, NULL);
    if (value == NULL)
        return -1;
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

int
mp_attr_int64(PyObject *obj, const char *name, int64_t *out)
{
    PyObject *value = PyObject_GetAttrString(obj, name);
    if (value == NULL)
        return -1;
    *out = value == Py_None ? -1 : PyLong_AsLongLong(value);
    Py_DECREF(value);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}
