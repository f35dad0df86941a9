/* The Python objects of the offload path and who owns what.
 *
 * StorageCopy: one storage span staged in a pool buffer. It owns the pool
 *   block (released at dealloc, after any copy still reading or writing it
 *   has completed), the source storage while the device-to-host copy may
 *   still read it (offload_window.h says when that reference is dropped),
 *   and the device tensor the span was copied back into during a restore.
 * TensorRecord: one offloaded input: which copy holds its bytes and how to
 *   view them (dtype, size, stride, offset), plus what the in-place check
 *   needs. It is what autograd's SavedTensor packs.
 * OffloadGroup: the copies of one checkpointed region. The groups of a
 *   device form a list in creation order (borrowed links, unlinked at
 *   dealloc): backward walks it in reverse to prefetch.
 * OffloadPacker: the pack hook that hands prepared records to SavedTensor.
 *
 * All of them are GC-tracked heap types of the module; GIL held throughout. */
#ifndef MATEPOINT_OFFLOAD_OFFLOAD_TYPES_H
#define MATEPOINT_OFFLOAD_OFFLOAD_TYPES_H

#include "offload_engine.h"
#include "offload_inspect.h"

typedef struct OffloadGroup OffloadGroup;

typedef struct {
    PyObject_HEAD
    PyObject *module;           /* keeps the engine alive */
    offload_device *device;
    PyObject *device_obj;       /* torch.device */
    uint64_t nbytes;
    pool_block block;
    PyObject *source;           /* storage kept while the D2H may read it */
    void *producer;             /* stream current when the copy was queued */
    uint64_t region;            /* the device's region count then (offload_window.h) */
    void *d2h_done;             /* cudaEvent_t until seen complete, else NULL */
    int producer_waited;        /* the producer stream waits on d2h_done already */
    PyObject *fetched;          /* uint8 tensor holding the span again, or NULL */
    void *h2d_done;             /* the last copy back, until the copy goes */
    int h2d_awaited;            /* the compute stream waits on h2d_done already */
} StorageCopy;

typedef struct {
    PyObject_HEAD
    StorageCopy *copy;          /* NULL for a tensor with no elements */
    PyObject *group;
    PyObject *dtype, *size, *stride, *device_obj;
    int64_t offset;             /* elements from the start of the span */
    PyObject *wrapper_type;     /* a DTensor input: rebuilt from its type and spec */
    PyObject *wrapper_spec;
    /* in-place checks: torch skips its version check for hooked saved
     * tensors, so the record watches the input while it is alive */
    PyObject *weak_source;      /* weakref to the input */
    PyObject *version;          /* the input's version when it was saved */
    Py_ssize_t input_index;     /* position among the region's input tensors */
    int modified_in_forward;
    int requires_grad;          /* restored by hand when no SavedTensor does it */
} TensorRecord;

struct OffloadGroup {
    PyObject_HEAD
    PyObject *module;
    offload_device *device;
    PyObject *copies;           /* tuple of StorageCopy */
    OffloadGroup *prev, *next;
    int linked;
    unsigned long thread;       /* creator: backward order means nothing across threads */
};

typedef struct {
    PyObject_HEAD
    PyObject *records;
    Py_ssize_t next;
} OffloadPacker;

/* A copy of `nbytes` on `device` with no pool block yet. */
StorageCopy *storage_copy_new(mp_state *st, PyObject *module, offload_device *device,
                              PyObject *device_obj, uint64_t nbytes);
/* The record of input #input_index, described by `info`, whose bytes are
 * in copies[info->copy_index] (none for an empty tensor). */
TensorRecord *record_new(mp_state *st, input_info *info, PyObject *copies, PyObject *group,
                         PyObject *tensor, Py_ssize_t input_index);
/* A group over `copies` (a list), linked into its device's list. */
PyObject *group_new(mp_state *st, PyObject *module, PyObject *copies);
/* 1 when the record's input is alive with another version than saved,
 * 0 when not (or dead), -1 on error. */
int offload_source_changed(mp_state *st, TensorRecord *record);
/* A pack hook that returns records[0], records[1], ... in turn. */
PyObject *packer_new(mp_state *st, PyObject *records);

#endif
