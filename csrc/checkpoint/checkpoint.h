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

#endif
