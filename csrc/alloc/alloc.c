/* The allocator's public API (alloc.h) over its parts: blocks and segments
 * (alloc_blocks.c), streams and events (alloc_streams.c), statistics
 * (alloc_stats.c). Contract of the parts: alloc_internal.h. */
#include "alloc_internal.h"

#include <stdlib.h>
#include <string.h>

/* Allocators made so far in the process (atomic, no owner): each gets the
 * next as its id, which a thread's last failure names (alloc_stats.c). */
static _Atomic uint64_t allocators_made;

allocator *
alloc_create(alloc_backend backend, int device_count)
{
    if (device_count <= 0)
        device_count = 1;
    allocator *a = calloc(1, sizeof(*a));
    if (a == NULL)
        return NULL;
    a->devices = calloc((size_t)device_count, sizeof(device_state));
    if (a->devices == NULL) {
        free(a);
        return NULL;
    }
    a->backend = backend;
    a->device_count = device_count;
    a->id = atomic_fetch_add(&allocators_made, 1) + 1;
    pthread_mutex_init(&a->history_lock, NULL);
    for (int i = 0; i < device_count; i++) {
        pthread_mutex_init(&a->devices[i].lock, NULL);
        a->devices[i].index = i;
        a->devices[i].limit = UINT64_MAX;
        a->devices[i].fraction = 1.0;
    }
    return a;
}

/* A request that got nothing: out of memory is counted and recorded
 * (torch's num_ooms and its trace's oom), a backend error (`status`
 * ALLOC_ERROR, a CUDA failure the backend reported) neither: torch's
 * allocator raises such an error as it is, before its out-of-memory
 * path. Unlocks the device. */
static void *
malloc_failed(allocator *a, device_state *dev, int status, uint64_t size, uint64_t rounded,
              void *stream, const private_pool *pool, uint64_t tag, void *context)
{
    if (status != ALLOC_ERROR) {
        stats_record_oom(a, dev, size, rounded);
        history_record_oom(a, dev, rounded, stream, pool, tag, context);
    }
    history_drop(dev, context);
    pthread_mutex_unlock(&dev->lock);
    return NULL;
}

void *
alloc_malloc(allocator *a, uint64_t size, int device, void *stream, uint64_t tag)
{
    int why;
    return alloc_malloc_why(a, size, device, stream, tag, &why);
}

void *
alloc_malloc_why(allocator *a, uint64_t size, int device, void *stream, uint64_t tag, int *why)
{
    device_state *dev = device_of(a, device);
    *why = ALLOC_OUT_OF_MEMORY;
    if (dev == NULL)
        return NULL;
    uint64_t rounded = alloc_round_size(size);
    int small = rounded <= SMALL_REQUEST;
    void *context = history_gather(a, ALLOC_CONTEXT_STATE, tag);
    pthread_mutex_lock(&dev->lock);
    /* while a capture is underway, no event is queried (torch's rule: one
     * recorded in the capture cannot be) */
    private_pool *pool = dev->active_pools != 0 ? pool_for_stream(dev, stream) : NULL;
    if (dev->unrecorded != NULL && dev->captures == 0)
        unrecorded_tick(a, dev);
    if ((dev->events_pending != 0 || dev->deferred != NULL) && dev->captures == 0)
        events_process(a, dev, 0);
    block *b = NULL;
    if (rounded != 0 &&
        (b = block_find_free(stream_list(dev, pool), rounded, small, stream, dev->index)) != NULL) {
        dev->stats.cache_hits++;
    } else if (rounded == 0 || (b = segment_new(a, dev, rounded, stream, pool, why)) == NULL) {
        return malloc_failed(a, dev, *why, size, rounded, stream, pool, tag, context);
    }
    if (block_take(b, rounded) < 0 || map_insert(dev, b) < 0) {
        if (!b->in_index)
            block_insert_free(b);
        return malloc_failed(a, dev, ALLOC_OUT_OF_MEMORY, size, rounded, stream, pool, tag,
                             context);
    }
    stats_account_malloc(dev, b, size, tag);
    /* the block keeps the stack for snapshots; the record only if asked */
    b->context = context;
    history_record(dev, ALLOC_TRACE_ALLOC, b->ptr, size, b->seg->owner, tag,
                   dev->history.when >= ALLOC_CONTEXT_ALLOC ? context : NULL);
    void *ptr = (void *)b->ptr;
    uint64_t bytes = b->size;
    *why = ALLOC_OK;
    pthread_mutex_unlock(&dev->lock);
    if (a->backend.on_handout != NULL)
        a->backend.on_handout(a->backend.ctx, device, stream, ptr, bytes);
    return ptr;
}

/* A freed block: queued behind events of the streams it was used on, or
 * free at once. When an event could not be made or recorded (the failure
 * was reported), it waits among the unrecorded blocks and records again
 * later (unrecorded_tick): a device-wide wait instead would break a capture
 * another thread runs on the device, which the allocator may not know of.
 * Lock held. */
void
block_retire(allocator *a, device_state *dev, block *b, void *context)
{
    if (b->n_extra > 0 && events_insert(a, dev, b) < 0) {
        block_defer_unrecorded(dev, b);
        return;
    }
    block_forget_streams(b);
    if (b->event_count == 0) {
        stats_block_inactive(dev, b, context);
        block_insert_free(b);
    }
}

int
alloc_free(allocator *a, void *ptr, int device)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    /* the free's own stack: its tag is the block's, known under the lock */
    void *context = history_gather(a, ALLOC_CONTEXT_ALL, ALLOC_TAG_NONE);
    pthread_mutex_lock(&dev->lock);
    block *b = map_take(dev, (uintptr_t)ptr);
    if (b == NULL) {
        history_drop(dev, context);
        pthread_mutex_unlock(&dev->lock);
        return -1;
    }
    stats_account_free(dev, b);
    history_record(dev, ALLOC_TRACE_FREE_REQUESTED, b->ptr, b->requested, b->seg->owner, b->tag,
                   history_free_context(dev, b, context));
    if (b->n_extra > 0 && dev->captures != 0)
        block_defer(dev, b);
    else
        block_retire(a, dev, b, context);
    history_drop(dev, context);
    pthread_mutex_unlock(&dev->lock);
    return 0;
}

/* Adds `use` to the streams `b` is used on: in the block while they fit
 * (no malloc for the common one or two), else in a grown array. 0, or -1
 * without memory. */
static int
remember_stream(block *b, stream_use use)
{
    if (b->n_extra < EXTRA_INLINE) {
        b->extra_streams = b->extra_inline;
    } else {
        int inline_now = b->extra_streams == b->extra_inline;
        size_t bytes = sizeof(stream_use) * (size_t)(b->n_extra + 1);
        stream_use *grown = realloc(inline_now ? NULL : b->extra_streams, bytes);
        if (grown == NULL)
            return -1;
        if (inline_now)
            memcpy(grown, b->extra_inline, sizeof(b->extra_inline));
        b->extra_streams = grown;
    }
    b->extra_streams[b->n_extra++] = use;
    return 0;
}

/* 1 when `b` is known to be used on `use` already: its own stream (whose
 * uses it orders itself) or one recorded. */
static int
used_on(const block *b, stream_use use)
{
    if (b->seg->owner->stream == use.stream && b->seg->dev->index == use.device)
        return 1;
    for (int i = 0; i < b->n_extra; i++) {
        if (b->extra_streams[i].stream == use.stream && b->extra_streams[i].device == use.device)
            return 1;
    }
    return 0;
}

int
alloc_record_stream(allocator *a, void *ptr, void *stream)
{
    return alloc_record_stream_on(a, ptr, stream, -1);
}

int
alloc_record_stream_on(allocator *a, void *ptr, void *stream, int stream_device)
{
    for (int d = 0; d < a->device_count; d++) {
        device_state *dev = &a->devices[d];
        pthread_mutex_lock(&dev->lock);
        block *b = map_find(dev, (uintptr_t)ptr);
        int result = -1;
        if (b != NULL) {
            stream_use use = {stream, stream_device < 0 ? dev->index : stream_device};
            result = used_on(b, use) ? 0 : remember_stream(b, use);
        }
        pthread_mutex_unlock(&dev->lock);
        if (b != NULL)
            return result;
    }
    return 1;
}

void
alloc_empty_cache(allocator *a)
{
    for (int d = 0; d < a->device_count; d++) {
        device_state *dev = &a->devices[d];
        pthread_mutex_lock(&dev->lock);
        segment_release_cached(a, dev);
        pthread_mutex_unlock(&dev->lock);
    }
}

void
alloc_set_limit(allocator *a, int device, uint64_t limit_bytes)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return;
    pthread_mutex_lock(&dev->lock);
    dev->limit = limit_bytes;
    pthread_mutex_unlock(&dev->lock);
}

/* `fraction` (in [0, 1]) of `total` bytes. The product of a total near
 * UINT64_MAX rounds up to 2^64 as a double, whose conversion is undefined:
 * a product at the total (rounded) is the total. */
static uint64_t
fraction_of(double fraction, uint64_t total)
{
    double bytes = fraction * (double)total;
    return bytes >= (double)total ? total : (uint64_t)bytes;
}

int
alloc_set_fraction(allocator *a, int device, double fraction, uint64_t total_bytes)
{
    device_state *dev = device_of(a, device);
    /* NaN fails both comparisons: (uint64_t)(NaN * total) is undefined */
    if (dev == NULL || !(fraction >= 0.0 && fraction <= 1.0))
        return -1;
    pthread_mutex_lock(&dev->lock);
    dev->fraction = fraction;
    if (total_bytes != 0)
        dev->limit = fraction_of(fraction, total_bytes);
    pthread_mutex_unlock(&dev->lock);
    return 0;
}

double
alloc_fraction(allocator *a, int device)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1.0;
    pthread_mutex_lock(&dev->lock);
    double fraction = dev->fraction;
    pthread_mutex_unlock(&dev->lock);
    return fraction;
}

void
alloc_destroy(allocator *a)
{
    if (a == NULL)
        return;
    alloc_empty_cache(a);
    for (int d = 0; d < a->device_count; d++) {
        device_state *dev = &a->devices[d];
        /* pools still in use too: nothing replays them any more */
        pthread_mutex_lock(&dev->lock);
        segment_release_free(a, dev, RELEASE_ALL);
        pthread_mutex_unlock(&dev->lock);
        /* segments with live blocks stay with the backend: only our books go */
        for (segment *seg = dev->segments, *next; seg != NULL; seg = next) {
            next = seg->next;
            for (block *b = seg->first, *after; b != NULL; b = after) {
                after = b->next;
                block_forget_streams(b);
                history_drop(dev, b->context);
                free(b);
            }
            free(seg);
        }
        /* empty_cache waited for every event: the streams hold none */
        for (stream_state *s = dev->streams, *next; s != NULL; s = next) {
            next = s->next;
            events_free_chain(a, s->head);
            free(s);
        }
        pools_free_all(dev);
        blocks_free_spares(dev);
        free(dev->map);
        free(dev->tags);
        free(dev->pool_figures);
        for (uint64_t i = 0; i < dev->ring_count; i++)
            history_drop(dev, dev->ring[(dev->ring_head + i) % dev->ring_capacity].context);
        free(dev->ring);
        pthread_mutex_destroy(&dev->lock);
    }
    pthread_mutex_destroy(&a->history_lock);
    free(a->devices);
    free(a);
}
