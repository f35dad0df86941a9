#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* posix_memalign under -std=c11 */
#endif
#include "pool.h"

#include <pthread.h>
#include <stdlib.h>

#define POOL_ALIGN 256u
#define POOL_SMALL_LIMIT 2048u
#define POOL_SMALL_LOG2 11u
#define CLASSES_PER_DOUBLING 8u
/* 256-byte steps up to 2 KiB, then 8 classes per power of two */
#define POOL_SMALL_CLASSES (POOL_SMALL_LIMIT / POOL_ALIGN)
#define POOL_CLASS_COUNT (POOL_SMALL_CLASSES + (64u - POOL_SMALL_LOG2) * CLASSES_PER_DOUBLING)

typedef struct cached_buffer {
    void *ptr;
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

static unsigned
pool_class_index(uint64_t bytes)
{
    if (bytes <= POOL_SMALL_LIMIT)
        return bytes == 0 ? 0 : (unsigned)((bytes - 1) / POOL_ALIGN);
    /* round up to a multiple of 1/8 of the power of two below `bytes` */
    unsigned power = floor_log2(bytes);
    uint64_t step = (uint64_t)1 << (power - 3);
    uint64_t eighths = (bytes + step - 1) >> (power - 3);   /* 9..16 */
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
    return pool_index_size(pool_class_index(bytes));
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

/* Frees every cached buffer back to the backend. Lock held. */
static void
drop_cache_locked(pool *p)
{
    for (unsigned i = 0; i < POOL_CLASS_COUNT; i++) {
        uint64_t size = pool_index_size(i);
        cached_buffer *node = p->free_lists[i];
        p->free_lists[i] = NULL;
        while (node != NULL) {
            cached_buffer *next = node->next;
            p->backend.free(p->backend.ctx, node->ptr, size);
            p->stats.bytes_reserved -= size;
            free(node);
            node = next;
        }
    }
}

void
pool_empty(pool *p)
{
    pthread_mutex_lock(&p->lock);
    drop_cache_locked(p);
    pthread_mutex_unlock(&p->lock);
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
    p->free_lists[index] = node->next;
    *ptr = node->ptr;
    free(node);
    return 1;
}

static int
within_limit(const pool *p, uint64_t size)
{
    return p->limit_bytes == 0 || p->stats.bytes_reserved + size <= p->limit_bytes;
}

/* A new backend buffer; when the limit or the backend refuses, the cache is
 * dropped once to make room and the request tried again. Lock held. */
static void *
allocate_locked(pool *p, uint64_t size)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        if (within_limit(p, size)) {
            void *ptr = p->backend.alloc(p->backend.ctx, size);
            if (ptr != NULL) {
                p->stats.host_allocations++;
                p->stats.bytes_reserved += size;
                return ptr;
            }
        }
        drop_cache_locked(p);
    }
    return NULL;
}

static void *
pageable_alloc(uint64_t size)
{
    void *ptr = NULL;
    if (size > SIZE_MAX || posix_memalign(&ptr, POOL_ALIGN, (size_t)size) != 0)
        return NULL;
    return ptr;
}

int
pool_acquire(pool *p, uint64_t bytes, pool_block *out)
{
    unsigned index = pool_class_index(bytes);
    uint64_t size = pool_index_size(index);
    void *ptr = NULL;
    int fallback = 0;

    pthread_mutex_lock(&p->lock);
    if (take_cached_locked(p, index, &ptr)) {
        p->stats.hits++;
    } else {
        p->stats.misses++;
        ptr = allocate_locked(p, size);
        if (ptr == NULL) {
            ptr = pageable_alloc(size);
            fallback = ptr != NULL;
        }
    }
    if (ptr == NULL) {
        p->stats.failures++;
        pthread_mutex_unlock(&p->lock);
        *out = (pool_block){0};
        return -1;
    }
    *out = (pool_block){.ptr = ptr, .size = size, .requested = bytes, .fallback = (uint8_t)fallback};
    p->stats.fallbacks += (uint64_t)fallback;
    p->stats.bytes_in_use += size;
    p->stats.bytes_requested += bytes;
    p->stats.blocks_in_use++;
    if (p->stats.bytes_in_use > p->stats.peak_bytes_in_use)
        p->stats.peak_bytes_in_use = p->stats.bytes_in_use;
    pthread_mutex_unlock(&p->lock);
    return 0;
}

void
pool_release(pool *p, pool_block *block)
{
    if (block->ptr == NULL)
        return;
    cached_buffer *node = block->fallback ? NULL : malloc(sizeof(*node));
    pthread_mutex_lock(&p->lock);
    p->stats.bytes_in_use -= block->size;
    p->stats.bytes_requested -= block->requested;
    p->stats.blocks_in_use--;
    if (block->fallback) {
        free(block->ptr);
    } else if (node == NULL) {
        /* no memory for a cache entry: give the buffer back instead */
        p->backend.free(p->backend.ctx, block->ptr, block->size);
        p->stats.bytes_reserved -= block->size;
    } else {
        unsigned index = pool_class_index(block->size);
        node->ptr = block->ptr;
        node->next = p->free_lists[index];
        p->free_lists[index] = node;
    }
    pthread_mutex_unlock(&p->lock);
    *block = (pool_block){0};
}

uint64_t
pool_reserve(pool *p, uint64_t bytes, uint64_t count)
{
    unsigned index = pool_class_index(bytes);
    uint64_t size = pool_index_size(index);
    uint64_t added = 0;
    for (; added < count; added++) {
        cached_buffer *node = malloc(sizeof(*node));
        if (node == NULL)
            break;
        /* claim the bytes first, so a concurrent acquire sees the limit */
        pthread_mutex_lock(&p->lock);
        int fits = within_limit(p, size);
        p->stats.bytes_reserved += fits ? size : 0;
        pthread_mutex_unlock(&p->lock);
        /* pinning takes milliseconds per buffer: not under the lock */
        void *ptr = fits ? p->backend.alloc(p->backend.ctx, size) : NULL;
        pthread_mutex_lock(&p->lock);
        if (ptr == NULL) {
            p->stats.bytes_reserved -= fits ? size : 0;
            pthread_mutex_unlock(&p->lock);
            free(node);
            break;
        }
        p->stats.host_allocations++;
        node->ptr = ptr;
        node->next = p->free_lists[index];
        p->free_lists[index] = node;
        pthread_mutex_unlock(&p->lock);
    }
    return added;
}

void
pool_set_limit(pool *p, uint64_t limit_bytes)
{
    pthread_mutex_lock(&p->lock);
    p->limit_bytes = limit_bytes;
    if (limit_bytes != 0 && p->stats.bytes_reserved > limit_bytes)
        drop_cache_locked(p);
    pthread_mutex_unlock(&p->lock);
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
