/* The allocator's shared library: the entry points torch's
 * CUDAPluggableAllocator calls, and the small C API matepoint._C reads
 * tags and statistics through.
 *
 * One allocator serves the process. It is created on first use under a
 * pthread_once and is thread-safe itself; the current tag is per thread.
 * MATEPOINT_ALLOC_BACKEND=host selects the host backend (tests). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* posix_memalign in alloc_host.h users */
#endif
#include "alloc.h"
#include "alloc_cuda.h"
#include "alloc_host.h"
#include "cuda/cudart.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))
#define HOST_DEVICES 8

/* Written once under `create_once`; the allocator locks itself. */
static allocator *instance;
static const cudart *runtime;
static alloc_host_ctx host_ctx;
static pthread_once_t create_once = PTHREAD_ONCE_INIT;

/* Tag of allocations made by this thread (checkpoint sets it). */
static _Thread_local uint64_t current_tag;

static void
create(void)
{
    const char *backend = getenv("MATEPOINT_ALLOC_BACKEND");
    if (backend != NULL && strcmp(backend, "host") == 0) {
        alloc_host_init(&host_ctx, 0);
        instance = alloc_create(alloc_host_backend(&host_ctx), HOST_DEVICES);
        return;
    }
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

static allocator *
get_allocator(void)
{
    pthread_once(&create_once, create);
    return instance;
}

/* torch does not check the pointer it gets back: returning NULL would
 * surface later as an illegal memory access far from its cause. Stop here
 * with the numbers instead. */
static void
out_of_memory(allocator *a, size_t size, int device)
{
    alloc_oom_info oom = a ? alloc_last_oom(a) : (alloc_oom_info){0};
    fprintf(stderr,
            "matepoint allocator: CUDA out of memory: could not allocate %zu bytes on device %d "
            "(matepoint reserved %llu bytes, %llu allocated). Reduce the batch or sequence "
            "size, checkpoint more blocks, or call matepoint.empty_cache().\n",
            size, device, (unsigned long long)oom.reserved, (unsigned long long)oom.allocated);
    fflush(stderr);
    abort();
}

EXPORT void *
matepoint_malloc(size_t size, int device, void *stream)
{
    allocator *a = get_allocator();
    void *ptr = a ? alloc_malloc(a, size, device, stream, current_tag) : NULL;
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
    if (a != NULL && alloc_record_stream(a, ptr, stream) < 0)
        fprintf(stderr, "matepoint allocator: record_stream on unknown pointer %p\n", ptr);
}

EXPORT void
matepoint_set_memory_fraction(double fraction, int device)
{
    allocator *a = get_allocator();
    size_t free_bytes = 0, total_bytes = 0;
    if (a == NULL || runtime == NULL || fraction <= 0.0 || fraction > 1.0)
        return;
    int previous = 0;
    if (runtime->get_device(&previous) != CUDART_SUCCESS || runtime->set_device(device) != CUDART_SUCCESS)
        return;
    int status = runtime->mem_get_info(&free_bytes, &total_bytes);
    (void)runtime->set_device(previous);
    if (status == CUDART_SUCCESS)
        alloc_set_limit(a, device, (uint64_t)(fraction * (double)total_bytes));
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
