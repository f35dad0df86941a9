#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* posix_memalign */
#endif
#include "cudart_sim.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define HOST_ALIGN 64

typedef struct {
    uint64_t recorded;          /* generation of the last record queued */
    uint64_t completed;         /* generation of the last record that ran */
    int device;                 /* current when the event was created */
    int refs;                   /* the caller's handle plus queued operations */
} sim_event;

typedef enum { OP_COPY, OP_RECORD, OP_WAIT } op_kind;

typedef struct {
    op_kind kind;
    uint64_t order;             /* global queueing order: oldest runs first */
    sim_event *event;
    uint64_t generation;        /* record: the one it completes; wait: the one it needs */
    void *dst;
    const void *src;
    size_t bytes;
} sim_op;

typedef struct sim_stream {
    sim_op *ops;
    size_t head, count, cap;    /* queued operations are ops[head .. head + count) */
    int device;
    int created;                /* 0 for the legacy streams, which live forever */
    int destroyed;              /* freed once its queue ran dry */
    struct sim_stream *next;
} sim_stream;

/* Memory handed out: device memory (device >= 0) or pinned host memory. */
typedef struct sim_range {
    char *base;
    size_t bytes;
    int device;
    struct sim_range *next;
} sim_range;

typedef struct {
    uint64_t skip, count;
    int status;
} sim_failure;

/* The whole simulation. Process-wide because the runtime table it stands
 * for is; every access holds `lock`. */
static struct {
    pthread_mutex_t lock;
    sim_stream legacy[CUDART_SIM_DEVICES];
    sim_stream *streams;        /* every stream with queued work or a live handle */
    sim_range *ranges;
    uint64_t next_order;
    uint64_t progress_per_call;
    sim_failure failures[SIM_ENTRY_COUNT];
    cudart_sim_observer sync_observer;
    cudart_sim_stats stats;
} sim = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* What CUDA keeps per host thread. */
static _Thread_local int current_device;
static _Thread_local int last_error;
static _Thread_local void *current_streams[CUDART_SIM_DEVICES];

static const char *const entry_names[SIM_ENTRY_COUNT] = {
    "cudaGetDeviceCount", "cudaGetDevice", "cudaSetDevice", "cudaHostAlloc", "cudaFreeHost",
    "cudaStreamCreateWithFlags", "cudaStreamDestroy", "cudaStreamWaitEvent",
    "cudaStreamSynchronize", "cudaEventCreateWithFlags", "cudaEventDestroy", "cudaEventRecord",
    "cudaEventQuery", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMalloc", "cudaFree",
    "cudaMemGetInfo", "cudaDeviceSynchronize", "cudaGetLastError",
};

/* ---- queues ------------------------------------------------------------------ */

static int
event_done(const sim_event *event)
{
    return event->completed >= event->recorded;
}

static void
event_release(sim_event *event)
{
    if (--event->refs == 0)
        free(event);
}

static int
op_runnable(const sim_op *op)
{
    return op->kind != OP_WAIT || op->event->completed >= op->generation;
}

static void
op_run(sim_op *op)
{
    sim.stats.ops_run++;
    switch (op->kind) {
    case OP_COPY:
        memcpy(op->dst, op->src, op->bytes);
        sim.stats.copies_run++;
        return;
    case OP_RECORD:
        if (op->generation > op->event->completed)
            op->event->completed = op->generation;
        event_release(op->event);
        return;
    case OP_WAIT:
        event_release(op->event);
        return;
    }
}

static void
stream_unlink_and_free(sim_stream *stream)
{
    for (sim_stream **link = &sim.streams; *link != NULL; link = &(*link)->next) {
        if (*link == stream) {
            *link = stream->next;
            break;
        }
    }
    sim.stats.streams_live--;
    free(stream->ops);
    free(stream);
}

static sim_stream *
first_stream(void)
{
    return &sim.legacy[0];
}

/* Streams are walked as legacy[0..n) followed by the created list. */
static sim_stream *
next_stream(sim_stream *s)
{
    if (s >= sim.legacy && s < sim.legacy + CUDART_SIM_DEVICES - 1)
        return s + 1;
    if (s == &sim.legacy[CUDART_SIM_DEVICES - 1])
        return sim.streams;
    return s->next;
}

/* Runs the head operation of `stream`, which must be runnable. */
static void
pop_and_run_locked(sim_stream *stream)
{
    sim_op op = stream->ops[stream->head];
    stream->head++;
    stream->count--;
    sim.stats.ops_queued--;
    if (stream->count == 0 && stream->destroyed)
        stream_unlink_and_free(stream);
    op_run(&op);
}

/* Runs the oldest runnable head operation of any stream; 0 if none. */
static int
run_one_locked(void)
{
    sim_stream *oldest = NULL;
    for (sim_stream *s = first_stream(); s != NULL; s = next_stream(s)) {
        if (s->count > 0 && op_runnable(&s->ops[s->head]) &&
            (oldest == NULL || s->ops[s->head].order < oldest->ops[oldest->head].order))
            oldest = s;
    }
    if (oldest == NULL)
        return 0;
    pop_and_run_locked(oldest);
    return 1;
}

static uint64_t
advance_locked(uint64_t ops)
{
    uint64_t ran = 0;
    while (ran < ops && run_one_locked())
        ran++;
    return ran;
}

/* The queued record that completes `generation` of `event`, and its stream. */
static sim_stream *
find_record_locked(const sim_event *event, uint64_t generation, uint64_t *order)
{
    for (sim_stream *s = first_stream(); s != NULL; s = next_stream(s)) {
        for (size_t i = s->head; i < s->head + s->count; i++) {
            if (s->ops[i].kind == OP_RECORD && s->ops[i].event == event &&
                s->ops[i].generation == generation) {
                *order = s->ops[i].order;
                return s;
            }
        }
    }
    return NULL;
}

static int run_stream_until_locked(sim_stream *stream, uint64_t order, int depth);

/* Runs only what `generation` of `event` needs: its record's stream up to
 * the record, and recursively what that waits for. The least a GPU must do,
 * so everything else stays as late as CUDA allows. */
static int
complete_locked(sim_event *event, uint64_t generation, int depth)
{
    if (event->completed >= generation)
        return CUDART_SUCCESS;
    uint64_t order;
    sim_stream *stream = find_record_locked(event, generation, &order);
    if (stream == NULL || depth > 64)
        return CUDART_SIM_DEADLOCK;
    return run_stream_until_locked(stream, order, depth + 1);
}

/* Runs `stream`'s operations queued up to `order` (all of them: UINT64_MAX). */
static int
run_stream_until_locked(sim_stream *stream, uint64_t order, int depth)
{
    while (stream->count > 0 && stream->ops[stream->head].order <= order) {
        sim_op *head = &stream->ops[stream->head];
        if (!op_runnable(head)) {
            int status = complete_locked(head->event, head->generation, depth);
            if (status != CUDART_SUCCESS)
                return status;
            continue;
        }
        int last = stream->count == 1;
        pop_and_run_locked(stream);   /* may free a destroyed stream */
        if (last)
            break;
    }
    return CUDART_SUCCESS;
}

/* Runs what `event` reaching `generation` needs. */
static int
run_until_locked(sim_event *event, uint64_t generation)
{
    return complete_locked(event, generation, 0);
}

/* Runs what `stream`'s queued work needs, and that work. */
static int
drain_locked(sim_stream *stream)
{
    return run_stream_until_locked(stream, UINT64_MAX, 0);
}

static int
push_locked(sim_stream *stream, sim_op op)
{
    if (stream->head + stream->count == stream->cap) {
        if (stream->head > 0) {
            memmove(stream->ops, stream->ops + stream->head, stream->count * sizeof(sim_op));
            stream->head = 0;
        } else {
            size_t cap = stream->cap ? stream->cap * 2 : 16;
            sim_op *grown = realloc(stream->ops, cap * sizeof(sim_op));
            if (grown == NULL)
                return CUDART_ERROR_MEMORY_ALLOCATION;
            stream->ops = grown;
            stream->cap = cap;
        }
    }
    op.order = sim.next_order++;
    stream->ops[stream->head + stream->count++] = op;
    sim.stats.ops_queued++;
    return CUDART_SUCCESS;
}

/* ---- devices, handles, memory ranges ---------------------------------------------- */

static void
use_device(int device)
{
    sim.stats.has_context[device] = 1;
}

/* NULL is the legacy stream of the thread's current device; a handle must
 * be a live created stream. */
static sim_stream *
resolve(void *handle)
{
    if (handle == NULL)
        return &sim.legacy[current_device];
    for (sim_stream *s = sim.streams; s != NULL; s = s->next) {
        if (s == handle && !s->destroyed)
            return s;
    }
    return NULL;
}

static int
add_range(void *base, size_t bytes, int device)
{
    sim_range *range = malloc(sizeof(*range));
    if (range == NULL)
        return -1;
    *range = (sim_range){.base = base, .bytes = bytes, .device = device, .next = sim.ranges};
    sim.ranges = range;
    return 0;
}

static sim_range *
find_range(const void *ptr)
{
    for (sim_range *r = sim.ranges; r != NULL; r = r->next) {
        if ((const char *)ptr >= r->base && (const char *)ptr < r->base + r->bytes)
            return r;
    }
    return NULL;
}

/* The host now waits for the GPU. */
static void
note_sync_locked(cudart_sim_entry entry)
{
    if (sim.sync_observer != NULL)
        sim.sync_observer(entry);
}

/* Frees what sim_host_alloc (pinned) or sim_malloc (device memory) handed
 * out at `ptr`; anything else is refused and left alone. The host waits
 * for the GPU, as cudaFreeHost and cudaFree do. */
static int
free_range_locked(void *ptr, int pinned, cudart_sim_entry entry)
{
    sim_range **link = &sim.ranges;
    while (*link != NULL && (*link)->base != ptr)
        link = &(*link)->next;
    sim_range *range = *link;
    if (range == NULL || (range->device == -1) != pinned)
        return CUDART_ERROR_INVALID_VALUE;
    note_sync_locked(entry);
    advance_locked(UINT64_MAX);
    if (pinned)
        sim.stats.host_bytes_live -= range->bytes;
    else
        sim.stats.device_bytes_live[range->device] -= range->bytes;
    *link = range->next;
    free(range);
    free(ptr);
    return CUDART_SUCCESS;
}

/* ---- entry and exit of every runtime call ------------------------------------------ */

/* Takes the lock, counts the call, lets the "GPU" make its progress and
 * says whether an injected failure applies (its status, else success). */
static int
enter(cudart_sim_entry entry)
{
    pthread_mutex_lock(&sim.lock);
    sim.stats.calls[entry]++;
    advance_locked(sim.progress_per_call);
    sim_failure *failure = &sim.failures[entry];
    if (failure->skip > 0) {
        failure->skip--;
        return CUDART_SUCCESS;
    }
    if (failure->count == 0)
        return CUDART_SUCCESS;
    failure->count--;
    return failure->status;
}

static int
leave(int status)
{
    pthread_mutex_unlock(&sim.lock);
    if (status != CUDART_SUCCESS)
        last_error = status;
    return status;
}

/* ---- the runtime table ------------------------------------------------------------ */

static int
sim_get_device_count(int *count)
{
    int status = enter(SIM_GET_DEVICE_COUNT);
    if (status == CUDART_SUCCESS)
        *count = CUDART_SIM_DEVICES;
    return leave(status);
}

static int
sim_get_device(int *device)
{
    int status = enter(SIM_GET_DEVICE);
    if (status == CUDART_SUCCESS)
        *device = current_device;
    return leave(status);
}

static int
sim_set_device(int device)
{
    int status = enter(SIM_SET_DEVICE);
    if (status == CUDART_SUCCESS && (device < 0 || device >= CUDART_SIM_DEVICES))
        status = CUDART_ERROR_INVALID_DEVICE;
    if (status == CUDART_SUCCESS) {
        /* since CUDA 12 setting a device initializes its primary context */
        current_device = device;
        use_device(device);
    }
    return leave(status);
}

static int
aligned_alloc_range(void **ptr, size_t bytes, int device)
{
    void *base = NULL;
    if (posix_memalign(&base, HOST_ALIGN, bytes ? bytes : 1) != 0)
        return CUDART_ERROR_MEMORY_ALLOCATION;
    if (add_range(base, bytes ? bytes : 1, device) < 0) {
        free(base);
        return CUDART_ERROR_MEMORY_ALLOCATION;
    }
    *ptr = base;
    return CUDART_SUCCESS;
}

static int
sim_host_alloc(void **ptr, size_t bytes, unsigned flags)
{
    (void)flags;
    int status = enter(SIM_HOST_ALLOC);
    if (status == CUDART_SUCCESS)
        status = aligned_alloc_range(ptr, bytes, -1);
    if (status == CUDART_SUCCESS) {
        use_device(current_device);  /* pinning happens in the current context */
        sim.stats.host_bytes_live += bytes;
    }
    return leave(status);
}

static int
sim_free_host(void *ptr)
{
    int status = enter(SIM_FREE_HOST);
    if (status == CUDART_SUCCESS && ptr != NULL)
        status = free_range_locked(ptr, 1, SIM_FREE_HOST);
    return leave(status);
}

static int
sim_malloc(void **ptr, size_t bytes)
{
    int status = enter(SIM_MALLOC);
    if (status == CUDART_SUCCESS)
        status = aligned_alloc_range(ptr, bytes, current_device);
    if (status == CUDART_SUCCESS) {
        use_device(current_device);
        sim.stats.device_bytes_live[current_device] += bytes;
    }
    return leave(status);
}

static int
sim_free(void *ptr)
{
    int status = enter(SIM_FREE);
    if (status == CUDART_SUCCESS && ptr != NULL)
        status = free_range_locked(ptr, 0, SIM_FREE);
    return leave(status);
}

static int
sim_stream_create(void **stream, unsigned flags)
{
    (void)flags;
    int status = enter(SIM_STREAM_CREATE);
    sim_stream *created = status == CUDART_SUCCESS ? calloc(1, sizeof(*created)) : NULL;
    if (status == CUDART_SUCCESS && created == NULL)
        status = CUDART_ERROR_MEMORY_ALLOCATION;
    if (status == CUDART_SUCCESS) {
        created->device = current_device;
        created->created = 1;
        created->next = sim.streams;
        sim.streams = created;
        sim.stats.streams_live++;
        use_device(current_device);
        *stream = created;
    }
    return leave(status);
}

static int
sim_stream_destroy(void *stream)
{
    int status = enter(SIM_STREAM_DESTROY);
    sim_stream *s = stream == NULL ? NULL : resolve(stream);
    if (status == CUDART_SUCCESS && s == NULL)
        status = CUDART_ERROR_INVALID_HANDLE;
    if (status == CUDART_SUCCESS) {
        /* as in CUDA, queued work still runs; the stream goes once it has */
        s->destroyed = 1;
        if (s->count == 0)
            stream_unlink_and_free(s);
    }
    return leave(status);
}

static int
sim_stream_wait_event(void *stream, void *event_handle, unsigned flags)
{
    (void)flags;
    sim_event *event = event_handle;
    int status = enter(SIM_STREAM_WAIT_EVENT);
    sim_stream *s = resolve(stream);
    if (status == CUDART_SUCCESS && s == NULL)
        status = CUDART_ERROR_INVALID_HANDLE;
    if (status != CUDART_SUCCESS || event->completed >= event->recorded)
        return leave(status);
    event->refs++;
    status = push_locked(s, (sim_op){.kind = OP_WAIT, .event = event,
                                     .generation = event->recorded});
    if (status != CUDART_SUCCESS)
        event->refs--;
    return leave(status);
}

static int
sim_stream_synchronize(void *stream)
{
    int status = enter(SIM_STREAM_SYNCHRONIZE);
    sim_stream *s = resolve(stream);
    if (status == CUDART_SUCCESS && s == NULL)
        status = CUDART_ERROR_INVALID_HANDLE;
    if (status == CUDART_SUCCESS) {
        note_sync_locked(SIM_STREAM_SYNCHRONIZE);
        status = drain_locked(s);
    }
    return leave(status);
}

static int
sim_event_create(void **event, unsigned flags)
{
    (void)flags;
    int status = enter(SIM_EVENT_CREATE);
    sim_event *created = status == CUDART_SUCCESS ? calloc(1, sizeof(*created)) : NULL;
    if (status == CUDART_SUCCESS && created == NULL)
        status = CUDART_ERROR_MEMORY_ALLOCATION;
    if (status == CUDART_SUCCESS) {
        created->refs = 1;
        created->device = current_device;
        use_device(current_device);
        sim.stats.events_live++;
        *event = created;
    }
    return leave(status);
}

static int
sim_event_destroy(void *event)
{
    int status = enter(SIM_EVENT_DESTROY);
    if (status == CUDART_SUCCESS) {
        sim.stats.events_live--;
        event_release(event);
    }
    return leave(status);
}

static int
sim_event_record(void *event_handle, void *stream)
{
    sim_event *event = event_handle;
    int status = enter(SIM_EVENT_RECORD);
    sim_stream *s = resolve(stream);
    if (status == CUDART_SUCCESS && (s == NULL || s->device != event->device))
        status = CUDART_ERROR_INVALID_HANDLE;   /* as CUDA: event and stream on one device */
    if (status != CUDART_SUCCESS)
        return leave(status);
    uint64_t generation = ++event->recorded;
    event->refs++;
    status = push_locked(s, (sim_op){.kind = OP_RECORD, .event = event, .generation = generation});
    if (status != CUDART_SUCCESS) {
        event->refs--;
        event->recorded--;
    }
    return leave(status);
}

static int
sim_event_query(void *event)
{
    int status = enter(SIM_EVENT_QUERY);
    if (status == CUDART_SUCCESS && !event_done(event))
        status = CUDART_ERROR_NOT_READY;
    return leave(status);
}

static int
sim_event_synchronize(void *event_handle)
{
    sim_event *event = event_handle;
    int status = enter(SIM_EVENT_SYNCHRONIZE);
    if (status == CUDART_SUCCESS) {
        note_sync_locked(SIM_EVENT_SYNCHRONIZE);
        status = run_until_locked(event, event->recorded);
    }
    return leave(status);
}

/* Host memory not pinned by cudaHostAlloc: CUDA copies through it
 * synchronously (a D2H returns once the copy completed). */
static int
touches_pageable(const void *dst, const void *src, int kind)
{
    const void *host = kind == CUDART_MEMCPY_DEVICE_TO_HOST ? dst
                       : kind == CUDART_MEMCPY_HOST_TO_DEVICE ? src : NULL;
    if (host == NULL)
        return 0;
    sim_range *range = find_range(host);
    return range == NULL || range->device != -1;
}

static int
sim_memcpy_async(void *dst, const void *src, size_t bytes, int kind, void *stream)
{
    int status = enter(SIM_MEMCPY_ASYNC);
    sim_stream *s = resolve(stream);
    if (status == CUDART_SUCCESS && s == NULL)
        status = CUDART_ERROR_INVALID_HANDLE;
    if (status == CUDART_SUCCESS)
        status = push_locked(s, (sim_op){.kind = OP_COPY, .dst = dst, .src = src,
                                         .bytes = bytes});
    if (status == CUDART_SUCCESS) {
        use_device(s->device);
        if (touches_pageable(dst, src, kind)) {
            sim.stats.pageable_copies++;
            note_sync_locked(SIM_MEMCPY_ASYNC);
            status = drain_locked(s);
        }
    }
    return leave(status);
}

static int
sim_mem_get_info(size_t *free_bytes, size_t *total_bytes)
{
    int status = enter(SIM_MEM_GET_INFO);
    if (status == CUDART_SUCCESS) {
        use_device(current_device);
        *total_bytes = (size_t)1 << 34;
        *free_bytes = *total_bytes - sim.stats.device_bytes_live[current_device];
    }
    return leave(status);
}

static int
sim_device_synchronize(void)
{
    int status = enter(SIM_DEVICE_SYNCHRONIZE);
    if (status == CUDART_SUCCESS) {
        note_sync_locked(SIM_DEVICE_SYNCHRONIZE);
        status = drain_locked(&sim.legacy[current_device]);
    }
    for (sim_stream *s = sim.streams; status == CUDART_SUCCESS && s != NULL; s = s->next) {
        if (s->device == current_device)
            status = drain_locked(s);
    }
    return leave(status);
}

static int
sim_get_last_error(void)
{
    pthread_mutex_lock(&sim.lock);
    sim.stats.calls[SIM_GET_LAST_ERROR]++;
    pthread_mutex_unlock(&sim.lock);
    int status = last_error;
    last_error = CUDART_SUCCESS;
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
    default: return "simulated CUDA error";
    }
}

static const cudart sim_table = {
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
};

/* ---- test controls ---------------------------------------------------------------- */

const cudart *
cudart_sim(void)
{
    pthread_mutex_lock(&sim.lock);
    for (int d = 0; d < CUDART_SIM_DEVICES; d++)
        sim.legacy[d].device = d;
    pthread_mutex_unlock(&sim.lock);
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
    pthread_mutex_lock(&sim.lock);
    uint64_t ran = advance_locked(ops);
    pthread_mutex_unlock(&sim.lock);
    return ran;
}

void
cudart_sim_set_progress(uint64_t progress_per_call)
{
    pthread_mutex_lock(&sim.lock);
    sim.progress_per_call = progress_per_call;
    pthread_mutex_unlock(&sim.lock);
}

int
cudart_sim_launch(int device, void *stream)
{
    if (device < 0 || device >= CUDART_SIM_DEVICES)
        return CUDART_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&sim.lock);
    sim_stream *s = stream == NULL ? &sim.legacy[device] : resolve(stream);
    int status = s == NULL ? CUDART_ERROR_INVALID_HANDLE : drain_locked(s);
    if (last_error != CUDART_SUCCESS) {
        sim.stats.launch_errors++;
        last_error = CUDART_SUCCESS;
    }
    pthread_mutex_unlock(&sim.lock);
    return status;
}

int
cudart_sim_current_device(void)
{
    return current_device;
}

int
cudart_sim_set_current_device(int device)
{
    if (device < 0 || device >= CUDART_SIM_DEVICES)
        return CUDART_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&sim.lock);
    current_device = device;
    use_device(device);
    pthread_mutex_unlock(&sim.lock);
    return CUDART_SUCCESS;
}

void *
cudart_sim_current_stream(int device)
{
    return device >= 0 && device < CUDART_SIM_DEVICES ? current_streams[device] : NULL;
}

void
cudart_sim_set_current_stream(int device, void *stream)
{
    if (device >= 0 && device < CUDART_SIM_DEVICES)
        current_streams[device] = stream;
}

int
cudart_sim_stream_device(void *stream)
{
    pthread_mutex_lock(&sim.lock);
    sim_stream *s = stream == NULL ? NULL : resolve(stream);
    int device = s == NULL ? -1 : s->device;
    pthread_mutex_unlock(&sim.lock);
    return device;
}

int
cudart_sim_device_of(const void *ptr)
{
    pthread_mutex_lock(&sim.lock);
    sim_range *range = find_range(ptr);
    int device = range == NULL ? -1 : range->device;
    pthread_mutex_unlock(&sim.lock);
    return device;
}

int
cudart_sim_peek_last_error(void)
{
    return last_error;
}

void
cudart_sim_fail(cudart_sim_entry entry, uint64_t skip, uint64_t count, int status)
{
    if ((int)entry < 0 || entry >= SIM_ENTRY_COUNT)
        return;
    pthread_mutex_lock(&sim.lock);
    sim.failures[entry] = (sim_failure){.skip = skip, .count = count, .status = status};
    pthread_mutex_unlock(&sim.lock);
}

void
cudart_sim_set_sync_observer(cudart_sim_observer observer)
{
    pthread_mutex_lock(&sim.lock);
    sim.sync_observer = observer;
    pthread_mutex_unlock(&sim.lock);
}

void
cudart_sim_forget_contexts(void)
{
    pthread_mutex_lock(&sim.lock);
    memset(sim.stats.has_context, 0, sizeof(sim.stats.has_context));
    pthread_mutex_unlock(&sim.lock);
}

int
cudart_sim_event_done(void *event)
{
    pthread_mutex_lock(&sim.lock);
    int done = event_done(event);
    pthread_mutex_unlock(&sim.lock);
    return done;
}

cudart_sim_stats
cudart_sim_get_stats(void)
{
    pthread_mutex_lock(&sim.lock);
    cudart_sim_stats stats = sim.stats;
    pthread_mutex_unlock(&sim.lock);
    return stats;
}
