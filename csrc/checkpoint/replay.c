#include "replay.h"
#include "base/compat.h"

int
context_enter(mp_state *st, PyObject *cm)
{
    PyObject *result = PyObject_CallMethodNoArgs(cm, st->str_enter);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

int
context_exit(mp_state *st, PyObject *cm)
{
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    PyObject *pending = mp_take_exception();
    if (pending != NULL) {
        type = (PyObject *)Py_TYPE(pending);
        value = pending;
        tb = PyException_GetTraceback(pending);
    }
    PyObject *result = PyObject_CallMethodObjArgs(cm, st->str_exit, type ? type : Py_None,
                                                  value ? value : Py_None, tb ? tb : Py_None,
                                                  NULL);
    Py_XDECREF(tb);
    if (result == NULL) {
        /* the new error wins, chained to the pending one */
        mp_chain_exception(pending);
        return -1;
    }
    int suppressed = pending != NULL && PyObject_IsTrue(result) == 1;
    Py_DECREF(result);
    if (pending != NULL)
        mp_restore_exception(pending);
    return suppressed;
}

/* 1 when `tensor` is a plain torch.Tensor on the CPU, told by one flag
 * (the device object and its type string cost more than the rest of a
 * tiny region's capture), 0 when not or not plain, -1 on error. */
static int
plain_on_cpu(mp_state *st, PyObject *tensor)
{
    if (!Py_IS_TYPE(tensor, (PyTypeObject *)st->tensor_class))
        return 0;
    PyObject *flag = PyObject_GetAttr(tensor, st->str_is_cpu);
    if (flag == NULL)
        return -1;
    Py_DECREF(flag);
    return flag == Py_True;
}

/* Device type of the region as torch.utils.checkpoint picks it: cuda if any
 * input is on cuda, else the first non-CPU type, else the default. */
static PyObject *
region_device_type(mp_state *st, PyObject *tensors, PyObject **devices_out)
{
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    PyObject *chosen = NULL;
    PyObject *devices = PyList_New(0);
    if (devices == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int cpu = plain_on_cpu(st, PyList_GET_ITEM(tensors, i));
        if (cpu < 0)
            goto error;
        if (cpu)
            continue;
        PyObject *device = PyObject_GetAttr(PyList_GET_ITEM(tensors, i), st->str_device);
        PyObject *type = device ? PyObject_GetAttr(device, st->str_type) : NULL;
        if (type == NULL) {
            Py_XDECREF(device);
            goto error;
        }
        int is_cpu = PyUnicode_Compare(type, st->str_cpu) == 0;
        int is_meta = PyUnicode_CompareWithASCIIString(type, "meta") == 0;
        if (!is_cpu && !is_meta && PyList_Append(devices, device) < 0) {
            Py_DECREF(type);
            Py_DECREF(device);
            goto error;
        }
        Py_DECREF(device);
        if (!is_cpu && (chosen == NULL || PyUnicode_CompareWithASCIIString(type, "cuda") == 0))
            Py_XSETREF(chosen, type);
        else
            Py_DECREF(type);
    }
    if (chosen == NULL) {
        chosen = PyObject_CallNoArgs(st->default_device_type);
        if (chosen == NULL)
            goto error;
    }
    *devices_out = devices;
    return chosen;
error:
    Py_XDECREF(chosen);
    Py_DECREF(devices);
    return NULL;
}

/* Indices of the distinct devices of `device_type` among `devices`. */
static PyObject *
distinct_indices(mp_state *st, PyObject *devices, PyObject *device_type)
{
    PyObject *indices = PyList_New(0);
    if (indices == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(devices); i++) {
        PyObject *device = PyList_GET_ITEM(devices, i);
        PyObject *type = PyObject_GetAttr(device, st->str_type);
        PyObject *index = type ? PyObject_GetAttr(device, st->str_index) : NULL;
        int same = index ? PyObject_RichCompareBool(type, device_type, Py_EQ) : -1;
        int seen = same == 1 ? PySequence_Contains(indices, index) : 0;
        int failed = same < 0 || seen < 0 ||
                     (same == 1 && !seen && index != Py_None && PyList_Append(indices, index) < 0);
        Py_XDECREF(type);
        Py_XDECREF(index);
        if (failed) {
            Py_DECREF(indices);
            return NULL;
        }
    }
    Py_SETREF(indices, PyList_AsTuple(indices));
    return indices;
}

static int
device_initialized(mp_state *st, PyObject *device_module)
{
    if (device_module == NULL)
        return 0;
    PyObject *flag;
    if (mp_optional_attr(device_module, st->str_initialized, &flag) < 0)
        return -1;
    if (flag == NULL)
        return 0;
    int result = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    return result;
}

static PyObject *
device_module_for(mp_state *st, PyObject *device_type)
{
    if (PyUnicode_Compare(device_type, st->str_cpu) == 0 ||
        PyUnicode_CompareWithASCIIString(device_type, "meta") == 0)
        return NULL;
    PyObject *module;
    if (mp_optional_attr(st->torch_module, device_type, &module) < 0)
        PyErr_Clear();
    return module;
}

static PyObject *
call_rng_getter(mp_state *st, PyObject *module, PyObject *indices)
{
    Py_ssize_t n = PyTuple_GET_SIZE(indices);
    PyObject *states = PyTuple_New(n);
    for (Py_ssize_t i = 0; states != NULL && i < n; i++) {
        PyObject *state = PyObject_CallMethodOneArg(module, st->str_get_rng_state,
                                                    PyTuple_GET_ITEM(indices, i));
        if (state == NULL)
            Py_CLEAR(states);
        else
            PyTuple_SET_ITEM(states, i, state);
    }
    return states;
}

static int
call_rng_setter(mp_state *st, PyObject *module, PyObject *indices, PyObject *states)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(indices); i++) {
        PyObject *done = PyObject_CallMethodObjArgs(module, st->str_set_rng_state,
                                                    PyTuple_GET_ITEM(states, i),
                                                    PyTuple_GET_ITEM(indices, i), NULL);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
    }
    return 0;
}

static int
autocast_is_available(mp_state *st, PyObject *device_type)
{
    PyObject *known = PyDict_GetItemWithError(st->autocast_available_cache, device_type);
    if (known == NULL) {
        if (PyErr_Occurred())
            return -1;
        known = PyObject_CallOneArg(st->autocast_available, device_type);
        if (known == NULL)
            return -1;
        int failed = PyDict_SetItem(st->autocast_available_cache, device_type, known);
        Py_DECREF(known);
        if (failed)
            return -1;
    }
    return known == Py_True;
}

static PyObject *
autocast_entry(mp_state *st, PyObject *device_type)
{
    PyObject *enabled = PyObject_CallOneArg(st->autocast_enabled, device_type);
    PyObject *dtype = enabled ? PyObject_CallOneArg(st->autocast_dtype, device_type) : NULL;
    PyObject *entry = dtype ? PyTuple_Pack(3, device_type, enabled, dtype) : NULL;
    Py_XDECREF(enabled);
    Py_XDECREF(dtype);
    return entry;
}

static int
capture_autocast(mp_state *st, replay_state *r, PyObject *device_type)
{
    int available = 0;
    if (PyUnicode_Compare(device_type, st->str_cpu) != 0) {
        available = autocast_is_available(st, device_type);
        if (available < 0)
            return -1;
    }
    PyObject *cpu = autocast_entry(st, st->str_cpu);
    PyObject *device = available && cpu ? autocast_entry(st, device_type) : NULL;
    if (cpu == NULL || (available && device == NULL)) {
        Py_XDECREF(cpu);
        return -1;
    }
    r->autocast = device ? PyTuple_Pack(2, device, cpu) : PyTuple_Pack(1, cpu);
    Py_XDECREF(device);
    Py_DECREF(cpu);
    if (r->autocast == NULL)
        return -1;
    r->autocast_cache = PyObject_CallNoArgs(st->autocast_cache_enabled);
    return r->autocast_cache ? 0 : -1;
}

static int
capture_device_context(mp_state *st, replay_state *r)
{
    PyObject *depth = PyObject_CallNoArgs(st->function_mode_depth);
    if (depth == NULL)
        return -1;
    long n = PyLong_AsLong(depth);
    Py_DECREF(depth);
    if (n <= 0)
        return n < 0 && PyErr_Occurred() ? -1 : 0;
    PyObject *stack = PyObject_CallNoArgs(st->function_mode_stack);
    PyObject *modes = stack ? PySequence_Fast(stack, "mode stack is not a sequence") : NULL;
    Py_XDECREF(stack);
    if (modes == NULL)
        return -1;
    for (Py_ssize_t i = PySequence_Fast_GET_SIZE(modes) - 1; i >= 0; i--) {
        PyObject *mode = PySequence_Fast_GET_ITEM(modes, i);
        if (PyObject_TypeCheck(mode, (PyTypeObject *)st->device_context_type)) {
            r->device_context = Py_NewRef(mode);
            break;
        }
    }
    Py_DECREF(modes);
    return 0;
}

int
replay_capture(mp_state *st, replay_state *r, PyObject *tensors, int preserve_rng)
{
    PyObject *devices = NULL;
    PyObject *device_type = region_device_type(st, tensors, &devices);
    PyObject *device_module = NULL;
    int result = -1;
    if (device_type == NULL)
        return -1;
    if (capture_autocast(st, r, device_type) < 0 || capture_device_context(st, r) < 0)
        goto done;
    if (!preserve_rng) {
        result = 0;
        goto done;
    }
    r->cpu_rng = PyObject_CallNoArgs(st->cpu_rng_get);
    if (r->cpu_rng == NULL)
        goto done;
    device_module = device_module_for(st, device_type);
    r->device_was_initialized = device_initialized(st, device_module);
    if (r->device_was_initialized < 0)
        goto done;
    if (!r->device_was_initialized && device_module != NULL)
        r->uninitialized_module = Py_NewRef(device_module);
    if (r->device_was_initialized) {
        r->device_indices = distinct_indices(st, devices, device_type);
        if (r->device_indices == NULL)
            goto done;
        r->device_rngs = call_rng_getter(st, device_module, r->device_indices);
        if (r->device_rngs == NULL)
            goto done;
        r->device_module = Py_NewRef(device_module);
    }
    result = 0;
done:
    Py_XDECREF(device_module);
    Py_DECREF(device_type);
    Py_DECREF(devices);
    return result;
}

/* torch refuses a forward that initialized the accelerator of the region's
 * inputs while RNG state was to be preserved: its state could not have been
 * saved before. Only that accelerator: a region of CPU (or meta) inputs has
 * none to check, whatever else the process initialized. */
int
replay_check_forward(mp_state *st, replay_state *r, int preserve_rng)
{
    if (!preserve_rng || r->uninitialized_module == NULL)
        return 0;
    int now = device_initialized(st, r->uninitialized_module);
    Py_CLEAR(r->uninitialized_module);
    if (now < 0)
        return -1;
    if (now) {
        PyErr_SetString(PyExc_RuntimeError,
                        "matepoint.checkpoint: the device of the region's inputs was initialized "
                        "inside the checkpointed function, so its RNG state could not be saved "
                        "for the recomputation; initialize it (e.g. torch.cuda.init()) before the "
                        "first checkpoint or pass preserve_rng_state=False");
        return -1;
    }
    return 0;
}

static int
autocast_matches_now(mp_state *st, PyObject *entry, PyObject *cache)
{
    PyObject *now = autocast_entry(st, PyTuple_GET_ITEM(entry, 0));
    if (now == NULL)
        return -1;
    int same = PyObject_RichCompareBool(now, entry, Py_EQ);
    Py_DECREF(now);
    if (same != 1)
        return same;
    PyObject *cache_now = PyObject_CallNoArgs(st->autocast_cache_enabled);
    if (cache_now == NULL)
        return -1;
    same = cache_now == cache;
    Py_DECREF(cache_now);
    return same;
}

static int
enter_and_keep(mp_state *st, replay_undo *undo, PyObject *cm)
{
    if (context_enter(st, cm) < 0)
        return -1;
    if (PyList_Append(undo->contexts, cm) < 0) {
        context_exit(st, cm);
        return -1;
    }
    return 0;
}

static int
enter_autocast(mp_state *st, replay_state *r, replay_undo *undo)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(r->autocast); i++) {
        PyObject *entry = PyTuple_GET_ITEM(r->autocast, i);
        int same = autocast_matches_now(st, entry, r->autocast_cache);
        if (same < 0)
            return -1;
        if (same)
            continue;
        PyObject *kwargs = Py_BuildValue("{sOsOsO}", "enabled", PyTuple_GET_ITEM(entry, 1),
                                         "dtype", PyTuple_GET_ITEM(entry, 2), "cache_enabled",
                                         r->autocast_cache);
        PyObject *posargs = kwargs ? PyTuple_Pack(1, PyTuple_GET_ITEM(entry, 0)) : NULL;
        PyObject *cm = posargs ? PyObject_Call(st->autocast_type, posargs, kwargs) : NULL;
        Py_XDECREF(kwargs);
        Py_XDECREF(posargs);
        if (cm == NULL || enter_and_keep(st, undo, cm) < 0) {
            Py_XDECREF(cm);
            return -1;
        }
        Py_DECREF(cm);
    }
    return 0;
}

static int
restore_rng(mp_state *st, replay_state *r, PyObject *cpu_state, PyObject *device_states)
{
    if (cpu_state != NULL) {
        PyObject *done = PyObject_CallOneArg(st->cpu_rng_set, cpu_state);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
    }
    if (device_states != NULL &&
        call_rng_setter(st, r->device_module, r->device_indices, device_states) < 0)
        return -1;
    return 0;
}

int
replay_enter(mp_state *st, replay_state *r, PyObject *extra_context, replay_undo *undo)
{
    undo->cpu_rng = NULL;
    undo->device_rngs = NULL;
    undo->contexts = PyList_New(0);
    if (undo->contexts == NULL)
        return -1;
    if (r->cpu_rng != NULL) {
        undo->cpu_rng = PyObject_CallNoArgs(st->cpu_rng_get);
        if (undo->cpu_rng == NULL)
            goto error;
    }
    if (r->device_module != NULL) {
        undo->device_rngs = call_rng_getter(st, r->device_module, r->device_indices);
        if (undo->device_rngs == NULL)
            goto error;
    }
    if (restore_rng(st, r, r->cpu_rng, r->device_rngs) < 0)
        goto error;
    if (enter_autocast(st, r, undo) < 0)
        goto error;
    if (extra_context != NULL && enter_and_keep(st, undo, extra_context) < 0)
        goto error;
    if (r->device_context != NULL && enter_and_keep(st, undo, r->device_context) < 0)
        goto error;
    return 0;
error:
    replay_exit(st, r, undo);
    return -1;
}

int
replay_exit(mp_state *st, replay_state *r, replay_undo *undo)
{
    int result = 0;
    if (undo->contexts != NULL) {
        for (Py_ssize_t i = PyList_GET_SIZE(undo->contexts) - 1; i >= 0; i--) {
            if (context_exit(st, PyList_GET_ITEM(undo->contexts, i)) < 0)
                result = -1;
        }
    }
    /* restoring RNG must not lose an exception already in flight */
    PyObject *pending = mp_take_exception();
    if (restore_rng(st, r, undo->cpu_rng, undo->device_rngs) < 0) {
        result = -1;
        mp_chain_exception(pending);
    } else if (pending != NULL) {
        mp_restore_exception(pending);
    }
    Py_CLEAR(undo->cpu_rng);
    Py_CLEAR(undo->device_rngs);
    Py_CLEAR(undo->contexts);
    return result;
}

int
replay_traverse(replay_state *r, visitproc visit, void *arg)
{
    Py_VISIT(r->cpu_rng);
    Py_VISIT(r->device_module);
    Py_VISIT(r->uninitialized_module);
    Py_VISIT(r->device_indices);
    Py_VISIT(r->device_rngs);
    Py_VISIT(r->autocast);
    Py_VISIT(r->autocast_cache);
    Py_VISIT(r->device_context);
    return 0;
}

void
replay_clear(replay_state *r)
{
    Py_CLEAR(r->cpu_rng);
    Py_CLEAR(r->device_module);
    Py_CLEAR(r->uninitialized_module);
    Py_CLEAR(r->device_indices);
    Py_CLEAR(r->device_rngs);
    Py_CLEAR(r->autocast);
    Py_CLEAR(r->autocast_cache);
    Py_CLEAR(r->device_context);
}
