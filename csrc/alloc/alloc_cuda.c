#include "alloc_cuda.h"
#include "cuda/cudart.h"
#include "cuda/cudart_util.h"

#include <stdio.h>

/* The calling thread's last reported failure (alloc_cuda_failure): each
 * thread owns its own copy, so no lock. */
static _Thread_local char failure[256];

const char *
alloc_cuda_failure(void)
{
    return failure;
}

void
alloc_cuda_forget_failure(void)
{
    failure[0] = '\0';
}

/* A CUDA failure the allocator goes on from: reported where it happened,
 * kept for the caller's message, and cleared from the thread's last error,
 * which torch checks after its kernel launches and would raise far from
 * here (as torch clears it). */
static void
report(const cudart *rt, int status, const char *what)
{
    cudart_describe_failure(rt, status, what, failure, sizeof(failure));
    fprintf(stderr, "matepoint allocator: %s\n", failure);
}

/* The calls a CUDA graph capture forbids in its global mode run in relaxed
 * mode (cudart_relax_capture): the allocator serves no capturing stream
 * (entry.c refuses them), so a capture of another stream must not see
 * them. */
/* Runs with `device` current; returns the previous device, or -1. */
static int
enter_device(const cudart *rt, int device)
{
    int previous;
    const char *failed = NULL;
    int status = cudart_enter_device(rt, device, &previous, &failed);
    if (status != CUDART_SUCCESS) {
        report(rt, status, failed);
        return -1;
    }
    return previous;
}

static int
cuda_device_malloc(void *ctx, int device, uint64_t bytes, void **ptr)
{
    const cudart *rt = ctx;
    int previous = enter_device(rt, device);
    if (previous < 0)
        return ALLOC_ERROR;
    int mode = cudart_relax_capture(rt);
    int status = rt->malloc(ptr, (size_t)bytes);
    cudart_restore_capture(rt, mode);
    cudart_leave_device(rt, device, previous);
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
    int mode = cudart_relax_capture(rt);
    int status = rt->free(ptr);
    cudart_restore_capture(rt, mode);
    cudart_leave_device(rt, device, previous);
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
    const char *failed = NULL;
    int status = cudart_record_event(rt, stream, event, &failed);
    cudart_leave_device(rt, device, previous);
    if (status != CUDART_SUCCESS) {
        report(rt, status, failed);
        return ALLOC_ERROR;
    }
    return ALLOC_OK;
}

static int
cuda_event_query(void *ctx, void *event)
{
    const cudart *rt = ctx;
    int status, mode = cudart_relax_capture(rt);
    int done = cudart_event_done(rt, event, &status);
    cudart_restore_capture(rt, mode);
    if (done >= 0)
        return done;
    report(rt, status, "cudaEventQuery");
    return ALLOC_ERROR;
}

static int
cuda_event_wait(void *ctx, void *event)
{
    const cudart *rt = ctx;
    int mode = cudart_relax_capture(rt);
    int status = rt->event_synchronize(event);
    cudart_restore_capture(rt, mode);
    if (status == CUDART_SUCCESS)
        return ALLOC_OK;
    report(rt, status, "cudaEventSynchronize");
    return ALLOC_ERROR;
}

static void
cuda_event_free(void *ctx, void *event)
{
    const cudart *rt = ctx;
    int status = rt->event_destroy(event);
    if (status != CUDART_SUCCESS)
        report(rt, status, "cudaEventDestroy");
}

static int
cuda_mem_info(void *ctx, int device, uint64_t *free_bytes, uint64_t *total_bytes)
{
    const cudart *rt = ctx;
    int previous = enter_device(rt, device);
    if (previous < 0)
        return ALLOC_ERROR;
    size_t free_now = 0, total = 0;
    int status = rt->mem_get_info(&free_now, &total);
    cudart_leave_device(rt, device, previous);
    if (status != CUDART_SUCCESS) {
        report(rt, status, "cudaMemGetInfo");
        return ALLOC_ERROR;
    }
    *free_bytes = free_now;
    *total_bytes = total;
    return ALLOC_OK;
}

static int
cuda_stream_capturing(void *ctx, int device, void *stream)
{
    const cudart *rt = ctx;
    int previous = enter_device(rt, device);     /* the legacy stream is the device's */
    if (previous < 0)
        return ALLOC_ERROR;
    int capturing = cudart_stream_capturing(rt, stream);
    cudart_leave_device(rt, device, previous);
    return capturing < 0 ? ALLOC_ERROR : capturing;
}

alloc_backend
alloc_cuda_backend(const cudart *rt)
{
    return (alloc_backend){
        .device_malloc = cuda_device_malloc, .device_free = cuda_device_free,
        .event_record = cuda_event_record, .event_query = cuda_event_query,
        .event_wait = cuda_event_wait, .event_free = cuda_event_free,
        .stream_capturing = cuda_stream_capturing, .mem_info = cuda_mem_info,
        .ctx = (void *)rt,
    };
}
