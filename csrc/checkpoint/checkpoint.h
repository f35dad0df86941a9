/* matepoint._C.checkpoint: the drop-in for torch.utils.checkpoint.checkpoint
 * with non-reentrant semantics. Needs the GIL; state per call lives in a
 * Frame (frame.h). */
#ifndef MATEPOINT_CHECKPOINT_CHECKPOINT_H
#define MATEPOINT_CHECKPOINT_CHECKPOINT_H

#include "base/state.h"

PyObject *checkpoint_call(PyObject *module, PyObject *const *args, Py_ssize_t nargsf,
                          PyObject *kwnames);
/* checkpoint()'s own keywords, as a new frozenset of str. */
PyObject *checkpoint_keywords(void);
/* _set_sac_adapter(adapter, /): METH_O on the module. Registers the one
 * callback selective checkpointing reaches Python through, replacing any
 * earlier one: adapter(forward_mode, recompute_mode_or_None, frame), called
 * for each region whose forward context is torch's selective-checkpoint
 * caching mode, before the region runs (matepoint/_sac_offload.py registers
 * `adapt` when the package is imported). A TypeError unless callable. */
PyObject *checkpoint_set_sac_adapter(PyObject *module, PyObject *adapter);

#endif
