#include "alloc_host.h"
#include "common/host_memory.h"

#include <stdint.h>
#include <stdlib.h>

typedef struct {
    alloc_host_stream *stream;
    uint64_t mark;              /* work queued on the stream when recorded */
} host_event;

void
alloc_host_init(alloc_host_ctx *ctx, uint64_t capacity_bytes)
{
    ctx->capacity_bytes = capacity_bytes;
    atomic_store(&ctx->live_bytes, 0);
    atomic_store(&ctx->live_events, 0);
    atomic_store(&ctx->events_recorded, 0);
    atomic_store(&ctx->events_created, 0);
    atomic_store(&ctx->event_queries, 0);
    atomic_store(&ctx->event_waits, 0);
    atomic_store(&ctx->fail_wait_at, 0);
}

/* 1 when a test asked the wait just counted to fail. */
static int
wait_fails(alloc_host_ctx *host)
{
    return atomic_load(&host->event_waits) == atomic_load(&host->fail_wait_at);
}

void
alloc_host_submit(alloc_host_stream *stream)
{
    atomic_fetch_add(&stream->submitted, 1);
}

void
alloc_host_complete(alloc_host_stream *stream)
{
    atomic_store(&stream->completed, atomic_load(&stream->submitted));
}

/* 512-byte alignment, as the allocator's rounding assumes of device memory */
static int
host_malloc(void *ctx, int device, uint64_t bytes, void **ptr)
{
    alloc_host_ctx *host = ctx;
    (void)device;
    *ptr = mp_host_alloc_capped(&host->live_bytes, host->capacity_bytes, bytes, 512);
    return *ptr != NULL ? ALLOC_OK : ALLOC_OUT_OF_MEMORY;
}

static void
host_free(void *ctx, int device, void *ptr, uint64_t bytes)
{
    alloc_host_ctx *host = ctx;
    (void)device;
    mp_host_free_capped(&host->live_bytes, ptr, bytes);
}

static int
host_event_record(void *ctx, int device, void *stream, void **event)
{
    alloc_host_ctx *host = ctx;
    (void)device;
    host_event *e = *event;
    if (e == NULL) {
        if ((e = malloc(sizeof(*e))) == NULL)
            return ALLOC_ERROR;
        atomic_fetch_add(&host->live_events, 1);
        atomic_fetch_add(&host->events_created, 1);
    }
    e->stream = stream;
    e->mark = stream ? atomic_load(&e->stream->submitted) : 0;
    atomic_fetch_add(&host->events_recorded, 1);
    *event = e;
    return ALLOC_OK;
}

static int
host_event_query(void *ctx, void *event)
{
    alloc_host_ctx *host = ctx;
    host_event *e = event;
    atomic_fetch_add(&host->event_queries, 1);
    return e->stream == NULL || atomic_load(&e->stream->completed) >= e->mark;
}

static int
host_event_wait(void *ctx, void *event)
{
    alloc_host_ctx *host = ctx;
    host_event *e = event;
    atomic_fetch_add(&host->event_waits, 1);
    if (wait_fails(host))
        return ALLOC_ERROR;
    if (e->stream == NULL)
        return ALLOC_OK;
    uint64_t done = atomic_load(&e->stream->completed);
    while (done < e->mark &&
           !atomic_compare_exchange_weak(&e->stream->completed, &done, e->mark))
        ;
    return ALLOC_OK;
}

static void
host_event_free(void *ctx, void *event)
{
    alloc_host_ctx *host = ctx;
    atomic_fetch_sub(&host->live_events, 1);
    free(event);
}

static int
host_stream_capturing(void *ctx, int device, void *stream)
{
    alloc_host_stream *s = stream;
    (void)ctx;
    (void)device;
    return s != NULL && atomic_load(&s->capturing);
}

/* The capacity and what is left of it (0 and 0 without a cap). */
static int
host_mem_info(void *ctx, int device, uint64_t *free_bytes, uint64_t *total_bytes)
{
    alloc_host_ctx *host = ctx;
    (void)device;
    uint64_t live = atomic_load(&host->live_bytes);
    *total_bytes = host->capacity_bytes;
    *free_bytes = host->capacity_bytes > live ? host->capacity_bytes - live : 0;
    return ALLOC_OK;
}

alloc_backend
alloc_host_backend(alloc_host_ctx *ctx)
{
    return (alloc_backend){
        .device_malloc = host_malloc, .device_free = host_free,
        .event_record = host_event_record, .event_query = host_event_query,
        .event_wait = host_event_wait, .event_free = host_event_free,
        .stream_capturing = host_stream_capturing,
        .mem_info = host_mem_info, .ctx = ctx,
    };
}
