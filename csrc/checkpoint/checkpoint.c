#include "checkpoint.h"
#include "base/compat.h"
#include "frame.h"
#include "no_dynamo.h"
#include "saved_inputs.h"
#include "base/hooks.h"
#include "tree.h"

#include <stddef.h>

/* Keyword options of checkpoint(); everything else goes to the function. */
typedef struct {
    PyObject *use_reentrant;
    PyObject *preserve_rng_state;
    PyObject *context_fn;
    PyObject *determinism_check;
    PyObject *debug;
    PyObject *early_stop;
    PyObject *matepoint_offload;    /* matepoint's own: force offload of this region on/off */
    PyObject *matepoint_prefetch;   /* matepoint's own: may its recompute prefetch others */
    PyObject *respect_saved_tensors_hooks; /* torch 2.14: selective checkpointing and user hooks */
} checkpoint_options;

/* The one list of checkpoint()'s own keywords: the parser, _C.CHECKPOINT_KEYWORDS
 * (read by matepoint/_enable.py and _patch.py) and, by a test, the docstring. */
#define OPTION(field) {#field, offsetof(checkpoint_options, field)}
static const struct {
    const char *name;
    size_t offset;
} option_table[] = {
    OPTION(use_reentrant), OPTION(preserve_rng_state), OPTION(context_fn),
    OPTION(determinism_check), OPTION(debug), OPTION(early_stop), OPTION(matepoint_offload),
    OPTION(matepoint_prefetch), OPTION(respect_saved_tensors_hooks),
};
#undef OPTION
#define OPTION_COUNT (sizeof(option_table) / sizeof(option_table[0]))

static PyObject **
option_slot(checkpoint_options *opts, PyObject *name)
{
    for (size_t i = 0; i < OPTION_COUNT; i++) {
        if (PyUnicode_CompareWithASCIIString(name, option_table[i].name) == 0)
            return (PyObject **)((char *)opts + option_table[i].offset);
    }
    return NULL;
}

PyObject *
checkpoint_keywords(void)
{
    PyObject *names = PyFrozenSet_New(NULL);
    for (size_t i = 0; names != NULL && i < OPTION_COUNT; i++) {
        PyObject *name = PyUnicode_InternFromString(option_table[i].name);
        if (name == NULL || PySet_Add(names, name) < 0)
            Py_CLEAR(names);
        Py_XDECREF(name);
    }
    return names;
}

static Py_ssize_t
code_count(PyObject *code, const char *name)
{
    PyObject *value = PyObject_GetAttrString(code, name);
    Py_ssize_t count = value != NULL ? PyLong_AsSsize_t(value) : -1;
    Py_XDECREF(value);
    return count;
}

/* The keyword-only parameter names of `function`'s code, as a new set. */
static PyObject *
keyword_only_names(PyObject *function)
{
    PyObject *code = PyObject_GetAttrString(function, "__code__");
    if (code == NULL)
        return NULL;
    PyObject *names = NULL, *varnames = PyObject_GetAttrString(code, "co_varnames");
    Py_ssize_t first = code_count(code, "co_argcount");
    Py_ssize_t count = code_count(code, "co_kwonlyargcount");
    if (varnames == NULL || first < 0 || count < 0)
        goto done;
    if (!PyTuple_Check(varnames) || PyTuple_GET_SIZE(varnames) < first + count) {
        PyErr_SetString(PyExc_TypeError, "matepoint: unexpected code object of torch's checkpoint");
        goto done;
    }
    PyObject *slice = PyTuple_GetSlice(varnames, first, first + count);
    names = slice ? PyFrozenSet_New(slice) : NULL;
    Py_XDECREF(slice);
done:
    Py_XDECREF(varnames);
    Py_DECREF(code);
    return names;
}

/* The keyword-only parameters of the installed torch's checkpoint (borrowed,
 * computed once): torch binds them itself, so they are never the function's. */
static PyObject *
torch_keywords(mp_state *st)
{
    if (st->torch_keywords != NULL)
        return st->torch_keywords;
    PyObject *function = PyDict_GetItemString(st->torch_checkpoint_dict, "checkpoint");
    if (function == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "matepoint: torch.utils.checkpoint has no checkpoint");
        return NULL;
    }
    PyObject *wrapped = PyUnicode_InternFromString("__wrapped__");
    if (wrapped == NULL)
        return NULL;
    Py_INCREF(function);
    /* torch._disable_dynamo wraps it: the parameters are those of the wrapped
     * function (a bounded walk, in case a __wrapped__ chain loops) */
    PyObject *inner;
    int found = 0;
    for (int depth = 0; depth < 16 && (found = mp_optional_attr(function, wrapped, &inner)) == 1;
         depth++)
        Py_SETREF(function, inner);
    if (found >= 0)
        st->torch_keywords = keyword_only_names(function);
    Py_DECREF(function);
    Py_DECREF(wrapped);
    return st->torch_keywords;
}

/* A keyword torch's checkpoint takes but matepoint does not know (one a newer
 * torch added) must not silently become an argument of the user's function. */
static int
reject_torch_keywords(mp_state *st, PyObject *fn_kwargs)
{
    PyObject *known = torch_keywords(st);
    if (known == NULL)
        return -1;
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    while (PyDict_Next(fn_kwargs, &pos, &name, &value)) {
        int found = PySet_Contains(known, name);
        if (found < 0)
            return -1;
        if (found) {
            PyErr_Format(PyExc_TypeError,
                         "matepoint.checkpoint: %R is an option of the installed "
                         "torch.utils.checkpoint.checkpoint that this matepoint does not "
                         "support; it is not passed on to the checkpointed function. "
                         "Drop it, or upgrade matepoint",
                         name);
            return -1;
        }
    }
    return 0;
}

/* Splits keywords into checkpoint options (borrowed) and the function's
 * own keywords (a new dict, or NULL when there are none). */
static int
split_keywords(PyObject *const *values, PyObject *kwnames, checkpoint_options *opts,
               PyObject **fn_kwargs)
{
    *fn_kwargs = NULL;
    Py_ssize_t n = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        PyObject **slot = option_slot(opts, name);
        if (slot != NULL) {
            *slot = values[i];
            continue;
        }
        if (*fn_kwargs == NULL && (*fn_kwargs = PyDict_New()) == NULL)
            return -1;
        if (PyDict_SetItem(*fn_kwargs, name, values[i]) < 0) {
            Py_CLEAR(*fn_kwargs);
            return -1;
        }
    }
    return 0;
}

static int
truth(PyObject *value, int fallback)
{
    return value == NULL || value == Py_None ? fallback : PyObject_IsTrue(value);
}

/* matepoint's own switches: True, False (or 1, 0) or None for `fallback`.
 * Not truthiness: matepoint_offload="False" must not mean True. */
static int
flag(const char *name, PyObject *value, int fallback)
{
    if (value == NULL || value == Py_None)
        return fallback;
    if (PyBool_Check(value))
        return value == Py_True;
    if (PyLong_CheckExact(value)) {
        long number = PyLong_AsLong(value);
        if (number == 0 || number == 1)
            return (int)number;
        if (number == -1 && PyErr_Occurred())
            PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "matepoint.checkpoint: %s must be True, False or None, "
                     "got %R", name, value);
        return -1;
    }
    PyErr_Format(PyExc_TypeError, "matepoint.checkpoint: %s must be True, False or None, got %R",
                 name, value);
    return -1;
}

/* torch.utils.checkpoint's process-wide switches win over the arguments. */
static int
global_override(mp_state *st, const char *name, int value)
{
    PyObject *flag = PyDict_GetItemString(st->torch_checkpoint_dict, name);
    if (flag == NULL || flag == Py_None)
        return value;
    return PyObject_IsTrue(flag);
}

static int
warn_reentrant_once(mp_state *st, PyObject *use_reentrant)
{
    int reentrant = truth(use_reentrant, 0);
    if (reentrant <= 0 || st->warned_reentrant)
        return reentrant < 0 ? -1 : 0;
    st->warned_reentrant = 1;
    /* stacklevel 1 is the Python frame that called checkpoint (a C function has none) */
    return PyErr_WarnEx(PyExc_UserWarning,
                        "matepoint.checkpoint: use_reentrant=True is accepted for compatibility, "
                        "but matepoint always uses the non-reentrant implementation.",
                        1);
}

static int
parse_determinism(mp_state *st, PyObject *value)
{
    (void)st;
    if (value == NULL)
        return 1;
    if (PyUnicode_Check(value)) {
        if (PyUnicode_CompareWithASCIIString(value, "default") == 0)
            return 1;
        if (PyUnicode_CompareWithASCIIString(value, "none") == 0)
            return 0;
    }
    PyErr_Format(PyExc_ValueError,
                 "matepoint.checkpoint: determinism_check must be 'default' or 'none', got %R",
                 value);
    return -1;
}

/* The (forward, recompute) context managers and the debug error callback. */
static int
resolve_contexts(mp_state *st, checkpoint_options *opts, PyObject **forward,
                 PyObject **recompute, PyObject **error_cb)
{
    PyObject *context_fn = opts->context_fn;
    PyObject *made = NULL;
    *forward = *recompute = *error_cb = NULL;
    if (context_fn == Py_None || context_fn == st->noop_context_fn)
        context_fn = NULL;
    int debug = truth(opts->debug, 0);
    if (debug < 0)
        return -1;
    if (global_override(st, "_checkpoint_debug_enabled", debug)) {
        if (context_fn != NULL) {
            PyErr_SetString(PyExc_ValueError,
                            "matepoint.checkpoint: debug=True is incompatible with a context_fn");
            return -1;
        }
        PyObject *pair = PyObject_CallNoArgs(st->debug_context_and_cb);
        if (pair == NULL)
            return -1;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_RuntimeError, "matepoint: unexpected torch debug context");
            return -1;
        }
        context_fn = PyTuple_GET_ITEM(pair, 0);
        *error_cb = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
        made = PyObject_CallNoArgs(context_fn);
        Py_DECREF(pair);
    } else if (context_fn != NULL) {
        if (!PyCallable_Check(context_fn)) {
            PyObject *type_name = mp_type_name(context_fn);
            PyErr_Format(PyExc_TypeError,
                         "matepoint.checkpoint: context_fn must be callable, got %.100V",
                         type_name, "?");
            Py_XDECREF(type_name);
            return -1;
        }
        made = PyObject_CallNoArgs(context_fn);
    } else {
        return 0;
    }
    if (made == NULL)
        goto error;
    if (!PyTuple_Check(made) || PyTuple_GET_SIZE(made) != 2) {
        PyErr_SetString(PyExc_TypeError, "matepoint.checkpoint: context_fn must return a tuple "
                                         "of two context managers (forward, recompute)");
        goto error;
    }
    *forward = Py_NewRef(PyTuple_GET_ITEM(made, 0));
    *recompute = Py_NewRef(PyTuple_GET_ITEM(made, 1));
    Py_DECREF(made);
    return 0;
error:
    Py_XDECREF(made);
    Py_CLEAR(*error_cb);
    return -1;
}

static int
check_respect_hooks(PyObject *value)
{
    if (value == NULL || value == Py_None || PyBool_Check(value))
        return 0;
    PyErr_Format(PyExc_TypeError,
                 "matepoint.checkpoint: respect_saved_tensors_hooks must be None, True or False, "
                 "got %R",
                 value);
    return -1;
}

/* 1 if `forward` is torch's selective-checkpoint caching mode, 0 if not (or
 * this torch has none: _C.TORCH_MISSING says so), -1 on error. */
static int
is_selective(mp_state *st, PyObject *forward)
{
    if (forward == NULL || st->caching_mode_type == NULL)
        return 0;
    return PyObject_IsInstance(forward, st->caching_mode_type);
}

PyObject *
checkpoint_set_sac_adapter(PyObject *module, PyObject *adapter)
{
    if (!PyCallable_Check(adapter)) {
        PyObject *type_name = mp_type_name(adapter);
        PyErr_Format(PyExc_TypeError, "matepoint: _set_sac_adapter takes a callable, got %.100V",
                     type_name, "?");
        Py_XDECREF(type_name);
        return NULL;
    }
    mp_state *st = mp_state_of(module);
    Py_XSETREF(st->sac_adapter, Py_NewRef(adapter));
    Py_RETURN_NONE;
}

/* Selective checkpointing, adapted in Python (matepoint/_sac_offload.py):
 * torch's eager caching mode recomputes the ops an offload policy names, so
 * their outputs are kept on the host instead, through the offload engine,
 * and the recompute mode brings them back ahead of use; and the outputs of
 * ops the early-stopping recompute never reaches (run after the last tensor
 * the region saved) are let go when the forward ends. The adapter is the
 * callback the package registered at import: the C core never imports its
 * own package by name. */
static int
adapt_selective(mp_state *st, PyObject *forward, PyObject *recompute, Frame *frame)
{
    int selective = is_selective(st, forward);
    if (selective <= 0)
        return selective;
    if (st->sac_adapter == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "matepoint.checkpoint: selective checkpointing needs the adapter that "
                        "`import matepoint` registers (matepoint/_sac_offload.py), and none is "
                        "registered: was the import of matepoint interrupted?");
        return -1;
    }
    PyObject *args[3] = {forward, recompute ? recompute : Py_None, (PyObject *)frame};
    /* held across the call: the adapter may register another one */
    PyObject *adapter = Py_NewRef(st->sac_adapter);
    PyObject *done = PyObject_Vectorcall(adapter, args, 3, NULL);
    Py_DECREF(adapter);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* respect_saved_tensors_hooks, with torch 2.14's meaning: whether the tensors
 * selective checkpointing keeps go through the user's saved-tensor hooks
 * around the region. torch hands it to its caching mode (the forward context
 * of create_selective_checkpoint_contexts) by attribute, and so does this.
 * Without selective checkpointing it has nothing to act on. An older torch's
 * caching mode always bypasses the hooks, so True cannot be honoured there. */
static int
pass_respect_hooks(mp_state *st, PyObject *forward, PyObject *value)
{
    if (forward == NULL || value == NULL || value == Py_None)
        return 0;
    PyObject *name = PyUnicode_FromString("respect_saved_tensors_hooks");
    if (name == NULL)
        return -1;
    PyObject *current;
    int result = mp_optional_attr(forward, name, &current);
    if (result == 1) {
        Py_DECREF(current);
        result = PyObject_SetAttr(forward, name, value);
    } else if (result == 0 && value == Py_True) {
        int selective = is_selective(st, forward);
        result = selective;
        if (selective == 1) {
            PyErr_SetString(PyExc_ValueError,
                            "matepoint.checkpoint: respect_saved_tensors_hooks=True needs torch "
                            "2.14 or newer (this torch's selective checkpointing always bypasses "
                            "saved-tensor hooks)");
            result = -1;
        }
    }
    Py_DECREF(name);
    return result < 0 ? -1 : 0;
}

/* Records the region's inputs, RNG and autocast state in the frame. */
static int
frame_capture(Frame *frame, PyObject *args, PyObject *fn_kwargs, int preserve_rng,
              int offload_override)
{
    mp_state *st = frame->st;
    PyObject *tensors = PyList_New(0);
    if (tensors == NULL)
        return -1;
    int result = -1;
    frame->args_template = tree_flatten(st, args, tensors);
    if (frame->args_template == NULL)
        goto done;
    if (fn_kwargs != NULL) {
        frame->kwargs_template = tree_flatten(st, fn_kwargs, tensors);
        if (frame->kwargs_template == NULL)
            goto done;
    }
    if (replay_capture(st, &frame->replay, tensors, preserve_rng) < 0)
        goto done;
    result = saved_inputs_save(frame, tensors, offload_override);
done:
    Py_DECREF(tensors);
    return result;
}

/* Runs the function with the frame's hooks installed and `forward` entered. */
static PyObject *
run_forward(mp_state *st, Frame *frame, PyObject *forward, PyObject *args, PyObject *fn_kwargs)
{
    if (hooks_push(st, (PyObject *)frame, st->unpack_hook) < 0)
        return NULL;
    PyObject *out = NULL;
    if (forward == NULL || context_enter(st, forward) == 0) {
        out = call_without_dynamo(st, frame->function, args, fn_kwargs);
        if (forward != NULL) {
            int suppressed = context_exit(st, forward);
            if (suppressed != 0)
                Py_CLEAR(out);
            if (suppressed == 1) {
                PyErr_Clear();
                PyErr_SetString(PyExc_RuntimeError,
                                "matepoint.checkpoint: the forward context from context_fn "
                                "suppressed an exception raised by the checkpointed function; "
                                "checkpoint has no value to return for a failed forward");
            }
        }
    }
    if (hooks_pop(st) < 0)
        Py_CLEAR(out);
    return out;
}

static PyObject *
checkpointed_forward(mp_state *st, PyObject *module, PyObject *function, PyObject *args,
                     PyObject *fn_kwargs, checkpoint_options *opts)
{
    PyObject *forward = NULL, *out = NULL;
    int preserve_rng = truth(opts->preserve_rng_state, 1);
    int check_metadata = parse_determinism(st, opts->determinism_check);
    int early_stop = truth(opts->early_stop, 1);
    int prefetch_ahead = flag("matepoint_prefetch", opts->matepoint_prefetch, 1);
    int offload_override = flag("matepoint_offload", opts->matepoint_offload, -1);
    if (preserve_rng < 0 || check_metadata < 0 || early_stop < 0 || prefetch_ahead < 0 ||
        (offload_override == -1 && PyErr_Occurred()))
        return NULL;
    Frame *frame = frame_new(st, module, function);
    if (frame == NULL)
        return NULL;
    frame->check_metadata = (char)check_metadata;
    frame->prefetch_ahead = (char)prefetch_ahead;
    frame->early_stop = (char)global_override(st, "_enable_checkpoint_early_stop", early_stop);
    if (resolve_contexts(st, opts, &forward, &frame->recompute_context, &frame->error_cb) < 0 ||
        pass_respect_hooks(st, forward, opts->respect_saved_tensors_hooks) < 0 ||
        adapt_selective(st, forward, frame->recompute_context, frame) < 0 ||
        frame_capture(frame, args, fn_kwargs, preserve_rng, offload_override) < 0)
        goto done;
    uint64_t outer_tag = alloc_link_tag(&st->alloc, alloc_region_tag(frame->region_id, TAG_FORWARD));
    out = run_forward(st, frame, forward, args, fn_kwargs);
    alloc_link_tag(&st->alloc, outer_tag);
    if (out == NULL)
        goto done;
    frame->forward_completed = 1;
    if (saved_inputs_finish_forward(frame) < 0 ||
        replay_check_forward(st, &frame->replay, preserve_rng) < 0) {
        Py_CLEAR(out);
        goto done;
    }
    saved_inputs_drop_unneeded(frame);
done:
    Py_XDECREF(forward);
    Py_DECREF(frame);
    return out;
}

PyObject *
checkpoint_call(PyObject *module, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    mp_state *st = mp_state_of(module);
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    checkpoint_options opts = {0};
    PyObject *fn_kwargs = NULL, *fn_args = NULL, *out = NULL;
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError,
                        "matepoint.checkpoint() missing required argument 'function'");
        return NULL;
    }
    PyObject *function = args[0];
    if (!PyCallable_Check(function)) {
        PyObject *type_name = mp_type_name(function);
        PyErr_Format(PyExc_TypeError,
                     "matepoint.checkpoint: function must be callable, got %.100V",
                     type_name, "?");
        Py_XDECREF(type_name);
        return NULL;
    }
    if (split_keywords(args + nargs, kwnames, &opts, &fn_kwargs) < 0)
        return NULL;
    if (fn_kwargs != NULL && reject_torch_keywords(st, fn_kwargs) < 0)
        goto done;
    if (check_respect_hooks(opts.respect_saved_tensors_hooks) < 0)
        goto done;
    if (warn_reentrant_once(st, opts.use_reentrant) < 0)
        goto done;
    fn_args = PyTuple_New(nargs - 1);
    if (fn_args == NULL)
        goto done;
    for (Py_ssize_t i = 1; i < nargs; i++)
        PyTuple_SET_ITEM(fn_args, i - 1, Py_NewRef(args[i]));

    PyObject *grad = PyObject_CallNoArgs(st->is_grad_enabled);
    if (grad == NULL)
        goto done;
    Py_DECREF(grad);
    /* without grad nothing is saved, so there is nothing to recompute */
    if (grad == Py_False)
        out = call_without_dynamo(st, function, fn_args, fn_kwargs);
    else
        out = checkpointed_forward(st, module, function, fn_args, fn_kwargs, &opts);
done:
    Py_XDECREF(fn_args);
    Py_XDECREF(fn_kwargs);
    return out;
}
