/* matepoint._C: module definition, multi-phase init and module state. */
#include "base/alloc_link.h"
#include "checkpoint/bn_guard.h"
#include "checkpoint/checkpoint.h"
#include "base/compat.h"
#include "checkpoint/frame.h"
#include "checkpoint/recompute.h"
#include "offload/offload.h"
#include "options.h"
#include "plan.h"
#include "base/state.h"
#include "checkpoint/tree.h"
#include "checkpoint/unpack.h"

#ifdef MATEPOINT_TESTING
#include "testing/testing.h"
#define MATEPOINT_TEST_BUILD 1
#else
#define MATEPOINT_TEST_BUILD 0
#endif

#include <stddef.h>
#include <string.h>

static PyObject *
is_recomputing(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyBool_FromLong(recompute_in_progress());
}

static PyObject *
identity(PyObject *module, PyObject *obj)
{
    (void)module;
    return Py_NewRef(obj);
}

PyDoc_STRVAR(checkpoint_doc,
"checkpoint($module, function, /, *args, use_reentrant=None,\n"
"           preserve_rng_state=True, context_fn=None, determinism_check='default',\n"
"           debug=False, early_stop=True, matepoint_offload=None,\n"
"           matepoint_prefetch=True, respect_saved_tensors_hooks=None,\n"
"           **kwargs)\n"
"--\n\n"
"Run function(*args, **kwargs) without keeping its intermediate tensors.\n\n"
"A drop-in replacement for torch.utils.checkpoint.checkpoint with its\n"
"non-reentrant semantics: autograd keeps only the region's inputs, and the\n"
"region is recomputed in backward when its saved tensors are first needed.\n"
"Under torch.no_grad() it just calls function. Tensors may be nested in\n"
"lists, tuples, dicts and namedtuples; the output may have any structure.\n\n"
"function: any callable (a TypeError otherwise); args and the keywords not\n"
"    listed here are passed to it.\n"
"use_reentrant: accepted for drop-in compatibility. True still gives the\n"
"    non-reentrant behaviour (same gradients, keyword arguments and\n"
"    torch.autograd.grad work) and warns once per process.\n"
"preserve_rng_state: replay the CPU and CUDA random state of the forward in\n"
"    the recompute (dropout masks identical). False skips it.\n"
"context_fn: a callable returning two context managers, entered around the\n"
"    forward and around the recompute (as torch's). A selective policy's\n"
"    MUST/PREFER_CPU_OFFLOAD keeps that op's output on the host (offloaded).\n"
"determinism_check: 'default' compares the shape, dtype and device of each\n"
"    recomputed tensor with the forward's; 'none' skips it.\n"
"debug: True records the operations of both passes to explain a mismatch.\n"
"early_stop: stop the recompute once every saved tensor is recomputed.\n"
"matepoint_offload: True or False forces this region's inputs to be\n"
"    offloaded to host memory or not; None follows matepoint.options.\n"
"    Offload acts on CUDA tensors only: on a CPU-only machine it does nothing.\n"
"matepoint_prefetch: False stops this region's recompute from prefetching\n"
"    the inputs of earlier offloaded regions.\n"
"respect_saved_tensors_hooks: torch 2.14's: whether the tensors selective\n"
"    checkpointing keeps go through the saved-tensor hooks around the region\n"
"    (None: torch's default; True needs torch 2.14).\n\n"
"Returns what function returns. Raises TypeError for a non-callable function\n"
"or a context_fn giving no pair of context managers, ValueError for a bad\n"
"determinism_check or debug=True with a context_fn, RuntimeError in backward\n"
"for an input changed in place after the forward, CheckpointError when the\n"
"recompute differs from the forward; errors in function propagate unchanged.");

static PyObject *
pool_stats(PyObject *module, PyObject *unused)
{
    (void)unused;
    return offload_pool_stats(mp_state_of(module));
}

static PyObject *
offload_device_type_py(PyObject *module, PyObject *unused)
{
    (void)unused;
    return PyUnicode_FromString(offload_device_type(mp_state_of(module)));
}

static PyObject *
offload_left_on_device_py(PyObject *module, PyObject *args)
{
    PyObject *function, *tensors;
    if (!PyArg_ParseTuple(args, "OO:_offload_left_on_device", &function, &tensors))
        return NULL;
    return offload_left_on_device(mp_state_of(module), function, tensors);
}

static PyObject *
empty_pool(PyObject *module, PyObject *unused)
{
    (void)unused;
    if (offload_empty_pool(mp_state_of(module)) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* _reserve_pool(buffer_bytes, count) -> buffers added */
static PyObject *
reserve_pool(PyObject *module, PyObject *args)
{
    unsigned long long buffer_bytes, count;
    uint64_t added;
    if (!PyArg_ParseTuple(args, "KK:_reserve_pool", &buffer_bytes, &count))
        return NULL;
    if (offload_reserve_pool(mp_state_of(module), buffer_bytes, count, &added) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(added);
}

/* Docstrings of module_methods; the first line is each function's signature. */
PyDoc_STRVAR(reserve_pool_doc,
"_reserve_pool($module, buffer_bytes, count, /)\n--\n\nAdd count host pool buffers of buffer_bytes bytes; returns how many were added.\nmatepoint.reserve_pool is the checked public entry.");
PyDoc_STRVAR(pool_stats_doc,
"pool_stats($module, /)\n--\n\nCounters of the pinned host pool, as a dict.");
PyDoc_STRVAR(offload_left_on_device_doc,
"_offload_left_on_device($module, function, tensors, /)\n--\n\nPer tensor, True where an offload of checkpoint(function, *tensors) leaves it on\nthe device (the engine's own rule; the planner counts them as held).");
PyDoc_STRVAR(offload_device_type_doc,
"_offload_device_type($module, /)\n--\n\ntorch's device type of the tensors offload moves: 'cuda' ('cpu' on the simulated GPU of test builds).");
PyDoc_STRVAR(sac_offload_doc,
"_sac_offload($module, tensors, opens_region=False, /)\n--\n\nOffload a selectively checkpointed op's output tensors: (group, saved), or None when none moved. opens_region: the first outputs of their region.");
PyDoc_STRVAR(sac_restore_doc,
"_sac_restore($module, group, saved, /)\n--\n\nThe tensors _sac_offload moved, back on their device (None where one stayed).");
PyDoc_STRVAR(sac_prefetch_doc,
"_sac_prefetch($module, group, /)\n--\n\nStart copying back the tensors _sac_offload moved, ahead of _sac_restore.");
PyDoc_STRVAR(sac_discard_doc,
"_sac_discard($module, group, /)\n--\n\nDrop the device copies _sac_prefetch made that no _sac_restore took.");
PyDoc_STRVAR(set_sac_adapter_doc,
"_set_sac_adapter($module, adapter, /)\n--\n\nRegister adapter(forward_mode, recompute_mode, frame), called for each selectively checkpointed region before it runs (import matepoint registers it; checkpoint.h).");
PyDoc_STRVAR(empty_pool_doc,
"empty_pool($module, /)\n--\n\nFree cached, unused host pool buffers.");
PyDoc_STRVAR(configure_doc,
"_configure($module, /, **options)\n--\n\nCheck, then apply, the options given (names and ranges: OPTIONS); the others keep their values.");
PyDoc_STRVAR(check_option_doc,
"_check_option($module, name, value, /)\n--\n\nvalue when option name accepts it; else the TypeError or ValueError set_options raises.");
PyDoc_STRVAR(attach_allocator_doc,
"_attach_allocator($module, path, /)\n--\n\nLink to the allocator library at path, already loaded by torch.");
PyDoc_STRVAR(allocator_stats_doc,
"_allocator_stats($module, /)\n--\n\nPer device, the allocator's counters and its tags' rows (region, phase, bytes), as a list of dicts.");
PyDoc_STRVAR(allocator_reset_peaks_doc,
"_allocator_reset_peaks($module, /)\n--\n\nReset the allocator's peak counters on every device.");
PyDoc_STRVAR(allocator_empty_cache_doc,
"_allocator_empty_cache($module, /)\n--\n\nGive the allocator's cached, unused segments back to the device.");
PyDoc_STRVAR(plan_solve_doc,
"_plan_solve($module, blocks, budget_units, pipeline, /)\n--\n\nThe fastest plan within budget_units: (choices bytes, seconds, peak units), or None.\nblocks: one record per block, a dict keyed by PLAN_BLOCK_FIELDS and, per name of\nPLAN_POLICIES, a dict keyed by PLAN_POLICY_FIELDS.");
PyDoc_STRVAR(plan_evaluate_doc,
"_plan_evaluate($module, blocks, choices, pipeline, /)\n--\n\n(seconds, peak units) of the plan choices (bytes, indexes into PLAN_CHOICES).");
PyDoc_STRVAR(plan_min_budget_doc,
"_plan_min_budget($module, blocks, pipeline, /)\n--\n\nThe smallest budget in units that any plan of blocks fits in.");
PyDoc_STRVAR(plan_frontier_doc,
"_plan_frontier($module, blocks, pipeline, max_points, /)\n--\n\nUp to max_points (seconds, peak units) pairs, from the fastest plan to the smallest.");
PyDoc_STRVAR(is_recomputing_doc,
"is_recomputing($module, /)\n--\n\nTrue while this thread recomputes a checkpointed region.\n\nLets code inside a checkpointed function tell the recompute in backward\nfrom the forward pass (to skip logging or a side effect the second time).");

static PyMethodDef module_methods[] = {
    {"_reserve_pool", reserve_pool, METH_VARARGS, reserve_pool_doc},
    {"pool_stats", pool_stats, METH_NOARGS, pool_stats_doc},
    {"empty_pool", empty_pool, METH_NOARGS, empty_pool_doc},
    {"_offload_device_type", offload_device_type_py, METH_NOARGS, offload_device_type_doc},
    {"_offload_left_on_device", offload_left_on_device_py, METH_VARARGS,
     offload_left_on_device_doc},
    {"_sac_offload", offload_sac_save_py, METH_VARARGS, sac_offload_doc},
    {"_sac_restore", offload_sac_restore_py, METH_VARARGS, sac_restore_doc},
    {"_sac_prefetch", offload_sac_prefetch_py, METH_O, sac_prefetch_doc},
    {"_sac_discard", offload_sac_discard_py, METH_O, sac_discard_doc},
    {"_configure", (PyCFunction)(void (*)(void))options_configure_py,
     METH_VARARGS | METH_KEYWORDS, configure_doc},
    {"_check_option", (PyCFunction)(void (*)(void))options_check_py, METH_FASTCALL,
     check_option_doc},
    {"_attach_allocator", alloc_link_attach, METH_O, attach_allocator_doc},
    {"_allocator_stats", alloc_link_stats, METH_NOARGS, allocator_stats_doc},
    {"_allocator_reset_peaks", alloc_link_reset_peaks, METH_NOARGS, allocator_reset_peaks_doc},
    {"_allocator_empty_cache", alloc_link_empty_cache, METH_NOARGS, allocator_empty_cache_doc},
    {"_set_sac_adapter", checkpoint_set_sac_adapter, METH_O, set_sac_adapter_doc},
    {"checkpoint", (PyCFunction)(void (*)(void))checkpoint_call,
     METH_FASTCALL | METH_KEYWORDS, checkpoint_doc},
    {"_plan_solve", plan_solve_py, METH_VARARGS, plan_solve_doc},
    {"_plan_evaluate", plan_evaluate_py, METH_VARARGS, plan_evaluate_doc},
    {"_plan_evaluate_blocks", plan_evaluate_blocks_py, METH_VARARGS, PLAN_EVALUATE_BLOCKS_DOC},
    {"_plan_min_budget", plan_min_budget_py, METH_VARARGS, plan_min_budget_doc},
    {"_plan_frontier", plan_frontier_py, METH_VARARGS, plan_frontier_doc},
    {"is_recomputing", is_recomputing, METH_NOARGS, is_recomputing_doc},
    {NULL, NULL, 0, NULL},
};

/* Bound to the module at exec time and handed to torch as hooks. */
static PyMethodDef unpack_def = {"_unpack_hook", unpack_saved_tensor, METH_O, NULL};
static PyMethodDef offload_unpack_def = {"_offload_unpack", offload_unpack_hook, METH_O, NULL};
static PyMethodDef identity_def = {"_identity", identity, METH_O, NULL};
static PyMethodDef bn_guard_def = {"_batchnorm_guard",
                                   (PyCFunction)(void (*)(void))bn_guard_pre_hook,
                                   METH_FASTCALL, NULL};

static PyObject *
import_attr(const char *module_name, const char *dotted)
{
    PyObject *obj = PyImport_ImportModule(module_name);
    const char *name = dotted;
    while (obj != NULL && name != NULL) {
        const char *dot = strchr(name, '.');
        PyObject *part = dot ? PyUnicode_FromStringAndSize(name, dot - name)
                             : PyUnicode_FromString(name);
        PyObject *next = part ? PyObject_GetAttr(obj, part) : NULL;
        Py_XDECREF(part);
        Py_SETREF(obj, next);
        name = dot ? dot + 1 : NULL;
    }
    return obj;
}

/* Same, but a missing attribute (an older torch) gives NULL without error. */
static PyObject *
import_optional_attr(const char *module_name, const char *dotted)
{
    PyObject *obj = import_attr(module_name, dotted);
    if (obj == NULL && PyErr_ExceptionMatches(PyExc_AttributeError))
        PyErr_Clear();
    return obj;
}

struct torch_entry {
    size_t offset;
    const char *module;
    const char *attr;
    int optional;
};

#define ENTRY(field, mod, attr, optional) {offsetof(mp_state, field), mod, attr, optional}

static const struct torch_entry torch_entries[] = {
    ENTRY(torch_module, "torch", NULL, 0),
    ENTRY(tensor_type, "torch._C", "TensorBase", 0),
    ENTRY(parameter_type, "torch.nn", "Parameter", 0),
    ENTRY(is_grad_enabled, "torch._C", "is_grad_enabled", 0),
    ENTRY(set_grad_enabled, "torch._C", "_set_grad_enabled", 0),
    ENTRY(push_hooks, "torch._C._autograd", "_push_saved_tensors_default_hooks", 0),
    ENTRY(pop_hooks, "torch._C._autograd", "_pop_saved_tensors_default_hooks", 0),
    ENTRY(make_saved_tensor, "torch._C._autograd", "_make_saved_tensor", 1),
    ENTRY(graph_task_id, "torch._C", "_current_graph_task_id", 0),
    ENTRY(graph_exec_group, "torch._C", "_get_graph_exec_group", 1),
    ENTRY(function_mode_depth, "torch._C", "_len_torch_function_stack", 0),
    ENTRY(function_mode_stack, "torch.overrides", "_get_current_function_mode_stack", 0),
    ENTRY(device_context_type, "torch.utils._device", "DeviceContext", 0),
    ENTRY(cpu_rng_get, "torch", "default_generator.get_state", 0),
    ENTRY(cpu_rng_set, "torch", "default_generator.set_state", 0),
    ENTRY(autocast_type, "torch.amp", "autocast", 0),
    ENTRY(autocast_available, "torch.amp", "is_autocast_available", 0),
    ENTRY(autocast_enabled, "torch", "is_autocast_enabled", 0),
    ENTRY(autocast_dtype, "torch", "get_autocast_dtype", 0),
    ENTRY(autocast_cache_enabled, "torch", "is_autocast_cache_enabled", 0),
    ENTRY(default_device_type, "torch.utils.checkpoint", "DefaultDeviceType.get_device_type", 0),
    ENTRY(torch_checkpoint_dict, "torch.utils.checkpoint", "__dict__", 0),
    ENTRY(noop_context_fn, "torch.utils.checkpoint", "noop_context_fn", 0),
    ENTRY(debug_context_and_cb, "torch.utils.checkpoint", "_get_debug_context_and_cb", 0),
    ENTRY(checkpoint_error, "torch.utils.checkpoint", "CheckpointError", 0),
    ENTRY(batchnorm_type, "torch.nn.modules.batchnorm", "_BatchNorm", 0),
    ENTRY(disable_dispatch_modes, "torch.utils._python_dispatch", "_disable_current_modes", 0),
    ENTRY(register_pre_hook, "torch.nn.modules.module", "register_module_forward_pre_hook", 0),
    ENTRY(tensor_class, "torch", "Tensor", 0),
    ENTRY(module_type, "torch.nn", "Module", 0),
    ENTRY(method_type, "types", "MethodType", 0),
    ENTRY(top_hooks, "torch._C._autograd", "_top_saved_tensors_default_hooks", 0),
    ENTRY(current_raw_stream, "torch._C", "_cuda_getCurrentRawStream", 1),
    ENTRY(has_primary_context, "torch._C", "_cuda_hasPrimaryContext", 1),
    ENTRY(maybe_exchange_device, "torch._C", "_cuda_maybeExchangeDevice", 1),
    ENTRY(cuda_default_stream, "torch.cuda", "default_stream", 1),
    ENTRY(cuda_external_stream, "torch.cuda", "ExternalStream", 1),
    ENTRY(tensor_record_stream, "torch", "Tensor.record_stream", 1),
    ENTRY(torch_empty, "torch", "empty", 0),
    ENTRY(torch_empty_strided, "torch", "empty_strided", 0),
    ENTRY(uint8_dtype, "torch", "uint8", 0),
    ENTRY(current_user_hooks, "torch.utils.checkpoint", "_current_user_saved_tensors_hooks", 1),
    ENTRY(set_eval_frame, "torch._C", "_dynamo.eval_frame.set_eval_frame", 1),
    ENTRY(caching_mode_type, "torch.utils.checkpoint", "_CachingTorchDispatchMode", 1),
};

/* Looks every entry up; a missing required one fails the import. Returns
 * the optional ones this torch lacks, as a new tuple of "module.attr"
 * (_C.TORCH_MISSING: a test holds it to what each CI torch may lack, so a
 * rename in torch fails a test instead of quietly turning a feature off). */
static PyObject *
load_torch(mp_state *st)
{
    PyObject *missing = PyList_New(0);
    if (missing == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof(torch_entries) / sizeof(torch_entries[0]); i++) {
        const struct torch_entry *e = &torch_entries[i];
        PyObject **field = (PyObject **)((char *)st + e->offset);
        *field = e->attr == NULL ? PyImport_ImportModule(e->module)
                 : e->optional   ? import_optional_attr(e->module, e->attr)
                                 : import_attr(e->module, e->attr);
        if (*field == NULL && PyErr_Occurred())
            goto error;
        if (*field == NULL) {
            PyObject *name = PyUnicode_FromFormat("%s.%s", e->module, e->attr);
            int added = name != NULL ? PyList_Append(missing, name) : -1;
            Py_XDECREF(name);
            if (added < 0)
                goto error;
        }
    }
    Py_SETREF(missing, PyList_AsTuple(missing));
    return missing;
error:
    Py_DECREF(missing);
    return NULL;
}

static int
intern_names(mp_state *st)
{
    struct { PyObject **field; const char *text; } names[] = {
        {&st->str_shape, "shape"}, {&st->str_dtype, "dtype"}, {&st->str_device, "device"},
        {&st->str_type, "type"}, {&st->str_index, "index"}, {&st->str_detach, "detach"},
        {&st->str_unpack, "unpack"}, {&st->str_version, "_version"},
        {&st->str_enter, "__enter__"}, {&st->str_exit, "__exit__"},
        {&st->str_initialized, "_initialized"}, {&st->str_get_rng_state, "get_rng_state"},
        {&st->str_set_rng_state, "set_rng_state"}, {&st->str_training, "training"},
        {&st->str_track_running_stats, "track_running_stats"}, {&st->str_remove, "remove"},
        {&st->str_cpu, "cpu"}, {&st->str_fields, "_fields"},
        {&st->str_register_prehook, "register_prehook"},
        {&st->str_requires_grad, "requires_grad"},
        {&st->str_is_cpu, "is_cpu"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].field = PyUnicode_InternFromString(names[i].text);
        if (*names[i].field == NULL)
            return -1;
    }
    return 0;
}

static int
add_type(PyObject *module, PyType_Spec *spec, PyTypeObject **out)
{
    *out = (PyTypeObject *)PyType_FromModuleAndSpec(module, spec, NULL);
    return *out ? 0 : -1;
}

/* Adds `value` (a new reference, or NULL with an error set) as `name`. */
static int
add_new(PyObject *module, const char *name, PyObject *value)
{
    int status = value != NULL ? PyModule_AddObjectRef(module, name, value) : -1;
    Py_XDECREF(value);
    return status;
}

static int
module_exec(PyObject *module)
{
    mp_state *st = mp_state_of(module);
    if (add_new(module, "TORCH_MISSING", load_torch(st)) < 0 || intern_names(st) < 0)
        return -1;
    st->autocast_available_cache = PyDict_New();
    if (st->autocast_available_cache == NULL)
        return -1;
    if (add_type(module, &frame_spec, &st->frame_type) < 0 ||
        add_type(module, &holder_spec, &st->holder_type) < 0 ||
        add_type(module, &recompute_hook_spec, &st->recompute_hook_type) < 0 ||
        add_type(module, &tree_slot_spec, &st->slot_type) < 0 ||
        add_type(module, &tree_node_spec, &st->node_type) < 0 ||
        add_type(module, &storage_copy_spec, &st->storage_copy_type) < 0 ||
        add_type(module, &tensor_record_spec, &st->tensor_record_type) < 0 ||
        add_type(module, &offload_group_spec, &st->offload_group_type) < 0 ||
        add_type(module, &offload_packer_spec, &st->offload_packer_type) < 0)
        return -1;
    st->engine = offload_engine_new();
    if (st->engine == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    options_set_defaults(st);
    st->stop_recompute = PyErr_NewException("matepoint._C._StopRecomputation", NULL, NULL);
    st->unpack_hook = PyCFunction_NewEx(&unpack_def, module, NULL);
    st->identity = PyCFunction_NewEx(&identity_def, module, NULL);
    st->offload_unpack = PyCFunction_NewEx(&offload_unpack_def, module, NULL);
    st->bn_guard_hook = PyCFunction_NewEx(&bn_guard_def, module, NULL);
    if (st->stop_recompute == NULL || st->unpack_hook == NULL || st->identity == NULL ||
        st->bn_guard_hook == NULL || st->offload_unpack == NULL)
        return -1;
#ifdef MATEPOINT_TESTING
    if (testing_add_functions(module) < 0)
        return -1;
#endif
    if (PyModule_AddIntConstant(module, "TEST_BUILD", MATEPOINT_TEST_BUILD) < 0 ||
        options_add_table(module) < 0 || plan_add_constants(module) < 0 ||
        add_new(module, "CHECKPOINT_KEYWORDS", checkpoint_keywords()) < 0 ||
        add_new(module, "POOL_STATS_KEYS", offload_pool_stats_keys()) < 0 ||
        add_new(module, "ALLOCATOR_SYMBOLS", alloc_link_symbols()) < 0)
        return -1;
    return PyModule_AddIntConstant(module, "HAS_SAVED_TENSOR", st->make_saved_tensor != NULL);
}

/* Visits (or clears) every PyObject * field of the state. */
#define STATE_OBJECT_FIELDS(X)                                                                  \
    X(tensor_type) X(parameter_type) X(is_grad_enabled) X(set_grad_enabled) X(push_hooks)      \
    X(pop_hooks) X(make_saved_tensor) X(graph_task_id) X(graph_exec_group)                     \
    X(function_mode_depth) X(function_mode_stack) X(device_context_type) X(cpu_rng_get)        \
    X(cpu_rng_set) X(torch_module) X(autocast_type) X(autocast_available) X(autocast_enabled)   \
    X(autocast_dtype) X(autocast_cache_enabled) X(default_device_type)                         \
    X(torch_checkpoint_dict) X(noop_context_fn) X(debug_context_and_cb) X(checkpoint_error)    \
    X(batchnorm_type) X(disable_dispatch_modes) X(register_pre_hook)                           \
    X(autocast_available_cache) X(str_shape) X(str_dtype) X(str_device) X(str_type) X(str_index) X(str_detach) X(str_unpack)            \
    X(str_version) X(str_enter) X(str_exit) X(str_initialized) X(str_get_rng_state)            \
    X(str_set_rng_state) X(str_training) X(str_track_running_stats) X(str_remove) X(str_cpu)   \
    X(str_fields) X(str_register_prehook) X(stop_recompute) X(bn_guard_hook) X(identity)       \
    X(str_requires_grad) X(str_is_cpu)                                                         \
    X(unpack_hook) X(tensor_class) X(module_type) X(method_type) X(top_hooks)                  \
    X(current_raw_stream) X(torch_empty) X(torch_empty_strided) X(uint8_dtype) X(offload_unpack) \
    X(current_user_hooks) X(hooks_below) X(torch_keywords) X(has_primary_context)              \
    X(maybe_exchange_device)                                                                   \
    X(cuda_default_stream) X(cuda_external_stream) X(tensor_record_stream) X(set_eval_frame)   \
    X(caching_mode_type) X(sac_adapter)

#define STATE_TYPE_FIELDS(X) X(frame_type) X(holder_type) X(recompute_hook_type) X(slot_type) \
    X(node_type) X(storage_copy_type) X(tensor_record_type) X(offload_group_type)          \
    X(offload_packer_type)

static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    mp_state *st = mp_state_of(module);
    if (st == NULL)
        return 0;
#define VISIT(field) Py_VISIT(st->field);
    STATE_OBJECT_FIELDS(VISIT)
    STATE_TYPE_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int
module_clear(PyObject *module)
{
    mp_state *st = mp_state_of(module);
    if (st == NULL)
        return 0;
#define CLEAR(field) Py_CLEAR(st->field);
    STATE_OBJECT_FIELDS(CLEAR)
    STATE_TYPE_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void
module_free(void *module)
{
    mp_state *st = mp_state_of((PyObject *)module);
    if (st != NULL && st->engine != NULL) {
        offload_engine_free(st->engine);
        st->engine = NULL;
    }
    module_clear((PyObject *)module);
}

/* Declared for what is true of this module. One interpreter only: it keeps
 * Python objects in thread-locals (checkpoint/bn_guard.c) and a process-wide
 * CUDA runtime table, and torch, which it calls throughout, is single-phase.
 * The GIL is needed: all state is guarded by it (base/state.h). */
static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "matepoint._C",
    .m_doc = "C core of matepoint: checkpoint frames, saved-tensor hooks, recomputation.",
    .m_size = sizeof(mp_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__C(void)
{
    return PyModuleDef_Init(&module_def);
}
