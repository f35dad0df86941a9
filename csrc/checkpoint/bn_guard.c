#include "bn_guard.h"
#include "base/compat.h"
#include "replay.h"

/* The innermost recompute's list of BatchNorm modules whose statistics
 * buffers were swapped (borrowed from frame_recompute, NULL outside one).
 * Thread-local: each thread only ever sees its own recomputes. */
static _Thread_local PyObject *guarded_modules;

PyObject *
bn_guard_enter(PyObject *bn_modules)
{
    PyObject *outer = guarded_modules;
    guarded_modules = bn_modules;
    return outer;
}

void
bn_guard_leave(PyObject *outer)
{
    guarded_modules = outer;
}

PyObject *
bn_guard_register(mp_state *st)
{
    return PyObject_CallOneArg(st->register_pre_hook, st->bn_guard_hook);
}

static const char *const bn_buffer_names[] = {"running_mean", "running_var",
                                              "num_batches_tracked"};
#define BN_BUFFERS 3

/* Puts the original statistics buffers back: entries are
 * (module, running_mean, running_var, num_batches_tracked). */
static int
restore_bn_buffers(PyObject *entry)
{
    PyObject *module = PyTuple_GET_ITEM(entry, 0);
    int result = 0;
    for (int i = 0; i < BN_BUFFERS; i++) {
        if (PyObject_SetAttrString(module, bn_buffer_names[i], PyTuple_GET_ITEM(entry, i + 1)) < 0)
            result = -1;
    }
    return result;
}

int
bn_guard_release(mp_state *st, PyObject *handle, PyObject *bn_modules)
{
    int result = 0;
    PyObject *pending = mp_take_exception();
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(bn_modules); i++) {
        if (restore_bn_buffers(PyList_GET_ITEM(bn_modules, i)) < 0)
            result = -1;
    }
    PyObject *done = PyObject_CallMethodNoArgs(handle, st->str_remove);
    if (done == NULL)
        result = -1;
    Py_XDECREF(done);
    if (result < 0)
        mp_chain_exception(pending);
    else if (pending != NULL)
        mp_restore_exception(pending);
    return result;
}

static int
bn_already_guarded(PyObject *module)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(guarded_modules); i++) {
        if (PyTuple_GET_ITEM(PyList_GET_ITEM(guarded_modules, i), 0) == module)
            return 1;
    }
    return 0;
}

/* Clones `buffer` with every TorchDispatchMode set aside: the copy is
 * matepoint's bookkeeping, not an op of the region, and selective
 * checkpointing's recompute mode refuses ops its forward did not see. */
static PyObject *
clone_outside_dispatch_modes(mp_state *st, PyObject *buffer)
{
    PyObject *modes_off = PyObject_CallNoArgs(st->disable_dispatch_modes);
    if (modes_off == NULL || context_enter(st, modes_off) < 0) {
        Py_XDECREF(modes_off);
        return NULL;
    }
    PyObject *copy = PyObject_CallMethod(buffer, "clone", NULL);
    if (context_exit(st, modes_off) < 0)
        Py_CLEAR(copy);
    Py_DECREF(modes_off);
    return copy;
}

/* Gives `module` throw-away copies of its statistics buffers, so the
 * recompute computes exactly what the forward did (same saved tensors, same
 * batch statistics) while the real running averages move once per step. */
static int
swap_in_bn_copies(mp_state *st, PyObject *module)
{
    PyObject *entry = PyTuple_New(1 + BN_BUFFERS);
    if (entry == NULL)
        return -1;
    PyTuple_SET_ITEM(entry, 0, Py_NewRef(module));
    for (int i = 0; i < BN_BUFFERS; i++) {
        PyObject *buffer = PyObject_GetAttrString(module, bn_buffer_names[i]);
        if (buffer == NULL) {
            Py_DECREF(entry);
            return -1;
        }
        PyTuple_SET_ITEM(entry, i + 1, buffer);
    }
    int result = PyList_Append(guarded_modules, entry);
    for (int i = 0; result == 0 && i < BN_BUFFERS; i++) {
        PyObject *buffer = PyTuple_GET_ITEM(entry, i + 1);
        if (buffer == Py_None)
            continue;
        PyObject *copy = clone_outside_dispatch_modes(st, buffer);
        result = copy ? PyObject_SetAttrString(module, bn_buffer_names[i], copy) : -1;
        Py_XDECREF(copy);
    }
    Py_DECREF(entry);
    return result;
}

PyObject *
bn_guard_pre_hook(PyObject *module_obj, PyObject *const *args, Py_ssize_t nargs)
{
    mp_state *st = mp_state_of(module_obj);
    if (nargs < 1 || guarded_modules == NULL)
        Py_RETURN_NONE;
    PyObject *module = args[0];
    int is_bn = PyObject_IsInstance(module, st->batchnorm_type);
    if (is_bn <= 0)
        return is_bn < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *training = PyObject_GetAttr(module, st->str_training);
    PyObject *tracking = training ? PyObject_GetAttr(module, st->str_track_running_stats) : NULL;
    int guard = tracking && PyObject_IsTrue(training) == 1 && PyObject_IsTrue(tracking) == 1;
    Py_XDECREF(training);
    Py_XDECREF(tracking);
    if (tracking == NULL)
        return NULL;
    if (guard && !bn_already_guarded(module) && swap_in_bn_copies(st, module) < 0)
        return NULL;
    Py_RETURN_NONE;
}
