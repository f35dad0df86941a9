/* The unpack hook of the forward pass (unpack.c): a Holder in, the
 * recomputed tensor out (a new reference). The first holder of a region
 * unpacked in a backward pass (or GraphExecGroup) recomputes the region
 * for that pass; a holder unpacked twice in one pass raises torch's
 * CheckpointError, and so does a released one. With debug=True the
 * region's error callback sees a CheckpointError first. GIL held. */
#ifndef MATEPOINT_CHECKPOINT_UNPACK_H
#define MATEPOINT_CHECKPOINT_UNPACK_H

#include "frame.h"

/* METH_O on the module: bound once at import (module.c), handed to torch
 * with every frame as the pack hook's partner. */
PyObject *unpack_saved_tensor(PyObject *module, PyObject *holder);

#endif
