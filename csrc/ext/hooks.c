#include "hooks.h"
#include "compat.h"

int
hooks_push(mp_state *st, PyObject *pack, PyObject *unpack)
{
    PyObject *done = PyObject_CallFunctionObjArgs(st->push_hooks, pack, unpack, NULL);
    Py_XDECREF(done);
    return done ? 0 : -1;
}

int
hooks_pop(mp_state *st)
{
    PyObject *pending = mp_take_exception();
    PyObject *done = PyObject_CallNoArgs(st->pop_hooks);
    Py_XDECREF(done);
    if (done == NULL) {
        mp_chain_exception(pending);
        return -1;
    }
    if (pending != NULL)
        mp_restore_exception(pending);
    return 0;
}

PyObject *
hooks_save_tensor(mp_state *st, PyObject *tensor)
{
    PyObject *args[2] = {tensor, Py_False};
    return PyObject_Vectorcall(st->make_saved_tensor, args, 2, NULL);
}
