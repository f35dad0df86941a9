/* Reading a Python value as a C integer, for the places that call torch
 * through its Python objects (a tensor's data_ptr(), nbytes, ...). GIL
 * held; 0 on success, -1 with the Python error set. */
#ifndef MATEPOINT_BASE_PYVALUE_H
#define MATEPOINT_BASE_PYVALUE_H

#include "compat.h"
#include <stdint.h>

/* obj.method() as a C integer. */
int mp_call_int64(PyObject *obj, const char *method, int64_t *out);
/* obj.name as a C integer; None reads as -1. */
int mp_attr_int64(PyObject *obj, const char *name, int64_t *out);

#endif
