/* A region's function runs without Dynamo's frame callback (why:
 * no_dynamo.h). The same two calls torch's DisableContext makes:
 * set_eval_frame(None) returns the callback in force, which is put back. */
#include "no_dynamo.h"
#include "base/compat.h"

PyObject *
call_without_dynamo(mp_state *st, PyObject *function, PyObject *args, PyObject *kwargs)
{
    if (st->set_eval_frame == NULL)
        return PyObject_Call(function, args, kwargs);
    PyObject *prior = PyObject_CallOneArg(st->set_eval_frame, Py_None);
    if (prior == NULL)
        return NULL;
    PyObject *out = PyObject_Call(function, args, kwargs);
    /* eager code (no callback) pays one call: nothing to put back */
    if (prior != Py_None) {
        PyObject *pending = mp_take_exception();
        PyObject *done = PyObject_CallOneArg(st->set_eval_frame, prior);
        if (done == NULL) {
            Py_CLEAR(out);
            mp_chain_exception(pending);
        } else if (pending != NULL) {
            mp_restore_exception(pending);
        }
        Py_XDECREF(done);
    }
    Py_DECREF(prior);
    return out;
}
