/* Module state of matepoint._C: the torch objects the extension calls and
 * the types it defines.
 *
 * Ownership: every PyObject * here is a strong reference owned by the module
 * and released in module_clear(). The struct is reached through the module
 * object or through a type created by PyType_FromModuleAndSpec; nothing in it
 * is a process-wide static. All access happens with the GIL held. */
#ifndef MATEPOINT_BASE_STATE_H
#define MATEPOINT_BASE_STATE_H

#include "compat.h"
#include <stdint.h>

#include "alloc_link.h"

typedef struct mp_state {
    /* torch entry points, looked up once at import */
    PyObject *tensor_type;              /* torch._C.TensorBase */
    PyObject *parameter_type;           /* torch.nn.Parameter */
    PyObject *is_grad_enabled;          /* torch._C.is_grad_enabled */
    PyObject *set_grad_enabled;         /* torch._C._set_grad_enabled */
    PyObject *push_hooks;               /* torch._C._autograd._push_saved_tensors_default_hooks */
    PyObject *pop_hooks;                /* torch._C._autograd._pop_saved_tensors_default_hooks */
    PyObject *make_saved_tensor;        /* torch._C._autograd._make_saved_tensor, or NULL */
    PyObject *graph_task_id;            /* torch._C._current_graph_task_id */
    PyObject *graph_exec_group;         /* torch._C._get_graph_exec_group, or NULL */
    PyObject *function_mode_depth;      /* torch._C._len_torch_function_stack */
    PyObject *function_mode_stack;      /* torch.overrides._get_current_function_mode_stack */
    PyObject *device_context_type;      /* torch.utils._device.DeviceContext */
    PyObject *cpu_rng_get;              /* torch.default_generator.get_state */
    PyObject *cpu_rng_set;              /* torch.default_generator.set_state */
    PyObject *torch_module;             /* torch */
    PyObject *autocast_type;            /* torch.amp.autocast */
    PyObject *autocast_available;       /* torch.amp.is_autocast_available */
    PyObject *autocast_enabled;         /* torch.is_autocast_enabled */
    PyObject *autocast_dtype;           /* torch.get_autocast_dtype */
    PyObject *autocast_cache_enabled;   /* torch.is_autocast_cache_enabled */
    PyObject *default_device_type;      /* torch.utils.checkpoint.DefaultDeviceType.get_device_type */
    PyObject *torch_checkpoint_dict;    /* torch.utils.checkpoint.__dict__ (global switches) */
    PyObject *noop_context_fn;          /* torch.utils.checkpoint.noop_context_fn */
    PyObject *debug_context_and_cb;     /* torch.utils.checkpoint._get_debug_context_and_cb */
    PyObject *checkpoint_error;         /* torch.utils.checkpoint.CheckpointError */
    PyObject *batchnorm_type;           /* torch.nn.modules.batchnorm._BatchNorm */
    PyObject *disable_dispatch_modes;   /* torch.utils._python_dispatch._disable_current_modes */
    PyObject *register_pre_hook;        /* torch.nn.modules.module.register_module_forward_pre_hook */
    PyObject *autocast_available_cache; /* dict: device type str -> bool */
    PyObject *tensor_class;             /* torch.Tensor */
    PyObject *module_type;              /* torch.nn.Module */
    PyObject *method_type;              /* types.MethodType (no PyMethod_Check in the limited API) */
    PyObject *top_hooks;                /* torch._C._autograd._top_saved_tensors_default_hooks */
    PyObject *current_raw_stream;       /* torch._C._cuda_getCurrentRawStream, or NULL */
    /* the rest of torch's CUDA API the offload adapter calls (a test build
     * swaps in a stand-in: csrc/testing/testing_torch.c); NULL when absent */
    PyObject *has_primary_context;      /* torch._C._cuda_hasPrimaryContext, or NULL */
    PyObject *maybe_exchange_device;    /* torch._C._cuda_maybeExchangeDevice, or NULL */
    PyObject *cuda_default_stream;      /* torch.cuda.default_stream, or NULL */
    PyObject *cuda_external_stream;     /* torch.cuda.ExternalStream, or NULL */
    PyObject *tensor_record_stream;     /* torch.Tensor.record_stream, or NULL */
    PyObject *torch_empty;              /* torch.empty */
    PyObject *torch_empty_strided;      /* torch.empty_strided */
    PyObject *uint8_dtype;              /* torch.uint8 */
    PyObject *current_user_hooks;  /* torch.utils.checkpoint._current_user_saved_tensors_hooks,
                                      or NULL (torch before 2.14) */
    PyObject *hooks_below;         /* dict: our pack hook on the stack -> user hooks under it */
    PyObject *torch_keywords;      /* frozenset: keywords of torch's checkpoint, once needed */
    PyObject *set_eval_frame;      /* torch._C._dynamo.eval_frame.set_eval_frame, or NULL */
    PyObject *caching_mode_type;   /* torch.utils.checkpoint._CachingTorchDispatchMode, or NULL */
    PyObject *sac_adapter;         /* the selective-checkpoint adapter the package registered
                                      at import (checkpoint.h), or NULL */

    /* interned attribute names */
    PyObject *str_shape, *str_dtype, *str_device, *str_type, *str_index;
    PyObject *str_detach, *str_unpack, *str_version, *str_enter, *str_exit;
    PyObject *str_initialized, *str_get_rng_state, *str_set_rng_state;
    PyObject *str_training, *str_track_running_stats, *str_remove, *str_cpu;
    PyObject *str_fields, *str_register_prehook, *str_requires_grad, *str_is_cpu;

    /* types and objects defined here */
    PyTypeObject *frame_type;
    PyTypeObject *holder_type;
    PyTypeObject *recompute_hook_type;
    PyTypeObject *slot_type;
    PyTypeObject *node_type;
    PyTypeObject *storage_copy_type;
    PyTypeObject *tensor_record_type;
    PyTypeObject *offload_group_type;
    PyTypeObject *offload_packer_type;
    PyObject *stop_recompute;           /* private exception ending a recompute early */
    PyObject *bn_guard_hook;            /* C function registered while recomputing */
    PyObject *identity;                 /* unpack hook of the recompute pass */
    PyObject *unpack_hook;              /* unpack hook of the forward pass */
    PyObject *offload_unpack;           /* unpack hook of offloaded inputs */

    /* offload engine and its options (offload.h); owned, freed with the module */
    struct offload_engine *engine;

    /* allocator library entry points once attached (alloc_link.h) */
    struct alloc_link alloc;
    uint64_t next_region_id;            /* numbers checkpointed regions for tags */

    /* set once use_reentrant=True was warned about; GIL-protected */
    int warned_reentrant;
} mp_state;

/* The one way to the module state: from matepoint._C itself (the `module`
 * its functions and bound hooks receive), or from one of its types (whose
 * methods get no module), which leads to the same module. */
static inline mp_state *
mp_state_of(PyObject *module)
{
    return (mp_state *)PyModule_GetState(module);
}

/* The state of the module that defined `type`; `type` must be one of ours.
 * Inline here, beside mp_state_of: defined in module.c it was a call from
 * base/ up into module/ (tests/test_layout.py). */
static inline mp_state *
mp_state_from_type(PyTypeObject *type)
{
    return mp_state_of(PyType_GetModule(type));
}

#endif
