/* The link from matepoint._C to the allocator's shared library, found only
 * once install_allocator() loaded it: tags for checkpointed regions and the
 * statistics. Without the link every call here is a no-op (or returns
 * "not installed"). The function pointers are set once, with the GIL. */
#ifndef MATEPOINT_BASE_ALLOC_LINK_H
#define MATEPOINT_BASE_ALLOC_LINK_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "alloc/alloc.h"

enum { TAG_OTHER = 0, TAG_FORWARD = 1, TAG_RECOMPUTE = 2 };

/* Tag of a checkpointed region in one phase. */
static inline uint64_t
alloc_region_tag(uint64_t region, int phase)
{
    return region << 2 | (uint64_t)phase;
}

typedef struct alloc_link {
    uint64_t (*set_tag)(uint64_t tag);
    int (*device_count)(void);
    int (*get_stats)(int device, alloc_stats *out);
    int (*get_tag_stats)(int device, alloc_tag_stats *out, int max);
    void (*reset_peaks)(void);
    void (*empty_cache)(void);
} alloc_link;

/* Sets this thread's allocation tag; returns the previous one. */
static inline uint64_t
alloc_link_tag(const alloc_link *link, uint64_t tag)
{
    return link->set_tag ? link->set_tag(tag) : 0;
}

PyObject *alloc_link_attach(PyObject *module, PyObject *path);
PyObject *alloc_link_stats(PyObject *module, PyObject *unused);
PyObject *alloc_link_reset_peaks(PyObject *module, PyObject *unused);
PyObject *alloc_link_empty_cache(PyObject *module, PyObject *unused);

#endif
