/* Small helpers over CPython API differences between 3.10 and 3.14, and
 * the limited C API: _C is built with Py_LIMITED_API=0x030A0000 (one abi3
 * wheel for every CPython from 3.10; matepoint/_build_layout.py). The
 * macros the limited API lacks are mapped below to the functions it has,
 * so call sites keep CPython's usual spellings. Every file of _C reaches
 * <Python.h> through this header. */
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


#ifdef Py_LIMITED_API
/* Tuples and lists: the checked functions in place of the field macros.
 * The _GET_ITEM forms return borrowed references as the macros do; the
 * _SET_ITEM forms steal as the macros do, on a fresh container whose index
 * is in range (the only use), where PyTuple_SetItem/PyList_SetItem cannot
 * fail. */
#define PyTuple_GET_ITEM(t, i) PyTuple_GetItem((t), (i))
#define PyTuple_GET_SIZE(t) PyTuple_Size(t)
#define PyTuple_SET_ITEM(t, i, v) ((void)PyTuple_SetItem((t), (i), (v)))
#define PyList_GET_ITEM(l, i) PyList_GetItem((l), (i))
#define PyList_GET_SIZE(l) PyList_Size(l)
#define PyList_SET_ITEM(l, i, v) ((void)PyList_SetItem((l), (i), (v)))
#define PyDict_GET_SIZE(d) PyDict_Size(d)
#define PyBytes_AS_STRING(o) PyBytes_AsString(o)
#define PyBytes_GET_SIZE(o) PyBytes_Size(o)
#define PyUnicode_AsUTF8(o) PyUnicode_AsUTF8AndSize((o), NULL)
/* 3.10's and 3.11's abstract.h define these over the field macros even
 * under the limited API: the results of PySequence_Fast are a list or a
 * tuple, read through the functions. */
#undef PySequence_Fast_GET_SIZE
#define PySequence_Fast_GET_SIZE(o) PySequence_Size(o)
#undef PySequence_Fast_GET_ITEM
#define PySequence_Fast_GET_ITEM(o, i) \
    (PyList_Check(o) ? PyList_GetItem((o), (i)) : PyTuple_GetItem((o), (i)))
#ifndef Py_SETREF
#define Py_SETREF(dst, src)                                                 \
    do {                                                                    \
        PyObject **mp_dst_ = (PyObject **)&(dst);                           \
        PyObject *mp_old_ = *mp_dst_;                                       \
        *mp_dst_ = (PyObject *)(src);                                       \
        Py_DECREF(mp_old_);                                                 \
    } while (0)
#endif
#ifndef Py_XSETREF
#define Py_XSETREF(dst, src)                                                \
    do {                                                                    \
        PyObject **mp_dst_ = (PyObject **)&(dst);                           \
        PyObject *mp_old_ = *mp_dst_;                                       \
        *mp_dst_ = (PyObject *)(src);                                       \
        Py_XDECREF(mp_old_);                                                \
    } while (0)
#endif

/* Calls: the vectorcall forms are limited API from 3.12 only. */
static inline PyObject *
mp_call_one_arg(PyObject *callable, PyObject *arg)
{
    return PyObject_CallFunctionObjArgs(callable, arg, NULL);
}
#define PyObject_CallOneArg mp_call_one_arg

static inline PyObject *
mp_call_method_no_args(PyObject *obj, PyObject *name)
{
    return PyObject_CallMethodObjArgs(obj, name, NULL);
}
#define PyObject_CallMethodNoArgs mp_call_method_no_args

static inline PyObject *
mp_call_method_one_arg(PyObject *obj, PyObject *name, PyObject *arg)
{
    return PyObject_CallMethodObjArgs(obj, name, arg, NULL);
}
#define PyObject_CallMethodOneArg mp_call_method_one_arg

/* Positional arguments only (no call site passes keyword names): the
 * arguments packed into a tuple. */
static inline PyObject *
mp_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (kwnames != NULL) {
        PyErr_SetString(PyExc_SystemError, "matepoint: keyword names in a limited-API call");
        return NULL;
    }
    Py_ssize_t n = (Py_ssize_t)(nargsf & ~((size_t)1 << (8 * sizeof(size_t) - 1)));
    PyObject *tuple = PyTuple_New(n);
    if (tuple == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SetItem(tuple, i, Py_NewRef(args[i]));
    PyObject *result = PyObject_Call(callable, tuple, NULL);
    Py_DECREF(tuple);
    return result;
}
#define PyObject_Vectorcall mp_vectorcall
#ifndef PyVectorcall_NARGS
/* the count without PY_VECTORCALL_ARGUMENTS_OFFSET (the top bit) */
#define PyVectorcall_NARGS(n) ((Py_ssize_t)((size_t)(n) & ~((size_t)1 << (8 * sizeof(size_t) - 1))))
#endif
#endif /* Py_LIMITED_API */

/* tp_alloc and tp_free of a type: PyTypeObject's fields are hidden under
 * the limited API, its slots read through PyType_GetSlot (which takes
 * static types too from 3.10). tp_alloc zero-fills, tracks a GC type and
 * takes the reference to a heap type that the dealloc gives back. */
static inline PyObject *
mp_type_alloc(PyTypeObject *type)
{
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    return alloc(type, 0);
}

static inline void
mp_type_free(PyTypeObject *type, void *self)
{
    freefunc free_slot = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free_slot(self);
}

/* The name of `obj`'s type for an error message (type(obj).__name__, as
 * tp_name reads for a class defined in Python; PyType_GetName is 3.11+):
 * a new reference, or NULL with no exception set (a message then prints
 * the fallback of PyErr_Format's "%V"). Use as
 *     PyObject *name = mp_type_name(obj);
 *     PyErr_Format(exc, "... got %.100V", name, "?");
 *     Py_XDECREF(name);
 */
static inline PyObject *
mp_type_name(PyObject *obj)
{
    PyObject *name = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__name__");
    if (name != NULL && !PyUnicode_Check(name))
        Py_CLEAR(name);
    if (name == NULL)
        PyErr_Clear();
    return name;
}

#endif
