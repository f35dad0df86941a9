/* BatchNorm statistics move once per step: during a recompute, a forward
 * pre-hook gives each training BatchNorm throw-away copies of its running
 * statistics (torch's checkpoint updates them a second time, pytorch#96136),
 * and the originals are put back when the recompute ends, error or not.
 *
 * Use: handle = bn_guard_register(); outer = bn_guard_enter(list); run the
 * region; bn_guard_leave(outer); bn_guard_release(handle, list). The list
 * (owned by the caller) collects (module, buffers...) entries; the current
 * one is per thread. GIL held. */
#ifndef MATEPOINT_CHECKPOINT_BN_GUARD_H
#define MATEPOINT_CHECKPOINT_BN_GUARD_H

#include "base/state.h"

/* Registers the global forward pre-hook; returns its removable handle. */
PyObject *bn_guard_register(mp_state *st);
/* Makes `bn_modules` this thread's list; returns the one it replaces. */
PyObject *bn_guard_enter(PyObject *bn_modules);
void bn_guard_leave(PyObject *outer);
/* Restores every swapped module's buffers and removes the hook; keeps an
 * exception already pending (a new error is chained to it). */
int bn_guard_release(mp_state *st, PyObject *handle, PyObject *bn_modules);

/* The pre-hook itself, a METH_FASTCALL function of the module. */
PyObject *bn_guard_pre_hook(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
