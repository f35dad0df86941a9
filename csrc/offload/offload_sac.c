/* Selective checkpointing's offload policies (MUST_CPU_OFFLOAD,
 * PREFER_CPU_OFFLOAD) in eager mode: an op's outputs that the policy keeps
 * go through the engine like a region's inputs (pool, copy-out stream,
 * window) and come back ahead of the recompute that asks for them: their
 * group is linked after the region's inputs and prefetched with them
 * (offload_restore.c), or when the recompute begins. The caching mode
 * around it is Python (matepoint/_sac_offload.py).
 *
 * Owns nothing: its Python functions check their arguments and call the
 * two directions. Floor `entry`: called by csrc/module; calls save,
 * restore and nothing lower but the struct of a group. GIL held. */
#include "offload_internal.h"

PyObject *
offload_sac_save_py(PyObject *module, PyObject *args)
{
    mp_state *st = mp_state_of(module);
    PyObject *tensors;
    int opens_region = 0;
    if (!PyArg_ParseTuple(args, "O|p:_sac_offload", &tensors, &opens_region))
        return NULL;
    if (!PyList_Check(tensors)) {
        PyObject *type_name = mp_type_name(tensors);
        PyErr_Format(PyExc_TypeError, "matepoint: _sac_offload takes a list of tensors, got %.100V",
                     type_name, "?");
        Py_XDECREF(type_name);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    PyObject *saved = PyList_New(n), *group = NULL, *records = NULL;
    if (saved == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyList_SET_ITEM(saved, i, Py_NewRef(Py_None));
    if (offload_save_outputs(st, module, tensors, opens_region, saved, &group, &records) < 0)
        goto error;
    if (group == NULL) {  /* nothing moved: the caller keeps the tensors */
        Py_DECREF(saved);
        Py_RETURN_NONE;
    }
    /* copies out in flight may race a later in-place change; the restore
     * checks each record's source version again */
    if (offload_check_forward(st, records) < 0)
        goto error;
    ((OffloadGroup *)group)->outputs = 1;
    PyObject *result = PyTuple_Pack(2, group, saved);
    Py_DECREF(group);
    Py_DECREF(records);
    Py_DECREF(saved);
    return result;
error:
    Py_XDECREF(group);
    Py_XDECREF(records);
    Py_DECREF(saved);
    return NULL;
}

typedef struct {
    mp_state *st;
    PyObject *saved;     /* slot i: SavedTensor, record, or None (kept) */
    PyObject *tensors;   /* slot i receives the restored tensor or None */
} sac_unpack_ctx;

static PyObject *
unpack_one(mp_state *st, PyObject *saved)
{
    if (saved == Py_None)
        return Py_NewRef(Py_None);
    if (Py_IS_TYPE(saved, st->tensor_record_type))
        return PyObject_CallOneArg(st->offload_unpack, saved);
    return PyObject_CallMethodNoArgs(saved, st->str_unpack);
}

static int
sac_unpack(void *arg)
{
    sac_unpack_ctx *ctx = arg;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ctx->saved); i++) {
        PyObject *tensor = unpack_one(ctx->st, PyList_GET_ITEM(ctx->saved, i));
        if (tensor == NULL)
            return -1;
        PyList_SET_ITEM(ctx->tensors, i, tensor);
    }
    return 0;
}

PyObject *
offload_sac_restore_py(PyObject *module, PyObject *args)
{
    mp_state *st = mp_state_of(module);
    PyObject *group, *saved;
    if (!PyArg_ParseTuple(args, "O!O!:_sac_restore", st->offload_group_type, &group,
                          &PyList_Type, &saved))
        return NULL;
    sac_unpack_ctx ctx = {.st = st, .saved = saved, .tensors = PyList_New(PyList_GET_SIZE(saved))};
    if (ctx.tensors == NULL)
        return NULL;
    /* handed out once (torch's cache allows one backward): no prefetch
     * may copy it back again */
    ((OffloadGroup *)group)->handed_back = 1;
    if (offload_restore_group(st, group, 0, sac_unpack, &ctx) < 0) {
        Py_DECREF(ctx.tensors);
        return NULL;
    }
    return ctx.tensors;
}

static int
check_group(mp_state *st, PyObject *group, const char *function)
{
    if (Py_IS_TYPE(group, st->offload_group_type))
        return 0;
    PyObject *type_name = mp_type_name(group);
    PyErr_Format(PyExc_TypeError, "matepoint: %s takes an offload group, got %.100V", function,
                 type_name, "?");
    Py_XDECREF(type_name);
    return -1;
}

PyObject *
offload_sac_prefetch_py(PyObject *module, PyObject *group)
{
    mp_state *st = mp_state_of(module);
    if (check_group(st, group, "_sac_prefetch") < 0 || offload_prefetch_group(st, group) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyObject *
offload_sac_discard_py(PyObject *module, PyObject *group)
{
    mp_state *st = mp_state_of(module);
    if (check_group(st, group, "_sac_discard") < 0)
        return NULL;
    /* its region's recompute is over: what it did not reach (an early stop)
     * is not worth copying back again */
    ((OffloadGroup *)group)->handed_back = 1;
    offload_discard_group(st, group);
    Py_RETURN_NONE;
}
