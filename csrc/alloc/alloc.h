/* Caching device allocator: the algorithm, over a small backend interface.
 *
 * Memory comes from the backend in segments; requests are rounded to 512
 * bytes and served best-fit from cached free blocks, splitting a larger
 * block and coalescing free neighbours again. Requests of at most 1 MiB
 * share 2 MiB segments (the small pool); larger ones use the large pool
 * (20 MiB segments below 10 MiB, else the request rounded to 2 MiB).
 *
 * Reuse is stream-ordered, as in torch's CUDACachingAllocator: a segment
 * belongs to the stream it was allocated on, and its blocks are handed out
 * again only on that stream, at once after a free (the stream orders the
 * reuse behind the old work). A block used on more streams
 * (alloc_record_stream) gets an event recorded on each of them at its
 * free and returns to its stream's cache once all completed; every malloc
 * queries those events per stream, oldest first, stopping at the first
 * not complete. No other event is ever made, and a completed one is
 * recorded again at a later such free (torch's event pool, at most 64 kept
 * per device) instead of being destroyed. When the backend is out of
 * memory the allocator waits for pending events, releases the cached
 * segments of every stream (freeing device memory synchronizes the
 * device) and retries: that is how memory moves between streams.
 *
 * Every allocation carries a tag (an opaque 64-bit region/phase id); live
 * and peak bytes are kept per tag.
 *
 * Ownership: the allocator owns segments and blocks; a caller owns a pointer
 * from alloc_malloc() until alloc_free(). Thread-safety: any function from
 * any thread; one mutex per device. Units: bytes. */
#ifndef MATEPOINT_ALLOC_H
#define MATEPOINT_ALLOC_H

#include <stdint.h>

enum { ALLOC_OK = 0, ALLOC_OUT_OF_MEMORY = 1, ALLOC_ERROR = -1 };

typedef struct {
    /* ALLOC_OK with *ptr set, ALLOC_OUT_OF_MEMORY, or ALLOC_ERROR */
    int (*device_malloc)(void *ctx, int device, uint64_t bytes, void **ptr);
    void (*device_free)(void *ctx, int device, void *ptr, uint64_t bytes);
    /* records an event on `stream`: a new one when *event is NULL, else
     * *event, made by an earlier call and completed, recorded again (the
     * allocator reuses events). ALLOC_OK, or ALLOC_ERROR: then a new event
     * was not made (*event NULL) and a given one stays the caller's */
    int (*event_record)(void *ctx, int device, void *stream, void **event);
    /* 1 completed, 0 pending, ALLOC_ERROR */
    int (*event_query)(void *ctx, void *event);
    void (*event_wait)(void *ctx, void *event);
    void (*event_free)(void *ctx, void *event);
    /* waits for all work on the device (a fallback when no event can be made) */
    void (*device_synchronize)(void *ctx, int device);
    /* optional, NULL: none. Told of each block alloc_malloc hands out,
     * after the lock was released: `bytes` is the block's size, the request
     * rounded up (more when a large block's small rest stayed attached) */
    void (*on_handout)(void *ctx, int device, void *stream, void *ptr, uint64_t bytes);
    void *ctx;
} alloc_backend;

typedef struct {
    uint64_t allocated_bytes, peak_allocated_bytes;   /* block sizes handed out */
    uint64_t requested_bytes;                         /* what callers asked for */
    uint64_t reserved_bytes, peak_reserved_bytes;     /* segments held */
    uint64_t mallocs, frees, cache_hits;
    uint64_t device_allocs, device_frees;
    uint64_t oom_retries, ooms;
    uint64_t live_blocks;
} alloc_stats;

typedef struct {
    uint64_t tag;
    uint64_t live_bytes, peak_bytes, allocations;
} alloc_tag_stats;

typedef struct {
    uint64_t requested;         /* bytes asked for by the failing call */
    int device;
    uint64_t reserved, allocated;
    uint64_t limit;             /* the device's cap on reserved bytes, 0: none */
} alloc_oom_info;

typedef struct allocator allocator;

allocator *alloc_create(alloc_backend backend, int device_count);
/* Frees cached segments; live blocks are the caller's leak. */
void alloc_destroy(allocator *a);

/* NULL when out of memory (then alloc_last_oom() tells the numbers) or on a
 * backend error. Size 0 is valid and gives a distinct pointer; a size too
 * large to round (alloc_round_size() == 0) is out of memory. */
void *alloc_malloc(allocator *a, uint64_t size, int device, void *stream, uint64_t tag);
/* -1 when `ptr` is not a live allocation of `device`. */
int alloc_free(allocator *a, void *ptr, int device);
/* Marks a live block as used on `stream` too: 0; 1 when `ptr` is not a
 * live block of this allocator (memory from elsewhere: DLPack, IPC);
 * -1 when no memory was left to remember the stream. */
int alloc_record_stream(allocator *a, void *ptr, void *stream);
/* Waits for pending frees and releases every segment with no live block. */
void alloc_empty_cache(allocator *a);
/* Caps reserved bytes of `device` (0: no cap). */
void alloc_set_limit(allocator *a, int device, uint64_t limit_bytes);

alloc_stats alloc_get_stats(allocator *a, int device);
void alloc_reset_peaks(allocator *a);
/* Copies up to `max` tag entries of `device` with live or peak bytes into
 * `out`; returns how many there are in all. */
int alloc_get_tag_stats(allocator *a, int device, alloc_tag_stats *out, int max);
alloc_oom_info alloc_last_oom(allocator *a);
/* Checks internal invariants of `device` (tests); 0 when they hold. */
int alloc_check(allocator *a, int device);

/* Rounding applied to a request (tests and reports); 0 when `size` is
 * within 511 bytes of UINT64_MAX and cannot be rounded up. */
uint64_t alloc_round_size(uint64_t size);

#endif
