/* The link from matepoint._C to the allocator's shared library, found only
 * once install_allocator() loaded it: tags for checkpointed regions and the
 * statistics. Without the link every call here is a no-op (or returns
 * "not installed"). The function pointers are set once, with the GIL. */
#ifndef MATEPOINT_BASE_ALLOC_LINK_H
#define MATEPOINT_BASE_ALLOC_LINK_H

#include "compat.h"

#include "alloc/alloc.h"
#include "alloc/torch_bridge.h"

/* The allocator library's entry points, by role. alloc_link.c holds their
 * one list of names; _C.ALLOCATOR_SYMBOLS gives it to matepoint/_allocator.py
 * (torch's CUDAPluggableAllocator and its hooks) and matepoint/_oom.py. */
typedef enum {
    ALLOC_SYM_MALLOC, ALLOC_SYM_FREE, ALLOC_SYM_INIT, ALLOC_SYM_RESET,
    ALLOC_SYM_RECORD_STREAM, ALLOC_SYM_SET_MEMORY_FRACTION, ALLOC_SYM_SET_OOM_HANDLER,
    ALLOC_SYM_SET_TAG, ALLOC_SYM_DEVICE_COUNT, ALLOC_SYM_GET_STATS, ALLOC_SYM_GET_TAG_STATS,
    ALLOC_SYM_RESET_PEAKS, ALLOC_SYM_BASE_ALLOCATION, ALLOC_SYM_TORCH_BRIDGE, ALLOC_SYM_COUNT
} alloc_symbol;

typedef struct alloc_link {
    uint64_t (*set_tag)(uint64_t tag);
    int (*device_count)(void);
    int (*get_stats)(int device, alloc_stats *out);
    int (*get_tag_stats)(int device, alloc_tag_stats *out, int max);
    void (*reset_peaks)(void);
    void (*empty_cache)(void);
    const matepoint_torch_bridge *bridge;   /* torch's figures (torch_bridge.h) */
} alloc_link;

/* Sets this thread's allocation tag; returns the previous one. */
static inline uint64_t
alloc_link_tag(const alloc_link *link, uint64_t tag)
{
    return link->set_tag ? link->set_tag(tag) : 0;
}

/* {role: symbol name} of every entry point, as a new dict. */
PyObject *alloc_link_symbols(void);
PyObject *alloc_link_attach(PyObject *module, PyObject *path);
PyObject *alloc_link_stats(PyObject *module, PyObject *unused);
PyObject *alloc_link_reset_peaks(PyObject *module, PyObject *unused);
PyObject *alloc_link_empty_cache(PyObject *module, PyObject *unused);

#endif
