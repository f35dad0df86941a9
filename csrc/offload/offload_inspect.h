/* Inspecting a checkpoint's input tensors before they are offloaded: which
 * ones are eligible, where their bytes live, and how inputs that share a
 * storage are grouped into one copied span.
 *
 * An eligible input is a plain strided torch.Tensor (no subclass, no
 * Parameter, no buffer of the checkpointed module, not sparse or nested)
 * of at least min_offload_bytes in a device's memory (as the offload
 * runtime tells: a CUDA tensor on a GPU), or a DTensor (not a parameter)
 * whose local tensor is one: the local tensor is copied, and the input
 * comes back as a DTensor of the same spec (mesh, placements, shape). Its
 * span is the
 * byte range of its storage that it reads: views, non-contiguous and
 * stride-0 tensors read less than their storage. input_info holds strong
 * references, released by input_info_clear. GIL held throughout. */
#ifndef MATEPOINT_OFFLOAD_OFFLOAD_INSPECT_H
#define MATEPOINT_OFFLOAD_OFFLOAD_INSPECT_H

#include "base/state.h"

/* copy_index values beside a real index into the list of copies */
#define UNPLANNED (-1)
#define STAYS (-2)      /* the pool had no memory: saved where it is */
#define NO_DATA (-3)    /* no elements: rebuilt empty */

/* What the offload path learns about one input tensor. */
typedef struct {
    PyObject *storage;          /* the input's untyped storage */
    PyObject *device_obj;
    PyObject *dtype, *size, *stride;
    int device_index;
    uintptr_t storage_ptr;
    uint64_t byte_offset, byte_extent;
    int64_t itemsize;
    Py_ssize_t copy_index;      /* into the copies list, or one of the values above */
    PyObject *wrapper_type;     /* a DTensor input: its type and spec, else NULL */
    PyObject *wrapper_spec;
} input_info;

void input_info_clear(input_info *info);

/* The buffers of `function` when it is a module (never offloaded), else
 * an empty list. */
PyObject *inspect_module_buffers(mp_state *st, PyObject *function);

/* Fills `info` for an input of `function` worth offloading: 1 if so, 0 if
 * it stays, -1 on error. *buffers caches the function's module buffers
 * (inspect_module_buffers), looked up once an input lives on a device; the
 * caller releases it. */
int inspect_input(mp_state *st, PyObject *function, PyObject *tensor, PyObject **buffers,
                  input_info *info);

/* Do two inspected inputs share one storage? */
int inspect_same_storage(const input_info *a, const input_info *b);

/* obj.method() or obj.name as a C integer (None reads as -1). */
int inspect_call_int64(PyObject *obj, const char *method, int64_t *out);
int inspect_attr_int64(PyObject *obj, const char *name, int64_t *out);

#endif
