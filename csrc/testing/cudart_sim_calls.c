/* The simulated runtime's table: one function per CUDA entry point, each
 * between sim_enter() and sim_leave(). Model: cudart_sim.h. */
#include "cudart_sim_internal.h"
#include "common/host_memory.h"
#include "common/mp_assert.h"

#include <stdlib.h>
#include <string.h>

#define HOST_ALIGN 64

/* ---- the runtime table ------------------------------------------------------------ */

static int
sim_get_device_count(int *count)
{
    int status = sim_enter(SIM_GET_DEVICE_COUNT);
    if (status == CUDART_SUCCESS)
        *count = CUDART_SIM_DEVICES;
    return sim_leave(status);
}

static int
sim_get_device(int *device)
{
    int status = sim_enter(SIM_GET_DEVICE);
    if (status == CUDART_SUCCESS)
        *device = sim_current_device;
    return sim_leave(status);
}

static int
sim_set_device(int device)
{
    int status = sim_enter(SIM_SET_DEVICE);
    if (status == CUDART_SUCCESS && (device < 0 || device >= CUDART_SIM_DEVICES))
        status = CUDART_ERROR_INVALID_DEVICE;
    if (status == CUDART_SUCCESS) {
        /* since CUDA 12 setting a device initializes its primary context */
        sim_current_device = device;
        sim_use_device(device);
    }
    return sim_leave(status);
}

/* New memory, device or pinned, is handed out full of poison: CUDA says
 * nothing of its bytes, and memory malloc handed back may still hold the
 * very bytes (a previous run's) that a copy reading it too early should
 * miss, so that a missing wait showed or not by where malloc put it. */
static int
aligned_alloc_range(void **ptr, size_t bytes, int device)
{
    void *base = mp_host_alloc(bytes, HOST_ALIGN);
    if (base == NULL)
        return CUDART_ERROR_MEMORY_ALLOCATION;
    memset(base, CUDART_SIM_POISON, bytes);
    if (sim_add_range(base, bytes ? bytes : 1, device) < 0) {
        mp_host_free(base);
        return CUDART_ERROR_MEMORY_ALLOCATION;
    }
    *ptr = base;
    return CUDART_SUCCESS;
}

static int
sim_host_alloc(void **ptr, size_t bytes, unsigned flags)
{
    (void)flags;
    int status = sim_enter(SIM_HOST_ALLOC);
    if (status == CUDART_SUCCESS)
        status = sim_capture_forbids_locked();
    if (status == CUDART_SUCCESS)
        status = aligned_alloc_range(ptr, bytes, -1);
    if (status == CUDART_SUCCESS) {
        sim_use_device(sim_current_device);  /* pinning happens in the current context */
        sim_gpu.stats.host_bytes_live += bytes;
    }
    return sim_leave(status);
}

/* Frees, like destroys, release their memory even when an injected
 * failure (an earlier asynchronous error) is reported; not when a capture
 * forbids the call (CUDA refuses it before doing anything). */
static int
sim_free_host(void *ptr)
{
    int injected = sim_enter(SIM_FREE_HOST);
    int forbidden = sim_capture_forbids_locked();
    if (forbidden != CUDART_SUCCESS)
        return sim_leave(forbidden);
    int status = ptr != NULL ? sim_free_range_locked(ptr, 1, SIM_FREE_HOST) : CUDART_SUCCESS;
    return sim_leave(status != CUDART_SUCCESS ? status : injected);
}

static int
sim_malloc(void **ptr, size_t bytes)
{
    int status = sim_enter(SIM_MALLOC);
    if (status == CUDART_SUCCESS)
        status = sim_capture_forbids_locked();
    if (status == CUDART_SUCCESS)
        status = aligned_alloc_range(ptr, bytes, sim_current_device);
    if (status == CUDART_SUCCESS) {
        sim_gpu.ranges->owner = sim_current_streams[sim_current_device];  /* just added */
        sim_use_device(sim_current_device);
        sim_gpu.stats.device_bytes_live[sim_current_device] += bytes;
    }
    return sim_leave(status);
}

static int
sim_free(void *ptr)
{
    int injected = sim_enter(SIM_FREE);
    int forbidden = sim_capture_forbids_locked();
    if (forbidden != CUDART_SUCCESS)
        return sim_leave(forbidden);   /* CUDA frees nothing then */
    int status = ptr != NULL ? sim_free_range_locked(ptr, 0, SIM_FREE) : CUDART_SUCCESS;
    return sim_leave(status != CUDART_SUCCESS ? status : injected);
}

static int
sim_stream_create(void **stream, unsigned flags)
{
    (void)flags;
    int status = sim_enter(SIM_STREAM_CREATE);
    sim_stream *created = status == CUDART_SUCCESS ? calloc(1, sizeof(*created)) : NULL;
    if (status == CUDART_SUCCESS && created == NULL)
        status = CUDART_ERROR_MEMORY_ALLOCATION;
    if (status == CUDART_SUCCESS) {
        created->device = sim_current_device;
        created->created = 1;
        created->next = sim_gpu.streams;
        sim_gpu.streams = created;
        sim_gpu.stats.streams_live++;
        sim_use_device(sim_current_device);
        *stream = created;
    }
    return sim_leave(status);
}

/* An injected failure of a destroy stands for what CUDA documents these
 * calls may return: an error of earlier asynchronous work. The handle is
 * released all the same. */
static int
sim_stream_destroy(void *stream)
{
    int injected = sim_enter(SIM_STREAM_DESTROY);
    sim_stream *s = stream == NULL ? NULL : sim_resolve(stream);
    if (s != NULL && !s->created)
        s = NULL;               /* a default stream is never destroyed */
    int status = s == NULL ? CUDART_ERROR_INVALID_HANDLE : injected;
    if (s != NULL) {
        /* as in CUDA, queued work still runs; the stream goes once it has */
        s->destroyed = 1;
        if (s->count == 0)
            sim_stream_unlink_and_free(s);
    }
    return sim_leave(status);
}

static int
sim_stream_wait_event(void *stream, void *event_handle, unsigned flags)
{
    (void)flags;
    sim_event *event = event_handle;
    int status = sim_enter(SIM_STREAM_WAIT_EVENT);
    sim_stream *s = sim_resolve(stream);
    if (status == CUDART_SUCCESS && s == NULL)
        status = CUDART_ERROR_INVALID_HANDLE;
    if (status == CUDART_SUCCESS)
        sim_log_wait_locked(s, event);
    if (status != CUDART_SUCCESS || event->completed >= event->recorded)
        return sim_leave(status);
    event->refs++;
    status = sim_push_locked(s, (sim_op){.kind = OP_WAIT, .event = event,
                                     .generation = event->recorded});
    if (status != CUDART_SUCCESS)
        event->refs--;
    return sim_leave(status);
}

static int
sim_stream_synchronize(void *stream)
{
    int status = sim_enter(SIM_STREAM_SYNCHRONIZE);
    if (status == CUDART_SUCCESS)
        status = sim_capture_forbids_locked();
    sim_stream *s = sim_resolve(stream);
    if (status == CUDART_SUCCESS && s == NULL)
        status = CUDART_ERROR_INVALID_HANDLE;
    if (status == CUDART_SUCCESS) {
        sim_note_sync_locked(SIM_STREAM_SYNCHRONIZE);
        status = sim_drain_locked(s);
    }
    return sim_leave(status);
}

static int
sim_event_create(void **event, unsigned flags)
{
    (void)flags;
    int status = sim_enter(SIM_EVENT_CREATE);
    sim_event *created = status == CUDART_SUCCESS ? calloc(1, sizeof(*created)) : NULL;
    if (status == CUDART_SUCCESS && created == NULL)
        status = CUDART_ERROR_MEMORY_ALLOCATION;
    if (status == CUDART_SUCCESS) {
        created->refs = 1;
        created->device = sim_current_device;
        sim_use_device(sim_current_device);
        sim_gpu.stats.events_live++;
        *event = created;
    }
    return sim_leave(status);
}

static int
sim_event_destroy(void *event)
{
    int status = sim_enter(SIM_EVENT_DESTROY);   /* released all the same (above) */
    mp_counter_sub(&sim_gpu.stats.events_live, 1);
    sim_event_release(event);
    return sim_leave(status);
}

static int
sim_event_record(void *event_handle, void *stream)
{
    sim_event *event = event_handle;
    int status = sim_enter(SIM_EVENT_RECORD);
    sim_stream *s = sim_resolve(stream);
    if (status == CUDART_SUCCESS && (s == NULL || s->device != event->device))
        status = CUDART_ERROR_INVALID_HANDLE;   /* as CUDA: event and stream on one device */
    if (status != CUDART_SUCCESS)
        return sim_leave(status);
    uint64_t generation = ++event->recorded;
    event->recorded_on = sim_handle_of(s);
    event->refs++;
    status = sim_push_locked(s, (sim_op){.kind = OP_RECORD, .event = event, .generation = generation});
    if (status != CUDART_SUCCESS) {
        event->refs--;
        event->recorded--;
    }
    return sim_leave(status);
}

static int
sim_event_query(void *event)
{
    int status = sim_enter(SIM_EVENT_QUERY);
    if (status == CUDART_SUCCESS)
        status = sim_capture_forbids_locked();
    if (status == CUDART_SUCCESS && !sim_event_done(event))
        status = CUDART_ERROR_NOT_READY;
    return sim_leave(status);
}

static int
sim_event_synchronize(void *event_handle)
{
    sim_event *event = event_handle;
    int status = sim_enter(SIM_EVENT_SYNCHRONIZE);
    if (status == CUDART_SUCCESS)
        status = sim_capture_forbids_locked();
    if (status == CUDART_SUCCESS) {
        sim_note_sync_locked(SIM_EVENT_SYNCHRONIZE);
        status = sim_run_until_locked(event, event->recorded);
    }
    return sim_leave(status);
}

/* Host memory not pinned by cudaHostAlloc. */
static int
touches_pageable(const void *dst, const void *src, int kind)
{
    const void *host = kind == CUDART_MEMCPY_DEVICE_TO_HOST ? dst
                       : kind == CUDART_MEMCPY_HOST_TO_DEVICE ? src : NULL;
    if (host == NULL)
        return 0;
    sim_range *range = sim_find_range(host);
    return range == NULL || range->device != -1;
}

/* CUDA copies through pageable memory synchronously for the host, but
 * only for the host: a device-to-host copy returns once it completed
 * (after the stream's earlier work), a host-to-device copy once the bytes
 * were staged into the driver's pinned memory, with the copy into device
 * memory still queued ("the DMA to final destination may not have
 * completed", CUDA's API synchronization behavior). So the source may be
 * reused at once, and whatever reads the destination must still wait for
 * the stream. Modelled the adversarial way: staged now, landed when the
 * stream reaches it. */
static int
push_copy(sim_stream *s, void *dst, const void *src, size_t bytes, int kind)
{
    int pageable = touches_pageable(dst, src, kind);
    void *staged = NULL;
    if (pageable && kind == CUDART_MEMCPY_HOST_TO_DEVICE) {
        if ((staged = malloc(bytes ? bytes : 1)) == NULL)
            return CUDART_ERROR_MEMORY_ALLOCATION;
        memcpy(staged, src, bytes);
        src = staged;
    }
    int status = sim_push_locked(s, (sim_op){.kind = OP_COPY, .dst = dst, .src = src,
                                             .bytes = bytes, .staged = staged});
    if (status != CUDART_SUCCESS) {
        free(staged);
        return status;
    }
    if (!pageable)
        return CUDART_SUCCESS;
    sim_gpu.stats.pageable_copies++;
    /* the host waits either way: for the copy, or while the driver stages */
    sim_note_sync_locked(SIM_MEMCPY_ASYNC);
    return staged != NULL ? CUDART_SUCCESS : sim_drain_locked(s);
}

static int
sim_memcpy_async(void *dst, const void *src, size_t bytes, int kind, void *stream)
{
    int status = sim_enter(SIM_MEMCPY_ASYNC);
    sim_stream *s = sim_resolve(stream);
    if (status == CUDART_SUCCESS && s == NULL)
        status = CUDART_ERROR_INVALID_HANDLE;
    if (status == CUDART_SUCCESS) {
        sim_use_device(s->device);
        status = push_copy(s, dst, src, bytes, kind);
    }
    return sim_leave(status);
}

static int
sim_mem_get_info(size_t *free_bytes, size_t *total_bytes)
{
    int status = sim_enter(SIM_MEM_GET_INFO);
    if (status == CUDART_SUCCESS) {
        sim_use_device(sim_current_device);
        *total_bytes = (size_t)1 << 34;
        *free_bytes = *total_bytes - sim_gpu.stats.device_bytes_live[sim_current_device];
    }
    return sim_leave(status);
}

static int
sim_device_synchronize(void)
{
    int status = sim_enter(SIM_DEVICE_SYNCHRONIZE);
    if (status == CUDART_SUCCESS)
        status = sim_capture_forbids_locked();
    if (status == CUDART_SUCCESS)
        status = sim_device_sync_forbidden_locked(sim_current_device);
    if (status == CUDART_SUCCESS) {
        sim_note_sync_locked(SIM_DEVICE_SYNCHRONIZE);
        status = sim_drain_locked(&sim_gpu.legacy[sim_current_device]);
    }
    for (sim_stream *s = sim_gpu.streams; status == CUDART_SUCCESS && s != NULL; s = s->next) {
        if (s->device == sim_current_device)
            status = sim_drain_locked(s);
    }
    return sim_leave(status);
}

/* CUDA's cudaStreamCaptureStatus of `stream`. (CUDA fails the question
 * for the legacy stream only while a blocking stream captures; the
 * simulated streams are all non-blocking, as torch's.) */
static int
sim_stream_is_capturing(void *stream, int *capture_status)
{
    int status = sim_enter(SIM_STREAM_IS_CAPTURING);
    sim_stream *s = sim_resolve(stream);
    if (status == CUDART_SUCCESS && s == NULL)
        status = CUDART_ERROR_INVALID_HANDLE;
    if (status == CUDART_SUCCESS)
        *capture_status = s->capture;
    return sim_leave(status);
}

static int
sim_thread_exchange_stream_capture_mode(int *mode)
{
    int status = sim_enter(SIM_THREAD_EXCHANGE_STREAM_CAPTURE_MODE);
    if (status == CUDART_SUCCESS && (*mode < 0 || *mode > CUDART_STREAM_CAPTURE_MODE_RELAXED))
        status = CUDART_ERROR_INVALID_VALUE;
    if (status == CUDART_SUCCESS) {
        int previous = sim_capture_mode;
        sim_capture_mode = *mode;
        *mode = previous;
    }
    return sim_leave(status);
}

static int
sim_get_last_error(void)
{
    pthread_mutex_lock(&sim_gpu.lock);
    sim_gpu.stats.calls[SIM_GET_LAST_ERROR]++;
    pthread_mutex_unlock(&sim_gpu.lock);
    int status = sim_last_error;
    sim_last_error = CUDART_SUCCESS;
    return status;
}

static const char *
sim_get_error_string(int status)
{
    switch (status) {
    case CUDART_SUCCESS: return "no error (simulated)";
    case CUDART_ERROR_NOT_READY: return "device not ready (simulated)";
    case CUDART_ERROR_MEMORY_ALLOCATION: return "out of memory (simulated)";
    case CUDART_ERROR_INVALID_VALUE: return "invalid argument (simulated)";
    case CUDART_ERROR_INVALID_DEVICE: return "invalid device ordinal (simulated)";
    case CUDART_ERROR_INVALID_HANDLE: return "invalid resource handle (simulated)";
    case CUDART_SIM_DEADLOCK: return "the awaited work can never run (simulated deadlock)";
    case CUDART_ERROR_STREAM_CAPTURE_UNSUPPORTED:
        return "operation not permitted when stream is capturing (simulated)";
    default: return "simulated CUDA error";
    }
}

const cudart sim_table = {
    .get_device_count = sim_get_device_count,
    .get_device = sim_get_device,
    .set_device = sim_set_device,
    .host_alloc = sim_host_alloc,
    .free_host = sim_free_host,
    .stream_create = sim_stream_create,
    .stream_destroy = sim_stream_destroy,
    .stream_wait_event = sim_stream_wait_event,
    .stream_synchronize = sim_stream_synchronize,
    .event_create = sim_event_create,
    .event_destroy = sim_event_destroy,
    .event_record = sim_event_record,
    .event_query = sim_event_query,
    .event_synchronize = sim_event_synchronize,
    .memcpy_async = sim_memcpy_async,
    .malloc = sim_malloc,
    .free = sim_free,
    .mem_get_info = sim_mem_get_info,
    .device_synchronize = sim_device_synchronize,
    .get_last_error = sim_get_last_error,
    .get_error_string = sim_get_error_string,
    .stream_is_capturing = sim_stream_is_capturing,
    .thread_exchange_stream_capture_mode = sim_thread_exchange_stream_capture_mode,
};

