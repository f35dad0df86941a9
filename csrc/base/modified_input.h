/* Errors that several parts of the extension raise in the user's terms.
 * Both the frame (plain saved inputs) and the offload path (records of
 * offloaded inputs) detect an input changed in place; the message lives
 * here, below both, so neither has to include the other. GIL held. */
#ifndef MATEPOINT_BASE_ERRORS_H
#define MATEPOINT_BASE_ERRORS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Raises the error for input tensor #index changed in place after the
 * forward pass, with any pending exception as its cause; returns NULL. */
PyObject *checkpoint_raise_modified_input(Py_ssize_t index);

#endif
