/* Host backend of the allocator, for tests: "device memory" is aligned host
 * memory (so tests can write patterns into blocks), and streams are
 * counters the test drives. A stream handle is an alloc_host_stream *;
 * NULL is a stream whose work is always complete.
 *
 * Thread-safety: every counter is atomic. */
#ifndef MATEPOINT_ALLOC_HOST_H
#define MATEPOINT_ALLOC_HOST_H

#include "alloc.h"

#include <stdatomic.h>

typedef struct {
    _Atomic uint64_t submitted;     /* work queued on the stream */
    _Atomic uint64_t completed;     /* work finished */
    _Atomic int capturing;          /* 1: being captured into a CUDA graph (tests set it) */
} alloc_host_stream;

typedef struct {
    uint64_t capacity_bytes;        /* 0: unlimited */
    _Atomic uint64_t live_bytes;
    _Atomic int64_t live_events;
    _Atomic uint64_t events_recorded, event_queries;    /* calls, for tests and benchmarks */
    _Atomic uint64_t events_created;                    /* records that made a new event */
    _Atomic uint64_t event_waits;                       /* calls, for tests */
    /* the event_wait call that makes their count this number fails
     * (ALLOC_ERROR, nothing waited for); 0: none. Tests set it */
    _Atomic uint64_t fail_wait_at;
} alloc_host_ctx;

void alloc_host_init(alloc_host_ctx *ctx, uint64_t capacity_bytes);
alloc_backend alloc_host_backend(alloc_host_ctx *ctx);

/* Queue one unit of work on `stream`; finish all queued work. */
void alloc_host_submit(alloc_host_stream *stream);
void alloc_host_complete(alloc_host_stream *stream);

#endif
