/* Small helpers over CPython API differences between 3.9 and 3.13. */
#ifndef MATEPOINT_BASE_COMPAT_H
#define MATEPOINT_BASE_COMPAT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Takes the pending exception (normalized, traceback attached), or NULL. */
static inline PyObject *
mp_take_exception(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL)
        return NULL;
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* Makes `exc` (stolen) the pending exception. */
static inline void
mp_restore_exception(PyObject *exc)
{
    PyObject *tb = PyException_GetTraceback(exc);
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, tb);
}

/* Chains: the pending exception gets `earlier` (stolen) as its context. */
static inline void
mp_chain_exception(PyObject *earlier)
{
    if (earlier == NULL)
        return;
    PyObject *raised = mp_take_exception();
    if (raised == NULL) {
        mp_restore_exception(earlier);
        return;
    }
    PyException_SetContext(raised, earlier);
    mp_restore_exception(raised);
}

/* Like getattr(obj, name, None) but tells errors apart: 0 with *out NULL
 * when the attribute is missing, 1 when found, -1 on another error. */
static inline int
mp_optional_attr(PyObject *obj, PyObject *name, PyObject **out)
{
    *out = PyObject_GetAttr(obj, name);
    if (*out != NULL)
        return 1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
    PyErr_Clear();
    return 0;
}

#endif
