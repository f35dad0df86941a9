#include "modified_input.h"
#include "compat.h"

PyObject *
raise_modified_input(Py_ssize_t index)
{
    PyObject *cause = mp_take_exception();
    PyErr_Format(PyExc_RuntimeError,
                 "matepoint.checkpoint: input tensor #%zd of the checkpointed function was "
                 "modified in place after the forward pass; the recomputation in backward "
                 "needs its original value. Clone the tensor before changing it, or change it "
                 "before calling checkpoint.",
                 index);
    if (cause != NULL) {
        PyObject *raised = mp_take_exception();
        PyException_SetCause(raised, Py_NewRef(cause));
        PyException_SetContext(raised, cause);
        mp_restore_exception(raised);
    }
    return NULL;
}
