#include "alloc_link.h"
#include "state.h"

#include <dlfcn.h>
#include <stdlib.h>

static alloc_link *
link_of(PyObject *module)
{
    return &((mp_state *)PyModule_GetState(module))->alloc;
}

PyObject *
alloc_link_attach(PyObject *module, PyObject *path_obj)
{
    alloc_link *link = link_of(module);
    PyObject *encoded = NULL;
    if (!PyUnicode_FSConverter(path_obj, &encoded))
        return NULL;
    /* the library is already loaded by torch: take that copy, never a second */
    void *handle = dlopen(PyBytes_AS_STRING(encoded), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(encoded);
    if (handle == NULL) {
        PyErr_Format(PyExc_RuntimeError, "matepoint: the allocator library is not loaded: %s",
                     dlerror());
        return NULL;
    }
    alloc_link found = {
        .set_tag = (uint64_t(*)(uint64_t))dlsym(handle, "matepoint_alloc_set_tag"),
        .device_count = (int (*)(void))dlsym(handle, "matepoint_alloc_device_count"),
        .get_stats = (int (*)(int, alloc_stats *))dlsym(handle, "matepoint_alloc_get_stats"),
        .get_tag_stats = (int (*)(int, alloc_tag_stats *, int))dlsym(
            handle, "matepoint_alloc_get_tag_stats"),
        .reset_peaks = (void (*)(void))dlsym(handle, "matepoint_alloc_reset_peaks"),
        .empty_cache = (void (*)(void))dlsym(handle, "matepoint_reset"),
    };
    if (!found.set_tag || !found.device_count || !found.get_stats || !found.get_tag_stats ||
        !found.reset_peaks || !found.empty_cache) {
        PyErr_SetString(PyExc_RuntimeError, "matepoint: the allocator library lacks its API");
        return NULL;
    }
    *link = found;
    Py_RETURN_NONE;
}

static int
require_link(const alloc_link *link)
{
    if (link->get_stats != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    "matepoint's allocator is not installed: call matepoint.install_allocator() "
                    "at program start, before the first CUDA allocation");
    return -1;
}

/* [(tag, live_bytes, peak_bytes, allocations), ...] of one device. */
static PyObject *
tag_list(const alloc_link *link, int device)
{
    int count = link->get_tag_stats(device, NULL, 0);
    alloc_tag_stats *tags = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(*tags));
    if (tags == NULL)
        return PyErr_NoMemory();
    count = link->get_tag_stats(device, tags, count);
    PyObject *list = PyList_New(0);
    for (int i = 0; list != NULL && i < count; i++) {
        PyObject *row = Py_BuildValue("(KKKK)", (unsigned long long)tags[i].tag,
                                      (unsigned long long)tags[i].live_bytes,
                                      (unsigned long long)tags[i].peak_bytes,
                                      (unsigned long long)tags[i].allocations);
        if (row == NULL || PyList_Append(list, row) < 0)
            Py_CLEAR(list);
        Py_XDECREF(row);
    }
    PyMem_Free(tags);
    return list;
}

static PyObject *
device_stats(const alloc_link *link, int device)
{
    alloc_stats s;
    if (link->get_stats(device, &s) < 0) {
        PyErr_SetString(PyExc_RuntimeError, "matepoint: the allocator could not start");
        return NULL;
    }
    PyObject *tags = tag_list(link, device);
    if (tags == NULL)
        return NULL;
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsN}", "allocated_bytes", s.allocated_bytes,
        "peak_allocated_bytes", s.peak_allocated_bytes, "requested_bytes", s.requested_bytes,
        "reserved_bytes", s.reserved_bytes, "peak_reserved_bytes", s.peak_reserved_bytes,
        "mallocs", s.mallocs, "frees", s.frees, "cache_hits", s.cache_hits, "device_allocs",
        s.device_allocs, "device_frees", s.device_frees, "oom_retries", s.oom_retries, "ooms",
        s.ooms, "live_blocks", s.live_blocks, "tags", tags);
}

PyObject *
alloc_link_stats(PyObject *module, PyObject *unused)
{
    (void)unused;
    alloc_link *link = link_of(module);
    if (require_link(link) < 0)
        return NULL;
    int devices = link->device_count();
    PyObject *result = PyList_New(0);
    for (int d = 0; result != NULL && d < devices; d++) {
        PyObject *one = device_stats(link, d);
        if (one == NULL || PyList_Append(result, one) < 0)
            Py_CLEAR(result);
        Py_XDECREF(one);
    }
    return result;
}

PyObject *
alloc_link_reset_peaks(PyObject *module, PyObject *unused)
{
    (void)unused;
    alloc_link *link = link_of(module);
    if (require_link(link) < 0)
        return NULL;
    link->reset_peaks();
    Py_RETURN_NONE;
}

PyObject *
alloc_link_empty_cache(PyObject *module, PyObject *unused)
{
    (void)unused;
    alloc_link *link = link_of(module);
    if (require_link(link) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    link->empty_cache();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
