/* A region's function runs without Dynamo, in the forward and in the
 * recompute alike (no_dynamo.c).
 *
 * Under torch.compile, a frame that Dynamo gave up on (a graph break in a
 * loop, say) still runs with Dynamo's frame callback installed, so every
 * Python frame it calls is compiled; the recompute in backward runs with no
 * callback and so eagerly. The two would save different tensors in a
 * different order, and torch's metadata check fails. torch's checkpoint
 * avoids this by running both with Dynamo disabled (torch._disable_dynamo on
 * checkpoint, _run_fn_with_dynamo_disabled for the recompute); so does this.
 * A block the user compiled itself (torch.compile(block)) installs its own
 * callback when called and so runs compiled in both.
 *
 * GIL held. The callback is per thread (Dynamo keeps it thread-local). */
#ifndef MATEPOINT_CHECKPOINT_NO_DYNAMO_H
#define MATEPOINT_CHECKPOINT_NO_DYNAMO_H

#include "base/state.h"

/* function(*args, **kwargs) (kwargs may be NULL) with Dynamo's frame
 * callback cleared for its duration and put back after, error or not.
 * Returns a new reference, or NULL with an error set. With a torch that has
 * no Dynamo (st->set_eval_frame NULL) it is a plain call. */
PyObject *call_without_dynamo(mp_state *st, PyObject *function, PyObject *args,
                              PyObject *kwargs);

#endif
