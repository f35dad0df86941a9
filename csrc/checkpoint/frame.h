/* Checkpoint frames: the per-region record that lives as long as the autograd
 * graph of one checkpointed call.
 *
 * A Frame owns the region's function, its saved inputs and the replay state.
 * A Frame is itself the forward pack hook: each tensor autograd saves inside
 * the region becomes a Holder, and the module-level unpack hook (unpack.h)
 * recomputes the region (once per backward pass) and hands out the
 * recomputed tensor.
 * Holders keep their frame alive; the frame points back at live holders
 * without owning them, so a holder released by autograd frees its
 * recomputed tensor at once. The frame's inputs are kept by
 * saved_inputs.h, the recompute runs in recompute.c. All of it runs with
 * the GIL held. */
#ifndef MATEPOINT_CHECKPOINT_FRAME_H
#define MATEPOINT_CHECKPOINT_FRAME_H

#include "base/state.h"
#include "replay.h"

typedef struct Holder Holder;

typedef struct {
    PyObject_HEAD
    mp_state *st;               /* borrowed: `module` keeps it alive */
    PyObject *module;
    PyObject *function;
    PyObject *args_template;    /* tuple template (tree.h) */
    PyObject *kwargs_template;  /* dict template, or NULL */
    PyObject *saved;            /* list: SavedTensor, or tensor when torch lacks it */
    PyObject *versions;         /* input versions when torch lacks SavedTensor, else NULL */
    PyObject *offload_group;    /* the inputs this frame offloaded (offload.h), or NULL */
    PyObject *offload_records;  /* their records, or NULL */
    PyObject *recompute_context;
    PyObject *error_cb;         /* debug=True callback, or NULL */
    PyObject *recomputed_gids;  /* set of graph tasks already recomputed */
    replay_state replay;
    Holder **holders;           /* borrowed; a dead holder leaves NULL */
    Py_ssize_t n_holders, cap_holders;
    uint64_t region_id;         /* names the region's allocations (alloc_link.h) */
    char early_stop;
    char prefetch_ahead;        /* its recompute may prefetch earlier regions' inputs */
    char check_metadata;
    char forward_completed;
    char ignore_saved_mismatch;
} Frame;

struct Holder {
    PyObject_HEAD
    Frame *frame;               /* strong */
    Py_ssize_t index;
    PyObject *meta;             /* (shape, dtype, device) or NULL */
    PyObject *recomputed;       /* dict: graph task -> recomputed tensor */
};

extern PyType_Spec frame_spec;
extern PyType_Spec holder_spec;

/* A new frame of `function`, called through `module` (kept alive by the
 * frame): numbered for the allocator's tags, prefetching allowed, every
 * other field empty. NULL with an error set. */
Frame *frame_new(mp_state *st, PyObject *module, PyObject *function);
/* (shape, dtype, device) of a tensor, as the metadata check compares it. */
PyObject *frame_tensor_metadata(mp_state *st, PyObject *tensor);

#endif
