/* The error for a checkpoint input changed in place between the forward
 * pass and its recompute.
 *
 * Errors are raised where they arise, in the user's terms; this is the one
 * error two layers detect: the saved inputs of a frame (plain saved
 * inputs, csrc/checkpoint) and the offload path (records of offloaded
 * inputs, csrc/offload). Its text lives here, below both, so neither has
 * to include the other. GIL held. */
#ifndef MATEPOINT_BASE_MODIFIED_INPUT_H
#define MATEPOINT_BASE_MODIFIED_INPUT_H

#include "compat.h"

/* Raises the error for input tensor #index changed in place after the
 * forward pass, with any pending exception as its cause; returns NULL. */
PyObject *raise_modified_input(Py_ssize_t index);

#endif
