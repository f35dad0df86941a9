/* The offload runtime over the simulated GPU (testing/cudart_sim.h).
 *
 * CPU tensors stand for device tensors. The device a tensor lives on is
 * the one whose simulated memory holds it: with matepoint's allocator
 * installed as torch's CPU allocator over the simulated GPU
 * (sim_runtime_attach_allocator), every tensor has one; without it, the
 * calling thread's current device. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dlopen flags */
#endif
#include "testing.h"
#include "testing/cudart_sim.h"
#include "offload/offload_internal.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef void (*handout_fn)(int device, void *stream, void *ptr, uint64_t bytes);

/* The allocator library's entry points, set once by
 * sim_runtime_attach_allocator with the GIL held and never changed. */
static void (*allocator_record_stream)(void *ptr, void *stream);

/* The engine's waits and records by call site (offload_sites.h): how many
 * each site issued since sim_runtime_drop_sites, and the sites whose calls
 * succeed and do nothing (bit `site` set). The engine calls the runtime
 * with the GIL held: the GIL guards this. */
static struct {
    uint64_t issued[OFFLOAD_SITE_COUNT];
    uint32_t dropped;
} sites;
_Static_assert(OFFLOAD_SITE_COUNT <= 32, "sites.dropped has a bit per site");

/* Copies back that find no device memory (sim_runtime_fail_fetches);
 * guarded by the GIL. */
static struct {
    uint64_t skip, count;
} failing_fetches;

static const cudart *
sim_load(void)
{
    return cudart_sim();
}

static int
storage_ptr(PyObject *storage, void **ptr)
{
    PyObject *value = PyObject_CallMethod(storage, "data_ptr", NULL);
    if (value == NULL)
        return -1;
    *ptr = PyLong_AsVoidPtr(value);
    Py_DECREF(value);
    return PyErr_Occurred() ? -1 : 0;
}

static int
sim_tensor_device(mp_state *st, PyObject *tensor, PyObject *device_obj, int *index)
{
    PyObject *type = PyObject_GetAttr(device_obj, st->str_type);
    if (type == NULL)
        return -1;
    int is_cpu = PyUnicode_Compare(type, st->str_cpu) == 0;
    Py_DECREF(type);
    if (!is_cpu)
        return 0;
    /* a sparse, mkldnn or nested tensor has no storage to ask about: the
     * engine leaves it where it is (offload_inspect.c), asking this first */
    int plain = inspect_is_strided(st, tensor);
    if (plain <= 0)
        return plain;
    PyObject *storage = PyObject_CallMethod(tensor, "untyped_storage", NULL);
    void *ptr = NULL;
    int failed = storage == NULL || storage_ptr(storage, &ptr) < 0;
    Py_XDECREF(storage);
    if (failed)
        return -1;
    int device = cudart_sim_device_of(ptr);
    *index = device >= 0 ? device : cudart_sim_current_device();
    return 1;
}

static int
sim_current_stream(mp_state *st, int device, void **stream)
{
    (void)st;
    *stream = cudart_sim_current_stream(device);
    return 0;
}

/* Counts a call of `site`: 1 when the test drops that site's calls. */
static int
site_dropped(offload_site site)
{
    MP_ASSERT(site >= 0 && site < OFFLOAD_SITE_COUNT);
    sites.issued[site]++;
    return (sites.dropped >> site) & 1u;
}

static int
sim_stream_wait_event(const cudart *rt, offload_site site, void *stream, void *event)
{
    if (site_dropped(site))
        return CUDART_SUCCESS;  /* dropped: the test proves this site is needed */
    return rt->stream_wait_event(stream, event, 0);
}

/* torch's adapter's record_stream, counted and dropped by site. */
static int
sim_torch_record_stream(mp_state *st, offload_site site, PyObject *storage, int device,
                        void *stream)
{
    if (site_dropped(site))
        return 0;
    return offload_torch_record_stream(st, site, storage, device, stream);
}

static int
sim_record_stream(mp_state *st, offload_site site, PyObject *storage, int device,
                  void *stream)
{
    (void)st;
    (void)device;
    void *ptr;
    if (site_dropped(site))
        return 0;
    if (allocator_record_stream == NULL)
        return 0;
    if (storage_ptr(storage, &ptr) < 0)
        return -1;
    allocator_record_stream(ptr, stream);
    return 0;
}

static int
sim_has_context(mp_state *st, int device)
{
    (void)st;
    return device >= 0 && device < CUDART_SIM_DEVICES &&
           cudart_sim_get_stats().has_context[device];
}

/* torch's own idea of the calling thread's current device where it
 * differs from CUDA's (c10::cuda's thread-local targetDeviceIndex, CUDA
 * 12 and later): -1, or the device a guard gave back without creating its
 * context, which torch then reports as current. Per thread, as torch's. */
static _Thread_local int torch_target_device = -1;

int
sim_runtime_maybe_exchange_device(int device)
{
    int current = cudart_sim_current_device();
    MP_ASSERT(device >= 0 && device < CUDART_SIM_DEVICES);
    if (device == current)
        return current;
    if (cudart_sim_get_stats().has_context[device])
        (void)cudart_sim_set_current_device(device);    /* a valid device: cannot fail */
    else
        torch_target_device = device;
    return current;
}

int
sim_runtime_torch_device(void)
{
    return torch_target_device >= 0 ? torch_target_device : cudart_sim_current_device();
}

int
sim_runtime_torch_set_device(int device)
{
    torch_target_device = -1;
    return cudart_sim_set_current_device(device);
}

static int
sim_keep_target_device(mp_state *st, int previous)
{
    (void)st;
    (void)sim_runtime_maybe_exchange_device(previous);
    return 0;
}

/* torch.empty on the CPU with `device` current, so the allocator harness
 * takes the memory from that device. */
static PyObject *
raise_out_of_memory(mp_state *st, uint64_t nbytes)
{
    PyObject *type = PyObject_GetAttrString(st->torch_module, "OutOfMemoryError");
    if (type != NULL)
        PyErr_Format(type, "simulated GPU: out of memory copying %llu bytes back",
                     (unsigned long long)nbytes);
    Py_XDECREF(type);
    return NULL;
}

static PyObject *
sim_empty_bytes(mp_state *st, int device, PyObject *device_obj, uint64_t nbytes)
{
    if (failing_fetches.skip > 0) {
        failing_fetches.skip--;
    } else if (failing_fetches.count > 0) {
        failing_fetches.count--;
        return raise_out_of_memory(st, nbytes);
    }
    int previous = cudart_sim_current_device();
    if (cudart_sim_set_current_device(device) != CUDART_SUCCESS)
        return PyErr_Format(PyExc_RuntimeError, "simulated GPU: no device %d", device);
    /* only the copy back fills it: its memory changes owner in stream
     * order, so a copy not ordered after the stream loses its data */
    cudart_sim_defer_handouts(1);
    PyObject *tensor = offload_runtime_torch.empty_bytes(st, device, device_obj, nbytes);
    cudart_sim_defer_handouts(0);
    (void)cudart_sim_set_current_device(previous);
    return tensor;
}

/* Every CPU tensor lives in the simulated GPU's memory. */
static int
sim_may_hold_tensors(mp_state *st)
{
    (void)st;
    return 1;
}

const offload_runtime offload_runtime_sim = {
    .name = "simulated",
    .device_type = "cpu",
    .load = sim_load,
    .may_hold_tensors = sim_may_hold_tensors,
    .tensor_device = sim_tensor_device,
    .current_stream = sim_current_stream,
    .record_stream = sim_record_stream,
    .stream_wait_event = sim_stream_wait_event,
    .has_context = sim_has_context,
    .keep_target_device = sim_keep_target_device,
    .empty_bytes = sim_empty_bytes,
};

/* torch's adapter (offload_runtime_torch.c) over the simulated GPU: what
 * only torch knows comes from torch's answers, through whatever stands in
 * the module state for torch.cuda (a test's stand-in in Python); the rest
 * as on the simulated GPU. */
const offload_runtime offload_runtime_torch_sim = {
    .name = "torch adapter over simulated",
    .device_type = "cpu",
    .load = sim_load,
    .may_hold_tensors = offload_torch_may_hold_tensors,
    .tensor_device = sim_tensor_device,
    .current_stream = offload_torch_current_stream,
    .record_stream = sim_torch_record_stream,
    .stream_wait_event = sim_stream_wait_event,
    .has_context = offload_torch_has_context,
    .keep_target_device = offload_torch_keep_target_device,
    .empty_bytes = sim_empty_bytes,
};

void
sim_runtime_fail_fetches(uint64_t skip, uint64_t count)
{
    failing_fetches.skip = skip;
    failing_fetches.count = count;
}

void
sim_runtime_drop_sites(uint32_t dropped)
{
    MP_ASSERT(dropped >> OFFLOAD_SITE_COUNT == 0);
    memset(sites.issued, 0, sizeof(sites.issued));
    sites.dropped = dropped;
}

uint32_t
sim_runtime_dropped_sites(void)
{
    return sites.dropped;
}

uint64_t
sim_runtime_failing_fetches(void)
{
    return failing_fetches.skip + failing_fetches.count;
}

uint64_t
sim_runtime_site_issued(offload_site site)
{
    MP_ASSERT(site >= 0 && site < OFFLOAD_SITE_COUNT);
    return sites.issued[site];
}

void
sim_runtime_where(int *device, void **stream)
{
    *device = cudart_sim_current_device();
    *stream = cudart_sim_current_stream(*device);
}

/* A block handed out is about to be used by a CPU kernel on `stream`: the
 * work queued there still touching it runs first (and nothing else: other
 * kernels keep lagging), then the block is filled with NaN bytes, so a
 * copy still reading or writing it is seen as wrong data. */
static void
handout(int device, void *stream, void *ptr, uint64_t bytes)
{
    int status = cudart_sim_handout(device, stream, ptr, bytes);
    if (status != CUDART_SUCCESS)
        fprintf(stderr, "simulated GPU: a kernel on device %d waits forever (%d)\n", device,
                status);
}

int
sim_runtime_attach_allocator(PyObject *path)
{
    const char *file = PyUnicode_AsUTF8(path);
    if (file == NULL)
        return -1;
    void *library = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    int (*use_runtime)(const cudart *, handout_fn) =
        library ? (int (*)(const cudart *, handout_fn))dlsym(library, "matepoint_alloc_use_runtime")
                : NULL;
    void (*record)(void *, void *) =
        library ? (void (*)(void *, void *))dlsym(library, "matepoint_record_stream") : NULL;
    if (use_runtime == NULL || record == NULL) {
        PyErr_Format(PyExc_RuntimeError, "matepoint: %s is not a test build of the allocator "
                     "library (%s)", file, library ? "no test entry point" : dlerror());
        return -1;
    }
    if (allocator_record_stream == NULL && use_runtime(cudart_sim(), handout) < 0) {
        PyErr_SetString(PyExc_RuntimeError, "matepoint: the allocator library was already in "
                        "use in this process; attach it to the simulated GPU first");
        return -1;
    }
    allocator_record_stream = record;
    return 0;
}
