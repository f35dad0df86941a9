/* The forward's unpack hook: backward asks for a tensor the region saved,
 * gets the region recomputed (once per backward pass, recompute.c) and
 * takes the recomputed tensor from its holder. Its own file because it
 * sits above both frame.c (the records) and recompute.c (which is built on
 * them): in frame.c it made the two files call each other. */
#include "unpack.h"
#include "recompute.h"
#include "base/compat.h"

/* The id recomputations are keyed by: the GraphExecGroup when one is
 * active (*in_group set), else the backward pass. */
static PyObject *
current_graph_task(mp_state *st, int *in_group)
{
    *in_group = 0;
    if (st->graph_exec_group != NULL) {
        PyObject *group = PyObject_CallNoArgs(st->graph_exec_group);
        if (group == NULL)
            return NULL;
        if (group != Py_None) {
            *in_group = 1;
            return group;
        }
        Py_DECREF(group);
    }
    PyObject *gid = PyObject_CallNoArgs(st->graph_task_id);
    if (gid == NULL)
        return NULL;
    long value = PyLong_AsLong(gid);
    if (value == -1 && !PyErr_Occurred()) {
        /* unpacked outside backward: every such access is its own pass */
        Py_DECREF(gid);
        return PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    }
    return gid;
}

static void
unpacked_twice(mp_state *st, int in_group)
{
    PyErr_Format(st->checkpoint_error,
                 "torch.utils.checkpoint: Unpack is being triggered for a tensor that was "
                 "already unpacked once. %sIf you are calling ctx.saved_tensors in backward, make "
                 "sure to do so only once.\n"
                 "matepoint.checkpoint: a saved tensor of a checkpointed region was unpacked "
                 "twice in %s (or its recomputation failed earlier in it).",
                 in_group ? "Performing two backward calls that overlap (i.e. require the same "
                            "saved activation in order to compute gradients) is not allowed "
                            "while under the torch.utils.checkpoint.GraphExecGroup context. "
                          : "",
                 in_group ? "one GraphExecGroup" : "one backward pass");
}

static PyObject *
unpack_holder(Holder *holder)
{
    Frame *frame = holder->frame;
    mp_state *st = frame->st;
    int in_group;
    PyObject *gid = current_graph_task(st, &in_group);
    if (gid == NULL)
        return NULL;
    PyObject *result = NULL;
    if (frame->recomputed_gids == NULL) {
        frame->recomputed_gids = PySet_New(NULL);
        if (frame->recomputed_gids == NULL)
            goto done;
    }
    int done_before = PySet_Contains(frame->recomputed_gids, gid);
    if (done_before < 0)
        goto done;
    if (!done_before) {
        /* marked first: a failed recompute is not retried with stale state */
        if (PySet_Add(frame->recomputed_gids, gid) < 0 || frame_recompute(frame, gid) < 0)
            goto done;
    }
    if (holder->recomputed != NULL) {
        result = PyDict_GetItemWithError(holder->recomputed, gid);
        if (result != NULL) {
            Py_INCREF(result);
            if (PyDict_DelItem(holder->recomputed, gid) < 0)
                Py_CLEAR(result);
            goto done;
        }
        if (PyErr_Occurred())
            goto done;
    }
    unpacked_twice(st, in_group);
done:
    Py_DECREF(gid);
    return result;
}

PyObject *
unpack_saved_tensor(PyObject *module, PyObject *obj)
{
    mp_state *st = mp_state_of(module);
    if (!Py_IS_TYPE(obj, st->holder_type)) {
        PyErr_SetString(PyExc_TypeError, "matepoint: unpack hook got a foreign object");
        return NULL;
    }
    Holder *holder = (Holder *)obj;
    if (holder->frame == NULL) {
        PyErr_SetString(st->checkpoint_error,
                        "matepoint.checkpoint: saved tensor was already released");
        return NULL;
    }
    PyObject *result = unpack_holder(holder);
    if (result == NULL && holder->frame->error_cb != NULL &&
        PyErr_ExceptionMatches(st->checkpoint_error)) {
        PyObject *exc = mp_take_exception();
        PyObject *cb_result = PyObject_CallOneArg(holder->frame->error_cb, exc);
        Py_XDECREF(cb_result);
        mp_chain_exception(exc);
    }
    return result;
}
