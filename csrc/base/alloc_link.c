#include "alloc_link.h"
#include "state.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

static const struct {
    const char *role;
    const char *name;
} symbols[ALLOC_SYM_COUNT] = {
    [ALLOC_SYM_MALLOC] = {"malloc", "matepoint_malloc"},
    [ALLOC_SYM_FREE] = {"free", "matepoint_free"},
    [ALLOC_SYM_INIT] = {"init", "matepoint_init"},
    [ALLOC_SYM_RESET] = {"reset", "matepoint_reset"},
    [ALLOC_SYM_RECORD_STREAM] = {"record_stream", "matepoint_record_stream"},
    [ALLOC_SYM_SET_MEMORY_FRACTION] = {"set_memory_fraction", "matepoint_set_memory_fraction"},
    [ALLOC_SYM_SET_OOM_HANDLER] = {"set_oom_handler", "matepoint_alloc_set_oom_handler"},
    [ALLOC_SYM_SET_TAG] = {"set_tag", "matepoint_alloc_set_tag"},
    [ALLOC_SYM_DEVICE_COUNT] = {"device_count", "matepoint_alloc_device_count"},
    [ALLOC_SYM_GET_STATS] = {"get_stats", "matepoint_alloc_get_stats"},
    [ALLOC_SYM_GET_TAG_STATS] = {"get_tag_stats", "matepoint_alloc_get_tag_stats"},
    [ALLOC_SYM_RESET_PEAKS] = {"reset_peaks", "matepoint_alloc_reset_peaks"},
    [ALLOC_SYM_BASE_ALLOCATION] = {"base_allocation", "matepoint_base_allocation"},
    [ALLOC_SYM_TORCH_BRIDGE] = {"torch_bridge", "matepoint_alloc_torch_bridge"},
};

PyObject *
alloc_link_symbols(void)
{
    PyObject *dict = PyDict_New();
    for (int i = 0; dict != NULL && i < ALLOC_SYM_COUNT; i++) {
        PyObject *name = PyUnicode_FromString(symbols[i].name);
        if (name == NULL || PyDict_SetItemString(dict, symbols[i].role, name) < 0)
            Py_CLEAR(dict);
        Py_XDECREF(name);
    }
    return dict;
}

static void *
find(void *handle, alloc_symbol symbol)
{
    return dlsym(handle, symbols[symbol].name);
}

static alloc_link *
link_of(PyObject *module)
{
    return &mp_state_of(module)->alloc;
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
        .set_tag = (uint64_t(*)(uint64_t))find(handle, ALLOC_SYM_SET_TAG),
        .device_count = (int (*)(void))find(handle, ALLOC_SYM_DEVICE_COUNT),
        .get_stats = (int (*)(int, alloc_stats *))find(handle, ALLOC_SYM_GET_STATS),
        .get_tag_stats = (int (*)(int, alloc_tag_stats *, int))find(handle,
                                                                    ALLOC_SYM_GET_TAG_STATS),
        .reset_peaks = (void (*)(void))find(handle, ALLOC_SYM_RESET_PEAKS),
        .empty_cache = (void (*)(void))find(handle, ALLOC_SYM_RESET),
    };
    const matepoint_torch_bridge *(*bridge)(void) =
        (const matepoint_torch_bridge *(*)(void))find(handle, ALLOC_SYM_TORCH_BRIDGE);
    found.bridge = bridge ? bridge() : NULL;
    if (!found.set_tag || !found.device_count || !found.get_stats || !found.get_tag_stats ||
        !found.reset_peaks || !found.empty_cache || found.bridge == NULL ||
        found.bridge->version != MATEPOINT_TORCH_BRIDGE_VERSION ||
        found.bridge->device_stats == NULL) {
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

static int
by_tag(const void *a, const void *b)
{
    uint64_t x = ((const alloc_tag_stats *)a)->tag, y = ((const alloc_tag_stats *)b)->tag;
    return (x > y) - (x < y);
}

/* One tag's row, its tag decoded into region and phase. */
static PyObject *
tag_row(const alloc_tag_stats *t)
{
    return Py_BuildValue("{sKsssKsKsK}", "region", (unsigned long long)alloc_tag_region(t->tag),
                         "phase", alloc_tag_phase(t->tag),
                         "live_bytes", (unsigned long long)t->live_bytes, "peak_bytes",
                         (unsigned long long)t->peak_bytes, "allocations",
                         (unsigned long long)t->allocations);
}

/* [{region, phase, live_bytes, peak_bytes, allocations}, ...] of one
 * device, by region then phase. */
static PyObject *
tag_list(const alloc_link *link, int device)
{
    int count = link->get_tag_stats(device, NULL, 0);
    alloc_tag_stats *tags = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(*tags));
    if (tags == NULL)
        return PyErr_NoMemory();
    count = link->get_tag_stats(device, tags, count);
    if (count > 0)
        qsort(tags, (size_t)count, sizeof(*tags), by_tag);
    PyObject *list = PyList_New(0);
    for (int i = 0; list != NULL && i < count; i++) {
        PyObject *row = tag_row(&tags[i]);
        if (row == NULL || PyList_Append(list, row) < 0)
            Py_CLEAR(list);
        Py_XDECREF(row);
    }
    PyMem_Free(tags);
    return list;
}

static int
set_figure(PyObject *dict, const char *key, int64_t value)
{
    PyObject *number = PyLong_FromLongLong(value);
    int result = number ? PyDict_SetItemString(dict, key, number) : -1;
    Py_XDECREF(number);
    return result;
}

/* torch's figures under torch.cuda.memory_stats()'s flat keys
 * ("allocated_bytes.all.current", "num_ooms", ...), named by alloc.h's
 * tables. */
static int
add_torch_figures(PyObject *dict, const alloc_device_stats *t)
{
    char key[96];
    for (int kind = 0; kind < ALLOC_STAT_ARRAYS; kind++) {
        for (int pool = 0; pool < ALLOC_POOLS; pool++) {
            for (int field = 0; field < ALLOC_STAT_FIELDS; field++) {
                snprintf(key, sizeof(key), "%s.%s.%s", alloc_stat_array_name(kind),
                         alloc_pool_name(pool), alloc_stat_field_name(field));
                if (set_figure(dict, key, alloc_stat_field(&t->arrays[kind][pool], field)) < 0)
                    return -1;
            }
        }
    }
    for (int field = 0; field < ALLOC_STAT_FIELDS; field++) {
        const char *name = alloc_stat_field_name(field);
        snprintf(key, sizeof(key), "oversize_allocations.%s", name);
        if (set_figure(dict, key, alloc_stat_field(&t->oversize_allocations, field)) < 0)
            return -1;
        snprintf(key, sizeof(key), "oversize_segments.%s", name);
        if (set_figure(dict, key, alloc_stat_field(&t->oversize_segments, field)) < 0)
            return -1;
    }
    if (set_figure(dict, "num_alloc_retries", t->num_alloc_retries) < 0 ||
        set_figure(dict, "num_ooms", t->num_ooms) < 0 ||
        set_figure(dict, "num_sync_all_streams", t->num_sync_all_streams) < 0 ||
        set_figure(dict, "num_device_alloc", t->num_device_alloc) < 0 ||
        set_figure(dict, "num_device_free", t->num_device_free) < 0 ||
        set_figure(dict, "max_split_size", t->max_split_size) < 0)
        return -1;
    return 0;
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
    alloc_device_stats figures;
    if (link->bridge->device_stats(device, &figures) < 0) {
        Py_DECREF(tags);
        PyErr_Format(PyExc_RuntimeError, "matepoint: the allocator has no device %d", device);
        return NULL;
    }
    PyObject *dict = Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsN}", "allocated_bytes", s.allocated_bytes,
        "peak_allocated_bytes", s.peak_allocated_bytes, "requested_bytes", s.requested_bytes,
        "reserved_bytes", s.reserved_bytes, "peak_reserved_bytes", s.peak_reserved_bytes,
        "mallocs", s.mallocs, "frees", s.frees, "cache_hits", s.cache_hits, "device_allocs",
        s.device_allocs, "device_frees", s.device_frees, "oom_retries", s.oom_retries, "ooms",
        s.ooms, "live_blocks", s.live_blocks, "tags", tags);
    if (dict != NULL && add_torch_figures(dict, &figures) < 0)
        Py_CLEAR(dict);
    return dict;
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
