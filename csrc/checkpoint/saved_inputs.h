/* A frame's inputs (saved_inputs.c): saving them when the region is
 * checkpointed, kept on their device through SavedTensor or offloaded
 * (offload.h), and rebuilding the call's arguments from them for a
 * recompute, with the in-place check. The state lives in the Frame
 * (saved, versions, offload_group, offload_records). GIL held. */
#ifndef MATEPOINT_CHECKPOINT_SAVED_INPUTS_H
#define MATEPOINT_CHECKPOINT_SAVED_INPUTS_H

#include "frame.h"

/* Saves `tensors` (a list) as the frame's inputs; offload_override is -1
 * (follow the options), 0 (keep them on their device) or 1 (offload). */
int saved_inputs_save(Frame *frame, PyObject *tensors, int offload_override);
/* Rebuilds (args, kwargs) for the recompute from the saved inputs. */
int saved_inputs_restore(Frame *frame, PyObject **args_out, PyObject **kwargs_out);
/* After the forward: checks offloaded inputs were not changed meanwhile. */
int saved_inputs_finish_forward(Frame *frame);
/* Frees what only a recompute would need, when nothing inside was saved. */
void saved_inputs_drop_unneeded(Frame *frame);

#endif
