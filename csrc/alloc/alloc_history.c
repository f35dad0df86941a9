/* The trace ring and the snapshot enumeration (alloc_history.h). Records
 * are made with the device's lock held, in the places that change a
 * block's or a segment's state; contexts are gathered before that lock is
 * taken (alloc_history_gather), since gathering a Python stack takes the
 * GIL. Contract of the parts: alloc_internal.h. */
#include "alloc_internal.h"

#include <stdlib.h>
#include <string.h>

/* The first ring of a device holds this many records; it doubles as
 * records come, up to the device's bound. */
#define RING_FIRST 64u

/* ---- the ring ----------------------------------------------------------------- */

/* Records kept at most: torch keeps at least one (its ring's
 * setMaxEntries). */
static uint64_t
ring_bound(const alloc_history_config *config)
{
    return config->max_entries > 0 ? config->max_entries : 1;
}

/* The oldest record goes, its context with it. Lock held. */
static void
ring_drop_oldest(device_state *dev)
{
    MP_ASSERT(dev->ring_count > 0);
    history_drop(dev, dev->ring[dev->ring_head].context);
    if (++dev->ring_head == dev->ring_capacity)
        dev->ring_head = 0;
    dev->ring_count--;
}

/* Drops the device's records and their contexts, and the ring's memory.
 * Lock held. */
static void
ring_clear(device_state *dev)
{
    while (dev->ring_count > 0)
        ring_drop_oldest(dev);
    free(dev->ring);
    dev->ring = NULL;
    dev->ring_capacity = dev->ring_head = 0;
}

/* Moves the records into a ring of `capacity` (at least their count),
 * oldest first. Lock held; 0, or -1 without memory (unchanged). */
static int
ring_move(device_state *dev, uint64_t capacity)
{
    MP_ASSERT(capacity >= dev->ring_count && capacity > 0);
    if (capacity > SIZE_MAX / sizeof(alloc_trace_record))
        return -1;
    alloc_trace_record *ring = malloc((size_t)capacity * sizeof(*ring));
    if (ring == NULL)
        return -1;
    for (uint64_t i = 0; i < dev->ring_count; i++)
        ring[i] = dev->ring[(dev->ring_head + i) % dev->ring_capacity];
    free(dev->ring);
    dev->ring = ring;
    dev->ring_capacity = capacity;
    dev->ring_head = 0;
    return 0;
}

/* Room for one more record: the ring grows (doubling, up to the bound)
 * while it may, else the oldest record goes. torch's ring is a vector
 * growing to max_entries, whose default is sys.maxsize: nothing may be
 * reserved up front. Lock held; 0, or -1 when no record fits (no memory
 * for a first ring). */
static int
ring_make_room(device_state *dev)
{
    uint64_t bound = ring_bound(&dev->history);
    while (dev->ring_count >= bound)
        ring_drop_oldest(dev);
    if (dev->ring_count < dev->ring_capacity)
        return 0;
    uint64_t grown = dev->ring_capacity ? dev->ring_capacity * 2 : RING_FIRST;
    if (grown > bound || grown < dev->ring_capacity)
        grown = bound;
    if (grown > dev->ring_capacity && ring_move(dev, grown) == 0)
        return 0;
    if (dev->ring_count == 0)
        return -1;
    ring_drop_oldest(dev);
    return 0;
}

/* ---- configuration --------------------------------------------------------- */

void
alloc_history_configure(allocator *a, const alloc_history_config *config)
{
    pthread_mutex_lock(&a->history_lock);
    a->history = *config;
    /* every allocation gathers (its tag travels in the context), frees
     * only when stacks are kept for them */
    atomic_store(&a->history_when, !config->enabled || !config->gather ? 0 :
                                   config->when == ALLOC_CONTEXT_ALL ? ALLOC_CONTEXT_ALL :
                                                                       ALLOC_CONTEXT_STATE);
    pthread_mutex_unlock(&a->history_lock);
    for (int d = 0; d < a->device_count; d++) {
        device_state *dev = &a->devices[d];
        pthread_mutex_lock(&dev->lock);
        /* torch's recordHistory: turning it off, or clear_history, drops
         * what was recorded */
        if (config->clear || !config->enabled)
            ring_clear(dev);
        /* the release of records made before stays the one they were made with
         * only while it is the same callback: torch passes one for the process */
        dev->history = *config;
        /* a smaller bound keeps the newest records; the ring's memory
         * shrinks with it when it can */
        uint64_t bound = ring_bound(config);
        while (dev->ring_count > bound)
            ring_drop_oldest(dev);
        if (dev->ring_capacity > bound)
            (void)ring_move(dev, bound);
        pthread_mutex_unlock(&dev->lock);
    }
}

int
alloc_history_enabled(allocator *a)
{
    pthread_mutex_lock(&a->history_lock);
    int enabled = a->history.enabled;
    pthread_mutex_unlock(&a->history_lock);
    return enabled;
}

void *
alloc_block_context(allocator *a, void *ptr)
{
    for (int d = 0; d < a->device_count; d++) {
        device_state *dev = &a->devices[d];
        pthread_mutex_lock(&dev->lock);
        block *b = map_find(dev, (uintptr_t)ptr);
        void *context = b != NULL && b->context != NULL && dev->history.retain != NULL
                            ? b->context : NULL;
        if (context != NULL)
            dev->history.retain(context);
        pthread_mutex_unlock(&dev->lock);
        if (b != NULL)
            return context;
    }
    return NULL;
}

/* ---- records ---------------------------------------------------------------- */

void *
history_gather_now(allocator *a, uint64_t tag)
{
    pthread_mutex_lock(&a->history_lock);
    void *(*gather)(uint64_t) = a->history.enabled ? a->history.gather : NULL;
    pthread_mutex_unlock(&a->history_lock);
    return gather ? gather(tag) : NULL;
}

void
history_append(device_state *dev, int action, uint64_t address, uint64_t size, void *stream,
               const private_pool *pool, uint64_t tag, void *context)
{
    if (!dev->history.enabled || (dev->history.skip >> action & 1u) || ring_make_room(dev) < 0)
        return;
    if (context != NULL && dev->history.retain != NULL)
        dev->history.retain(context);
    else
        context = NULL;
    uint64_t at = dev->ring_head + dev->ring_count;
    alloc_trace_record *slot = &dev->ring[at >= dev->ring_capacity ? at - dev->ring_capacity : at];
    dev->ring_count++;
    *slot = (alloc_trace_record){.action = action, .address = address, .size = size,
                                 .stream = stream, .pool_a = pool ? pool->id_a : 0,
                                 .pool_b = pool ? pool->id_b : 0, .tag = tag,
                                 .context = context,
                                 .time = dev->history.clock ? dev->history.clock() : 0};
}

void
history_record_oom(allocator *a, device_state *dev, uint64_t rounded, void *stream,
                   const private_pool *pool, uint64_t tag, void *context)
{
    uint64_t free_bytes = 0, total = 0;
    if (!dev->history.enabled)
        return;
    if (a->backend.mem_info != NULL &&
        a->backend.mem_info(a->backend.ctx, dev->index, &free_bytes, &total) != ALLOC_OK)
        free_bytes = 0;
    history_append(dev, ALLOC_TRACE_OOM, free_bytes, rounded, stream, pool, tag, context);
}

/* ---- snapshot ----------------------------------------------------------------- */

static void *
retained(device_state *dev, void *context)
{
    if (context != NULL && dev->history.retain != NULL) {
        dev->history.retain(context);
        return context;
    }
    return NULL;
}

static int
block_state(const block *b)
{
    if (b->allocated)
        return ALLOC_BLOCK_ALLOCATED;
    return b->event_count > 0 || b->deferred ? ALLOC_BLOCK_PENDING_FREE : ALLOC_BLOCK_INACTIVE;
}

/* Whether a snapshot of pool (pool_a, pool_b) shows `seg`: (0, 0) shows
 * every segment, another id its pool's only (torch's snapshot(mempool_id)). */
static int
shown(const segment *seg, uint64_t pool_a, uint64_t pool_b)
{
    const private_pool *pool = seg->owner->pool;
    if (pool_a == 0 && pool_b == 0)
        return 1;
    return pool != NULL && pool->id_a == pool_a && pool->id_b == pool_b;
}

/* Fills `out` from the device's state. Lock held. */
static int
snapshot_locked(device_state *dev, uint64_t pool_a, uint64_t pool_b, alloc_snapshot *out)
{
    uint64_t segments = 0, blocks = 0;
    for (segment *seg = dev->segments; seg != NULL; seg = seg->next) {
        segments++;
        blocks += (uint64_t)seg->n_blocks;
    }
    out->segments = calloc(segments ? segments : 1, sizeof(*out->segments));
    out->blocks = calloc(blocks ? blocks : 1, sizeof(*out->blocks));
    out->trace = calloc(dev->ring_count ? dev->ring_count : 1, sizeof(*out->trace));
    if (out->segments == NULL || out->blocks == NULL || out->trace == NULL)
        return -1;
    /* oldest segment first: the list is newest first */
    segment *last = dev->segments;
    while (last != NULL && last->next != NULL)
        last = last->next;
    for (segment *seg = last; seg != NULL; seg = seg->prev) {
        if (!shown(seg, pool_a, pool_b))
            continue;
        const private_pool *pool = seg->owner->pool;
        alloc_segment_record *s = &out->segments[out->segment_count++];
        *s = (alloc_segment_record){.address = seg->base, .size = seg->size,
                                    .stream = seg->owner->stream, .small = seg->small,
                                    .pool_a = pool ? pool->id_a : 0,
                                    .pool_b = pool ? pool->id_b : 0,
                                    .first_block = out->block_count};
        for (block *b = seg->first; b != NULL; b = b->next) {
            int state = block_state(b);
            out->blocks[out->block_count++] = (alloc_block_record){
                .address = b->ptr, .size = b->size,
                .requested = state == ALLOC_BLOCK_INACTIVE ? 0 : b->requested, .state = state,
                .tag = b->tag, .context = state ? retained(dev, b->context) : NULL};
            s->block_count++;
        }
    }
    for (uint64_t i = 0; i < dev->ring_count; i++) {
        alloc_trace_record r = dev->ring[(dev->ring_head + i) % dev->ring_capacity];
        r.context = retained(dev, r.context);
        out->trace[out->trace_count++] = r;
    }
    return 0;
}

int
alloc_take_snapshot(allocator *a, int device, alloc_snapshot *out)
{
    return alloc_take_pool_snapshot(a, device, 0, 0, out);
}

int
alloc_take_pool_snapshot(allocator *a, int device, uint64_t pool_a, uint64_t pool_b,
                         alloc_snapshot *out)
{
    memset(out, 0, sizeof(*out));
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return 0;
    pthread_mutex_lock(&dev->lock);
    int result = snapshot_locked(dev, pool_a, pool_b, out);
    out->release = dev->history.release;
    pthread_mutex_unlock(&dev->lock);
    if (result < 0)
        alloc_snapshot_free(a, out);
    return result;
}

void
alloc_snapshot_free(allocator *a, alloc_snapshot *snapshot)
{
    (void)a;
    void (*release)(void *) = snapshot->release;
    for (uint64_t i = 0; release != NULL && i < snapshot->block_count; i++) {
        if (snapshot->blocks[i].context != NULL)
            release(snapshot->blocks[i].context);
    }
    for (uint64_t i = 0; release != NULL && i < snapshot->trace_count; i++) {
        if (snapshot->trace[i].context != NULL)
            release(snapshot->trace[i].context);
    }
    free(snapshot->segments);
    free(snapshot->blocks);
    free(snapshot->trace);
    memset(snapshot, 0, sizeof(*snapshot));
}
