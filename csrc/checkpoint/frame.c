#include "frame.h"
#include "recompute.h"
#include "base/compat.h"
#include "base/hooks.h"

#include <stddef.h>
#include <string.h>
#include <structmember.h>

/* ---- Holder ------------------------------------------------------------ */

static int
holder_traverse(Holder *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->frame);
    Py_VISIT(self->meta);
    Py_VISIT(self->recomputed);
    return 0;
}

static int
holder_clear(Holder *self)
{
    if (self->frame != NULL)
        self->frame->holders[self->index] = NULL;
    Py_CLEAR(self->frame);
    Py_CLEAR(self->meta);
    Py_CLEAR(self->recomputed);
    return 0;
}

static void
holder_dealloc(Holder *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    holder_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyType_Slot holder_slots[] = {
    {Py_tp_dealloc, holder_dealloc},
    {Py_tp_traverse, holder_traverse},
    {Py_tp_clear, holder_clear},
    {0, NULL},
};

PyType_Spec holder_spec = {
    .name = "matepoint._C._Holder",
    .basicsize = sizeof(Holder),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = holder_slots,
};

PyObject *
frame_tensor_metadata(mp_state *st, PyObject *tensor)
{
    PyObject *shape = PyObject_GetAttr(tensor, st->str_shape);
    PyObject *dtype = shape ? PyObject_GetAttr(tensor, st->str_dtype) : NULL;
    PyObject *device = dtype ? PyObject_GetAttr(tensor, st->str_device) : NULL;
    PyObject *meta = device ? PyTuple_Pack(3, shape, dtype, device) : NULL;
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    return meta;
}

static int
frame_grow_holders(Frame *frame)
{
    if (frame->n_holders < frame->cap_holders)
        return 0;
    Py_ssize_t cap = frame->cap_holders ? frame->cap_holders * 2 : 8;
    Holder **grown = PyMem_Realloc(frame->holders, (size_t)cap * sizeof(Holder *));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    frame->holders = grown;
    frame->cap_holders = cap;
    return 0;
}

/* Forward pack hook: tensor -> Holder. The frame object is the hook. */
static PyObject *
frame_pack(Frame *frame, PyObject *args, PyObject *kwargs)
{
    PyObject *tensor;
    if (!PyArg_UnpackTuple(args, "pack_hook", 1, 1, &tensor) || frame_grow_holders(frame) < 0)
        return NULL;
    (void)kwargs;
    /* tp_alloc zero-fills, tracks, and takes the reference to the type
     * that holder_dealloc gives back */
    PyTypeObject *type = frame->st->holder_type;
    Holder *holder = (Holder *)type->tp_alloc(type, 0);
    if (holder == NULL)
        return NULL;
    holder->index = frame->n_holders;
    holder->frame = (Frame *)Py_NewRef(frame);
    frame->holders[frame->n_holders++] = holder;
    if (frame->check_metadata) {
        holder->meta = frame_tensor_metadata(frame->st, tensor);
        if (holder->meta == NULL) {
            Py_DECREF(holder);
            return NULL;
        }
    }
    return (PyObject *)holder;
}

/* ---- Frame ------------------------------------------------------------- */

static int
frame_traverse(Frame *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    Py_VISIT(self->function);
    Py_VISIT(self->args_template);
    Py_VISIT(self->kwargs_template);
    Py_VISIT(self->saved);
    Py_VISIT(self->versions);
    Py_VISIT(self->offload_group);
    Py_VISIT(self->offload_records);
    Py_VISIT(self->recompute_context);
    Py_VISIT(self->error_cb);
    Py_VISIT(self->recomputed_gids);
    return replay_traverse(&self->replay, visit, arg);
}

static int
frame_clear(Frame *self)
{
    Py_CLEAR(self->function);
    Py_CLEAR(self->args_template);
    Py_CLEAR(self->kwargs_template);
    Py_CLEAR(self->saved);
    Py_CLEAR(self->versions);
    Py_CLEAR(self->offload_group);
    Py_CLEAR(self->offload_records);
    Py_CLEAR(self->recompute_context);
    Py_CLEAR(self->error_cb);
    Py_CLEAR(self->recomputed_gids);
    replay_clear(&self->replay);
    Py_CLEAR(self->module);
    return 0;
}

static void
frame_dealloc(Frame *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    frame_clear(self);
    PyMem_Free(self->holders);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Read by the selective-checkpoint caching mode (matepoint/_sac_offload.py):
 * an op run once the forward has saved as many tensors as it ends with is
 * never reached by an early-stopping recompute. */
static PyMemberDef frame_members[] = {
    {"_saved_count", T_PYSSIZET, offsetof(Frame, n_holders), READONLY,
     "tensors saved for backward so far in the region's forward"},
    {"_early_stop", T_BOOL, offsetof(Frame, early_stop), READONLY,
     "the recompute stops at the last tensor the forward saved"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot frame_slots[] = {
    {Py_tp_dealloc, frame_dealloc},
    {Py_tp_members, frame_members},
    {Py_tp_traverse, frame_traverse},
    {Py_tp_clear, frame_clear},
    {Py_tp_call, frame_pack},
    {Py_tp_getset, hooks_internal_getset},
    {0, NULL},
};

PyType_Spec frame_spec = {
    .name = "matepoint._C._Frame",
    .basicsize = sizeof(Frame),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = frame_slots,
};

/* ---- unpack ------------------------------------------------------------- */

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
frame_unpack_hook(PyObject *module, PyObject *obj)
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
