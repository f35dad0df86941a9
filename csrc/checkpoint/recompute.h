/* The recompute of a checkpointed region in backward (recompute.c): runs
 * the frame's function again under the recompute pack hook, which files
 * each saved tensor under the forward's holder, and checks that the same
 * tensors with the same metadata were saved. GIL held. */
#ifndef MATEPOINT_CHECKPOINT_RECOMPUTE_H
#define MATEPOINT_CHECKPOINT_RECOMPUTE_H

#include "frame.h"

extern PyType_Spec recompute_hook_spec;

/* Recomputes `frame` for graph task `gid`; 0, or -1 with an error set. */
int frame_recompute(Frame *frame, PyObject *gid);

/* Per-thread: > 0 while a region is being recomputed on this thread. */
int recompute_in_progress(void);

#endif
