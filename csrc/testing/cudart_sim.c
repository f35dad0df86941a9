/* The simulated CUDA runtime's state and its test controls (cudart_sim.h).
 * The scheduler is in cudart_sim_queue.c, the runtime table in
 * cudart_sim_calls.c. */
#include "cudart_sim_internal.h"
#include "common/mp_assert.h"

#include <stdlib.h>
#include <string.h>

sim_world sim_gpu = {.lock = PTHREAD_MUTEX_INITIALIZER};

_Thread_local int sim_current_device;
_Thread_local int sim_last_error;
_Thread_local void *sim_current_streams[CUDART_SIM_DEVICES];
_Thread_local int sim_handouts_deferred;
_Thread_local int sim_capture_mode;
_Thread_local sim_stream *sim_per_thread_streams[CUDART_SIM_DEVICES];

static const char *const entry_names[SIM_ENTRY_COUNT] = {
    "cudaGetDeviceCount", "cudaGetDevice", "cudaSetDevice", "cudaHostAlloc", "cudaFreeHost",
    "cudaStreamCreateWithFlags", "cudaStreamDestroy", "cudaStreamWaitEvent",
    "cudaStreamSynchronize", "cudaEventCreateWithFlags", "cudaEventDestroy", "cudaEventRecord",
    "cudaEventQuery", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMalloc", "cudaFree",
    "cudaMemGetInfo", "cudaDeviceSynchronize", "cudaGetLastError", "cudaStreamIsCapturing",
    "cudaThreadExchangeStreamCaptureMode",
};

/* ---- test controls ---------------------------------------------------------------- */

const cudart *
cudart_sim(void)
{
    pthread_mutex_lock(&sim_gpu.lock);
    for (int d = 0; d < CUDART_SIM_DEVICES; d++)
        sim_gpu.legacy[d].device = d;
    pthread_mutex_unlock(&sim_gpu.lock);
    return &sim_table;
}

const char *
cudart_sim_entry_name(int entry)
{
    return entry >= 0 && entry < SIM_ENTRY_COUNT ? entry_names[entry] : NULL;
}

uint64_t
cudart_sim_advance(uint64_t ops)
{
    pthread_mutex_lock(&sim_gpu.lock);
    uint64_t ran = sim_advance_locked(ops, 1);
    pthread_mutex_unlock(&sim_gpu.lock);
    return ran;
}

void
cudart_sim_set_expandable(int on)
{
    pthread_mutex_lock(&sim_gpu.lock);
    sim_gpu.expandable = on;
    pthread_mutex_unlock(&sim_gpu.lock);
}

void
cudart_sim_set_progress(uint64_t progress_per_call)
{
    pthread_mutex_lock(&sim_gpu.lock);
    sim_gpu.progress_per_call = progress_per_call;
    pthread_mutex_unlock(&sim_gpu.lock);
}

/* What a launch on `stream` of `device` runs first: all its stream's work
 * (`spans` NULL) or what `spans` needs (cudart_sim_land.c); then, as torch
 * after a launch, it takes the thread's last error. */
static int
launch(int device, void *stream, const cudart_sim_span *spans, size_t n_spans)
{
    if (device < 0 || device >= CUDART_SIM_DEVICES)
        return CUDART_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&sim_gpu.lock);
    sim_stream *s = stream == NULL ? &sim_gpu.legacy[device] : sim_resolve(stream);
    int status = s == NULL ? CUDART_ERROR_INVALID_HANDLE
                 : spans == NULL ? sim_drain_locked(s)
                 : sim_land_for_locked(s, spans, n_spans);
    if (sim_last_error != CUDART_SUCCESS) {
        sim_gpu.stats.launch_errors++;
        sim_last_error = CUDART_SUCCESS;
    }
    pthread_mutex_unlock(&sim_gpu.lock);
    return status;
}

int
cudart_sim_launch(int device, void *stream)
{
    return launch(device, stream, NULL, 0);
}

int
cudart_sim_launch_for(int device, void *stream, const cudart_sim_span *spans, size_t n_spans)
{
    static const cudart_sim_span none = {NULL, 0};
    return launch(device, stream, spans != NULL ? spans : &none, spans != NULL ? n_spans : 0);
}

/* An event of the harness's own: counted nowhere, gone once its record
 * and wait ran. */
int
cudart_sim_order_streams(int waiter_device, void *waiter, int producer_device, void *producer)
{
    pthread_mutex_lock(&sim_gpu.lock);
    sim_stream *w = sim_resolve_on(waiter_device, waiter);
    sim_stream *p = sim_resolve_on(producer_device, producer);
    int status = w == NULL || p == NULL ? CUDART_ERROR_INVALID_HANDLE : CUDART_SUCCESS;
    /* a producer with nothing queued: what it did has run */
    int needed = status == CUDART_SUCCESS && w != p && p->count > 0;
    sim_event *event = needed ? calloc(1, sizeof(*event)) : NULL;
    if (needed && event == NULL)
        status = CUDART_ERROR_MEMORY_ALLOCATION;
    if (event != NULL) {
        /* one reference for the handle, one per queued op */
        *event = (sim_event){.recorded = 1, .device = p->device, .refs = 1};
        status = sim_push_locked(p, (sim_op){.kind = OP_RECORD, .event = event,
                                             .generation = 1});
        if (status == CUDART_SUCCESS) {
            event->refs++;
            status = sim_push_locked(w, (sim_op){.kind = OP_WAIT, .event = event,
                                                 .generation = 1});
            if (status == CUDART_SUCCESS)
                event->refs++;
        }
        sim_event_release(event);
    }
    pthread_mutex_unlock(&sim_gpu.lock);
    return status;
}

void
cudart_sim_defer_handouts(int on)
{
    sim_handouts_deferred = on;
}

int
cudart_sim_current_device(void)
{
    return sim_current_device;
}

int
cudart_sim_set_current_device(int device)
{
    if (device < 0 || device >= CUDART_SIM_DEVICES)
        return CUDART_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&sim_gpu.lock);
    sim_current_device = device;
    sim_use_device(device);
    pthread_mutex_unlock(&sim_gpu.lock);
    return CUDART_SUCCESS;
}

void *
cudart_sim_current_stream(int device)
{
    return device >= 0 && device < CUDART_SIM_DEVICES ? sim_current_streams[device] : NULL;
}

void
cudart_sim_set_current_stream(int device, void *stream)
{
    if (device >= 0 && device < CUDART_SIM_DEVICES)
        sim_current_streams[device] = stream;
}

int
cudart_sim_stream_device(void *stream)
{
    pthread_mutex_lock(&sim_gpu.lock);
    sim_stream *s = stream == NULL ? NULL : sim_resolve(stream);
    int device = s == NULL ? -1 : s->device;
    pthread_mutex_unlock(&sim_gpu.lock);
    return device;
}

int
cudart_sim_device_of(const void *ptr)
{
    pthread_mutex_lock(&sim_gpu.lock);
    sim_range *range = sim_find_range(ptr);
    int device = range == NULL ? -1 : range->device;
    pthread_mutex_unlock(&sim_gpu.lock);
    return device;
}

int
cudart_sim_peek_last_error(void)
{
    return sim_last_error;
}

void
cudart_sim_fail(cudart_sim_entry entry, uint64_t skip, uint64_t count, int status)
{
    if ((int)entry < 0 || entry >= SIM_ENTRY_COUNT)
        return;
    pthread_mutex_lock(&sim_gpu.lock);
    sim_gpu.failures[entry] = (sim_failure){.skip = skip, .count = count, .status = status};
    pthread_mutex_unlock(&sim_gpu.lock);
}

void
cudart_sim_log_waits(int on)
{
    pthread_mutex_lock(&sim_gpu.lock);
    free(sim_gpu.wait_log);
    sim_gpu.wait_log = NULL;
    sim_gpu.wait_log_count = sim_gpu.wait_log_capacity = 0;
    sim_gpu.wait_log_on = on;
    pthread_mutex_unlock(&sim_gpu.lock);
}

size_t
cudart_sim_wait_log(cudart_sim_wait *out, size_t max)
{
    pthread_mutex_lock(&sim_gpu.lock);
    size_t count = sim_gpu.wait_log_count;
    if (out != NULL && count > 0)
        memcpy(out, sim_gpu.wait_log, (count < max ? count : max) * sizeof(*out));
    pthread_mutex_unlock(&sim_gpu.lock);
    return count;
}


void
cudart_sim_set_sync_observer(cudart_sim_observer observer)
{
    pthread_mutex_lock(&sim_gpu.lock);
    sim_gpu.sync_observer = observer;
    pthread_mutex_unlock(&sim_gpu.lock);
}

/* The created, live stream `handle` of `device`; NULL otherwise. */
static sim_stream *
created_stream_locked(int device, void *handle)
{
    sim_stream *s = handle == NULL ? NULL : sim_resolve(handle);
    return s != NULL && s->created && s->device == device ? s : NULL;
}

int
cudart_sim_begin_capture(int device, void *stream)
{
    pthread_mutex_lock(&sim_gpu.lock);
    sim_stream *s = created_stream_locked(device, stream);
    int status = s == NULL || s->capture != 0 ? CUDART_ERROR_INVALID_VALUE : CUDART_SUCCESS;
    if (status == CUDART_SUCCESS) {
        s->capture = 1;
        sim_gpu.captures++;
    }
    pthread_mutex_unlock(&sim_gpu.lock);
    return status;
}

int
cudart_sim_end_capture(int device, void *stream)
{
    pthread_mutex_lock(&sim_gpu.lock);
    sim_stream *s = created_stream_locked(device, stream);
    int status = s == NULL || s->capture == 0 ? CUDART_ERROR_INVALID_VALUE
                 : s->capture == 1 ? CUDART_SUCCESS
                 : CUDART_SIM_CAPTURE_INVALIDATED;
    if (s != NULL && s->capture != 0) {
        s->capture = 0;
        mp_counter_sub(&sim_gpu.captures, 1);
    }
    pthread_mutex_unlock(&sim_gpu.lock);
    return status;
}

int
sim_capture_forbids_locked(void)
{
    if (sim_gpu.captures == 0 || sim_capture_mode == CUDART_STREAM_CAPTURE_MODE_RELAXED)
        return CUDART_SUCCESS;
    for (sim_stream *s = sim_gpu.streams; s != NULL; s = s->next) {
        if (s->capture != 0)
            s->capture = 2;
    }
    return CUDART_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

int
sim_device_sync_forbidden_locked(int device)
{
    int capturing = 0;
    for (sim_stream *s = sim_gpu.streams; s != NULL; s = s->next) {
        if (s->device == device && s->capture != 0) {
            s->capture = 2;
            capturing = 1;
        }
    }
    return capturing ? CUDART_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDART_SUCCESS;
}

void
cudart_sim_forget_contexts(void)
{
    pthread_mutex_lock(&sim_gpu.lock);
    memset(sim_gpu.stats.has_context, 0, sizeof(sim_gpu.stats.has_context));
    pthread_mutex_unlock(&sim_gpu.lock);
}

int
cudart_sim_event_done(void *event)
{
    pthread_mutex_lock(&sim_gpu.lock);
    int done = sim_event_done(event);
    pthread_mutex_unlock(&sim_gpu.lock);
    return done;
}

cudart_sim_stats
cudart_sim_get_stats(void)
{
    pthread_mutex_lock(&sim_gpu.lock);
    cudart_sim_stats stats = sim_gpu.stats;
    pthread_mutex_unlock(&sim_gpu.lock);
    return stats;
}
