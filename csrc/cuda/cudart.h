/* The few CUDA runtime entry points matepoint's extension needs, loaded at
 * run time with dlopen so the module builds and imports without CUDA.
 *
 * cudart_load() returns the process-wide table, loading it on first use. It
 * resolves the runtime through torch's own CUDA libraries when they are
 * loaded (libtorch_cuda, libc10_cuda: the libcudart they link), so the
 * process has one runtime even where several libcudart versions are loaded;
 * else a libcudart already loaded, else one found by name.
 * It returns NULL when no runtime can be found; cudart_error() then says
 * why. The table is immutable once loaded; loading is serialized by a
 * pthread_once. Handles are the runtime's own (cudaStream_t, cudaEvent_t)
 * carried as void *. Status codes: 0 is success. */
#ifndef MATEPOINT_CUDART_H
#define MATEPOINT_CUDART_H

#include <stddef.h>
#include <stdint.h>

/* CUDA's own values (tests/c/cudart_abi.cpp checks them against its headers) */
enum {
    CUDART_SUCCESS = 0,
    CUDART_ERROR_INVALID_VALUE = 1,
    CUDART_ERROR_MEMORY_ALLOCATION = 2,
    CUDART_ERROR_INVALID_DEVICE = 101,
    CUDART_ERROR_INVALID_HANDLE = 400,
    CUDART_ERROR_NOT_READY = 600,
    CUDART_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDART_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
    CUDART_STREAM_CAPTURE_STATUS_NONE = 0,
    CUDART_STREAM_CAPTURE_MODE_RELAXED = 2,
    CUDART_MEMCPY_HOST_TO_DEVICE = 1,
    CUDART_MEMCPY_DEVICE_TO_HOST = 2,
    CUDART_HOST_ALLOC_PORTABLE = 1,
    CUDART_EVENT_DISABLE_TIMING = 2,
    CUDART_STREAM_NON_BLOCKING = 1,
};

/* CUDA's special stream handles (driver_types.h): cudaStreamLegacy names
 * the legacy default stream of the calling thread's current device, as
 * NULL does (matepoint loads the runtime's legacy-stream entry points);
 * cudaStreamPerThread names the calling thread's own default stream of
 * its current device: one handle, another stream on every thread. */
#define CUDART_STREAM_LEGACY ((void *)(uintptr_t)0x1)
#define CUDART_STREAM_PER_THREAD ((void *)(uintptr_t)0x2)

typedef struct cudart {
    int (*get_device_count)(int *count);
    int (*get_device)(int *device);
    int (*set_device)(int device);
    int (*host_alloc)(void **ptr, size_t bytes, unsigned flags);
    int (*free_host)(void *ptr);
    int (*stream_create)(void **stream, unsigned flags);
    int (*stream_destroy)(void *stream);
    int (*stream_wait_event)(void *stream, void *event, unsigned flags);
    int (*stream_synchronize)(void *stream);
    int (*event_create)(void **event, unsigned flags);
    int (*event_destroy)(void *event);
    int (*event_record)(void *event, void *stream);
    int (*event_query)(void *event);
    int (*event_synchronize)(void *event);
    int (*memcpy_async)(void *dst, const void *src, size_t bytes, int kind, void *stream);
    int (*malloc)(void **ptr, size_t bytes);
    int (*free)(void *ptr);
    int (*mem_get_info)(size_t *free_bytes, size_t *total_bytes);
    int (*device_synchronize)(void);
    int (*get_last_error)(void);
    const char *(*get_error_string)(int status);
    /* Not a runtime entry point: whether `device` has its primary context
     * (the driver's cuDevicePrimaryCtxGetState), so that switching back to
     * a device creates none (cudaSetDevice does since CUDA 12). 0 with
     * *active set, else nonzero (unknown; the last error is untouched).
     * NULL where the driver lacks it: unknown too. */
    int (*primary_context_active)(int device, int *active);
    /* Optional, NULL where the runtime lacks it: cudaStreamIsCapturing.
     * *status is CUDA's cudaStreamCaptureStatus: CUDART_STREAM_CAPTURE_
     * STATUS_NONE, else a capture (active, or invalidated) is underway on
     * `stream`. The legacy stream (NULL) answers
     * CUDART_ERROR_STREAM_CAPTURE_IMPLICIT while a blocking stream of its
     * device captures. Allowed during a capture, unlike event queries,
     * synchronizations, cudaMalloc and cudaFree, which invalidate it. */
    int (*stream_is_capturing)(void *stream, int *status);
    /* Optional, NULL where the runtime lacks it:
     * cudaThreadExchangeStreamCaptureMode. Makes *mode (CUDA's
     * cudaStreamCaptureMode) the calling thread's and returns the one it
     * had in *mode. A thread in CUDART_STREAM_CAPTURE_MODE_RELAXED may make
     * the calls above that a capture forbids, as torch's allocator does
     * for cudaMalloc while a capture is underway. */
    int (*thread_exchange_stream_capture_mode)(int *mode);
} cudart;

const cudart *cudart_load(void);
const char *cudart_error(void);
/* The path of the library the loaded table came from ("" when none). */
const char *cudart_origin(void);

#endif
