/* matepoint's options (matepoint.set_options): their one table of names,
 * defaults and accepted ranges, the one check of a value, and _configure,
 * which applies them to the offload engine. matepoint/_options.py reads
 * the table (_C.OPTIONS) and checks through _C._check_option. */
#ifndef MATEPOINT_MODULE_OPTIONS_H
#define MATEPOINT_MODULE_OPTIONS_H

#include "base/state.h"

/* Sets the engine's options to the table's defaults. */
void options_set_defaults(mp_state *st);
/* Adds OPTIONS (name -> (default, accepted values in words or None)). */
int options_add_table(PyObject *module);

PyObject *options_check_py(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *options_configure_py(PyObject *module, PyObject *args, PyObject *kwargs);

#endif
