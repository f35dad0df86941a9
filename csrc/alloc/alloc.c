#include "alloc.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MIN_BLOCK 512u
#define SMALL_REQUEST (1u << 20)        /* at most this goes to the small pool */
#define SMALL_SEGMENT (2u << 20)
#define LARGE_SEGMENT (20u << 20)       /* shared by requests below MID_LIMIT */
#define MID_LIMIT (10u << 20)
#define LARGE_ROUND (2u << 20)
#define LARGE_SPLIT_MIN (1u << 20)      /* large remainders smaller than this stay attached */
#define BUCKETS 64

typedef struct segment segment;
typedef struct block block;

struct block {
    uintptr_t ptr;
    uint64_t size, requested;
    void *stream;                   /* last stream it was allocated on */
    segment *seg;
    block *prev, *next;             /* address neighbours inside the segment */
    block *list_prev, *list_next;   /* free bucket or pending list */
    block *map_next;                /* chain of the live-pointer table */
    uint64_t tag;
    void *reuse_event;              /* on `stream`, recorded when another stream wants it */
    void **events;                  /* pending: one per stream it was recorded on */
    int n_events;
    void **extra_streams;           /* streams from alloc_record_stream */
    int n_extra;
    uint8_t allocated, pending, in_index;
};

struct segment {
    uintptr_t base;
    uint64_t size;
    int small;
    block *first;
    segment *prev, *next;
};

typedef struct {
    uint64_t tag, live_bytes, peak_bytes, allocations;
    int used;
} tag_slot;

typedef struct {
    pthread_mutex_t lock;
    int index;
    block *buckets[2][BUCKETS];     /* [small][floor(log2 size)] */
    block *pending;
    segment *segments;
    block **map;                    /* live blocks by pointer */
    uint64_t map_size, map_count;
    tag_slot *tags;
    uint64_t tag_capacity, tag_count;
    alloc_stats stats;
    uint64_t limit;
} device_state;

struct allocator {
    alloc_backend backend;
    int device_count;
    device_state *devices;
    pthread_mutex_t oom_lock;       /* guards last_oom */
    alloc_oom_info last_oom;
};

uint64_t
alloc_round_size(uint64_t size)
{
    if (size < MIN_BLOCK)
        return MIN_BLOCK;
    return (size + MIN_BLOCK - 1) & ~(uint64_t)(MIN_BLOCK - 1);
}

static uint64_t
segment_size_for(uint64_t rounded)
{
    if (rounded <= SMALL_REQUEST)
        return SMALL_SEGMENT;
    if (rounded < MID_LIMIT)
        return LARGE_SEGMENT;
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
    b->list_prev = NULL;
    b->list_next = *head;
    if (*head != NULL)
        (*head)->list_prev = b;
    *head = b;
}

static void
list_remove(block **head, block *b)
{
    if (b->list_prev != NULL)
        b->list_prev->list_next = b->list_next;
    else
        *head = b->list_next;
    if (b->list_next != NULL)
        b->list_next->list_prev = b->list_prev;
    b->list_prev = b->list_next = NULL;
}

static block **
bucket_for(device_state *dev, block *b)
{
    return &dev->buckets[b->seg->small][bucket_of(b->size)];
}

static void
index_insert(device_state *dev, block *b)
{
    list_push(bucket_for(dev, b), b);
    b->in_index = 1;
}

static void
index_remove(device_state *dev, block *b)
{
    list_remove(bucket_for(dev, b), b);
    b->in_index = 0;
}

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

static int
map_insert(device_state *dev, block *b)
{
    if (dev->map_count >= dev->map_size && map_grow(dev) < 0)
        return -1;
    uint64_t slot = hash_ptr(b->ptr, dev->map_size);
    b->map_next = dev->map[slot];
    dev->map[slot] = b;
    dev->map_count++;
    return 0;
}

static block *
map_take(device_state *dev, uintptr_t ptr)
{
    if (dev->map_size == 0)
        return NULL;
    block **link = &dev->map[hash_ptr(ptr, dev->map_size)];
    for (block *b = *link; b != NULL; link = &b->map_next, b = b->map_next) {
        if (b->ptr == ptr) {
            *link = b->map_next;
            b->map_next = NULL;
            dev->map_count--;
            return b;
        }
    }
    return NULL;
}

static block *
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
        dev->tag_capacity = capacity;
    }
    uint64_t slot = (tag * 0x9e3779b97f4a7c15ull) & (dev->tag_capacity - 1);
    while (dev->tags[slot].used && dev->tags[slot].tag != tag)
        slot = (slot + 1) & (dev->tag_capacity - 1);
    if (!dev->tags[slot].used) {
        dev->tags[slot] = (tag_slot){.tag = tag, .used = 1};
        dev->tag_count++;
    }
    return &dev->tags[slot];
}

/* Tag accounting is best effort: without memory for the table the
 * allocation still succeeds, only untracked. */
static void
tag_account(device_state *dev, uint64_t tag, uint64_t size, int allocate)
{
    tag_slot *slot = tag_find(dev, tag);
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

/* ---- blocks and segments ------------------------------------------------- */

static void
drop_reuse_event(allocator *a, block *b)
{
    if (b->reuse_event != NULL) {
        a->backend.event_free(a->backend.ctx, b->reuse_event);
        b->reuse_event = NULL;
    }
}

static int
mergeable(const block *neighbour, const block *b)
{
    return neighbour != NULL && neighbour->in_index && neighbour->stream == b->stream;
}

/* Absorbs `victim`, the free block right after `b`, into `b`. */
static void
absorb_next(allocator *a, device_state *dev, block *b, block *victim)
{
    index_remove(dev, victim);
    drop_reuse_event(a, victim);
    b->size += victim->size;
    b->next = victim->next;
    if (victim->next != NULL)
        victim->next->prev = b;
    free(victim);
}

/* A block becomes free: merged with free neighbours of its stream, indexed. */
static void
insert_free(allocator *a, device_state *dev, block *b)
{
    drop_reuse_event(a, b);
    if (mergeable(b->prev, b)) {
        block *prev = b->prev;
        index_remove(dev, prev);
        drop_reuse_event(a, prev);
        prev->size += b->size;
        prev->next = b->next;
        if (b->next != NULL)
            b->next->prev = prev;
        free(b);
        b = prev;
    }
    if (mergeable(b->next, b))
        absorb_next(a, dev, b, b->next);
    index_insert(dev, b);
}

/* Gives a segment whose blocks are all free back to the backend. Freeing
 * device memory waits for the device (cudaFree does), so blocks of several
 * streams may go together. */
static void
release_segment(allocator *a, device_state *dev, segment *seg)
{
    for (block *b = seg->first, *next; b != NULL; b = next) {
        next = b->next;
        index_remove(dev, b);
        drop_reuse_event(a, b);
        if (b != seg->first)
            free(b);
    }
    a->backend.device_free(a->backend.ctx, dev->index, (void *)seg->base, seg->size);
    dev->stats.reserved_bytes -= seg->size;
    dev->stats.device_frees++;
    if (seg->prev != NULL)
        seg->prev->next = seg->next;
    else
        dev->segments = seg->next;
    if (seg->next != NULL)
        seg->next->prev = seg->prev;
    free(seg->first);
    free(seg);
}

static int
segment_all_free(const segment *seg)
{
    for (const block *b = seg->first; b != NULL; b = b->next) {
        if (!b->in_index)
            return 0;
    }
    return 1;
}

/* Releases every segment with no live or pending block. Lock held. */
static void
release_free_segments(allocator *a, device_state *dev)
{
    segment *seg = dev->segments;
    while (seg != NULL) {
        segment *next = seg->next;
        if (segment_all_free(seg))
            release_segment(a, dev, seg);
        seg = next;
    }
}

static int
events_done(allocator *a, block *b, int wait)
{
    for (int i = 0; i < b->n_events; i++) {
        if (wait)
            a->backend.event_wait(a->backend.ctx, b->events[i]);
        else if (a->backend.event_query(a->backend.ctx, b->events[i]) != 1)
            return 0;
    }
    return 1;
}

/* Frees blocks whose cross-stream events completed (all of them if `wait`). */
static void
free_events(allocator *a, block *b)
{
    for (int i = 0; i < b->n_events; i++)
        a->backend.event_free(a->backend.ctx, b->events[i]);
    free(b->events);
    b->events = NULL;
    b->n_events = 0;
}

static void
process_pending(allocator *a, device_state *dev, int wait)
{
    block *b = dev->pending;
    while (b != NULL) {
        block *next = b->list_next;
        if (events_done(a, b, wait)) {
            list_remove(&dev->pending, b);
            free_events(a, b);
            b->pending = 0;
            insert_free(a, dev, b);
        }
        b = next;
    }
}

/* A block freed on another stream may serve `stream` once an event recorded
 * on its old stream since the free has completed. The event is recorded
 * lazily, at the first such request: later than the free, so still safe. */
static int
usable_across_streams(allocator *a, device_state *dev, block *b)
{
    if (b->reuse_event == NULL &&
        a->backend.event_record(a->backend.ctx, dev->index, b->stream, &b->reuse_event) != ALLOC_OK) {
        b->reuse_event = NULL;
        return 0;
    }
    return a->backend.event_query(a->backend.ctx, b->reuse_event) == 1;
}

/* Best fit among free blocks of the pool: same stream first. Lock held. */
static block *
find_free_block(allocator *a, device_state *dev, uint64_t size, int small, void *stream)
{
    for (int other_streams = 0; other_streams < 2; other_streams++) {
        for (unsigned bucket = bucket_of(size); bucket < BUCKETS; bucket++) {
            block *best = NULL;
            for (block *b = dev->buckets[small][bucket]; b != NULL; b = b->list_next) {
                if (b->size < size || (best != NULL && b->size >= best->size))
                    continue;
                if ((b->stream == stream) == !other_streams &&
                    (!other_streams || usable_across_streams(a, dev, b)))
                    best = b;
            }
            if (best != NULL)
                return best;
        }
    }
    return NULL;
}

static int
should_split(const block *b, uint64_t size)
{
    uint64_t remaining = b->size - size;
    return b->seg->small ? remaining >= MIN_BLOCK : remaining > LARGE_SPLIT_MIN;
}

/* Takes `b` for a request of `size` bytes on `stream`, splitting off the
 * rest as a new free block. Lock held. 0, or -1 without memory. */
static int
take_block(allocator *a, device_state *dev, block *b, uint64_t size, void *stream)
{
    if (b->in_index)
        index_remove(dev, b);
    drop_reuse_event(a, b);
    b->stream = stream;
    if (should_split(b, size)) {
        block *rest = calloc(1, sizeof(*rest));
        if (rest == NULL) {
            index_insert(dev, b);
            return -1;
        }
        rest->ptr = b->ptr + size;
        rest->size = b->size - size;
        rest->stream = stream;
        rest->seg = b->seg;
        rest->prev = b;
        rest->next = b->next;
        if (b->next != NULL)
            b->next->prev = rest;
        b->next = rest;
        b->size = size;
        insert_free(a, dev, rest);
    }
    return 0;
}

static int
within_limit(const device_state *dev, uint64_t size)
{
    return dev->limit == 0 || dev->stats.reserved_bytes + size <= dev->limit;
}

static int
backend_segment(allocator *a, device_state *dev, uint64_t size, void **ptr)
{
    if (!within_limit(dev, size))
        return ALLOC_OUT_OF_MEMORY;
    return a->backend.device_malloc(a->backend.ctx, dev->index, size, ptr);
}

/* A new segment holding one free block; on out-of-memory it waits for
 * pending frees, releases cached segments and tries once more. */
static block *
new_segment(allocator *a, device_state *dev, uint64_t rounded, void *stream)
{
    uint64_t size = segment_size_for(rounded);
    void *ptr = NULL;
    int status = backend_segment(a, dev, size, &ptr);
    if (status == ALLOC_OUT_OF_MEMORY) {
        dev->stats.oom_retries++;
        process_pending(a, dev, 1);
        release_free_segments(a, dev);
        status = backend_segment(a, dev, size, &ptr);
    }
    if (status != ALLOC_OK)
        return NULL;
    segment *seg = calloc(1, sizeof(*seg));
    block *b = seg ? calloc(1, sizeof(*b)) : NULL;
    if (b == NULL) {
        free(seg);
        a->backend.device_free(a->backend.ctx, dev->index, ptr, size);
        return NULL;
    }
    *seg = (segment){.base = (uintptr_t)ptr, .size = size, .small = rounded <= SMALL_REQUEST,
                     .first = b, .next = dev->segments};
    if (dev->segments != NULL)
        dev->segments->prev = seg;
    dev->segments = seg;
    *b = (block){.ptr = (uintptr_t)ptr, .size = size, .stream = stream, .seg = seg};
    dev->stats.reserved_bytes += size;
    dev->stats.device_allocs++;
    if (dev->stats.reserved_bytes > dev->stats.peak_reserved_bytes)
        dev->stats.peak_reserved_bytes = dev->stats.reserved_bytes;
    return b;
}

/* ---- public API ------------------------------------------------------------ */

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
    pthread_mutex_init(&a->oom_lock, NULL);
    for (int i = 0; i < device_count; i++) {
        pthread_mutex_init(&a->devices[i].lock, NULL);
        a->devices[i].index = i;
    }
    return a;
}

static device_state *
device_of(allocator *a, int device)
{
    return device >= 0 && device < a->device_count ? &a->devices[device] : NULL;
}

static void
record_oom(allocator *a, device_state *dev, uint64_t size)
{
    dev->stats.ooms++;
    pthread_mutex_lock(&a->oom_lock);
    a->last_oom = (alloc_oom_info){.requested = size, .device = dev->index,
                                   .reserved = dev->stats.reserved_bytes,
                                   .allocated = dev->stats.allocated_bytes,
                                   .limit = dev->limit};
    pthread_mutex_unlock(&a->oom_lock);
}

static void
account_malloc(device_state *dev, block *b, uint64_t size, uint64_t tag)
{
    b->allocated = 1;
    b->requested = size;
    b->tag = tag;
    dev->stats.mallocs++;
    dev->stats.live_blocks++;
    dev->stats.allocated_bytes += b->size;
    dev->stats.requested_bytes += size;
    if (dev->stats.allocated_bytes > dev->stats.peak_allocated_bytes)
        dev->stats.peak_allocated_bytes = dev->stats.allocated_bytes;
    tag_account(dev, tag, b->size, 1);
}

void *
alloc_malloc(allocator *a, uint64_t size, int device, void *stream, uint64_t tag)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return NULL;
    uint64_t rounded = alloc_round_size(size);
    int small = rounded <= SMALL_REQUEST;
    pthread_mutex_lock(&dev->lock);
    process_pending(a, dev, 0);
    block *b = find_free_block(a, dev, rounded, small, stream);
    if (b != NULL) {
        dev->stats.cache_hits++;
    } else if ((b = new_segment(a, dev, rounded, stream)) == NULL) {
        record_oom(a, dev, size);
        pthread_mutex_unlock(&dev->lock);
        return NULL;
    }
    if (take_block(a, dev, b, rounded, stream) < 0 || map_insert(dev, b) < 0) {
        if (!b->in_index)
            insert_free(a, dev, b);
        record_oom(a, dev, size);
        pthread_mutex_unlock(&dev->lock);
        return NULL;
    }
    account_malloc(dev, b, size, tag);
    void *ptr = (void *)b->ptr;
    uint64_t bytes = b->size;
    pthread_mutex_unlock(&dev->lock);
    if (a->backend.on_handout != NULL)
        a->backend.on_handout(a->backend.ctx, device, stream, ptr, bytes);
    return ptr;
}

/* Records an event on each extra stream the block was used on. */
static int
record_pending_events(allocator *a, device_state *dev, block *b)
{
    b->events = calloc((size_t)b->n_extra, sizeof(void *));
    if (b->events == NULL)
        return -1;
    for (int i = 0; i < b->n_extra; i++) {
        if (a->backend.event_record(a->backend.ctx, dev->index, b->extra_streams[i],
                                    &b->events[b->n_events]) != ALLOC_OK)
            return -1;
        b->n_events++;
    }
    return 0;
}

int
alloc_free(allocator *a, void *ptr, int device)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    pthread_mutex_lock(&dev->lock);
    block *b = map_take(dev, (uintptr_t)ptr);
    if (b == NULL) {
        pthread_mutex_unlock(&dev->lock);
        return -1;
    }
    dev->stats.frees++;
    dev->stats.live_blocks--;
    dev->stats.allocated_bytes -= b->size;
    dev->stats.requested_bytes -= b->requested;
    tag_account(dev, b->tag, b->size, 0);
    b->allocated = 0;
    int deferred = 0;
    if (b->n_extra > 0) {
        deferred = record_pending_events(a, dev, b) == 0;
        if (!deferred) {
            /* no event for some stream: only a device-wide wait is safe */
            a->backend.device_synchronize(a->backend.ctx, dev->index);
            free_events(a, b);
        }
        free(b->extra_streams);
        b->extra_streams = NULL;
        b->n_extra = 0;
    }
    if (deferred) {
        b->pending = 1;
        list_push(&dev->pending, b);
    } else {
        insert_free(a, dev, b);
    }
    pthread_mutex_unlock(&dev->lock);
    return 0;
}

int
alloc_record_stream(allocator *a, void *ptr, void *stream)
{
    for (int d = 0; d < a->device_count; d++) {
        device_state *dev = &a->devices[d];
        pthread_mutex_lock(&dev->lock);
        block *b = map_find(dev, (uintptr_t)ptr);
        int result = -1;
        if (b != NULL) {
            result = 0;
            int known = b->stream == stream;
            for (int i = 0; i < b->n_extra && !known; i++)
                known = b->extra_streams[i] == stream;
            if (!known) {
                void **grown = realloc(b->extra_streams, sizeof(void *) * (size_t)(b->n_extra + 1));
                if (grown == NULL)
                    result = -1;
                else {
                    grown[b->n_extra++] = stream;
                    b->extra_streams = grown;
                }
            }
        }
        pthread_mutex_unlock(&dev->lock);
        if (b != NULL)
            return result;
    }
    return -1;
}

void
alloc_empty_cache(allocator *a)
{
    for (int d = 0; d < a->device_count; d++) {
        device_state *dev = &a->devices[d];
        pthread_mutex_lock(&dev->lock);
        process_pending(a, dev, 1);
        release_free_segments(a, dev);
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

void
alloc_reset_peaks(allocator *a)
{
    for (int d = 0; d < a->device_count; d++) {
        device_state *dev = &a->devices[d];
        pthread_mutex_lock(&dev->lock);
        dev->stats.peak_allocated_bytes = dev->stats.allocated_bytes;
        dev->stats.peak_reserved_bytes = dev->stats.reserved_bytes;
        for (uint64_t i = 0; i < dev->tag_capacity; i++)
            dev->tags[i].peak_bytes = dev->tags[i].live_bytes;
        pthread_mutex_unlock(&dev->lock);
    }
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
    pthread_mutex_lock(&a->oom_lock);
    alloc_oom_info info = a->last_oom;
    pthread_mutex_unlock(&a->oom_lock);
    return info;
}

static void
free_block_struct(allocator *a, block *b)
{
    drop_reuse_event(a, b);
    free_events(a, b);
    free(b->extra_streams);
    free(b);
}

void
alloc_destroy(allocator *a)
{
    if (a == NULL)
        return;
    alloc_empty_cache(a);
    for (int d = 0; d < a->device_count; d++) {
        device_state *dev = &a->devices[d];
        /* segments with live blocks stay with the backend: only our books go */
        for (segment *seg = dev->segments, *next; seg != NULL; seg = next) {
            next = seg->next;
            for (block *b = seg->first, *after; b != NULL; b = after) {
                after = b->next;
                free_block_struct(a, b);
            }
            free(seg);
        }
        free(dev->map);
        free(dev->tags);
        pthread_mutex_destroy(&dev->lock);
    }
    pthread_mutex_destroy(&a->oom_lock);
    free(a->devices);
    free(a);
}

/* ---- invariants (tests) ------------------------------------------------------- */

static int
check_segment(device_state *dev, segment *seg, uint64_t *allocated, uint64_t *live)
{
    uintptr_t expected = seg->base;
    uint64_t total = 0;
    for (block *b = seg->first; b != NULL; b = b->next) {
        if (b->ptr != expected || b->seg != seg || (b->next && b->next->prev != b))
            return -1;
        if (b->allocated + b->pending + b->in_index != 1)
            return -2;   /* exactly one state */
        if (b->allocated) {
            *allocated += b->size;
            (*live)++;
            if (map_find(dev, b->ptr) != b)
                return -3;
        }
        if (b->in_index && b->next && b->next->in_index && b->next->stream == b->stream)
            return -4;   /* missed coalescing */
        if (b->in_index) {
            block *found = dev->buckets[seg->small][bucket_of(b->size)];
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

int
alloc_check(allocator *a, int device)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return -1;
    pthread_mutex_lock(&dev->lock);
    uint64_t allocated = 0, live = 0, reserved = 0;
    int result = 0;
    for (segment *seg = dev->segments; seg != NULL && result == 0; seg = seg->next) {
        reserved += seg->size;
        result = check_segment(dev, seg, &allocated, &live);
    }
    if (result == 0 && (allocated != dev->stats.allocated_bytes ||
                        reserved != dev->stats.reserved_bytes || live != dev->map_count ||
                        live != dev->stats.live_blocks))
        result = -7;
    pthread_mutex_unlock(&dev->lock);
    return result;
}
