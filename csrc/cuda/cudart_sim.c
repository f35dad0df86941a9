#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* posix_memalign */
#endif
#include "cudart_sim.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define HOST_HEADER 64  /* keeps handed-out memory 64-byte aligned */

typedef struct {
    uint64_t recorded;          /* generation of the last record queued */
    uint64_t completed;         /* generation of the last record that ran */
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
    int destroyed;              /* freed once its queue ran dry */
    struct sim_stream *next;
} sim_stream;

/* The whole simulation. Process-wide because the runtime table it stands
 * for is; every access holds `lock`. */
static struct {
    pthread_mutex_t lock;
    sim_stream *streams;
    uint64_t next_order;
    uint64_t progress_per_call;
    cudart_sim_stats stats;
} sim = {.lock = PTHREAD_MUTEX_INITIALIZER};

static char compute_stream_marker;

static int
is_compute(void *stream)
{
    /* the legacy default stream (NULL) is the compute stream too */
    return stream == NULL || stream == &compute_stream_marker;
}

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
    free(stream->ops);
    free(stream);
}

/* Runs the oldest runnable head operation of any stream; 0 if none. */
static int
run_one_locked(void)
{
    sim_stream *oldest = NULL;
    for (sim_stream *s = sim.streams; s != NULL; s = s->next) {
        if (s->count > 0 && op_runnable(&s->ops[s->head]) &&
            (oldest == NULL || s->ops[s->head].order < oldest->ops[oldest->head].order))
            oldest = s;
    }
    if (oldest == NULL)
        return 0;
    sim_op op = oldest->ops[oldest->head];
    oldest->head++;
    oldest->count--;
    sim.stats.ops_queued--;
    if (oldest->count == 0 && oldest->destroyed) {
        sim.stats.streams_live--;
        stream_unlink_and_free(oldest);
    }
    op_run(&op);
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

/* Runs streams until `event` reached `generation`. */
static int
run_until_locked(sim_event *event, uint64_t generation)
{
    while (event->completed < generation) {
        if (!run_one_locked())
            return CUDART_SIM_DEADLOCK;
    }
    return CUDART_SUCCESS;
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

/* Every entry point: take the lock and let the "GPU" make its progress. */
static void
enter(void)
{
    pthread_mutex_lock(&sim.lock);
    advance_locked(sim.progress_per_call);
}

static int
leave(int status)
{
    pthread_mutex_unlock(&sim.lock);
    return status;
}

/* ---- the runtime table ------------------------------------------------ */

static int
sim_get_device_count(int *count)
{
    *count = 1;
    return CUDART_SUCCESS;
}

static int
sim_get_device(int *device)
{
    *device = 0;
    return CUDART_SUCCESS;
}

static int
sim_set_device(int device)
{
    return device == 0 ? CUDART_SUCCESS : 101; /* cudaErrorInvalidDevice */
}

static int
sim_host_alloc(void **ptr, size_t bytes, unsigned flags)
{
    (void)flags;
    void *base = NULL;
    if (bytes > SIZE_MAX - HOST_HEADER || posix_memalign(&base, HOST_HEADER, bytes + HOST_HEADER))
        return CUDART_ERROR_MEMORY_ALLOCATION;
    memcpy(base, &bytes, sizeof(bytes));
    *ptr = (char *)base + HOST_HEADER;
    pthread_mutex_lock(&sim.lock);
    sim.stats.host_bytes_live += bytes;
    return leave(CUDART_SUCCESS);
}

static int
sim_free_host(void *ptr)
{
    if (ptr == NULL)
        return CUDART_SUCCESS;
    char *base = (char *)ptr - HOST_HEADER;
    size_t bytes;
    memcpy(&bytes, base, sizeof(bytes));
    pthread_mutex_lock(&sim.lock);
    sim.stats.host_bytes_live -= bytes;
    pthread_mutex_unlock(&sim.lock);
    free(base);
    return CUDART_SUCCESS;
}

static int
sim_malloc(void **ptr, size_t bytes)
{
    return sim_host_alloc(ptr, bytes, 0);
}

static int
sim_stream_create(void **stream, unsigned flags)
{
    (void)flags;
    sim_stream *created = calloc(1, sizeof(*created));
    if (created == NULL)
        return CUDART_ERROR_MEMORY_ALLOCATION;
    enter();
    created->next = sim.streams;
    sim.streams = created;
    sim.stats.streams_live++;
    *stream = created;
    return leave(CUDART_SUCCESS);
}

static int
sim_stream_destroy(void *stream)
{
    if (is_compute(stream))
        return 1; /* cudaErrorInvalidValue */
    sim_stream *s = stream;
    enter();
    /* as in CUDA, queued work still runs; the stream goes once it has */
    s->destroyed = 1;
    if (s->count == 0) {
        sim.stats.streams_live--;
        stream_unlink_and_free(s);
    }
    return leave(CUDART_SUCCESS);
}

static int
sim_stream_wait_event(void *stream, void *event_handle, unsigned flags)
{
    (void)flags;
    sim_event *event = event_handle;
    enter();
    uint64_t generation = event->recorded;
    if (is_compute(stream))
        return leave(run_until_locked(event, generation));
    if (event->completed >= generation)
        return leave(CUDART_SUCCESS);
    event->refs++;
    int status = push_locked(stream, (sim_op){.kind = OP_WAIT, .event = event,
                                              .generation = generation});
    if (status != CUDART_SUCCESS)
        event->refs--;
    return leave(status);
}

static int
sim_event_create(void **event, unsigned flags)
{
    (void)flags;
    sim_event *created = calloc(1, sizeof(*created));
    if (created == NULL)
        return CUDART_ERROR_MEMORY_ALLOCATION;
    created->refs = 1;
    enter();
    sim.stats.events_live++;
    *event = created;
    return leave(CUDART_SUCCESS);
}

static int
sim_event_destroy(void *event)
{
    enter();
    sim.stats.events_live--;
    event_release(event);
    return leave(CUDART_SUCCESS);
}

static int
sim_event_record(void *event_handle, void *stream)
{
    sim_event *event = event_handle;
    enter();
    uint64_t generation = ++event->recorded;
    if (is_compute(stream)) {
        event->completed = generation;
        return leave(CUDART_SUCCESS);
    }
    event->refs++;
    int status = push_locked(stream, (sim_op){.kind = OP_RECORD, .event = event,
                                              .generation = generation});
    if (status != CUDART_SUCCESS) {
        event->refs--;
        event->recorded--;
    }
    return leave(status);
}

static int
sim_event_query(void *event)
{
    enter();
    return leave(event_done(event) ? CUDART_SUCCESS : CUDART_ERROR_NOT_READY);
}

static int
sim_event_synchronize(void *event_handle)
{
    sim_event *event = event_handle;
    enter();
    return leave(run_until_locked(event, event->recorded));
}

static int
sim_memcpy_async(void *dst, const void *src, size_t bytes, int kind, void *stream)
{
    (void)kind;
    enter();
    if (is_compute(stream)) {
        memcpy(dst, src, bytes);
        sim.stats.copies_run++;
        return leave(CUDART_SUCCESS);
    }
    return leave(push_locked(stream, (sim_op){.kind = OP_COPY, .dst = dst, .src = src,
                                              .bytes = bytes}));
}

static int
sim_free(void *ptr)
{
    return sim_free_host(ptr);
}

static int
sim_mem_get_info(size_t *free_bytes, size_t *total_bytes)
{
    *free_bytes = *total_bytes = (size_t)1 << 34;
    return CUDART_SUCCESS;
}

static int
sim_device_synchronize(void)
{
    enter();
    advance_locked(UINT64_MAX);
    return leave(sim.stats.ops_queued == 0 ? CUDART_SUCCESS : CUDART_SIM_DEADLOCK);
}

static int
sim_get_last_error(void)
{
    return CUDART_SUCCESS;
}

static const char *
sim_get_error_string(int status)
{
    switch (status) {
    case CUDART_SUCCESS: return "no error (simulated)";
    case CUDART_ERROR_NOT_READY: return "device not ready (simulated)";
    case CUDART_ERROR_MEMORY_ALLOCATION: return "out of memory (simulated)";
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

/* ---- test controls -------------------------------------------------------- */

const cudart *
cudart_sim(void)
{
    return &sim_table;
}

void *
cudart_sim_compute_stream(void)
{
    return &compute_stream_marker;
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
