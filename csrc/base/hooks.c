#include "hooks.h"
#include "compat.h"

/* torch 2.14 tells a checkpoint's own saved-tensor hooks from the user's
 * (save_on_cpu, ...) by a `_checkpoint_internal` attribute on the pack hook,
 * and asks such a hook for `_user_hooks`, the user's (pack, unpack) pair that
 * was visible when it was pushed (None if none). Selective checkpointing
 * warns when it finds user hooks around its region, so matepoint's hooks must
 * answer both, or every selective region inside matepoint would warn. Like
 * torch, the pair is kept only while the hook is on the stack: autograd keeps
 * pack hooks alive through saved variables that the GC cannot traverse. */
static int
remember_user_hooks(mp_state *st, PyObject *pack)
{
    if (st->current_user_hooks == NULL)
        return 0;
    if (st->hooks_below == NULL && (st->hooks_below = PyDict_New()) == NULL)
        return -1;
    PyObject *user = PyObject_CallNoArgs(st->current_user_hooks);
    if (user == NULL)
        return -1;
    int failed = PyDict_SetItem(st->hooks_below, pack, user);
    Py_DECREF(user);
    return failed;
}

static void
forget_user_hooks(mp_state *st, PyObject *pack)
{
    if (st->hooks_below == NULL || PyDict_GET_SIZE(st->hooks_below) == 0)
        return;
    if (pack == NULL) {
        /* the hook on top of torch's stack is the one about to be popped */
        PyObject *top = PyObject_CallOneArg(st->top_hooks, Py_False);
        if (top != NULL && PyTuple_Check(top) && PyTuple_GET_SIZE(top) == 2)
            forget_user_hooks(st, PyTuple_GET_ITEM(top, 0));
        Py_XDECREF(top);
        PyErr_Clear();
        return;
    }
    if (PyDict_DelItem(st->hooks_below, pack) < 0)
        PyErr_Clear(); /* not one of ours */
}

int
hooks_push(mp_state *st, PyObject *pack, PyObject *unpack)
{
    if (remember_user_hooks(st, pack) < 0)
        return -1;
    PyObject *done = PyObject_CallFunctionObjArgs(st->push_hooks, pack, unpack, NULL);
    Py_XDECREF(done);
    if (done == NULL) {
        PyObject *pending = mp_take_exception();
        forget_user_hooks(st, pack);
        mp_restore_exception(pending);
        return -1;
    }
    return 0;
}

int
hooks_pop(mp_state *st)
{
    PyObject *pending = mp_take_exception();
    forget_user_hooks(st, NULL);
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

static PyObject *
get_checkpoint_internal(PyObject *self, void *closure)
{
    (void)self;
    (void)closure;
    Py_RETURN_TRUE;
}

static PyObject *
get_user_hooks(PyObject *self, void *closure)
{
    (void)closure;
    mp_state *st = mp_state_from_type(Py_TYPE(self));
    PyObject *user = st->hooks_below ? PyDict_GetItemWithError(st->hooks_below, self) : NULL;
    if (user != NULL)
        return Py_NewRef(user);
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_AttributeError,
                        "_user_hooks: this matepoint hook is not on the saved-tensor hook stack");
    return NULL;
}

PyGetSetDef hooks_internal_getset[] = {
    {"_checkpoint_internal", get_checkpoint_internal, NULL,
     "True: a checkpoint's own pack hook, not the user's (torch 2.14)", NULL},
    {"_user_hooks", get_user_hooks, NULL,
     "the user's (pack, unpack) hooks visible when this hook was pushed, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};
