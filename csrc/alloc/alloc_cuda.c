#include "alloc_cuda.h"
#include "cuda/cudart.h"

#include <stdio.h>

/* A CUDA failure the allocator goes on from: reported where it happened,
 * and cleared from the thread's last error, which torch checks after its
 * kernel launches and would raise far from here (as torch clears it). */
static void
report(const cudart *rt, int status, const char *what)
{
    (void)rt->get_last_error();
    fprintf(stderr, "matepoint allocator: %s failed: %s (CUDA error %d)\n", what,
            rt->get_error_string(status), status);
}

/* Runs with `device` current; returns the previous device, or -1. */
static int
enter_device(const cudart *rt, int device)
{
    int previous = -1;
    int status = rt->get_device(&previous);
    if (status == CUDART_SUCCESS && previous != device)
        status = rt->set_device(device);
    if (status != CUDART_SUCCESS) {
        report(rt, status, "cudaSetDevice");
        return -1;
    }
    return previous;
}

static void
leave_device(const cudart *rt, int device, int previous)
{
    if (previous >= 0 && previous != device && rt->set_device(previous) != CUDART_SUCCESS)
        (void)rt->get_last_error();
}

static int
cuda_device_malloc(void *ctx, int device, uint64_t bytes, void **ptr)
{
    const cudart *rt = ctx;
    int previous = enter_device(rt, device);
    if (previous < 0)
        return ALLOC_ERROR;
    int status = rt->malloc(ptr, (size_t)bytes);
    leave_device(rt, device, previous);
    if (status == CUDART_SUCCESS)
        return ALLOC_OK;
    if (status == CUDART_ERROR_MEMORY_ALLOCATION) {
        (void)rt->get_last_error();   /* the allocator frees its cache and retries */
        return ALLOC_OUT_OF_MEMORY;
    }
    report(rt, status, "cudaMalloc");
    return ALLOC_ERROR;
}

static void
cuda_device_free(void *ctx, int device, void *ptr, uint64_t bytes)
{
    const cudart *rt = ctx;
    (void)bytes;
    int previous = enter_device(rt, device);
    if (previous < 0)
        return;
    int status = rt->free(ptr);
    leave_device(rt, device, previous);
    if (status != CUDART_SUCCESS)
        report(rt, status, "cudaFree");
}

static int
cuda_event_record(void *ctx, int device, void *stream, void **event)
{
    const cudart *rt = ctx;
    int previous = enter_device(rt, device);
    if (previous < 0)
        return ALLOC_ERROR;
    int status = rt->event_create(event, CUDART_EVENT_DISABLE_TIMING);
    if (status == CUDART_SUCCESS) {
        status = rt->event_record(*event, stream);
        if (status != CUDART_SUCCESS)
            (void)rt->event_destroy(*event);
    }
    leave_device(rt, device, previous);
    if (status != CUDART_SUCCESS) {
        report(rt, status, "cudaEventRecord");
        return ALLOC_ERROR;
    }
    return ALLOC_OK;
}

static int
cuda_event_query(void *ctx, void *event)
{
    const cudart *rt = ctx;
    int status = rt->event_query(event);
    if (status == CUDART_SUCCESS)
        return 1;
    if (status == CUDART_ERROR_NOT_READY) {
        (void)rt->get_last_error();   /* not a failure: only a pending event */
        return 0;
    }
    report(rt, status, "cudaEventQuery");
    return ALLOC_ERROR;
}

static void
cuda_event_wait(void *ctx, void *event)
{
    const cudart *rt = ctx;
    int status = rt->event_synchronize(event);
    if (status != CUDART_SUCCESS)
        report(rt, status, "cudaEventSynchronize");
}

static void
cuda_event_free(void *ctx, void *event)
{
    const cudart *rt = ctx;
    int status = rt->event_destroy(event);
    if (status != CUDART_SUCCESS)
        report(rt, status, "cudaEventDestroy");
}

static void
cuda_device_synchronize(void *ctx, int device)
{
    const cudart *rt = ctx;
    int previous = enter_device(rt, device);
    if (previous < 0)
        return;
    int status = rt->device_synchronize();
    leave_device(rt, device, previous);
    if (status != CUDART_SUCCESS)
        report(rt, status, "cudaDeviceSynchronize");
}

alloc_backend
alloc_cuda_backend(const cudart *rt)
{
    return (alloc_backend){
        .device_malloc = cuda_device_malloc, .device_free = cuda_device_free,
        .event_record = cuda_event_record, .event_query = cuda_event_query,
        .event_wait = cuda_event_wait, .event_free = cuda_event_free,
        .device_synchronize = cuda_device_synchronize, .ctx = (void *)rt,
    };
}
