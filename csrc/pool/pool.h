/* Size-bucketed host memory pool for offloaded tensors.
 *
 * Sizes round up to size classes, eight per power of two, so a buffer wastes
 * less than 12.5% of its request (requests below 2 KiB round up to 256-byte
 * steps instead). Released buffers are cached per class and handed out again,
 * so a training loop in steady state makes no new host allocations.
 *
 * Memory comes from a backend: pinned memory through the CUDA runtime, or
 * plain aligned host memory (pool_host.c). When the backend fails or the
 * byte limit would be passed, the pool first frees cached buffers, as few
 * and as small as make room (the bytes past the limit; the request's own
 * size when the backend failed), and retries, then falls back to pageable
 * memory that is freed on release, not cached.
 *
 * Ownership: the pool owns every buffer it made; a caller owns an acquired
 * block until it calls pool_release(). Thread-safety: every function may be
 * called from any thread; one mutex guards the pool. Units: bytes.
 *
 * Locks and the GIL: the pool never calls its backend with its mutex held.
 * The CUDA backend's calls may synchronize the device (cudaFreeHost always
 * does; cudaHostAlloc takes milliseconds), so a caller holding a lock of
 * its own, such as the GIL, releases it around the functions that may call
 * the backend: pool_acquire() on a miss, pool_release() when it cannot
 * allocate a 24-byte cache entry, pool_reserve(), pool_empty(),
 * pool_set_limit() when it lowers the limit below what is held, and
 * pool_destroy(). pool_acquire_cached(), pool_get_stats(),
 * pool_reset_peak() and the other pool_release() calls never call the
 * backend: they are cheap enough to call with the GIL held, and
 * pool_acquire_cached() then pool_acquire() without the GIL on its miss is
 * the intended hot path. Dropping the cache takes its buffers out under the
 * mutex and frees them after it was released: for that moment the reserved
 * count is below what the backend holds. */
#ifndef MATEPOINT_POOL_H
#define MATEPOINT_POOL_H

#include <stdatomic.h>
#include <stdint.h>

typedef struct {
    /* Allocates `bytes` of host memory, NULL on failure. */
    void *(*alloc)(void *ctx, uint64_t bytes);
    void (*free)(void *ctx, void *ptr, uint64_t bytes);
    void *ctx;
    const char *name;           /* "cuda-pinned" or "host" */
} pool_backend;

typedef struct {
    void *ptr;
    uint64_t size;              /* class size actually reserved */
    uint64_t requested;
    uint8_t fallback;           /* pageable memory outside the cache */
} pool_block;

typedef struct {
    uint64_t bytes_in_use;          /* class bytes of acquired blocks, fallbacks included */
    uint64_t bytes_requested;       /* what callers asked for, of those */
    uint64_t bytes_reserved;        /* backend memory held: in use plus cached */
    uint64_t peak_bytes_in_use;
    uint64_t host_allocations;      /* backend allocations made */
    uint64_t host_frees;            /* buffers given back to the backend (cudaFreeHost) */
    uint64_t hits;                  /* acquisitions served from the cache */
    uint64_t misses;                /* acquisitions that needed a new buffer */
    uint64_t fallbacks;             /* acquisitions served by pageable memory */
    uint64_t failures;              /* acquisitions that got nothing */
    uint64_t blocks_in_use;
} pool_stats;

typedef struct pool pool;

/* NULL when out of memory. limit_bytes == 0 means no limit. */
pool *pool_create(pool_backend backend, uint64_t limit_bytes);
/* Frees cached buffers; blocks still acquired are the caller's leak. */
void pool_destroy(pool *p);

/* 0 on success; -1 when neither the backend nor pageable memory could
 * serve it, or `bytes` is past the largest class (the block is then
 * zeroed). May call the backend: see the note on locks above. */
int pool_acquire(pool *p, uint64_t bytes, pool_block *out);
/* 0 when a cached buffer of the class serves the request (a hit);
 * -1 otherwise, counting nothing (then call pool_acquire()). Never calls
 * the backend. */
int pool_acquire_cached(pool *p, uint64_t bytes, pool_block *out);
void pool_release(pool *p, pool_block *block);
/* A release in two steps, for a buffer a queued copy may still read or
 * write (torch's CachingHostAllocator: counted free at once, reused once
 * the copy's event completed): pool_release_pending() takes the block out
 * of the in-use counters (its bytes stay reserved, outside the cache) and
 * leaves it with the caller, who hands it to pool_recycle() once nothing
 * uses it any more, which caches it (or frees it, as pool_release would)
 * and zeroes it. Every pending block must be recycled before
 * pool_destroy(). pool_recycle() calls the backend only where
 * pool_release() does. */
void pool_release_pending(pool *p, pool_block *block);
void pool_recycle(pool *p, pool_block *block);

/* Allocates up to `count` buffers for requests of `bytes` into the cache
 * now, so later acquisitions of that size class make no backend call;
 * returns how many it added (fewer when the limit or the backend refused).
 * The backend runs outside the lock. */
uint64_t pool_reserve(pool *p, uint64_t bytes, uint64_t count);
/* Frees every cached, unused buffer (after releasing the mutex). */
void pool_empty(pool *p);
/* A new limit; when less than is reserved, cached buffers are freed as on
 * a miss, as few as bring the reserved bytes within it (buffers in use
 * stay: the limit then only refuses new ones). */
void pool_set_limit(pool *p, uint64_t limit_bytes);
pool_stats pool_get_stats(pool *p);
void pool_reset_peak(pool *p);
const char *pool_backend_name(pool *p);

/* Size class of a request: the bytes a buffer for it reserves; 0 past the
 * largest class (15 << 60 bytes), which no acquisition can serve. */
uint64_t pool_class_size(uint64_t bytes);

/* Backend over plain aligned host memory. capacity_bytes > 0 makes
 * allocations fail past that many live bytes (tests inject failures so). */
typedef struct {
    uint64_t capacity_bytes;
    _Atomic uint64_t live_bytes;    /* the pool calls its backend unlocked */
} pool_host_ctx;

pool_backend pool_host_backend(pool_host_ctx *ctx);

/* Backend over pinned memory from a loaded CUDA runtime (pool_cuda.c). */
struct cudart;
pool_backend pool_cuda_backend(const struct cudart *rt);

#endif
