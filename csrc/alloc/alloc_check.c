/* The allocator's invariants, checked by the tests (alloc_check, alloc.h):
 * blocks tile their segments in exactly one state each, the free index,
 * the streams' queues and the pools' books agree with the blocks, and
 * torch's figures with the segments. Contract: alloc_internal.h. */
#include "alloc_internal.h"

/* `s` is on the list it belongs to: its pool's, or the device's. */
static int
stream_known(device_state *dev, const stream_state *s)
{
    for (const stream_state *t = *stream_list(dev, s->pool); t != NULL; t = t->next) {
        if (t == s)
            return 1;
    }
    return 0;
}

static int
check_segment(device_state *dev, segment *seg, uint64_t *allocated, uint64_t *live,
              uint64_t *events)
{
    uintptr_t expected = seg->base;
    uint64_t total = 0;
    if (!stream_known(dev, seg->owner))
        return -8;
    for (block *b = seg->first; b != NULL; b = b->next) {
        if (b->ptr != expected || b->seg != seg || (b->next && b->next->prev != b))
            return -1;
        if (b->allocated + (b->event_count > 0) + b->in_index + b->deferred != 1 ||
            b->event_count < 0)
            return -2;   /* exactly one state */
        *events += (uint64_t)b->event_count;
        if (b->allocated) {
            *allocated += b->size;
            (*live)++;
            if (map_find(dev, b->ptr) != b)
                return -3;
        }
        if (b->in_index && b->next && b->next->in_index)
            return -4;   /* missed coalescing */
        if (b->in_index) {
            block *found = *block_bucket(b);
            while (found != NULL && found != b)
                found = found->list_next;
            if (found == NULL)
                return -5;
        }
        expected += b->size;
        total += b->size;
    }
    return total == seg->size ? 0 : -6;
}

static uint64_t
segments_owned_by(device_state *dev, const stream_state *s)
{
    uint64_t segments = 0;
    for (segment *seg = dev->segments; seg != NULL; seg = seg->next)
        segments += seg->owner == s;
    return segments;
}

/* A pool's books match its segments: counts, its streams' counts, and
 * the number of pools being allocated to. */
static int
check_pools(device_state *dev)
{
    uint64_t active = 0, counted = 0;
    for (private_pool *p = dev->pools; p != NULL; p = p->next) {
        uint64_t segments = 0;
        for (segment *seg = dev->segments; seg != NULL; seg = seg->next)
            segments += seg->owner->pool == p;
        if (segments != p->segments || (pool_released(p) && segments == 0))
            return -13;     /* a released, empty pool is forgotten */
        for (stream_state *s = p->streams; s != NULL; s = s->next) {
            if (s->pool != p || s->head != NULL || s->segments == 0 ||
                segments_owned_by(dev, s) != s->segments)
                return -14;
        }
        active += p->use_pool != NULL;
        counted += (uint64_t)p->counted_as_capture;
        if (p->counted_as_capture && p->use_pool == NULL)
            return -15;
    }
    if (active != dev->active_pools || counted > dev->captures)
        return -15;
    /* deferred blocks wait on the list */
    uint64_t deferred = 0, listed = 0;
    for (segment *seg = dev->segments; seg != NULL; seg = seg->next) {
        for (block *b = seg->first; b != NULL; b = b->next)
            deferred += b->deferred;
    }
    for (block *b = dev->deferred; b != NULL; b = b->list_next)
        listed += b->deferred;
    for (block *b = dev->unrecorded; b != NULL; b = b->list_next)
        listed += b->deferred;
    return deferred == listed ? 0 : -16;
}

/* Segment counts per stream and queued events match the blocks'. */
static int
check_streams(device_state *dev, uint64_t events)
{
    for (stream_state *s = dev->streams; s != NULL; s = s->next) {
        if (s->pool != NULL || segments_owned_by(dev, s) != s->segments)
            return -9;
        for (pending_event *e = s->head; e != NULL; e = e->next) {
            if (e->b->event_count <= 0 || (e->next == NULL && e != s->tail))
                return -10;
            events--;
        }
    }
    return events == 0 ? 0 : -11;
}

/* torch's figures agree with the blocks: allocated, reserved and inactive
 * split (free blocks of segments of more than one block), per pool. */
static int
check_torch_figures(device_state *dev)
{
    int64_t split[ALLOC_POOLS][2] = {{0}}, reserved[ALLOC_POOLS] = {0};
    int64_t allocated[ALLOC_POOLS] = {0};
    for (segment *seg = dev->segments; seg != NULL; seg = seg->next) {
        int pool = seg->small ? ALLOC_POOL_SMALL : ALLOC_POOL_LARGE;
        int64_t blocks = 0;
        reserved[pool] += (int64_t)seg->size;
        for (block *b = seg->first; b != NULL; b = b->next) {
            blocks++;
            allocated[pool] += b->allocated ? (int64_t)b->size : 0;
        }
        if (blocks != seg->n_blocks)
            return -13;
        for (block *b = seg->first; b != NULL && blocks > 1; b = b->next) {
            split[pool][0] += b->in_index;
            split[pool][1] += b->in_index ? (int64_t)b->size : 0;
        }
    }
    const alloc_device_stats *t = &dev->torch;
    for (int pool = ALLOC_POOL_SMALL; pool <= ALLOC_POOL_LARGE; pool++) {
        if (t->arrays[ALLOC_STAT_RESERVED_BYTES][pool].current != reserved[pool] ||
            t->arrays[ALLOC_STAT_ALLOCATED_BYTES][pool].current != allocated[pool] ||
            t->arrays[ALLOC_STAT_INACTIVE_SPLIT][pool].current != split[pool][0] ||
            t->arrays[ALLOC_STAT_INACTIVE_SPLIT_BYTES][pool].current != split[pool][1])
            return -14;
    }
    for (int kind = 0; kind < ALLOC_STAT_ARRAYS; kind++) {
        const alloc_stat *p = t->arrays[kind];
        if (p[ALLOC_POOL_ALL].current != p[ALLOC_POOL_SMALL].current + p[ALLOC_POOL_LARGE].current)
            return -15;
    }
    for (uint64_t i = 0; i < dev->pool_figure_count; i++) {
        const alloc_pool_figures *f = &dev->pool_figures[i];
        int64_t in_pool = 0;
        for (segment *seg = dev->segments; seg != NULL; seg = seg->next) {
            const private_pool *p = seg->owner->pool;
            if (p != NULL && p->id_a == f->pool_a && p->id_b == f->pool_b)
                in_pool += (int64_t)seg->size;
        }
        if (f->reserved[ALLOC_POOL_ALL].current != in_pool)
            return -17;
    }
    if (t->arrays[ALLOC_STAT_ALLOCATED_BYTES][ALLOC_POOL_ALL].current !=
            (int64_t)dev->stats.allocated_bytes ||
        t->arrays[ALLOC_STAT_ALLOCATION][ALLOC_POOL_ALL].current != (int64_t)dev->stats.live_blocks)
        return -16;
    return 0;
}

int
alloc_check(allocator *a, int device)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    pthread_mutex_lock(&dev->lock);
    uint64_t allocated = 0, live = 0, reserved = 0, events = 0;
    int result = 0;
    for (segment *seg = dev->segments; seg != NULL && result == 0; seg = seg->next) {
        reserved += seg->size;
        result = check_segment(dev, seg, &allocated, &live, &events);
    }
    if (result == 0 && (allocated != dev->stats.allocated_bytes ||
                        reserved != dev->stats.reserved_bytes || live != dev->map_count ||
                        live != dev->stats.live_blocks))
        result = -7;
    if (result == 0 && events != dev->events_pending)
        result = -12;
    if (result == 0)
        result = check_streams(dev, events);
    if (result == 0)
        result = check_pools(dev);
    if (result == 0)
        result = check_torch_figures(dev);
    pthread_mutex_unlock(&dev->lock);
    return result;
}
