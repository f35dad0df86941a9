/* The live-pointer table, device, per-tag and per-pool statistics and the
 * last out-of-memory report. Contract: alloc_internal.h. */
#include "alloc_internal.h"

#include <stdlib.h>

/* ---- live-pointer table ---------------------------------------------------- */

static uint64_t
hash_ptr(uintptr_t ptr, uint64_t size)
{
    uint64_t h = (uint64_t)ptr >> 9;
    h ^= h >> 29;
    h *= 0x9e3779b97f4a7c15ull;
    return (h >> 17) & (size - 1);
}

static int
map_grow(device_state *dev)
{
    uint64_t size = dev->map_size ? dev->map_size * 2 : 1024;
    block **map = calloc(size, sizeof(block *));
    if (map == NULL)
        return -1;
    for (uint64_t i = 0; i < dev->map_size; i++) {
        block *b = dev->map[i];
        while (b != NULL) {
            block *next = b->map_next;
            uint64_t slot = hash_ptr(b->ptr, size);
            b->map_next = map[slot];
            map[slot] = b;
            b = next;
        }
    }
    free(dev->map);
    dev->map = map;
    dev->map_size = size;
    return 0;
}

int
map_reserve(device_state *dev, uint64_t count)
{
    while (count > dev->map_size) {
        if (map_grow(dev) < 0)
            return -1;
    }
    return 0;
}

int
map_insert(device_state *dev, block *b)
{
    if (dev->map_count >= dev->map_size && map_grow(dev) < 0)
        return -1;
    uint64_t slot = hash_ptr(b->ptr, dev->map_size);
    MP_ASSERT(b->map_next == NULL && map_find(dev, b->ptr) == NULL);
    b->map_next = dev->map[slot];
    dev->map[slot] = b;
    dev->map_count++;
    return 0;
}

block *
map_take(device_state *dev, uintptr_t ptr)
{
    if (dev->map_size == 0)
        return NULL;
    block **link = &dev->map[hash_ptr(ptr, dev->map_size)];
    for (block *b = *link; b != NULL; link = &b->map_next, b = b->map_next) {
        if (b->ptr == ptr) {
            *link = b->map_next;
            b->map_next = NULL;
            mp_counter_sub(&dev->map_count, 1);
            return b;
        }
    }
    return NULL;
}

block *
map_find(device_state *dev, uintptr_t ptr)
{
    if (dev->map_size == 0)
        return NULL;
    for (block *b = dev->map[hash_ptr(ptr, dev->map_size)]; b != NULL; b = b->map_next) {
        if (b->ptr == ptr)
            return b;
    }
    return NULL;
}

/* ---- tags ------------------------------------------------------------------ */

static tag_slot *
tag_find(device_state *dev, uint64_t tag)
{
    if (dev->tag_count * 10 >= dev->tag_capacity * 7) {
        uint64_t capacity = dev->tag_capacity ? dev->tag_capacity * 2 : 64;
        tag_slot *grown = calloc(capacity, sizeof(tag_slot));
        if (grown == NULL)
            return NULL;
        for (uint64_t i = 0; i < dev->tag_capacity; i++) {
            if (!dev->tags[i].used)
                continue;
            uint64_t slot = (dev->tags[i].tag * 0x9e3779b97f4a7c15ull) & (capacity - 1);
            while (grown[slot].used)
                slot = (slot + 1) & (capacity - 1);
            grown[slot] = dev->tags[i];
        }
        free(dev->tags);
        dev->tags = grown;
        dev->tag_last = NULL;
        dev->tag_capacity = capacity;
    }
    uint64_t slot = (tag * 0x9e3779b97f4a7c15ull) & (dev->tag_capacity - 1);
    while (dev->tags[slot].used && dev->tags[slot].tag != tag)
        slot = (slot + 1) & (dev->tag_capacity - 1);
    if (!dev->tags[slot].used) {
        dev->tags[slot] = (tag_slot){.tag = tag, .used = 1};
        dev->tag_count++;
    }
    dev->tag_last = &dev->tags[slot];
    return dev->tag_last;
}

/* Tag accounting is best effort: without memory for the table the
 * allocation still succeeds, only untracked. */
static void
tag_account(device_state *dev, uint64_t tag, uint64_t size, int allocate)
{
    tag_slot *slot = dev->tag_last != NULL && dev->tag_last->tag == tag ? dev->tag_last
                                                                      : tag_find(dev, tag);
    if (slot == NULL)
        return;
    if (allocate) {
        slot->live_bytes += size;
        slot->allocations++;
        if (slot->live_bytes > slot->peak_bytes)
            slot->peak_bytes = slot->live_bytes;
    } else {
        slot->live_bytes -= size < slot->live_bytes ? size : slot->live_bytes;
    }
}

/* ---- torch's figures (alloc.h: alloc_device_stats) --------------------------- */

void
stats_block_inactive(device_state *dev, block *b, void *context)
{
    MP_ASSERT(!b->allocated);
    int pool = stat_pool(b->seg);
    stat_sub(dev, ALLOC_STAT_ACTIVE, pool, 1);
    stat_sub(dev, ALLOC_STAT_ACTIVE_BYTES, pool, (int64_t)b->size);
    stat_sub(dev, ALLOC_STAT_REQUESTED_BYTES, pool, (int64_t)b->requested);
    history_record(dev, ALLOC_TRACE_FREE_COMPLETED, b->ptr, b->requested, b->seg->owner, b->tag,
                   history_free_context(dev, b, context));
    history_drop(dev, b->context);
    b->context = NULL;
}

void
stats_count_retry(device_state *dev)
{
    dev->stats.oom_retries++;
    dev->torch.num_alloc_retries++;
}

/* The calling thread's last failed request, and the id of the allocator it
 * failed on (0: none). A thread reads its own failure's numbers after the
 * device's lock is gone (matepoint_malloc's message and torch's observers);
 * another thread's failure meanwhile, as when DataParallel's replicas (a
 * thread per GPU) run out of memory together, must not take their place.
 * Each thread owns its copy: no lock. */
static _Thread_local alloc_oom_info thread_oom;
static _Thread_local uint64_t thread_oom_of;

void
stats_record_oom(allocator *a, device_state *dev, uint64_t size, uint64_t rounded)
{
    dev->stats.ooms++;
    dev->torch.num_ooms++;
    thread_oom_of = a->id;
    thread_oom = (alloc_oom_info){.requested = size, .device = dev->index,
                                  .segment_bytes = rounded ? segment_size_for(rounded) : 0,
                                  .reserved = dev->stats.reserved_bytes,
                                  .allocated = dev->stats.allocated_bytes,
                                  .limit = dev->limit};
}

void
stats_account_malloc(device_state *dev, block *b, uint64_t size, uint64_t tag)
{
    MP_ASSERT(!b->allocated && !b->in_index && b->event_count == 0 && size <= b->size);
    b->allocated = 1;
    b->requested = size;
    b->tag = tag;
    dev->stats.mallocs++;
    dev->stats.live_blocks++;
    dev->stats.allocated_bytes += b->size;
    dev->stats.requested_bytes += size;
    if (dev->stats.allocated_bytes > dev->stats.peak_allocated_bytes)
        dev->stats.peak_allocated_bytes = dev->stats.allocated_bytes;
    MP_ASSERT(dev->stats.allocated_bytes <= dev->stats.reserved_bytes);
    MP_ASSERT(dev->stats.requested_bytes <= dev->stats.allocated_bytes);
    tag_account(dev, tag, b->size, 1);
    int pool = stat_pool(b->seg);
    stat_add(dev, ALLOC_STAT_ALLOCATION, pool, 1);
    stat_add(dev, ALLOC_STAT_ALLOCATED_BYTES, pool, (int64_t)b->size);
    stat_add(dev, ALLOC_STAT_ACTIVE, pool, 1);
    stat_add(dev, ALLOC_STAT_ACTIVE_BYTES, pool, (int64_t)b->size);
    stat_add(dev, ALLOC_STAT_REQUESTED_BYTES, pool, (int64_t)size);
}

void
stats_account_free(device_state *dev, block *b)
{
    MP_ASSERT(b->allocated && b->requested <= b->size);
    dev->stats.frees++;
    mp_counter_sub(&dev->stats.live_blocks, 1);
    mp_counter_sub(&dev->stats.allocated_bytes, b->size);
    mp_counter_sub(&dev->stats.requested_bytes, b->requested);
    tag_account(dev, b->tag, b->size, 0);
    int pool = stat_pool(b->seg);
    stat_sub(dev, ALLOC_STAT_ALLOCATION, pool, 1);
    stat_sub(dev, ALLOC_STAT_ALLOCATED_BYTES, pool, (int64_t)b->size);
    b->allocated = 0;
}

/* The figures of private pool `pool`, made (zero) when missing and
 * `make`; NULL when missing, or without memory: counting them is best
 * effort, as the tags'. Lock held. */
static alloc_pool_figures *
pool_figures_of(device_state *dev, const private_pool *pool, int make)
{
    for (uint64_t i = 0; i < dev->pool_figure_count; i++) {
        alloc_pool_figures *f = &dev->pool_figures[i];
        if (f->pool_a == pool->id_a && f->pool_b == pool->id_b)
            return f;
    }
    if (!make)
        return NULL;
    if (dev->pool_figure_count == dev->pool_figure_capacity) {
        uint64_t capacity = dev->pool_figure_capacity ? dev->pool_figure_capacity * 2 : 8;
        alloc_pool_figures *grown = realloc(dev->pool_figures, capacity * sizeof(*grown));
        if (grown == NULL)
            return NULL;
        dev->pool_figures = grown;
        dev->pool_figure_capacity = capacity;
    }
    alloc_pool_figures *f = &dev->pool_figures[dev->pool_figure_count++];
    *f = (alloc_pool_figures){.pool_a = pool->id_a, .pool_b = pool->id_b};
    return f;
}

/* A segment of a private pool was added (`size` > 0) or released. */
static void
pool_figures_count(device_state *dev, const segment *seg, int added)
{
    const private_pool *pool = seg->owner->pool;
    alloc_pool_figures *f = pool ? pool_figures_of(dev, pool, added) : NULL;
    if (f == NULL)
        return;
    alloc_stat *all = &f->reserved[ALLOC_POOL_ALL], *kind = &f->reserved[stat_pool(seg)];
    if (added) {
        stat_increase(all, (int64_t)seg->size);
        stat_increase(kind, (int64_t)seg->size);
    } else if (all->current >= (int64_t)seg->size) {   /* counted when added */
        stat_decrease(all, (int64_t)seg->size);
        stat_decrease(kind, (int64_t)seg->size);
    }
}

void
stats_segment_added(device_state *dev, segment *seg)
{
    uint64_t size = seg->size;
    pool_figures_count(dev, seg, 1);
    stat_add(dev, ALLOC_STAT_SEGMENT, stat_pool(seg), 1);
    stat_add(dev, ALLOC_STAT_RESERVED_BYTES, stat_pool(seg), (int64_t)size);
    dev->torch.num_device_alloc++;
    dev->stats.reserved_bytes += size;
    dev->stats.device_allocs++;
    if (dev->stats.reserved_bytes > dev->stats.peak_reserved_bytes)
        dev->stats.peak_reserved_bytes = dev->stats.reserved_bytes;
}

void
stats_segment_released(device_state *dev, segment *seg)
{
    uint64_t size = seg->size;
    pool_figures_count(dev, seg, 0);
    stat_sub(dev, ALLOC_STAT_SEGMENT, stat_pool(seg), 1);
    stat_sub(dev, ALLOC_STAT_RESERVED_BYTES, stat_pool(seg), (int64_t)size);
    dev->torch.num_device_free++;
    mp_counter_sub(&dev->stats.reserved_bytes, size);
    MP_ASSERT(dev->stats.allocated_bytes <= dev->stats.reserved_bytes);
    dev->stats.device_frees++;
    MP_ASSERT(dev->stats.device_frees <= dev->stats.device_allocs);
}

alloc_stats
alloc_get_stats(allocator *a, int device)
{
    alloc_stats stats = {0};
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return stats;
    pthread_mutex_lock(&dev->lock);
    stats = dev->stats;
    pthread_mutex_unlock(&dev->lock);
    return stats;
}

/* Every peak of `dev` restarts from now. Lock held. */
static void
reset_peaks_locked(device_state *dev)
{
    dev->stats.peak_allocated_bytes = dev->stats.allocated_bytes;
    dev->stats.peak_reserved_bytes = dev->stats.reserved_bytes;
    for (uint64_t i = 0; i < dev->tag_capacity; i++)
        dev->tags[i].peak_bytes = dev->tags[i].live_bytes;
    for (int kind = 0; kind < ALLOC_STAT_ARRAYS; kind++) {
        for (int pool = 0; pool < ALLOC_POOLS; pool++)
            dev->torch.arrays[kind][pool].peak = dev->torch.arrays[kind][pool].current;
    }
    dev->torch.oversize_allocations.peak = dev->torch.oversize_allocations.current;
    dev->torch.oversize_segments.peak = dev->torch.oversize_segments.current;
    for (uint64_t i = 0; i < dev->pool_figure_count; i++) {
        for (int pool = 0; pool < ALLOC_POOLS; pool++) {
            alloc_stat *stat = &dev->pool_figures[i].reserved[pool];
            stat->peak = stat->current;
        }
    }
}

/* torch's reset of accumulated figures: a pool gone (nothing reserved)
 * leaves its figures then. Lock held. */
static void
reset_pool_figures(device_state *dev)
{
    uint64_t kept = 0;
    for (uint64_t i = 0; i < dev->pool_figure_count; i++) {
        alloc_pool_figures f = dev->pool_figures[i];
        if (f.reserved[ALLOC_POOL_ALL].current == 0 && pool_find(dev, f.pool_a, f.pool_b) == NULL)
            continue;
        for (int pool = 0; pool < ALLOC_POOLS; pool++)
            f.reserved[pool].allocated = f.reserved[pool].freed = 0;
        dev->pool_figures[kept++] = f;
    }
    dev->pool_figure_count = kept;
}

void
alloc_reset_peaks(allocator *a)
{
    for (int d = 0; d < a->device_count; d++)
        (void)alloc_reset_device_peaks(a, d);
}

int
alloc_reset_device_peaks(allocator *a, int device)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    pthread_mutex_lock(&dev->lock);
    reset_peaks_locked(dev);
    pthread_mutex_unlock(&dev->lock);
    return 0;
}

int
alloc_reset_accumulated(allocator *a, int device)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    pthread_mutex_lock(&dev->lock);
    alloc_device_stats *t = &dev->torch;
    for (int kind = 0; kind < ALLOC_STAT_ARRAYS; kind++) {
        for (int pool = 0; pool < ALLOC_POOLS; pool++)
            t->arrays[kind][pool].allocated = t->arrays[kind][pool].freed = 0;
    }
    t->oversize_allocations.allocated = t->oversize_allocations.freed = 0;
    t->oversize_segments.allocated = t->oversize_segments.freed = 0;
    t->num_alloc_retries = t->num_ooms = t->num_sync_all_streams = 0;
    t->num_device_alloc = t->num_device_free = 0;
    reset_pool_figures(dev);
    pthread_mutex_unlock(&dev->lock);
    return 0;
}

int
alloc_get_device_stats(allocator *a, int device, alloc_device_stats *out)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    pthread_mutex_lock(&dev->lock);
    *out = dev->torch;
    pthread_mutex_unlock(&dev->lock);
    out->max_split_size = -1;
    return 0;
}

int
alloc_get_pool_figures(allocator *a, int device, alloc_pool_figures *out, int max)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    pthread_mutex_lock(&dev->lock);
    uint64_t count = dev->pool_figure_count;
    for (uint64_t i = 0; i < count && i < (uint64_t)(max > 0 ? max : 0); i++)
        out[i] = dev->pool_figures[i];
    pthread_mutex_unlock(&dev->lock);
    return (int)count;
}

int
alloc_get_tag_stats(allocator *a, int device, alloc_tag_stats *out, int max)
{
    device_state *dev = device_of(a, device);
    int count = 0;
    if (dev == NULL)
        return 0;
    pthread_mutex_lock(&dev->lock);
    for (uint64_t i = 0; i < dev->tag_capacity; i++) {
        tag_slot *slot = &dev->tags[i];
        if (!slot->used || (slot->live_bytes == 0 && slot->peak_bytes == 0))
            continue;
        if (count < max)
            out[count] = (alloc_tag_stats){.tag = slot->tag, .live_bytes = slot->live_bytes,
                                           .peak_bytes = slot->peak_bytes,
                                           .allocations = slot->allocations};
        count++;
    }
    pthread_mutex_unlock(&dev->lock);
    return count;
}

alloc_oom_info
alloc_last_oom(allocator *a)
{
    if (thread_oom_of != a->id)
        return (alloc_oom_info){.limit = UINT64_MAX};
    return thread_oom;
}
