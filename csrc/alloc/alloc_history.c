/* The trace ring and the snapshot enumeration (alloc_history.h). Records
 * are made with the device's lock held, in the places that change a
 * block's or a segment's state; contexts are gathered before that lock is
 * taken (alloc_history_gather), since gathering a Python stack takes the
 * GIL. Contract of the parts: alloc_internal.h. */
#include "alloc_internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- configuration --------------------------------------------------------- */

/* Drops the device's records and their contexts. Lock held. */
static void
ring_clear(device_state *dev)
{
    for (uint64_t i = 0; i < dev->ring_count; i++) {
        alloc_trace_record *r = &dev->ring[(dev->ring_head + i) % dev->ring_capacity];
        if (r->context != NULL && dev->history.release != NULL)
            dev->history.release(r->context);
    }
    dev->ring_head = dev->ring_count = 0;
}

/* The ring holds the newest `capacity` records: a smaller one keeps the
 * newest of those it had. Lock held; 0, or -1 without memory (unchanged). */
static int
ring_resize(device_state *dev, uint64_t capacity)
{
    if (capacity == dev->ring_capacity)
        return 0;
    alloc_trace_record *ring = capacity ? calloc(capacity, sizeof(*ring)) : NULL;
    if (capacity != 0 && ring == NULL)
        return -1;
    uint64_t keep = dev->ring_count < capacity ? dev->ring_count : capacity;
    for (uint64_t i = 0; i < dev->ring_count; i++) {
        alloc_trace_record *r = &dev->ring[(dev->ring_head + i) % dev->ring_capacity];
        if (i + keep >= dev->ring_count)
            ring[i + keep - dev->ring_count] = *r;
        else if (r->context != NULL && dev->history.release != NULL)
            dev->history.release(r->context);
    }
    free(dev->ring);
    dev->ring = ring;
    dev->ring_capacity = capacity;
    dev->ring_head = 0;
    dev->ring_count = keep;
    return 0;
}

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
        if (config->clear)
            ring_clear(dev);
        /* without memory for a new ring the old one stays: records go on */
        (void)ring_resize(dev, config->enabled ? config->max_entries : dev->ring_capacity);
        /* the release of records made before stays the one they were made with
         * only while it is the same callback: torch passes one for the process */
        dev->history = *config;
        pthread_mutex_unlock(&dev->lock);
    }
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
               uint64_t tag, void *context)
{
    if (!dev->history.enabled || dev->ring_capacity == 0 || (dev->history.skip >> action & 1u))
        return;
    if (context != NULL && dev->history.retain != NULL)
        dev->history.retain(context);
    else
        context = NULL;
    alloc_trace_record *slot;
    /* head < capacity and count <= capacity: a subtraction wraps, no modulo */
    if (dev->ring_count == dev->ring_capacity) {
        slot = &dev->ring[dev->ring_head];          /* the oldest goes */
        history_drop(dev, slot->context);
        if (++dev->ring_head == dev->ring_capacity)
            dev->ring_head = 0;
    } else {
        uint64_t at = dev->ring_head + dev->ring_count;
        slot = &dev->ring[at >= dev->ring_capacity ? at - dev->ring_capacity : at];
        dev->ring_count++;
    }
    *slot = (alloc_trace_record){.action = action, .address = address, .size = size,
                                 .stream = stream, .tag = tag, .context = context,
                                 .time = dev->history.clock ? dev->history.clock() : 0};
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
