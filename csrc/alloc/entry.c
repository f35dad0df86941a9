/* The allocator's shared library: the entry points torch's
 * CUDAPluggableAllocator calls, and the small C API matepoint._C reads
 * tags and statistics through.
 *
 * One allocator serves the process. It is created on first use under a
 * pthread_once and is thread-safe itself; the current tag is per thread.
 * In test builds (MATEPOINT_TESTING) MATEPOINT_ALLOC_BACKEND=host selects
 * the host backend, whose "device" holds MATEPOINT_ALLOC_HOST_CAPACITY bytes
 * (0 or unset: no cap); a plain build has no host backend.
 *
 * Out of memory (after the allocator released its cache and retried)
 * calls the handler install_allocator() registered, which throws torch's
 * c10::OutOfMemoryError (oom_raise.cpp): the exception unwinds through
 * matepoint_malloc, so this file is built with -fexceptions and holds no
 * lock or resource while calling it. Without a handler the process stops
 * with the same message, as returning NULL to torch would crash later. */
#include "alloc.h"
#include "alloc_cuda.h"
#include "entry.h"
#include "alloc_history.h"
#ifdef MATEPOINT_TESTING
#include "alloc_host.h"
#endif
#include "torch_bridge.h"
#include "cuda/cudart.h"
#include "cuda/cudart_util.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HOST_DEVICES 8

/* Written once under `create_once`; the allocator locks itself.
 * `published` is `instance` once made, for readers that must not make it
 * (making it asks CUDA for its devices, which initializes CUDA). */
static allocator *instance;
static _Atomic(allocator *) published;
static const cudart *runtime;
static pthread_once_t create_once = PTHREAD_ONCE_INIT;

/* The adapter's torch marks its captures (alloc_use_capture_marks): told
 * at install, before torch's first allocation, whether or not the
 * allocator is made yet. */
static _Atomic int capture_marks_wanted;

/* Tag of allocations made by this thread (checkpoint sets it). */
static _Thread_local uint64_t current_tag;

/* Set by install_allocator() before torch's first allocation, read by any
 * thread that runs out of memory; atomic, so no lock is needed. The error
 * handler (the C++ adapter's) raises the failures that are no lack of
 * memory as torch's RuntimeError. */
typedef void (*oom_handler)(const char *message);
static _Atomic(oom_handler) raise_oom;
static _Atomic(oom_handler) raise_error;

#ifdef MATEPOINT_TESTING
/* Test builds: the host backend's context (written once under
 * `create_once`, then atomic counters); a runtime table and a hand-out hook
 * given before first use (matepoint_alloc_use_runtime), read by create()
 * under `create_once`. */
static alloc_host_ctx host_ctx;
typedef void (*handout_fn)(int device, void *stream, void *ptr, uint64_t bytes);
static const cudart *test_runtime;
static handout_fn test_handout;
static _Atomic int created;

static void
test_on_handout(void *ctx, int device, void *stream, void *ptr, uint64_t bytes)
{
    (void)ctx;
    test_handout(device, stream, ptr, bytes);
}

/* The allocator runs its CUDA backend over `rt` (the simulated GPU), and
 * `handout` sees every block handed out. -1 once the allocator exists. */
EXPORT int
matepoint_alloc_use_runtime(const cudart *rt, handout_fn handout)
{
    if (atomic_load(&created))
        return -1;
    test_runtime = rt;
    test_handout = handout;
    return 0;
}

/* MATEPOINT_ALLOC_BACKEND=host: the host backend; 1 if chosen. */
static int
create_over_host(void)
{
    const char *backend = getenv("MATEPOINT_ALLOC_BACKEND");
    if (backend == NULL || strcmp(backend, "host") != 0)
        return 0;
    const char *capacity = getenv("MATEPOINT_ALLOC_HOST_CAPACITY");
    alloc_host_init(&host_ctx, capacity ? strtoull(capacity, NULL, 0) : 0);
    instance = alloc_create(alloc_host_backend(&host_ctx), HOST_DEVICES);
    return 1;
}

/* Free and total bytes of the host backend's "device". */
static void
host_memory(uint64_t *free_bytes, uint64_t *total_bytes)
{
    *total_bytes = host_ctx.capacity_bytes;
    *free_bytes = host_ctx.capacity_bytes - atomic_load(&host_ctx.live_bytes);
}

/* The allocator over a test backend (the simulated GPU's runtime, or the
 * host backend); 1 if one was chosen. */
static int
create_over_test_runtime(void)
{
    atomic_store(&created, 1);
    if (test_runtime == NULL)
        return create_over_host();
    runtime = test_runtime;
    alloc_backend backend = alloc_cuda_backend(runtime);
    backend.on_handout = test_on_handout;
    int count = 0;
    if (runtime->get_device_count(&count) != CUDART_SUCCESS || count <= 0)
        count = 1;
    instance = alloc_create(backend, count);
    return 1;
}
#else
static int
create_over_test_runtime(void)
{
    return 0;
}

static void
host_memory(uint64_t *free_bytes, uint64_t *total_bytes)
{
    *free_bytes = *total_bytes = 0;
}
#endif

static void
create(void)
{
    if (create_over_test_runtime())
        return;
    runtime = cudart_load();
    if (runtime == NULL) {
        fprintf(stderr, "matepoint allocator: %s\n", cudart_error());
        return;
    }
    int count = 0;
    if (runtime->get_device_count(&count) != CUDART_SUCCESS || count <= 0)
        count = 1;
    instance = alloc_create(alloc_cuda_backend(runtime), count);
}

/* Both sides publish first, then look (sequentially consistent): of a
 * creation and a late use_capture_marks, one sees the other. */
static void
create_and_publish(void)
{
    create();
    atomic_store(&published, instance);
    if (instance != NULL && atomic_load(&capture_marks_wanted))
        alloc_use_capture_marks(instance);
}

static allocator *
get_allocator(void)
{
    pthread_once(&create_once, create_and_publish);
    return instance;
}

void
entry_use_capture_marks(void)
{
    atomic_store(&capture_marks_wanted, 1);
    allocator *a = atomic_load(&published);
    if (a != NULL)
        alloc_use_capture_marks(a);
}

allocator *
entry_allocator(void)
{
    return get_allocator();
}

/* Free and total bytes of `device` as the backend sees them; 0 if unknown. */
static void
device_memory(int device, uint64_t *free_bytes, uint64_t *total_bytes)
{
    *free_bytes = *total_bytes = 0;
    if (runtime == NULL) {
        host_memory(free_bytes, total_bytes);
        return;
    }
    int previous;
    const char *failed;
    size_t free_now = 0, total = 0;
    if (cudart_enter_device(runtime, device, &previous, &failed) != CUDART_SUCCESS) {
        (void)runtime->get_last_error();    /* the numbers are only left out of a message */
        return;
    }
    if (runtime->mem_get_info(&free_now, &total) == CUDART_SUCCESS) {
        *free_bytes = free_now;
        *total_bytes = total;
    } else {
        (void)runtime->get_last_error();
    }
    cudart_leave_device(runtime, device, previous);
}

/* "1.50 GiB" and the like, as torch writes sizes. */
static void
format_bytes(char *out, size_t n, uint64_t bytes)
{
    static const char *const units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
    double value = (double)bytes;
    int unit = 0;
    while (value >= 1024.0 && unit < 4) {
        value /= 1024.0;
        unit++;
    }
    snprintf(out, n, unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
}

static void
oom_message(char *out, size_t n, allocator *a, size_t size, int device)
{
    alloc_oom_info oom = a ? alloc_last_oom(a) : (alloc_oom_info){0};
    uint64_t free_bytes, total_bytes;
    char request[32], allocated[32], reserved[32], free_text[32], total[32], cap[96] = "";
    device_memory(device, &free_bytes, &total_bytes);
    format_bytes(request, sizeof(request), size);
    format_bytes(allocated, sizeof(allocated), oom.allocated);
    format_bytes(reserved, sizeof(reserved), oom.reserved);
    format_bytes(free_text, sizeof(free_text), free_bytes);
    format_bytes(total, sizeof(total), total_bytes);
    if (oom.limit != UINT64_MAX) {
        char limit[32];
        format_bytes(limit, sizeof(limit), oom.limit);
        snprintf(cap, sizeof(cap), " (capped at %s by the memory fraction)", limit);
    }
    snprintf(out, n,
             "CUDA out of memory. Tried to allocate %s. GPU %d has a total capacity of %s of "
             "which %s is free. matepoint's allocator holds %s allocated and %s reserved%s. "
             "Free tensors or call matepoint.empty_cache(), reduce the batch or sequence, or "
             "checkpoint (and offload) more blocks.",
             request, device, total, free_text, allocated, reserved, cap);
}

/* torch does not check the pointer it gets back: returning NULL would
 * surface later as an illegal memory access far from its cause. Raises
 * torch's exception through the handler (the one exception this library
 * can throw), or stops here with the message. */
static void
give_up(const char *message)
{
    oom_handler handler = atomic_load(&raise_oom);
    if (handler != NULL)
        handler(message);  /* throws through this frame; does not return */
    fprintf(stderr, "matepoint allocator: %s\n", message);
    fflush(stderr);
    abort();
}

/* A request refused for another reason than memory (a capture no pool
 * takes, a CUDA error): raised as torch's RuntimeError where the adapter
 * set its handler, for code that retries smaller on torch.OutOfMemoryError
 * would misread it; else as give_up does. */
static void
refuse(const char *message)
{
    oom_handler handler = atomic_load(&raise_error);
    if (handler != NULL)
        handler(message);  /* throws through this frame; does not return */
    give_up(message);
}

void
entry_set_error_handler(void (*handler)(const char *message))
{
    atomic_store(&raise_error, handler);
}

/* torch's out-of-memory observers, through the adapter's trampoline:
 * written by set_oom_observer, read by any thread that runs out of memory
 * (copied under the lock, called after it). */
static pthread_mutex_t observer_lock = PTHREAD_MUTEX_INITIALIZER;
static matepoint_oom_observer oom_observer;
static void *oom_observer_ctx;

void
entry_set_oom_observer(matepoint_oom_observer observer, void *ctx)
{
    pthread_mutex_lock(&observer_lock);
    oom_observer = observer;
    oom_observer_ctx = ctx;
    pthread_mutex_unlock(&observer_lock);
}

/* Tells the observer, as torch's allocator does before it throws. */
static void
notify_oom(allocator *a, int device)
{
    pthread_mutex_lock(&observer_lock);
    matepoint_oom_observer observer = oom_observer;
    void *ctx = oom_observer_ctx;
    pthread_mutex_unlock(&observer_lock);
    if (observer == NULL)
        return;
    uint64_t free_bytes, total_bytes;
    alloc_oom_info oom = a ? alloc_last_oom(a) : (alloc_oom_info){.limit = UINT64_MAX};
    device_memory(device, &free_bytes, &total_bytes);
    observer(ctx, device, oom.segment_bytes, oom.limit != UINT64_MAX ? oom.limit : total_bytes,
             free_bytes);
}

static void
out_of_memory(allocator *a, size_t size, int device)
{
    char message[512];
    oom_message(message, sizeof(message), a, size, device);
    notify_oom(a, device);
    give_up(message);
}

/* A CUDA failure other than out of memory (`failure`, its text) left the
 * request with nothing: said as such, not as out of memory. */
static void
cuda_failure(size_t size, int device, const char *failure)
{
    char message[512];
    snprintf(message, sizeof(message),
             "matepoint's allocator could not allocate %zu bytes on GPU %d: %s. This is a CUDA "
             "error, not out of memory: CUDA errors of a failed kernel are sticky, every later "
             "call fails with them (CUDA_LAUNCH_BLOCKING=1 shows which kernel failed).",
             size, device, failure);
    refuse(message);
}

/* An allocation during a CUDA graph capture that no private pool takes.
 * torch gives a graph its pool through hooks C cannot set (std::function):
 * the C++ adapter install_allocator() builds sets them (alloc_begin_pool).
 * Without a pool, memory handed out now would go to other tensors once
 * freed while the replayed graph still writes it, and the event queries,
 * cudaMalloc and cudaFree the allocator may make invalidate a capture in
 * CUDA's global mode. Refused, through the same handler as out of memory
 * (the one exception this library can throw). */
static void
refuse_capture(size_t size, int device)
{
    char message[768];
    snprintf(message, sizeof(message),
             "matepoint's allocator cannot allocate during this CUDA graph capture (asked for "
             "%zu bytes on GPU %d): no private memory pool takes the capturing stream, so the "
             "memory could be handed to other tensors while the graph still uses it. "
             "torch.cuda.graph, make_graphed_callables and torch.compile's cudagraphs give it "
             "one through the C++ adapter matepoint.install_allocator() builds (it warned if "
             "it could not); a capture begun otherwise (cudaStreamBeginCapture directly) gets "
             "none: capture it in a process without matepoint.install_allocator().",
             size, device);
    refuse(message);
}

/* Zero bytes get NULL and count nothing, as from torch's allocator
 * (whose allocate() asks its device allocator for nothing then): torch
 * and its CUDA graph trees take a null data pointer for "no memory". */
EXPORT void *
matepoint_malloc(size_t size, int device, void *stream)
{
    if (size == 0)
        return NULL;
    allocator *a = get_allocator();
    /* `stream` is of the current device (`device`, as torch calls); a
     * failure to ask is taken as no. A graph's pool (begun before its
     * capture) takes its stream's requests. */
    if (runtime != NULL && cudart_stream_capturing(runtime, stream) > 0 &&
        (a == NULL || !alloc_pool_takes(a, device, stream)))
        refuse_capture(size, device);
    alloc_cuda_forget_failure();
    /* a CUDA error of the request itself, not one reported on the way (an
     * earlier free's event record tried again): that request may still be
     * out of memory */
    int why = ALLOC_OUT_OF_MEMORY;
    void *ptr = a ? alloc_malloc_why(a, size, device, stream, current_tag, &why) : NULL;
    if (ptr == NULL && why == ALLOC_ERROR) {
        const char *failure = alloc_cuda_failure();
        cuda_failure(size, device, failure[0] != '\0' ? failure : "its backend failed");
    }
    if (ptr == NULL)
        out_of_memory(a, size, device);
    return ptr;
}

EXPORT void
matepoint_free(void *ptr, size_t size, int device, void *stream)
{
    (void)size;
    (void)stream;
    allocator *a = get_allocator();
    if (ptr == NULL)
        return;     /* zero bytes (matepoint_malloc) */
    if (a != NULL && alloc_free(a, ptr, device) < 0)
        fprintf(stderr, "matepoint allocator: free of %p on device %d, which it did not "
                        "allocate (ignored)\n", ptr, device);
}

EXPORT void
matepoint_init(int device_count)
{
    (void)device_count;
    (void)get_allocator();
}

EXPORT void
matepoint_reset(void)
{
    allocator *a = get_allocator();
    if (a != NULL)
        alloc_empty_cache(a);
}

EXPORT void
matepoint_record_stream(void *ptr, void *stream)
{
    allocator *a = get_allocator();
    /* memory this allocator did not hand out (a tensor from DLPack or
     * another process) is skipped without a word, as torch's caching
     * allocator skips it: whoever allocated it orders its reuse */
    if (a != NULL && alloc_record_stream(a, ptr, stream) < 0)
        fprintf(stderr, "matepoint allocator: out of host memory recording a stream on %p\n",
                ptr);
}

/* torch.cuda.set_per_process_memory_fraction: caps what the allocator
 * reserves on `device` at that fraction of its total memory (0.0: at
 * nothing). torch's hook cannot fail: a fraction outside [0, 1] (NaN
 * too) or a device the allocator does not serve changes nothing (the
 * adapter refuses them first, with an error naming them). */
EXPORT void
matepoint_set_memory_fraction(double fraction, int device)
{
    allocator *a = get_allocator();
    uint64_t free_bytes, total_bytes;
    if (a == NULL)
        return;
    device_memory(device, &free_bytes, &total_bytes);
    (void)alloc_set_fraction(a, device, fraction, total_bytes);
}

double
entry_memory_fraction(int device)
{
    allocator *a = get_allocator();
    return a ? alloc_fraction(a, device) : -1.0;
}

/* install_allocator(): the function that raises torch.OutOfMemoryError. */
EXPORT void
matepoint_alloc_set_oom_handler(oom_handler handler)
{
    atomic_store(&raise_oom, handler);
}

/* ---- C API for matepoint._C ----------------------------------------------- */

EXPORT uint64_t
matepoint_alloc_set_tag(uint64_t tag)
{
    uint64_t previous = current_tag;
    current_tag = tag;
    return previous;
}

EXPORT int
matepoint_alloc_device_count(void)
{
    allocator *a = get_allocator();
    int count = 0;
    if (a == NULL)
        return 0;
    if (runtime != NULL && runtime->get_device_count(&count) == CUDART_SUCCESS && count > 0)
        return count;
    return runtime != NULL ? 1 : HOST_DEVICES;
}

EXPORT int
matepoint_alloc_get_stats(int device, alloc_stats *out)
{
    allocator *a = get_allocator();
    if (a == NULL)
        return -1;
    *out = alloc_get_stats(a, device);
    return 0;
}

EXPORT int
matepoint_alloc_get_tag_stats(int device, alloc_tag_stats *out, int max)
{
    allocator *a = get_allocator();
    return a ? alloc_get_tag_stats(a, device, out, max) : 0;
}

EXPORT void
matepoint_alloc_reset_peaks(void)
{
    allocator *a = get_allocator();
    if (a != NULL)
        alloc_reset_peaks(a);
}

/* The C++ adapter's table (torch_bridge.h, made in entry_bridge.c). */
EXPORT const matepoint_torch_bridge *
matepoint_alloc_torch_bridge(void)
{
    return entry_bridge();
}
