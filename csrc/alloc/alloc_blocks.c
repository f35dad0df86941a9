/* Blocks and segments: size rounding, the free index (per-stream buckets),
 * best fit, split and coalesce, and segments taken from and given back to
 * the backend. Contract: alloc_internal.h. */
#include "alloc_internal.h"

#include <stdlib.h>

uint64_t
alloc_round_size(uint64_t size)
{
    if (size < MIN_BLOCK)
        return MIN_BLOCK;
    if (size > UINT64_MAX - (MIN_BLOCK - 1))
        return 0;   /* rounding up would wrap to a tiny block */
    return (size + MIN_BLOCK - 1) & ~(uint64_t)(MIN_BLOCK - 1);
}

uint64_t
segment_size_for(uint64_t rounded)
{
    if (rounded <= SMALL_REQUEST)
        return SMALL_SEGMENT;
    if (rounded < MID_LIMIT)
        return LARGE_SEGMENT;
    if (rounded > UINT64_MAX - (LARGE_ROUND - 1))
        return 0;
    return (rounded + LARGE_ROUND - 1) & ~(uint64_t)(LARGE_ROUND - 1);
}

static unsigned
bucket_of(uint64_t size)
{
    return 63u - (unsigned)__builtin_clzll(size);
}

/* ---- free index ---------------------------------------------------------- */

static void
list_push(block **head, block *b)
{
    MP_ASSERT(!b->in_index && b->list_prev == NULL && b->list_next == NULL);
    MP_ASSERT(*head == NULL || (*head)->list_prev == NULL);
    b->list_prev = NULL;
    b->list_next = *head;
    if (*head != NULL)
        (*head)->list_prev = b;
    *head = b;
}

static void
list_remove(block **head, block *b)
{
    MP_ASSERT(b->in_index);
    /* the links agree both ways: b is the head exactly when it has no prev */
    MP_ASSERT((b->list_prev == NULL) == (*head == b));
    MP_ASSERT(b->list_prev == NULL || b->list_prev->list_next == b);
    MP_ASSERT(b->list_next == NULL || b->list_next->list_prev == b);
    if (b->list_prev != NULL)
        b->list_prev->list_next = b->list_next;
    else
        *head = b->list_next;
    if (b->list_next != NULL)
        b->list_next->list_prev = b->list_prev;
    b->list_prev = b->list_next = NULL;
}

block **
block_bucket(block *b)
{
    return &b->seg->owner->buckets[b->seg->small][bucket_of(b->size)];
}

static void
index_insert(block *b)
{
    /* only a block nobody uses and no event waits for is free */
    MP_ASSERT(!b->allocated && b->event_count == 0 && b->n_extra == 0);
    list_push(block_bucket(b), b);
    b->in_index = 1;
    stats_segment_free(b->seg, 1, (int64_t)b->size);
}

static void
index_remove(block *b)
{
    list_remove(block_bucket(b), b);
    b->in_index = 0;
    stats_segment_free(b->seg, 0, (int64_t)b->size);
}

/* ---- blocks and segments ------------------------------------------------- */

/* A zeroed block node: a spare, or a new one (NULL without memory). */
static block *
block_node_new(device_state *dev)
{
    block *b = dev->spare_blocks;
    if (b == NULL)
        return calloc(1, sizeof(*b));
    dev->spare_blocks = b->list_next;
    mp_counter_sub(&dev->spare_block_count, 1);
    *b = (block){0};
    return b;
}

/* Keeps the node of a block merged away for the next split, up to
 * SPARE_BLOCKS_MAX per device. */
static void
block_node_give(device_state *dev, block *b)
{
    MP_ASSERT(b->context == NULL && b->n_extra == 0 && !b->allocated && !b->in_index);
    if (dev->spare_block_count >= SPARE_BLOCKS_MAX) {
        free(b);
        return;
    }
    b->list_next = dev->spare_blocks;
    dev->spare_blocks = b;
    dev->spare_block_count++;
}

void
blocks_free_spares(device_state *dev)
{
    for (block *b = dev->spare_blocks, *next; b != NULL; b = next) {
        next = b->list_next;
        free(b);
    }
    dev->spare_blocks = NULL;
    dev->spare_block_count = 0;
}

int
blocks_reserve_spares(device_state *dev, uint64_t count)
{
    while (dev->spare_block_count < count) {
        block *b = calloc(1, sizeof(*b));
        if (b == NULL)
            return -1;
        b->list_next = dev->spare_blocks;
        dev->spare_blocks = b;
        dev->spare_block_count++;
    }
    return 0;
}

/* Absorbs `victim`, the free block right after `b` in the same segment
 * (taken out of the index already), into `b`. */
static void
absorb_next(block *b, block *victim)
{
    MP_ASSERT(b->next == victim && victim->prev == b && victim->seg == b->seg);
    MP_ASSERT(b->ptr + b->size == victim->ptr);
    MP_ASSERT(!victim->allocated && !victim->in_index && victim->event_count == 0);
    b->size += victim->size;
    b->next = victim->next;
    if (victim->next != NULL)
        victim->next->prev = b;
    stats_segment_blocks(b->seg, 0);
    block_node_give(b->seg->dev, victim);
}

/* A block becomes free: merged with its free neighbours, indexed. */
void
block_insert_free(block *b)
{
    MP_ASSERT(!b->allocated && !b->in_index && b->event_count == 0);
    if (b->prev != NULL && b->prev->in_index) {
        block *prev = b->prev;
        index_remove(prev);
        absorb_next(prev, b);
        b = prev;
    }
    if (b->next != NULL && b->next->in_index) {
        block *next = b->next;
        index_remove(next);
        absorb_next(b, next);
    }
    index_insert(b);
}

/* Gives a segment whose blocks are all free back to the backend. Freeing
 * device memory waits for the device (cudaFree does), so no event is
 * needed: neither for the streams that used it, nor for a graph replayed
 * from a released pool. */
void
segment_release(allocator *a, device_state *dev, segment *seg)
{
    /* free neighbours are always merged: an all-free segment is one block */
    MP_ASSERT(seg->first->next == NULL && seg->first->size == seg->size);
    for (block *b = seg->first, *next; b != NULL; b = next) {
        next = b->next;
        index_remove(b);
        if (b != seg->first)
            free(b);
    }
    a->backend.device_free(a->backend.ctx, dev->index, (void *)seg->base, seg->size);
    stats_segment_released(dev, seg);
    history_record(dev, ALLOC_TRACE_SEGMENT_FREE, seg->base, seg->size, seg->owner, 0, NULL);
    MP_ASSERT((seg->prev == NULL) == (dev->segments == seg));
    MP_ASSERT(seg->next == NULL || seg->next->prev == seg);
    if (seg->prev != NULL)
        seg->prev->next = seg->next;
    else
        dev->segments = seg->next;
    if (seg->next != NULL)
        seg->next->prev = seg->prev;
    mp_counter_sub(&seg->owner->segments, 1);
    if (seg->owner->pool != NULL)
        mp_counter_sub(&seg->owner->pool->segments, 1);
    stream_drop_if_unused(dev, seg->owner);
    free(seg->first);
    free(seg);
}

int
segment_all_free(const segment *seg)
{
    for (const block *b = seg->first; b != NULL; b = b->next) {
        if (!b->in_index)
            return 0;
    }
    return 1;
}

/* Whether `scope` lets a segment of `pool` (NULL: the ordinary cache) go:
 * a pool still in use keeps its segments, as a graph replays into them. */
static int
in_scope(const private_pool *pool, release_scope scope)
{
    return scope == RELEASE_ALL || pool == NULL || pool_released(pool);
}

/* Releases the segments with no live or pending block that `scope` lets
 * go, then forgets the pools left empty. Lock held. */
void
segment_release_free(allocator *a, device_state *dev, release_scope scope)
{
    segment *seg = dev->segments;
    while (seg != NULL) {
        segment *next = seg->next;
        if (in_scope(seg->owner->pool, scope) && segment_all_free(seg))
            segment_release(a, dev, seg);
        seg = next;
    }
    pools_forget_done(dev);
}

/* While a capture is underway, a wait on an event or a cudaFree could
 * break it (torch's allocator skips its release of cached blocks then):
 * nothing goes. Lock held. */
void
segment_release_cached(allocator *a, device_state *dev)
{
    if (dev->captures != 0)
        return;
    dev->torch.num_sync_all_streams++;      /* torch's synchronize_and_free_events */
    unrecorded_retry(dev);
    events_process(a, dev, 1);
    events_free_spares(a, dev);
    blocks_free_spares(dev);
    segment_release_free(a, dev, RELEASE_CACHE);
}

/* Best fit among the free blocks of `stream`'s segments. Lock held. */
block *
block_find_free(stream_state **list, uint64_t size, int small, void *stream, int device)
{
    stream_state *s = stream_find_in(list, stream, device);
    if (s == NULL)
        return NULL;
    for (unsigned bucket = bucket_of(size); bucket < BUCKETS; bucket++) {
        block *best = NULL;
        for (block *b = s->buckets[small][bucket]; b != NULL; b = b->list_next) {
            if (b->size >= size && (best == NULL || b->size < best->size))
                best = b;
        }
        if (best != NULL)
            return best;
    }
    return NULL;
}

static int
should_split(const block *b, uint64_t size)
{
    uint64_t remaining = b->size - size;
    return b->seg->small ? remaining >= MIN_BLOCK : remaining > LARGE_SPLIT_MIN;
}

/* Makes the node `rest` the remainder of `b` past its first `size` bytes,
 * linked after it in the segment (not yet in any free list). Lock held. */
static void
split_into(block *b, uint64_t size, block *rest)
{
    rest->ptr = b->ptr + size;
    rest->size = b->size - size;
    rest->seg = b->seg;
    rest->prev = b;
    rest->next = b->next;
    if (b->next != NULL)
        b->next->prev = rest;
    b->next = rest;
    b->size = size;
    stats_segment_blocks(b->seg, 1);
    MP_ASSERT(b->ptr + b->size == rest->ptr && rest->ptr + rest->size <= b->seg->base + b->seg->size);
}

/* Takes `b` for a request of `size` bytes, splitting off the rest as a new
 * free block. Lock held. 0, or -1 without memory. */
int
block_take(block *b, uint64_t size)
{
    MP_ASSERT(!b->allocated && b->event_count == 0 && b->size >= size && size % MIN_BLOCK == 0);
    if (b->in_index)
        index_remove(b);
    if (should_split(b, size)) {
        block *rest = block_node_new(b->seg->dev);
        if (rest == NULL) {
            index_insert(b);
            return -1;
        }
        split_into(b, size, rest);
        block_insert_free(rest);
    }
    return 0;
}

int
block_carve(block *b, uint64_t size)
{
    MP_ASSERT(!b->allocated && b->event_count == 0 && b->size >= size && size % MIN_BLOCK == 0);
    if (b->size > size && b->seg->dev->spare_blocks == NULL)
        return -1;
    if (b->in_index)
        index_remove(b);
    if (b->size == size)
        return 0;
    split_into(b, size, block_node_new(b->seg->dev));
    return 0;
}

/* Overflow-safe: reserved + size <= limit. */
static int
within_limit(const device_state *dev, uint64_t size)
{
    return size <= dev->limit && dev->stats.reserved_bytes <= dev->limit - size;
}

static int
backend_segment(allocator *a, device_state *dev, uint64_t size, void **ptr)
{
    if (!within_limit(dev, size))
        return ALLOC_OUT_OF_MEMORY;
    return a->backend.device_malloc(a->backend.ctx, dev->index, size, ptr);
}

/* A new segment of `stream` in `pool` (NULL: the ordinary cache) holding
 * one free block; on out-of-memory it frees what the cache may and tries
 * once more, unless a capture is underway. NULL, with *status
 * ALLOC_OUT_OF_MEMORY or ALLOC_ERROR (the backend's error), when it got
 * none. */
block *
segment_new(allocator *a, device_state *dev, uint64_t rounded, void *stream, private_pool *pool,
            int *status)
{
    uint64_t size = segment_size_for(rounded);
    void *ptr = NULL;
    if (size == 0) {
        *status = ALLOC_OUT_OF_MEMORY;
        return NULL;
    }
    *status = backend_segment(a, dev, size, &ptr);
    /* while a capture is underway nothing is released (segment_release_cached):
     * no retry, and none counted, as torch's allocator skips both then */
    if (*status == ALLOC_OUT_OF_MEMORY && dev->captures == 0) {
        stats_count_retry(dev);
        segment_release_cached(a, dev);
        *status = backend_segment(a, dev, size, &ptr);
    }
    if (*status != ALLOC_OK)
        return NULL;
    *status = ALLOC_OUT_OF_MEMORY;      /* from here on only host memory can fail */
    /* after the retry, which may have forgotten this stream */
    stream_state *owner = stream_get(dev, pool, stream, dev->index);
    segment *seg = owner ? calloc(1, sizeof(*seg)) : NULL;
    block *b = seg ? calloc(1, sizeof(*b)) : NULL;
    if (b == NULL) {
        free(seg);
        a->backend.device_free(a->backend.ctx, dev->index, ptr, size);
        if (owner != NULL)
            stream_drop_if_unused(dev, owner);
        return NULL;
    }
    *seg = (segment){.base = (uintptr_t)ptr, .size = size, .small = rounded <= SMALL_REQUEST,
                     .dev = dev, .n_blocks = 1, .owner = owner, .first = b,
                     .next = dev->segments};
    if (dev->segments != NULL)
        dev->segments->prev = seg;
    dev->segments = seg;
    owner->segments++;
    if (pool != NULL)
        pool->segments++;
    *b = (block){.ptr = (uintptr_t)ptr, .size = size, .seg = seg};
    stats_segment_added(dev, seg);
    history_record(dev, ALLOC_TRACE_SEGMENT_ALLOC, seg->base, seg->size, owner, 0, NULL);
    return b;
}
