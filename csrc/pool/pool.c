#include "pool.h"
#include "common/host_memory.h"
#include "common/mp_assert.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define POOL_ALIGN 256u
#define POOL_SMALL_LIMIT 2048u
#define POOL_SMALL_LOG2 11u
#define CLASSES_PER_DOUBLING 8u
/* 256-byte steps up to 2 KiB, then 8 classes per power of two */
#define POOL_SMALL_CLASSES (POOL_SMALL_LIMIT / POOL_ALIGN)
#define POOL_CLASS_COUNT (POOL_SMALL_CLASSES + (64u - POOL_SMALL_LOG2) * CLASSES_PER_DOUBLING)

/* The largest class: 15/8 of 2^63. A request past it has no class (its
 * size would not fit in 64 bits). */
#define POOL_MAX_CLASS ((uint64_t)15 << 60)

typedef struct cached_buffer {
    void *ptr;
    uint64_t size;
    struct cached_buffer *next;
} cached_buffer;

struct pool {
    pthread_mutex_t lock;
    pool_backend backend;
    uint64_t limit_bytes;
    pool_stats stats;
    cached_buffer *free_lists[POOL_CLASS_COUNT];
};

static unsigned
floor_log2(uint64_t value)
{
    return 63u - (unsigned)__builtin_clzll(value);
}

/* Callers pass bytes <= POOL_MAX_CLASS. */
static unsigned
pool_class_index(uint64_t bytes)
{
    if (bytes <= POOL_SMALL_LIMIT)
        return bytes == 0 ? 0 : (unsigned)((bytes - 1) / POOL_ALIGN);
    /* round up to a multiple of 1/8 of the power of two below `bytes` */
    unsigned power = floor_log2(bytes);
    uint64_t eighths = ((bytes - 1) >> (power - 3)) + 1;   /* 9..16, no wrap */
    if (eighths == 16) {
        power++;
        eighths = 8;
    }
    return POOL_SMALL_CLASSES + (power - POOL_SMALL_LOG2) * CLASSES_PER_DOUBLING +
           (unsigned)(eighths - CLASSES_PER_DOUBLING);
}

static uint64_t
pool_index_size(unsigned index)
{
    if (index < POOL_SMALL_CLASSES)
        return (uint64_t)(index + 1) * POOL_ALIGN;
    unsigned large = index - POOL_SMALL_CLASSES;
    unsigned power = POOL_SMALL_LOG2 + large / CLASSES_PER_DOUBLING;
    uint64_t eighths = CLASSES_PER_DOUBLING + large % CLASSES_PER_DOUBLING;
    return eighths << (power - 3);
}

uint64_t
pool_class_size(uint64_t bytes)
{
    return bytes > POOL_MAX_CLASS ? 0 : pool_index_size(pool_class_index(bytes));
}

pool *
pool_create(pool_backend backend, uint64_t limit_bytes)
{
    pool *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    if (pthread_mutex_init(&p->lock, NULL) != 0) {
        free(p);
        return NULL;
    }
    p->backend = backend;
    p->limit_bytes = limit_bytes;
    return p;
}

/* Takes every cached buffer out of the cache and its bytes out of the
 * reserved count; the caller frees them with free_detached() once it let
 * the lock go (pinned memory is freed with cudaFreeHost, which waits for
 * the device). Lock held. */
static cached_buffer *
detach_cache_locked(pool *p)
{
    cached_buffer *detached = NULL;
    for (unsigned i = 0; i < POOL_CLASS_COUNT; i++) {
        cached_buffer *node = p->free_lists[i];
        p->free_lists[i] = NULL;
        while (node != NULL) {
            cached_buffer *next = node->next;
            MP_ASSERT(node->size == pool_index_size(i));
            mp_counter_sub(&p->stats.bytes_reserved, node->size);
            node->next = detached;
            detached = node;
            node = next;
        }
    }
    return detached;
}

/* A non-empty cache class for freeing `needed` bytes: the smallest
 * whose buffers hold them all, else the largest there is (one of its
 * buffers frees part of them); -1 when the cache is empty. Lock held. */
static int
class_to_free_locked(const pool *p, uint64_t needed)
{
    unsigned fit = pool_class_index(needed < POOL_MAX_CLASS ? needed : POOL_MAX_CLASS);
    for (unsigned i = fit; i < POOL_CLASS_COUNT; i++) {
        if (p->free_lists[i] != NULL)
            return (int)i;
    }
    for (unsigned i = fit; i-- > 0;) {
        if (p->free_lists[i] != NULL)
            return (int)i;
    }
    return -1;
}

/* Takes cached buffers out, as few and as small as hold `needed` bytes
 * (class_to_free_locked, one buffer at a time), and their bytes out of
 * the reserved count: the rest of the cache stays, so a miss at the limit
 * frees what it needs rather than every buffer (each cudaFreeHost waits
 * for the device, and what is freed must be pinned again). The caller
 * frees them with free_detached(). Lock held. */
static cached_buffer *
detach_some_locked(pool *p, uint64_t needed)
{
    cached_buffer *detached = NULL;
    while (needed > 0) {
        int index = class_to_free_locked(p, needed);
        if (index < 0)
            break;
        cached_buffer *node = p->free_lists[index];
        p->free_lists[index] = node->next;
        MP_ASSERT(node->size == pool_index_size((unsigned)index));
        mp_counter_sub(&p->stats.bytes_reserved, node->size);
        node->next = detached;
        detached = node;
        needed = node->size >= needed ? 0 : needed - node->size;
    }
    return detached;
}

/* Counts `count` buffers given back to the backend. */
static void
count_frees(pool *p, uint64_t count)
{
    if (count == 0)
        return;
    pthread_mutex_lock(&p->lock);
    p->stats.host_frees += count;
    pthread_mutex_unlock(&p->lock);
}

/* Gives detached buffers back to the backend. Lock not held. */
static void
free_detached(pool *p, cached_buffer *node)
{
    uint64_t freed = 0;
    while (node != NULL) {
        cached_buffer *next = node->next;
        p->backend.free(p->backend.ctx, node->ptr, node->size);
        free(node);
        node = next;
        freed++;
    }
    count_frees(p, freed);
}

void
pool_empty(pool *p)
{
    pthread_mutex_lock(&p->lock);
    cached_buffer *detached = detach_cache_locked(p);
    pthread_mutex_unlock(&p->lock);
    free_detached(p, detached);
}

void
pool_destroy(pool *p)
{
    if (p == NULL)
        return;
    pool_empty(p);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

static int
take_cached_locked(pool *p, unsigned index, void **ptr)
{
    cached_buffer *node = p->free_lists[index];
    if (node == NULL)
        return 0;
    MP_ASSERT(node->size == pool_index_size(index));
    p->free_lists[index] = node->next;
    *ptr = node->ptr;
    free(node);
    return 1;
}

/* reserved + size <= limit, without wrapping. */
static int
within_limit(const pool *p, uint64_t size)
{
    return p->limit_bytes == 0 ||
           (size <= p->limit_bytes && p->stats.bytes_reserved <= p->limit_bytes - size);
}

/* Counts `size` bytes as reserved when they fit under the limit, before the
 * backend runs unlocked, so concurrent callers see the limit. Lock held. */
static int
claim_locked(pool *p, uint64_t size)
{
    if (!within_limit(p, size))
        return 0;
    p->stats.bytes_reserved += size;
    MP_ASSERT(p->limit_bytes == 0 || p->stats.bytes_reserved <= p->limit_bytes);
    return 1;
}

/* Calls the backend for a claimed buffer; gives the claim back when it
 * fails. Lock not held. */
static void *
backend_alloc(pool *p, uint64_t size)
{
    void *ptr = p->backend.alloc(p->backend.ctx, size);
    pthread_mutex_lock(&p->lock);
    if (ptr != NULL)
        p->stats.host_allocations++;
    else
        mp_counter_sub(&p->stats.bytes_reserved, size);
    pthread_mutex_unlock(&p->lock);
    return ptr;
}

/* Cached bytes to free before a buffer of `size` may be tried again: what
 * passes the limit, or, when the backend refused (out of pinned memory),
 * `size` itself; 0 when freeing cannot help (larger than the limit).
 * Lock held. */
static uint64_t
room_needed_locked(const pool *p, uint64_t size)
{
    if (p->limit_bytes != 0 && size > p->limit_bytes)
        return 0;
    if (!within_limit(p, size))
        return p->stats.bytes_reserved + size - p->limit_bytes;
    return size;
}

/* A new backend buffer; when the limit or the backend refuses, cached
 * buffers are freed once, as few as make room (detach_some_locked), and
 * the request tried again. Every backend call runs with the lock
 * released. */
static void *
allocate_new(pool *p, uint64_t size)
{
    pthread_mutex_lock(&p->lock);
    int claimed = claim_locked(p, size);
    pthread_mutex_unlock(&p->lock);
    void *ptr = claimed ? backend_alloc(p, size) : NULL;
    if (ptr != NULL)
        return ptr;
    pthread_mutex_lock(&p->lock);
    cached_buffer *detached = detach_some_locked(p, room_needed_locked(p, size));
    claimed = claim_locked(p, size);
    pthread_mutex_unlock(&p->lock);
    free_detached(p, detached);
    return claimed ? backend_alloc(p, size) : NULL;
}

/* Hands `ptr` out as `out`. Lock held. */
static void
hand_out_locked(pool *p, pool_block *out, void *ptr, uint64_t size, uint64_t bytes, int fallback)
{
    *out = (pool_block){.ptr = ptr, .size = size, .requested = bytes, .fallback = (uint8_t)fallback};
    p->stats.fallbacks += (uint64_t)fallback;
    p->stats.bytes_in_use += size;
    p->stats.bytes_requested += bytes;
    p->stats.blocks_in_use++;
    MP_ASSERT(bytes <= size && p->stats.bytes_requested <= p->stats.bytes_in_use);
    if (p->stats.bytes_in_use > p->stats.peak_bytes_in_use)
        p->stats.peak_bytes_in_use = p->stats.bytes_in_use;
}

int
pool_acquire_cached(pool *p, uint64_t bytes, pool_block *out)
{
    void *ptr = NULL;
    *out = (pool_block){0};
    if (bytes > POOL_MAX_CLASS)
        return -1;
    unsigned index = pool_class_index(bytes);
    pthread_mutex_lock(&p->lock);
    int hit = take_cached_locked(p, index, &ptr);
    if (hit) {
        p->stats.hits++;
        hand_out_locked(p, out, ptr, pool_index_size(index), bytes, 0);
    }
    pthread_mutex_unlock(&p->lock);
    return hit ? 0 : -1;
}

int
pool_acquire(pool *p, uint64_t bytes, pool_block *out)
{
    if (pool_acquire_cached(p, bytes, out) == 0)
        return 0;
    /* too large for any class: counted as a miss that got nothing */
    uint64_t size = bytes > POOL_MAX_CLASS ? 0 : pool_class_size(bytes);
    pthread_mutex_lock(&p->lock);
    p->stats.misses++;
    pthread_mutex_unlock(&p->lock);
    void *ptr = size != 0 ? allocate_new(p, size) : NULL;
    int fallback = 0;
    if (ptr == NULL && size != 0) {
        ptr = mp_host_alloc(size, POOL_ALIGN);
        fallback = ptr != NULL;
    }
    pthread_mutex_lock(&p->lock);
    if (ptr == NULL)
        p->stats.failures++;
    else
        hand_out_locked(p, out, ptr, size, bytes, fallback);
    pthread_mutex_unlock(&p->lock);
    return ptr == NULL ? -1 : 0;
}

/* Takes an acquired block out of the in-use counters. Lock held. */
static void
unaccount_locked(pool *p, const pool_block *block)
{
    /* a block this pool handed out: its size is its request's class */
    MP_ASSERT(block->size == pool_class_size(block->requested));
    mp_counter_sub(&p->stats.bytes_in_use, block->size);
    mp_counter_sub(&p->stats.bytes_requested, block->requested);
    mp_counter_sub(&p->stats.blocks_in_use, 1);
}

/* Puts a block no longer counted in use into the cache; pageable memory,
 * or a buffer with no memory for its cache entry, is freed instead. */
static void
cache_or_free(pool *p, pool_block *block)
{
    cached_buffer *node = block->fallback ? NULL : malloc(sizeof(*node));
    pthread_mutex_lock(&p->lock);
    if (node != NULL) {
        *node = (cached_buffer){.ptr = block->ptr, .size = block->size};
        unsigned index = pool_class_index(block->size);
        node->next = p->free_lists[index];
        p->free_lists[index] = node;
    } else if (!block->fallback) {
        mp_counter_sub(&p->stats.bytes_reserved, block->size);
    }
    pthread_mutex_unlock(&p->lock);
    if (block->fallback) {
        mp_host_free(block->ptr);
    } else if (node == NULL) {  /* no memory for a cache entry: give the buffer back */
        p->backend.free(p->backend.ctx, block->ptr, block->size);
        count_frees(p, 1);
    }
    *block = (pool_block){0};
}

void
pool_release(pool *p, pool_block *block)
{
    if (block->ptr == NULL)
        return;
    pool_release_pending(p, block);
    cache_or_free(p, block);
}

void
pool_release_pending(pool *p, pool_block *block)
{
    if (block->ptr == NULL)
        return;
    pthread_mutex_lock(&p->lock);
    unaccount_locked(p, block);
    pthread_mutex_unlock(&p->lock);
}

void
pool_recycle(pool *p, pool_block *block)
{
    if (block->ptr != NULL)
        cache_or_free(p, block);
}

uint64_t
pool_reserve(pool *p, uint64_t bytes, uint64_t count)
{
    if (bytes > POOL_MAX_CLASS)
        return 0;
    unsigned index = pool_class_index(bytes);
    uint64_t size = pool_index_size(index);
    uint64_t added = 0;
    for (; added < count; added++) {
        cached_buffer *node = malloc(sizeof(*node));
        if (node == NULL)
            break;
        pthread_mutex_lock(&p->lock);
        int claimed = claim_locked(p, size);
        pthread_mutex_unlock(&p->lock);
        /* pinning takes milliseconds per buffer: not under the lock */
        void *ptr = claimed ? backend_alloc(p, size) : NULL;
        if (ptr == NULL) {
            free(node);
            break;
        }
        *node = (cached_buffer){.ptr = ptr, .size = size};
        pthread_mutex_lock(&p->lock);
        node->next = p->free_lists[index];
        p->free_lists[index] = node;
        pthread_mutex_unlock(&p->lock);
    }
    return added;
}

void
pool_set_limit(pool *p, uint64_t limit_bytes)
{
    cached_buffer *detached = NULL;
    pthread_mutex_lock(&p->lock);
    p->limit_bytes = limit_bytes;
    /* only what passes the new limit goes: the rest stays cached */
    if (limit_bytes != 0 && p->stats.bytes_reserved > limit_bytes)
        detached = detach_some_locked(p, p->stats.bytes_reserved - limit_bytes);
    pthread_mutex_unlock(&p->lock);
    free_detached(p, detached);
}

pool_stats
pool_get_stats(pool *p)
{
    pthread_mutex_lock(&p->lock);
    pool_stats stats = p->stats;
    pthread_mutex_unlock(&p->lock);
    return stats;
}

void
pool_reset_peak(pool *p)
{
    pthread_mutex_lock(&p->lock);
    p->stats.peak_bytes_in_use = p->stats.bytes_in_use;
    pthread_mutex_unlock(&p->lock);
}

const char *
pool_backend_name(pool *p)
{
    return p->backend.name;
}
