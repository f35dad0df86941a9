/* The recompute of a checkpointed region in backward: the region's
 * function runs again from its restored inputs under the recompute pack
 * hook, which files each tensor it saves under the forward's holder (in
 * order), with the forward's RNG, autocast and device context replayed,
 * grad mode on and BatchNorm statistics guarded; then torch's checks on
 * the count and metadata of what was saved. */
#include "recompute.h"
#include "base/compat.h"
#include "base/hooks.h"
#include "bn_guard.h"
#include "no_dynamo.h"
#include "saved_inputs.h"

/* Per-thread recompute depth. Thread-local, so it needs no lock: each
 * thread only ever sees its own recomputes. */
static _Thread_local int recompute_depth;

int
recompute_in_progress(void)
{
    return recompute_depth > 0;
}

/* Where matepoint raises the CheckpointError torch raises for the same case,
 * the message starts with torch's sentence (people search for it and test
 * suites match it) and keeps torch's pointer to its debug mode, which
 * matepoint.checkpoint honours too; matepoint's own detail follows. */
#define DEBUG_TIP                                                                             \
    "\nTip: To see a more detailed error message, either pass `debug=True` to\n"              \
    "`matepoint.checkpoint(...)` or wrap the code block\n"                                     \
    "with `with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):` to\n"              \
    "enable checkpoint-debug mode globally.\n"

static PyObject *
checkpoint_error(mp_state *st, const char *message)
{
    PyErr_SetString(st->checkpoint_error, message);
    return NULL;
}

typedef struct {
    PyObject_HEAD
    Frame *frame;
    PyObject *gid;
    Py_ssize_t count;           /* tensors saved so far by this recompute */
} RecomputeHook;

static int
recompute_hook_traverse(RecomputeHook *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->frame);
    Py_VISIT(self->gid);
    return 0;
}

static int
recompute_hook_clear(RecomputeHook *self)
{
    Py_CLEAR(self->frame);
    Py_CLEAR(self->gid);
    return 0;
}

static void
recompute_hook_dealloc(RecomputeHook *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    recompute_hook_clear(self);
    mp_type_free(tp, self);
    Py_DECREF(tp);
}

static int
holder_store(Holder *holder, PyObject *gid, PyObject *tensor)
{
    if (holder->recomputed == NULL) {
        holder->recomputed = PyDict_New();
        if (holder->recomputed == NULL)
            return -1;
    }
    return PyDict_SetItem(holder->recomputed, gid, tensor);
}

/* What the recompute keeps of a saved tensor, as torch does: a tensor that
 * requires grad is detached (the recomputed graph must not stay alive);
 * any other is kept as the same object, so a frozen nn.Parameter, a buffer
 * or a tensor carrying Python attributes comes back as itself. */
static PyObject *
recompute_keep(mp_state *st, PyObject *tensor)
{
    PyObject *flag = PyObject_GetAttr(tensor, st->str_requires_grad);
    if (flag == NULL)
        return NULL;
    int requires_grad = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    if (requires_grad < 0)
        return NULL;
    return requires_grad ? PyObject_CallMethodNoArgs(tensor, st->str_detach) : Py_NewRef(tensor);
}

/* Recompute pack hook: files each recomputed tensor under its holder. */
static PyObject *
recompute_pack(RecomputeHook *self, PyObject *args, PyObject *kwargs)
{
    Frame *frame = self->frame;
    mp_state *st = frame->st;
    PyObject *tensor;
    (void)kwargs;
    if (!PyArg_UnpackTuple(args, "pack_hook", 1, 1, &tensor))
        return NULL;
    PyObject *detached = recompute_keep(st, tensor);
    if (detached == NULL)
        return NULL;
    Py_ssize_t index = self->count++;
    if (index >= frame->n_holders) {
        if (!frame->forward_completed) {
            /* backward ran inside the forward: counts cannot be compared */
            frame->ignore_saved_mismatch = 1;
            return detached;
        }
        Py_DECREF(detached);
        return checkpoint_error(st, "torch.utils.checkpoint: trying to save more tensors during "
                                    "recomputation than during the original forward pass.\n"
                                    "matepoint.checkpoint: the recomputation saved more tensors "
                                    "than the original forward pass; the checkpointed function "
                                    "must run the same operations both times.\n" DEBUG_TIP);
    }
    Holder *holder = frame->holders[index];
    if (holder != NULL && holder_store(holder, self->gid, detached) < 0) {
        Py_DECREF(detached);
        return NULL;
    }
    if (frame->early_stop && self->count == frame->n_holders) {
        Py_DECREF(detached);
        PyErr_SetNone(st->stop_recompute);
        return NULL;
    }
    return detached;
}

static PyType_Slot recompute_hook_slots[] = {
    {Py_tp_dealloc, recompute_hook_dealloc},
    {Py_tp_traverse, recompute_hook_traverse},
    {Py_tp_clear, recompute_hook_clear},
    {Py_tp_call, recompute_pack},
    {Py_tp_getset, hooks_internal_getset},
    {0, NULL},
};

PyType_Spec recompute_hook_spec = {
    .name = "matepoint._C._RecomputeHook",
    .basicsize = sizeof(RecomputeHook),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = recompute_hook_slots,
};

static PyObject *
describe_metadata(PyObject *meta)
{
    return PyUnicode_FromFormat("{'shape': %R, 'dtype': %R, 'device': %R}",
                                PyTuple_GET_ITEM(meta, 0), PyTuple_GET_ITEM(meta, 1),
                                PyTuple_GET_ITEM(meta, 2));
}

/* Appends torch's report of one tensor whose metadata changed. */
static int
append_mismatch(PyObject *report, Holder *holder, PyObject *now)
{
    PyObject *before = describe_metadata(holder->meta);
    PyObject *after = before ? describe_metadata(now) : NULL;
    PyObject *entry = after ? PyUnicode_FromFormat("tensor at position %zd:\nsaved metadata: "
                                                   "%U\nrecomputed metadata: %U\n",
                                                   holder->index, before, after)
                            : NULL;
    int result = entry ? PyList_Append(report, entry) : -1;
    Py_XDECREF(before);
    Py_XDECREF(after);
    Py_XDECREF(entry);
    return result;
}

/* Compares one holder's recomputed tensor with the forward's metadata;
 * a difference is appended to `report`. */
static int
compare_metadata(mp_state *st, Holder *holder, PyObject *gid, PyObject *report)
{
    if (holder == NULL || holder->meta == NULL || holder->recomputed == NULL)
        return 0;
    PyObject *tensor = PyDict_GetItemWithError(holder->recomputed, gid);
    if (tensor == NULL)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *now = frame_tensor_metadata(st, tensor);
    if (now == NULL)
        return -1;
    int same = PyObject_RichCompareBool(now, holder->meta, Py_EQ);
    int result = same < 0 ? -1 : same ? 0 : append_mismatch(report, holder, now);
    Py_DECREF(now);
    return result;
}

/* Every tensor whose shape, dtype or device changed, in one error. */
static int
check_metadata(RecomputeHook *hook)
{
    Frame *frame = hook->frame;
    mp_state *st = frame->st;
    PyObject *report = PyList_New(0);
    if (report == NULL)
        return -1;
    int result = 0;
    for (Py_ssize_t i = 0; i < frame->n_holders && result == 0; i++)
        result = compare_metadata(st, frame->holders[i], hook->gid, report);
    if (result == 0 && PyList_GET_SIZE(report) > 0) {
        PyObject *empty = PyUnicode_FromStringAndSize("", 0);
        PyObject *joined = empty ? PyUnicode_Join(empty, report) : NULL;
        if (joined != NULL)
            PyErr_Format(st->checkpoint_error,
                         "torch.utils.checkpoint: Recomputed values for the following tensors "
                         "have different metadata than during the forward pass.\n%U"
                         "matepoint.checkpoint: the checkpointed function must be deterministic "
                         "in shapes, dtypes and devices.\n" DEBUG_TIP,
                         joined);
        Py_XDECREF(empty);
        Py_XDECREF(joined);
        result = -1;
    }
    Py_DECREF(report);
    return result;
}

static int
check_recomputed(RecomputeHook *hook)
{
    Frame *frame = hook->frame;
    mp_state *st = frame->st;
    if (frame->ignore_saved_mismatch)
        return 0;
    if (hook->count != frame->n_holders) {
        PyErr_Format(st->checkpoint_error,
                     "torch.utils.checkpoint: A different number of tensors was saved during "
                     "the original forward and recomputation.\n"
                     "Number of tensors saved during forward: %zd\n"
                     "Number of tensors saved during recomputation: %zd.\n"
                     "matepoint.checkpoint: the forward pass saved %zd tensors but the "
                     "recomputation saved %zd; the checkpointed function must run the same "
                     "operations both times.\n" DEBUG_TIP,
                     frame->n_holders, hook->count, frame->n_holders, hook->count);
        return -1;
    }
    return frame->check_metadata ? check_metadata(hook) : 0;
}

static int
set_grad_enabled(mp_state *st, PyObject *flag)
{
    PyObject *done = PyObject_CallOneArg(st->set_grad_enabled, flag);
    Py_XDECREF(done);
    return done ? 0 : -1;
}

/* Runs the region again under the recompute hook, with the forward's RNG,
 * autocast and device context, grad mode on, BatchNorm statistics frozen. */
int
frame_recompute(Frame *frame, PyObject *gid)
{
    mp_state *st = frame->st;
    PyObject *args = NULL, *kwargs = NULL, *bn_handle = NULL, *grad_was = NULL;
    PyObject *bn_modules = NULL, *outer_bn_modules;
    replay_undo undo;
    int result = -1, hooks_pushed = 0, replayed = 0;

    if (frame->saved == NULL) {
        checkpoint_error(st, "matepoint.checkpoint: internal error: inputs were released");
        return -1;
    }
    /* tp_alloc zero-fills, tracks and takes the type reference */
    PyTypeObject *type = st->recompute_hook_type;
    RecomputeHook *hook = (RecomputeHook *)mp_type_alloc(type);
    if (hook == NULL)
        return -1;
    hook->frame = (Frame *)Py_NewRef(frame);
    hook->gid = Py_NewRef(gid);

    if (saved_inputs_restore(frame, &args, &kwargs) < 0)
        goto done;
    grad_was = PyObject_CallNoArgs(st->is_grad_enabled);
    bn_modules = grad_was ? PyList_New(0) : NULL;
    if (bn_modules == NULL)
        goto done;
    if (hooks_push(st, (PyObject *)hook, st->identity) < 0)
        goto done;
    hooks_pushed = 1;
    if (set_grad_enabled(st, Py_True) < 0)
        goto done;
    if (replay_enter(st, &frame->replay, frame->recompute_context, &undo) < 0)
        goto done;
    replayed = 1;
    bn_handle = bn_guard_register(st);
    if (bn_handle == NULL)
        goto done;

    recompute_depth++;
    outer_bn_modules = bn_guard_enter(bn_modules);
    uint64_t outer_tag =
        alloc_link_tag(&st->alloc, alloc_region_tag(frame->region_id, TAG_RECOMPUTE));
    PyObject *out = call_without_dynamo(st, frame->function, args, kwargs);
    alloc_link_tag(&st->alloc, outer_tag);
    bn_guard_leave(outer_bn_modules);
    recompute_depth--;
    Py_XDECREF(out);
    if (out != NULL || PyErr_ExceptionMatches(st->stop_recompute)) {
        PyErr_Clear();
        result = 0;
    }
done:
    if (bn_handle != NULL && bn_guard_release(st, bn_handle, bn_modules) < 0)
        result = -1;
    if (replayed && replay_exit(st, &frame->replay, &undo) < 0)
        result = -1;
    if (grad_was != NULL && hooks_pushed) {
        PyObject *pending = mp_take_exception();
        if (set_grad_enabled(st, grad_was) < 0) {
            result = -1;
            mp_chain_exception(pending);
        } else if (pending != NULL) {
            mp_restore_exception(pending);
        }
    }
    if (hooks_pushed && hooks_pop(st) < 0)
        result = -1;
    if (result == 0)
        result = check_recomputed(hook);
    Py_XDECREF(bn_handle);
    Py_XDECREF(bn_modules);
    Py_XDECREF(grad_was);
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_DECREF(hook);
    return result;
}
