/* Private pools of CUDA graphs (torch's PrivatePool, see the note
 * "Interaction with CUDA graph capture" in CUDACachingAllocator.cpp), and
 * two questions torch asks about the cache: its largest free block
 * (cudnn.benchmark sizes workspaces by it) and the segment a pointer is
 * in (CUDA IPC shares whole segments). Contract: alloc.h; the structures:
 * alloc_internal.h.
 *
 * Why a graph needs its own pool: a replay writes the addresses the
 * capture was handed, whatever happened to them since. Memory freed during
 * the capture may be handed out again inside the same capture (the graph
 * orders its own reuse), but never to anything else while the graph can
 * still replay: so a pool's segments serve only that pool until every
 * graph using it was released and its blocks were freed. */
#include "alloc_internal.h"

#include <stdlib.h>

private_pool *
pool_find(device_state *dev, uint64_t pool_a, uint64_t pool_b)
{
    for (private_pool *p = dev->pools; p != NULL; p = p->next) {
        if (p->id_a == pool_a && p->id_b == pool_b)
            return p;
    }
    return NULL;
}

/* A new pool of id (pool_a, pool_b), first in its device's list (found
 * first: one being allocated to is looked for on every malloc); NULL
 * without memory. Lock held. */
static private_pool *
pool_add(device_state *dev, uint64_t pool_a, uint64_t pool_b)
{
    private_pool *pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        return NULL;
    pool->id_a = pool_a;
    pool->id_b = pool_b;
    pool->next = dev->pools;
    dev->pools = pool;
    return pool;
}

static void
pool_unlink(device_state *dev, private_pool *pool)
{
    for (private_pool **link = &dev->pools; *link != NULL; link = &(*link)->next) {
        if (*link == pool) {
            *link = pool->next;
            pool->next = NULL;
            return;
        }
    }
    MP_ASSERT(0);   /* a pool missing from its device's list */
}

int
pool_released(const private_pool *pool)
{
    return pool->use_count == 0 && pool->use_pool == NULL;
}

private_pool *
pool_for_stream(device_state *dev, void *stream)
{
    /* the list holds the pool begun last first: nested captures ask the
     * innermost first, as torch walks captures_underway backwards */
    for (private_pool *p = dev->pools; p != NULL; p = p->next) {
        if (p->use_pool != NULL && p->use_pool(p->filter, stream))
            return p;
    }
    return NULL;
}

void
pools_forget_done(device_state *dev)
{
    private_pool **link = &dev->pools;
    while (*link != NULL) {
        private_pool *p = *link;
        if (pool_released(p) && p->segments == 0) {
            MP_ASSERT(p->streams == NULL);   /* a stream state goes with its last segment */
            *link = p->next;
            free(p);
        } else {
            link = &p->next;
        }
    }
}

void
pools_free_all(device_state *dev)
{
    for (private_pool *p = dev->pools, *next; p != NULL; p = next) {
        next = p->next;
        for (stream_state *s = p->streams, *after; s != NULL; s = after) {
            after = s->next;
            free(s);
        }
        free(p);
    }
    dev->pools = NULL;
    dev->active_pools = 0;
    dev->captures = 0;
}

/* Gives back the all-free segments of a released pool (torch's
 * emptyCache(mempool_id) at a MemPool's end). */
static void
pool_release_free(allocator *a, device_state *dev, private_pool *pool)
{
    for (segment *seg = dev->segments, *next; seg != NULL; seg = next) {
        next = seg->next;
        if (seg->owner->pool == pool && segment_all_free(seg))
            segment_release(a, dev, seg);
    }
    pools_forget_done(dev);
}

int
alloc_begin_pool(allocator *a, int device, uint64_t pool_a, uint64_t pool_b,
                 alloc_pool_filter use_pool, void *filter)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return ALLOC_BEGIN_NO_DEVICE;
    if (use_pool == NULL)
        return ALLOC_BEGIN_NO_FILTER;
    pthread_mutex_lock(&dev->lock);
    private_pool *pool = pool_find(dev, pool_a, pool_b);
    int result;
    /* torch refuses a pool being recorded to already, and one whose
     * graphs were all released (its memory may be on its way back) */
    if (pool != NULL && pool->use_pool != NULL) {
        result = ALLOC_BEGIN_BEING_ALLOCATED_TO;
        goto done;
    }
    if (pool != NULL && pool->use_count == 0) {
        result = ALLOC_BEGIN_RELEASED;
        goto done;
    }
    if (pool != NULL) {
        pool_unlink(dev, pool);
        pool->next = dev->pools;
        dev->pools = pool;
    } else if ((pool = pool_add(dev, pool_a, pool_b)) == NULL) {
        result = ALLOC_BEGIN_NO_MEMORY;
        goto done;
    }
    pool->use_count++;
    pool->use_pool = use_pool;
    pool->filter = filter;
    dev->active_pools++;
    /* without torch's capture marks, a pool being allocated to is a capture */
    pool->counted_as_capture = !atomic_load(&a->capture_marks);
    dev->captures += (uint64_t)pool->counted_as_capture;
    result = ALLOC_BEGIN_OK;
done:
    pthread_mutex_unlock(&dev->lock);
    return result;
}

int
alloc_create_pool(allocator *a, int device, uint64_t pool_a, uint64_t pool_b)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    pthread_mutex_lock(&dev->lock);
    private_pool *pool = pool_find(dev, pool_a, pool_b);
    int result = -1;
    if (pool == NULL) {
        pool = pool_add(dev, pool_a, pool_b);
    } else if (pool->use_count == 0) {
        pool = NULL;        /* released: torch asserts a live pool's use */
    }
    if (pool != NULL) {
        pool->use_count++;
        result = 0;
    }
    pthread_mutex_unlock(&dev->lock);
    return result;
}

void
alloc_empty_pool(allocator *a, uint64_t pool_a, uint64_t pool_b)
{
    for (int d = 0; d < a->device_count; d++) {
        device_state *dev = &a->devices[d];
        pthread_mutex_lock(&dev->lock);
        private_pool *pool = pool_find(dev, pool_a, pool_b);
        if (pool != NULL && pool_released(pool) && dev->captures == 0)
            pool_release_free(a, dev, pool);
        pthread_mutex_unlock(&dev->lock);
    }
}

/* Puts freed block `b` on the deferred `list`. Lock held. */
static void
defer_onto(block **list, block *b)
{
    MP_ASSERT(!b->allocated && !b->in_index && !b->deferred && b->event_count == 0);
    b->deferred = 1;
    b->list_next = *list;
    *list = b;
}

void
block_defer(device_state *dev, block *b)
{
    defer_onto(&dev->deferred, b);
}

void
block_defer_unrecorded(device_state *dev, block *b)
{
    defer_onto(&dev->unrecorded, b);
}

void
unrecorded_retry(device_state *dev)
{
    while (dev->unrecorded != NULL) {
        block *b = dev->unrecorded;
        dev->unrecorded = b->list_next;
        b->list_next = dev->deferred;
        dev->deferred = b;
    }
}

void
unrecorded_tick(allocator *a, device_state *dev)
{
    MP_ASSERT(dev->captures == 0 && dev->unrecorded != NULL);
    if (dev->unrecorded_skip > 0) {
        dev->unrecorded_skip--;
        return;
    }
    unrecorded_retry(dev);
    deferred_process(a, dev);
    if (dev->unrecorded == NULL) {
        dev->unrecorded_backoff = 0;     /* the next failure is tried at the next malloc */
        return;
    }
    uint64_t step = dev->unrecorded_backoff * 2;
    dev->unrecorded_backoff = step == 0 ? 1 : step < UNRECORDED_BACKOFF_MAX ? step :
                                                                         UNRECORDED_BACKOFF_MAX;
    dev->unrecorded_skip = dev->unrecorded_backoff;
}

void
deferred_process(allocator *a, device_state *dev)
{
    MP_ASSERT(dev->captures == 0);
    block *b = dev->deferred;
    dev->deferred = NULL;
    while (b != NULL) {
        block *next = b->list_next;
        b->list_next = NULL;
        b->deferred = 0;
        block_retire(a, dev, b, NULL);
        b = next;
    }
}

int
alloc_end_pool(allocator *a, int device, uint64_t pool_a, uint64_t pool_b)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    pthread_mutex_lock(&dev->lock);
    private_pool *pool = pool_find(dev, pool_a, pool_b);
    int result = -1;
    if (pool != NULL && pool->use_pool != NULL) {
        pool->use_pool = NULL;
        pool->filter = NULL;
        mp_counter_sub(&dev->active_pools, 1);
        if (pool->counted_as_capture)
            captures_end_one(a, dev);
        pool->counted_as_capture = 0;
        pools_forget_done(dev);           /* released while allocated to, and empty */
        result = 0;
    }
    pthread_mutex_unlock(&dev->lock);
    return result;
}

void
captures_end_one(allocator *a, device_state *dev)
{
    mp_counter_sub(&dev->captures, 1);
    if (dev->captures == 0)
        deferred_process(a, dev);
}

void
alloc_use_capture_marks(allocator *a)
{
    atomic_store(&a->capture_marks, 1);
}

int
alloc_mark_capture(allocator *a, int device, int begin)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL || !atomic_load(&a->capture_marks))
        return -1;
    pthread_mutex_lock(&dev->lock);
    int result = 0;
    if (begin)
        dev->captures++;
    else if (dev->captures > 0)
        captures_end_one(a, dev);
    else
        result = -1;
    pthread_mutex_unlock(&dev->lock);
    return result;
}

int
alloc_release_pool(allocator *a, int device, uint64_t pool_a, uint64_t pool_b)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    pthread_mutex_lock(&dev->lock);
    private_pool *pool = pool_find(dev, pool_a, pool_b);
    int result = -1;
    if (pool != NULL && pool->use_count > 0) {
        /* torch marks the pool freeable: its memory goes at the next
         * empty_cache or out-of-memory retry (or the MemPool's end), never
         * at a release or a tensor's free, where a cudaFree would
         * synchronize the device, maybe during another thread's capture */
        pool->use_count--;
        pools_forget_done(dev);
        result = 0;
    }
    pthread_mutex_unlock(&dev->lock);
    return result;
}

int
alloc_pool_takes(allocator *a, int device, void *stream)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return 0;
    pthread_mutex_lock(&dev->lock);
    int takes = dev->active_pools != 0 && pool_for_stream(dev, stream) != NULL;
    pthread_mutex_unlock(&dev->lock);
    return takes;
}

int
alloc_pool_use_count(allocator *a, int device, uint64_t pool_a, uint64_t pool_b)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    pthread_mutex_lock(&dev->lock);
    private_pool *pool = pool_find(dev, pool_a, pool_b);
    int count = pool != NULL ? (int)pool->use_count : -1;
    pthread_mutex_unlock(&dev->lock);
    return count;
}

uint64_t
alloc_largest_free_block(allocator *a, int device)
{
    device_state *dev = device_of(a, device);
    uint64_t largest = 0;
    if (dev == NULL)
        return 0;
    pthread_mutex_lock(&dev->lock);
    for (const segment *seg = dev->segments; seg != NULL; seg = seg->next) {
        for (const block *b = seg->first; b != NULL; b = b->next) {
            if (b->in_index && b->size > largest)
                largest = b->size;
        }
    }
    pthread_mutex_unlock(&dev->lock);
    return largest;
}

/* The live block of `dev` that holds `address`, or NULL. Lock held. */
static const block *
live_block_holding(const device_state *dev, uintptr_t address)
{
    for (const segment *seg = dev->segments; seg != NULL; seg = seg->next) {
        if (address < seg->base || address - seg->base >= seg->size)
            continue;
        for (const block *b = seg->first; b != NULL; b = b->next) {
            if (address >= b->ptr && address - b->ptr < b->size)
                return b->allocated ? b : NULL;
        }
    }
    return NULL;
}

void *
alloc_base_allocation(allocator *a, void *ptr, uint64_t *size)
{
    for (int d = 0; d < a->device_count; d++) {
        device_state *dev = &a->devices[d];
        pthread_mutex_lock(&dev->lock);
        const block *b = live_block_holding(dev, (uintptr_t)ptr);
        void *base = b != NULL ? (void *)b->seg->base : NULL;
        if (b != NULL)
            *size = b->seg->size;
        pthread_mutex_unlock(&dev->lock);
        if (base != NULL)
            return base;
    }
    return NULL;
}
