/* A frame's inputs: saving them (kept on their device through SavedTensor,
 * or offloaded) and rebuilding the call's arguments from them for a
 * recompute, with the in-place check (saved_inputs.h). */
#include "saved_inputs.h"
#include "base/compat.h"
#include "base/modified_input.h"
#include "base/hooks.h"
#include "offload/offload.h"
#include "tree.h"

#include <string.h>

static PyObject *
list_of_none(Py_ssize_t n)
{
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list != NULL && i < n; i++)
        PyList_SET_ITEM(list, i, Py_NewRef(Py_None));
    return list;
}

/* Keeps one input as it is. torch's SavedTensor keeps the input's version
 * counter, so an in-place change between forward and backward is caught;
 * without it (older torch) the frame keeps tensor and version. */
static int
save_plain(Frame *frame, PyObject *tensor, Py_ssize_t i)
{
    mp_state *st = frame->st;
    PyObject *saved;
    if (st->make_saved_tensor != NULL) {
        saved = hooks_save_tensor(st, tensor);
    } else {
        PyObject *version = PyObject_GetAttr(tensor, st->str_version);
        if (version == NULL || PyList_SetItem(frame->versions, i, version) < 0)
            return -1;
        saved = Py_NewRef(tensor);
    }
    return saved == NULL ? -1 : PyList_SetItem(frame->saved, i, saved);
}

int
saved_inputs_save(Frame *frame, PyObject *tensors, int offload_override)
{
    mp_state *st = frame->st;
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    frame->saved = list_of_none(n);
    if (frame->saved == NULL)
        return -1;
    if (st->make_saved_tensor == NULL && (frame->versions = list_of_none(n)) == NULL)
        return -1;
    if (offload_save_inputs(st, frame->module, frame->function, tensors, offload_override,
                            frame->saved, &frame->offload_group, &frame->offload_records) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GET_ITEM(frame->saved, i) == Py_None &&
            save_plain(frame, PyList_GET_ITEM(tensors, i), i) < 0)
            return -1;
    }
    return 0;
}

int
saved_inputs_finish_forward(Frame *frame)
{
    return offload_check_forward(frame->st, frame->offload_records);
}

void
saved_inputs_drop_unneeded(Frame *frame)
{
    if (frame->n_holders > 0)
        return;
    Py_CLEAR(frame->saved);
    Py_CLEAR(frame->versions);
    Py_CLEAR(frame->offload_group);
    Py_CLEAR(frame->offload_records);
    Py_CLEAR(frame->args_template);
    Py_CLEAR(frame->kwargs_template);
}

static int
is_inplace_error(PyObject *exc)
{
    PyObject *text = PyObject_Str(exc);
    const char *utf8 = text ? PyUnicode_AsUTF8(text) : NULL;
    int found = utf8 != NULL && strstr(utf8, "modified by an inplace operation") != NULL;
    if (utf8 == NULL)
        PyErr_Clear();
    Py_XDECREF(text);
    return found;
}

/* Input i of a region, saved as torch's SavedTensor, unpacked; torch's
 * in-place RuntimeError becomes matepoint's, naming input i. (Not the
 * forward's unpack hook of unpack.c, which recomputes a region.) */
static PyObject *
unpack_saved_input(mp_state *st, PyObject *saved, Py_ssize_t i)
{
    PyObject *tensor = PyObject_CallMethodNoArgs(saved, st->str_unpack);
    if (tensor == NULL && PyErr_ExceptionMatches(PyExc_RuntimeError)) {
        PyObject *exc = mp_take_exception();
        int modified = is_inplace_error(exc);
        mp_restore_exception(exc);
        if (modified)
            return raise_modified_input(i);
    }
    return tensor;
}

/* Without SavedTensor (older torch): the input's version now must be the
 * one it had in the forward pass. */
static int
check_version(Frame *frame, PyObject *tensor, Py_ssize_t i)
{
    PyObject *version = PyObject_GetAttr(tensor, frame->st->str_version);
    if (version == NULL)
        return -1;
    int same = PyObject_RichCompareBool(version, PyList_GET_ITEM(frame->versions, i), Py_EQ);
    Py_DECREF(version);
    if (same == 0)
        raise_modified_input(i);
    return same == 1 ? 0 : -1;
}

/* Without SavedTensor (older torch) an offloaded input's slot holds its
 * offload record, unpacked by the same hook SavedTensor would call. */
static PyObject *
restore_one_input(Frame *frame, Py_ssize_t i)
{
    mp_state *st = frame->st;
    PyObject *saved = PyList_GET_ITEM(frame->saved, i);
    if (frame->versions == NULL)
        return unpack_saved_input(st, saved, i);
    if (Py_IS_TYPE(saved, st->tensor_record_type))
        return PyObject_CallOneArg(st->offload_unpack, saved);
    return check_version(frame, saved, i) < 0 ? NULL : Py_NewRef(saved);
}

typedef struct {
    Frame *frame;
    PyObject *tensors;          /* list: slot i receives input #i */
} unpack_ctx;

static int
unpack_inputs(void *arg)
{
    unpack_ctx *ctx = arg;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ctx->tensors); i++) {
        PyObject *tensor = restore_one_input(ctx->frame, i);
        if (tensor == NULL)
            return -1;
        PyList_SET_ITEM(ctx->tensors, i, tensor);
    }
    return 0;
}

int
saved_inputs_restore(Frame *frame, PyObject **args_out, PyObject **kwargs_out)
{
    mp_state *st = frame->st;
    Py_ssize_t n = PyList_GET_SIZE(frame->saved);
    unpack_ctx ctx = {.frame = frame, .tensors = PyList_New(n)};
    *args_out = *kwargs_out = NULL;
    if (ctx.tensors == NULL)
        return -1;
    if (offload_restore_group(st, frame->offload_group, frame->prefetch_ahead, unpack_inputs,
                              &ctx) < 0)
        goto error;
    *args_out = tree_unflatten(st, frame->args_template, ctx.tensors);
    if (*args_out == NULL)
        goto error;
    if (frame->kwargs_template != NULL) {
        *kwargs_out = tree_unflatten(st, frame->kwargs_template, ctx.tensors);
        if (*kwargs_out == NULL)
            goto error;
    }
    Py_DECREF(ctx.tensors);
    return 0;
error:
    Py_CLEAR(*args_out);
    Py_DECREF(ctx.tensors);
    return -1;
}
