#include "frame.h"
#include "base/hooks.h"

#include <stddef.h>
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
    mp_type_free(tp, self);
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
    Holder *holder = (Holder *)mp_type_alloc(type);
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
    mp_type_free(tp, self);
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

Frame *
frame_new(mp_state *st, PyObject *module, PyObject *function)
{
    /* tp_alloc zero-fills every field (NULL objects, empty replay state),
     * tracks the frame and takes the reference to the type that
     * frame_dealloc gives back */
    Frame *frame = (Frame *)mp_type_alloc(st->frame_type);
    if (frame == NULL)
        return NULL;
    frame->st = st;
    frame->module = Py_NewRef(module);
    frame->function = Py_NewRef(function);
    frame->region_id = ++st->next_region_id;
    frame->prefetch_ahead = 1;
    return frame;
}
