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
typedef struct stream_state stream_state;
typedef struct pending_event pending_event;

struct block {
    uintptr_t ptr;
    uint64_t size, requested;
    segment *seg;
    block *prev, *next;             /* address neighbours inside the segment */
    block *list_prev, *list_next;   /* free bucket */
    block *map_next;                /* chain of the live-pointer table */
    uint64_t tag;
    void **extra_streams;           /* streams from alloc_record_stream, recorded on at the free */
    int n_extra;
    int event_count;                /* events of its free not yet seen complete */
    uint8_t allocated, in_index;
};

/* Blocks of a segment serve only the stream the segment was allocated on
 * (torch's rule): reuse on that stream is ordered by the stream itself,
 * so no event is needed, and no other stream ever waits on it. */
struct segment {
    uintptr_t base;
    uint64_t size;
    int small;
    stream_state *owner;
    block *first;
    segment *prev, *next;
};

/* An event recorded at a free on a stream that used the block. */
struct pending_event {
    void *event;
    block *b;
    pending_event *next;
};

/* One stream of a device: the free blocks of its segments, and the events
 * frees recorded on it, oldest first. `stream` is a key only: nothing is
 * recorded on it after the call that named it returned, so a stream
 * destroyed since does no harm. Freed once it has neither. */
struct stream_state {
    void *stream;
    block *buckets[2][BUCKETS];     /* [small][floor(log2 size)] */
    uint64_t segments;
    pending_event *head, *tail;
    stream_state *next;
};

typedef struct {
    uint64_t tag, live_bytes, peak_bytes, allocations;
    int used;
} tag_slot;

typedef struct {
    pthread_mutex_t lock;
    int index;
    stream_state *streams;          /* most recently allocated on first */
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
    if (size > UINT64_MAX - (MIN_BLOCK - 1))
        return 0;   /* rounding up would wrap to a tiny block */
    return (size + MIN_BLOCK - 1) & ~(uint64_t)(MIN_BLOCK - 1);
}

/* 0 when the segment size cannot be represented. */
static uint64_t
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
bucket_for(block *b)
{
    return &b->seg->owner->buckets[b->seg->small][bucket_of(b->size)];
}

static void
index_insert(block *b)
{
    list_push(bucket_for(b), b);
    b->in_index = 1;
}

static void
index_remove(block *b)
{
    list_remove(bucket_for(b), b);
    b->in_index = 0;
}

/* ---- streams --------------------------------------------------------------- */

/* The state of `stream`, moved to the front: a device mostly allocates on
 * one or two streams. NULL when the device has none for it. */
static stream_state *
stream_find(device_state *dev, void *stream)
{
    for (stream_state **link = &dev->streams; *link != NULL; link = &(*link)->next) {
        stream_state *s = *link;
        if (s->stream != stream)
            continue;
        *link = s->next;
        s->next = dev->streams;
        dev->streams = s;
        return s;
    }
    return NULL;
}

/* The state of `stream`, made when missing; NULL without memory. */
static stream_state *
stream_get(device_state *dev, void *stream)
{
    stream_state *s = stream_find(dev, stream);
    if (s == NULL && (s = calloc(1, sizeof(*s))) != NULL) {
        s->stream = stream;
        s->next = dev->streams;
        dev->streams = s;
    }
    return s;
}

static int
stream_unused(const stream_state *s)
{
    return s->segments == 0 && s->head == NULL;
}

static void
stream_drop_if_unused(device_state *dev, stream_state *s)
{
    if (!stream_unused(s))
        return;
    for (stream_state **link = &dev->streams; *link != NULL; link = &(*link)->next) {
        if (*link == s) {
            *link = s->next;
            free(s);
            return;
        }
    }
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

/* Absorbs `victim`, the free block right after `b`, into `b`. */
static void
absorb_next(block *b, block *victim)
{
    index_remove(victim);
    b->size += victim->size;
    b->next = victim->next;
    if (victim->next != NULL)
        victim->next->prev = b;
    free(victim);
}

/* A block becomes free: merged with its free neighbours, indexed. */
static void
insert_free(block *b)
{
    if (b->prev != NULL && b->prev->in_index) {
        block *prev = b->prev;
        index_remove(prev);
        prev->size += b->size;
        prev->next = b->next;
        if (b->next != NULL)
            b->next->prev = prev;
        free(b);
        b = prev;
    }
    if (b->next != NULL && b->next->in_index)
        absorb_next(b, b->next);
    index_insert(b);
}

/* Gives a segment whose blocks are all free back to the backend. Freeing
 * device memory waits for the device (cudaFree does), so no event is needed. */
static void
release_segment(allocator *a, device_state *dev, segment *seg)
{
    for (block *b = seg->first, *next; b != NULL; b = next) {
        next = b->next;
        index_remove(b);
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
    seg->owner->segments--;
    stream_drop_if_unused(dev, seg->owner);
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

/* Retires the events frees recorded on one stream, oldest first, up to the
 * first one not complete: later ones on the same stream cannot be complete
 * before it, so querying them would only cost (torch's process_events).
 * With `wait`, waits for each instead. A block whose last event completed
 * returns to its stream's free blocks. Lock held. */
static void
retire_events(allocator *a, stream_state *s, int wait)
{
    while (s->head != NULL) {
        pending_event *e = s->head;
        if (wait)
            a->backend.event_wait(a->backend.ctx, e->event);
        else if (a->backend.event_query(a->backend.ctx, e->event) != 1)
            return;
        s->head = e->next;
        if (s->head == NULL)
            s->tail = NULL;
        a->backend.event_free(a->backend.ctx, e->event);
        block *b = e->b;
        free(e);
        if (--b->event_count == 0)
            insert_free(b);
    }
}

/* Retires completed events of every stream (all of them if `wait`) and
 * forgets the streams left with nothing. Lock held. */
static void
process_events(allocator *a, device_state *dev, int wait)
{
    stream_state **link = &dev->streams;
    while (*link != NULL) {
        stream_state *s = *link;
        retire_events(a, s, wait);
        if (stream_unused(s)) {
            *link = s->next;
            free(s);
        } else {
            link = &s->next;
        }
    }
}

/* Best fit among the free blocks of `stream`'s segments. Lock held. */
static block *
find_free_block(device_state *dev, uint64_t size, int small, void *stream)
{
    stream_state *s = stream_find(dev, stream);
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

/* Takes `b` for a request of `size` bytes, splitting off the rest as a new
 * free block. Lock held. 0, or -1 without memory. */
static int
take_block(block *b, uint64_t size)
{
    if (b->in_index)
        index_remove(b);
    if (should_split(b, size)) {
        block *rest = calloc(1, sizeof(*rest));
        if (rest == NULL) {
            index_insert(b);
            return -1;
        }
        rest->ptr = b->ptr + size;
        rest->size = b->size - size;
        rest->seg = b->seg;
        rest->prev = b;
        rest->next = b->next;
        if (b->next != NULL)
            b->next->prev = rest;
        b->next = rest;
        b->size = size;
        insert_free(rest);
    }
    return 0;
}

/* Overflow-safe: reserved + size <= limit. */
static int
within_limit(const device_state *dev, uint64_t size)
{
    return dev->limit == 0 || (size <= dev->limit && dev->stats.reserved_bytes <= dev->limit - size);
}

static int
backend_segment(allocator *a, device_state *dev, uint64_t size, void **ptr)
{
    if (!within_limit(dev, size))
        return ALLOC_OUT_OF_MEMORY;
    return a->backend.device_malloc(a->backend.ctx, dev->index, size, ptr);
}

/* A new segment of `stream` holding one free block; on out-of-memory it
 * waits for pending frees, releases cached segments of every stream and
 * tries once more. NULL when out of memory. */
static block *
new_segment(allocator *a, device_state *dev, uint64_t rounded, void *stream)
{
    uint64_t size = segment_size_for(rounded);
    void *ptr = NULL;
    if (size == 0)
        return NULL;
    int status = backend_segment(a, dev, size, &ptr);
    if (status == ALLOC_OUT_OF_MEMORY) {
        dev->stats.oom_retries++;
        process_events(a, dev, 1);
        release_free_segments(a, dev);
        status = backend_segment(a, dev, size, &ptr);
    }
    if (status != ALLOC_OK)
        return NULL;
    /* after the retry, which may have forgotten this stream */
    stream_state *owner = stream_get(dev, stream);
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
                     .owner = owner, .first = b, .next = dev->segments};
    if (dev->segments != NULL)
        dev->segments->prev = seg;
    dev->segments = seg;
    owner->segments++;
    *b = (block){.ptr = (uintptr_t)ptr, .size = size, .seg = seg};
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
    process_events(a, dev, 0);
    block *b = NULL;
    if (rounded != 0 && (b = find_free_block(dev, rounded, small, stream)) != NULL) {
        dev->stats.cache_hits++;
    } else if (rounded == 0 || (b = new_segment(a, dev, rounded, stream)) == NULL) {
        record_oom(a, dev, size);
        pthread_mutex_unlock(&dev->lock);
        return NULL;
    }
    if (take_block(b, rounded) < 0 || map_insert(dev, b) < 0) {
        if (!b->in_index)
            insert_free(b);
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

static void
free_event_chain(allocator *a, pending_event *e)
{
    while (e != NULL) {
        pending_event *next = e->next;
        if (e->event != NULL)
            a->backend.event_free(a->backend.ctx, e->event);
        free(e);
        e = next;
    }
}

/* Records an event on each extra stream the block was used on and queues
 * it on that stream; the block returns to its free blocks once all
 * completed (torch's insert_events). Everything that can fail happens
 * before anything is queued: on -1 nothing was. */
static int
insert_events(allocator *a, device_state *dev, block *b)
{
    pending_event *made = NULL;
    for (int i = 0; i < b->n_extra; i++) {
        pending_event *e = calloc(1, sizeof(*e));
        if (e == NULL || stream_get(dev, b->extra_streams[i]) == NULL) {
            free(e);
            free_event_chain(a, made);
            return -1;
        }
        e->b = b;
        e->next = made;
        made = e;
        if (a->backend.event_record(a->backend.ctx, dev->index, b->extra_streams[i],
                                    &e->event) != ALLOC_OK) {
            e->event = NULL;
            free_event_chain(a, made);
            return -1;
        }
    }
    /* `made` holds the streams' events in reverse order */
    for (int i = b->n_extra - 1; i >= 0; i--) {
        pending_event *e = made;
        made = e->next;
        e->next = NULL;
        stream_state *s = stream_find(dev, b->extra_streams[i]);
        if (s->tail != NULL)
            s->tail->next = e;
        else
            s->head = e;
        s->tail = e;
        b->event_count++;
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
    if (b->n_extra > 0 && insert_events(a, dev, b) < 0) {
        /* no event for some stream: only a device-wide wait is safe */
        a->backend.device_synchronize(a->backend.ctx, dev->index);
    }
    free(b->extra_streams);
    b->extra_streams = NULL;
    b->n_extra = 0;
    if (b->event_count == 0)
        insert_free(b);
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
            /* uses on its own stream are ordered by the stream already */
            int known = b->seg->owner->stream == stream;
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
        process_events(a, dev, 1);
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
                free(b->extra_streams);
                free(b);
            }
            free(seg);
        }
        /* empty_cache waited for every event: the streams hold none */
        for (stream_state *s = dev->streams, *next; s != NULL; s = next) {
            next = s->next;
            free_event_chain(a, s->head);
            free(s);
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
stream_known(device_state *dev, const stream_state *s)
{
    for (const stream_state *t = dev->streams; t != NULL; t = t->next) {
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
        if (b->allocated + (b->event_count > 0) + b->in_index != 1 || b->event_count < 0)
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
            block *found = *bucket_for(b);
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

/* Segment counts per stream and queued events match the blocks'. */
static int
check_streams(device_state *dev, uint64_t events)
{
    for (stream_state *s = dev->streams; s != NULL; s = s->next) {
        uint64_t segments = 0;
        for (segment *seg = dev->segments; seg != NULL; seg = seg->next)
            segments += seg->owner == s;
        if (segments != s->segments)
            return -9;
        for (pending_event *e = s->head; e != NULL; e = e->next) {
            if (e->b->event_count <= 0 || (e->next == NULL && e != s->tail))
                return -10;
            events--;
        }
    }
    return events == 0 ? 0 : -11;
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
    if (result == 0)
        result = check_streams(dev, events);
    pthread_mutex_unlock(&dev->lock);
    return result;
}
