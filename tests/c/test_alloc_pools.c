/* Unit tests of the allocator's private pools (CUDA graphs), its largest
 * free block (cudnn.benchmark) and a pointer's segment (CUDA IPC), on the
 * host backend (csrc/alloc/alloc_pools.c). */
#include "alloc/alloc.h"
#include "alloc/alloc_history.h"
#include "alloc/alloc_host.h"
#include "check.h"

#include <stdlib.h>

#define MiB (1ull << 20)

/* A filter: the streams a capture records (a NULL-terminated list). */
typedef struct {
    void *streams[4];
    int calls;
} capture;

static int
captures(void *filter, void *stream)
{
    capture *c = filter;
    c->calls++;
    for (int i = 0; i < 4 && c->streams[i] != NULL; i++) {
        if (c->streams[i] == stream)
            return 1;
    }
    return 0;
}

static allocator *
make(alloc_host_ctx *ctx, uint64_t capacity)
{
    alloc_host_init(ctx, capacity);
    return alloc_create(alloc_host_backend(ctx), 2);
}

static void
finish(allocator *a, alloc_host_ctx *ctx)
{
    CHECK(alloc_check(a, 0) == 0 && alloc_check(a, 1) == 0);
    alloc_destroy(a);
    CHECK(ctx->live_bytes == 0);
    CHECK(atomic_load(&ctx->live_events) == 0);
}

/* A capturing stream's allocations come from the pool's own segments; the
 * ordinary cache and other streams never see them, nor the pool theirs. */
static void
test_capture_allocates_from_its_pool(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0}, other = {0};
    allocator *a = make(&ctx, 0);
    capture cap = {.streams = {&side}};
    void *cached = alloc_malloc(a, 4096, 0, &side, 0);
    CHECK(alloc_free(a, cached, 0) == 0);       /* a free block of `side`'s cache */
    CHECK(!alloc_pool_takes(a, 0, &side));
    CHECK(alloc_begin_pool(a, 0, 1, 0, captures, &cap) == 0);
    CHECK(alloc_pool_takes(a, 0, &side) && !alloc_pool_takes(a, 0, &other));
    CHECK(!alloc_pool_takes(a, 1, &side) && !alloc_pool_takes(a, 9, &side));
    void *in_pool = alloc_malloc(a, 4096, 0, &side, 0);
    CHECK(in_pool != NULL && in_pool != cached);
    CHECK(alloc_get_stats(a, 0).device_allocs == 2);  /* its own segment */
    void *beside = alloc_malloc(a, 4096, 0, &other, 0);
    CHECK(beside != NULL && beside != in_pool && cap.calls >= 2);
    CHECK(alloc_free(a, in_pool, 0) == 0);      /* freed inside the capture ... */
    void *again = alloc_malloc(a, 4096, 0, &side, 0);
    CHECK(again == in_pool);                    /* ... reused inside it */
    void *other_side = alloc_malloc(a, 4096, 0, &other, 0);
    CHECK(other_side != in_pool);
    CHECK(alloc_check(a, 0) == 0);
    CHECK(alloc_end_pool(a, 0, 1, 0) == 0);
    CHECK(!alloc_pool_takes(a, 0, &side));
    CHECK(alloc_free(a, again, 0) == 0);
    void *after = alloc_malloc(a, 4096, 0, &side, 0);
    CHECK(after == cached);                     /* the ordinary cache again, not the pool */
    int calls = cap.calls;
    alloc_free(a, after, 0);
    alloc_free(a, beside, 0);
    alloc_free(a, other_side, 0);
    CHECK(cap.calls == calls);                  /* no filter asked once the capture ended */
    alloc_empty_cache(a);                       /* the pool is in use: its segment stays */
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 2 * MiB);
    CHECK(alloc_release_pool(a, 0, 1, 0) == 0); /* the graph goes: its memory is freeable */
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 2 * MiB && alloc_pool_use_count(a, 0, 1, 0) == 0);
    alloc_empty_cache(a);                       /* and goes here, as torch's */
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 0 && ctx.live_bytes == 0);
    CHECK(alloc_pool_use_count(a, 0, 1, 0) == -1);
    finish(a, &ctx);
}

/* Two graphs' pools share nothing; a graph sharing a pool (torch's
 * graph(pool=...)) reuses its free blocks and holds one use more. */
static void
test_pools_share_nothing_unless_asked(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0};
    allocator *a = make(&ctx, 0);
    capture cap = {.streams = {&side}};
    CHECK(alloc_begin_pool(a, 0, 1, 0, captures, &cap) == 0);
    void *first = alloc_malloc(a, 1000, 0, &side, 0);
    alloc_free(a, first, 0);
    CHECK(alloc_end_pool(a, 0, 1, 0) == 0);
    CHECK(alloc_begin_pool(a, 0, 2, 0, captures, &cap) == 0);
    void *second = alloc_malloc(a, 1000, 0, &side, 0);
    CHECK(second != first && alloc_get_stats(a, 0).device_allocs == 2);
    CHECK(alloc_end_pool(a, 0, 2, 0) == 0);
    CHECK(alloc_begin_pool(a, 0, 1, 0, captures, &cap) == 0);   /* shares pool 1 */
    CHECK(alloc_pool_use_count(a, 0, 1, 0) == 2);
    void *shared = alloc_malloc(a, 1000, 0, &side, 0);
    CHECK(shared == first);
    CHECK(alloc_end_pool(a, 0, 1, 0) == 0);
    alloc_free(a, shared, 0);
    alloc_free(a, second, 0);
    CHECK(alloc_release_pool(a, 0, 1, 0) == 0);   /* one graph of two released */
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 4 * MiB);
    CHECK(alloc_release_pool(a, 0, 1, 0) == 0 && alloc_release_pool(a, 0, 2, 0) == 0);
    alloc_empty_cache(a);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 0);
    finish(a, &ctx);
}

/* A released pool's memory goes at the next empty_cache (or retry after
 * out of memory), as torch's: never at the release nor at a tensor's free,
 * where a cudaFree would synchronize the device; a segment still holding a
 * live block (a graph's output the caller holds) stays then. */
static void
test_released_pool_keeps_live_blocks_until_freed(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0};
    allocator *a = make(&ctx, 0);
    capture cap = {.streams = {&side}};
    CHECK(alloc_begin_pool(a, 1, 7, 0, captures, &cap) == 0);     /* on device 1 */
    void *output = alloc_malloc(a, 3 * MiB, 1, &side, 0);
    void *scratch = alloc_malloc(a, 4096, 1, &side, 0);
    CHECK(alloc_end_pool(a, 1, 7, 0) == 0);
    alloc_free(a, scratch, 1);
    CHECK(alloc_release_pool(a, 1, 7, 0) == 0);
    alloc_stats s = alloc_get_stats(a, 1);
    CHECK(s.reserved_bytes == 22 * MiB && s.device_frees == 0);   /* nothing freed yet */
    alloc_empty_cache(a);
    s = alloc_get_stats(a, 1);
    CHECK(s.reserved_bytes == 20 * MiB && s.device_frees == 1);   /* the small segment went */
    CHECK(alloc_pool_use_count(a, 1, 7, 0) == 0);
    CHECK(alloc_begin_pool(a, 1, 7, 0, captures, &cap) == ALLOC_BEGIN_RELEASED);  /* torch refuses */
    CHECK(alloc_check(a, 1) == 0);
    alloc_free(a, output, 1);
    CHECK(alloc_get_stats(a, 1).reserved_bytes == 20 * MiB);    /* no cudaFree at a free */
    alloc_empty_cache(a);
    CHECK(alloc_get_stats(a, 1).reserved_bytes == 0 && ctx.live_bytes == 0);
    CHECK(alloc_pool_use_count(a, 1, 7, 0) == -1);
    CHECK(alloc_get_stats(a, 0).device_allocs == 0);              /* device 0 untouched */
    finish(a, &ctx);
}

/* A block of a pool freed after a record_stream waits for its event as
 * any other, then returns to the pool (released: freeable). */
static void
test_pool_block_used_on_another_stream(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0}, reader = {0};
    allocator *a = make(&ctx, 0);
    capture cap = {.streams = {&side}};
    CHECK(alloc_begin_pool(a, 0, 3, 0, captures, &cap) == 0);
    void *p = alloc_malloc(a, 8192, 0, &side, 0);
    CHECK(alloc_end_pool(a, 0, 3, 0) == 0);
    CHECK(alloc_record_stream(a, p, &reader) == 0);
    alloc_host_submit(&reader);
    alloc_free(a, p, 0);
    CHECK(alloc_release_pool(a, 0, 3, 0) == 0);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 2 * MiB);      /* pending on `reader` */
    alloc_host_complete(&reader);
    void *q = alloc_malloc(a, 8192, 0, &reader, 0);               /* retires the event */
    CHECK(q != p && alloc_check(a, 0) == 0);
    alloc_empty_cache(a);
    CHECK(alloc_pool_use_count(a, 0, 3, 0) == -1);                /* its segment went back */
    alloc_free(a, q, 0);
    finish(a, &ctx);
}

/* While a pool is allocated to (a capture, without torch's marks), no
 * event is queried (one recorded during the capture cannot be) and out of
 * memory frees nothing, neither the ordinary cache nor a released pool's
 * (the wait and cudaFree would break the capture), as torch's allocator
 * skips its release then. */
static void
test_no_forbidden_calls_during_a_capture(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0}, s1 = {0}, s2 = {0};
    allocator *a = make(&ctx, 6 * MiB);
    capture cap = {.streams = {&side}};
    CHECK(alloc_begin_pool(a, 0, 3, 0, captures, &cap) == 0);  /* a graph, released */
    alloc_free(a, alloc_malloc(a, 4096, 0, &side, 0), 0);
    CHECK(alloc_end_pool(a, 0, 3, 0) == 0 && alloc_release_pool(a, 0, 3, 0) == 0);
    void *p = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(alloc_record_stream(a, p, &s2) == 0);
    alloc_host_submit(&s2);
    alloc_free(a, p, 0);                          /* an event to query */
    void *cached = alloc_malloc(a, 4096, 0, &s2, 0);
    alloc_free(a, cached, 0);                     /* a 2 MiB segment cached for s2 */
    uint64_t queries = atomic_load(&ctx.event_queries);
    CHECK(alloc_begin_pool(a, 0, 4, 0, captures, &cap) == 0);
    void *beside = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(beside != NULL && atomic_load(&ctx.event_queries) == queries);
    void *none = alloc_malloc(a, 3 * MiB, 0, &side, 0);    /* 20 MiB: never fits */
    alloc_stats s = alloc_get_stats(a, 0);
    CHECK(none == NULL && s.ooms == 1 && s.device_frees == 0 && s.reserved_bytes == 6 * MiB);
    CHECK(atomic_load(&ctx.event_queries) == queries);
    /* nothing was released, so there was no retry (torch counts one only
     * after its release of cached blocks, which a capture skips) */
    alloc_device_stats torch;
    CHECK(alloc_get_device_stats(a, 0, &torch) == 0 && torch.num_alloc_retries == 0);
    CHECK(s.oom_retries == 0);
    CHECK(alloc_end_pool(a, 0, 4, 0) == 0);
    alloc_host_complete(&s2);
    alloc_free(a, beside, 0);
    alloc_empty_cache(a);                         /* now the cache may go */
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 0);
    CHECK(alloc_release_pool(a, 0, 4, 0) == 0);
    finish(a, &ctx);
}

/* A block used on another stream and freed during a capture records no
 * event then (one recorded on a capturing stream can never be queried):
 * its events wait for the capture's end, then it waits for them. */
static void
test_cross_stream_free_during_a_capture_is_deferred(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0}, reader = {0};
    allocator *a = make(&ctx, 0);
    capture cap = {.streams = {&side}};
    CHECK(alloc_begin_pool(a, 0, 5, 0, captures, &cap) == 0);
    void *p = alloc_malloc(a, 8192, 0, &side, 0);
    CHECK(alloc_record_stream(a, p, &reader) == 0);
    alloc_host_submit(&reader);
    alloc_free(a, p, 0);
    CHECK(atomic_load(&ctx.events_recorded) == 0 && alloc_check(a, 0) == 0);
    void *q = alloc_malloc(a, 8192, 0, &side, 0);
    CHECK(q != p);                              /* not free yet */
    CHECK(alloc_end_pool(a, 0, 5, 0) == 0);
    CHECK(atomic_load(&ctx.events_recorded) == 1 && alloc_check(a, 0) == 0);
    alloc_host_complete(&reader);
    CHECK(alloc_begin_pool(a, 0, 5, 0, captures, &cap) == 0);   /* a graph sharing it */
    CHECK(alloc_end_pool(a, 0, 5, 0) == 0);
    alloc_free(a, alloc_malloc(a, 8, 0, NULL, 0), 0);          /* retires the event */
    CHECK(alloc_begin_pool(a, 0, 5, 0, captures, &cap) == 0);
    void *r = alloc_malloc(a, 8192, 0, &side, 0);
    CHECK(r == p);                              /* back in the pool once its event completed */
    CHECK(alloc_end_pool(a, 0, 5, 0) == 0);
    alloc_free(a, q, 0);
    alloc_free(a, r, 0);
    for (int i = 0; i < 3; i++)
        CHECK(alloc_release_pool(a, 0, 5, 0) == 0);
    alloc_empty_cache(a);
    CHECK(alloc_pool_use_count(a, 0, 5, 0) == -1);
    finish(a, &ctx);
}

/* torch 2.13+ marks captures apart from pools allocated to outside one
 * (use_mem_pool, cudagraph trees' warmup): then a pool being allocated to
 * stops nothing, and only a marked capture stops event queries and frees
 * of the ordinary cache. */
static void
test_capture_marks_tell_routing_from_capture(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0}, s1 = {0}, s2 = {0};
    allocator *a = make(&ctx, 5 * MiB);
    capture cap = {.streams = {&side}};
    CHECK(alloc_mark_capture(a, 0, 1) == -1);     /* no marks until told */
    alloc_use_capture_marks(a);
    void *used = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(alloc_record_stream(a, used, &s2) == 0);
    alloc_host_submit(&s2);
    alloc_free(a, used, 0);                       /* an event to query */
    alloc_free(a, alloc_malloc(a, 4096, 0, &s2, 0), 0);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 4 * MiB);     /* the ordinary cache */
    CHECK(alloc_begin_pool(a, 0, 8, 0, captures, &cap) == 0);
    uint64_t queries = atomic_load(&ctx.event_queries);
    void *beside = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(beside != NULL && atomic_load(&ctx.event_queries) > queries);
    alloc_free(a, beside, 0);
    alloc_host_complete(&s2);
    /* the pool needs a segment the cap leaves no room for: the cache goes */
    void *in_pool = alloc_malloc(a, 600 * 1024, 0, &side, 0);
    alloc_stats s = alloc_get_stats(a, 0);
    CHECK(in_pool != NULL && s.oom_retries == 1 && s.device_frees == 2 && s.ooms == 0);
    /* a marked capture: nothing is queried or freed */
    CHECK(alloc_free(a, in_pool, 0) == 0);
    CHECK(alloc_mark_capture(a, 0, 1) == 0);
    alloc_free(a, alloc_malloc(a, 4096, 0, &s1, 0), 0);     /* 2 MiB cached for s1 */
    queries = atomic_load(&ctx.event_queries);
    CHECK(alloc_malloc(a, 3 * MiB, 0, &side, 0) == NULL);   /* 20 MiB: never fits */
    s = alloc_get_stats(a, 0);
    CHECK(s.device_frees == 2 && s.reserved_bytes == 4 * MiB && s.ooms == 1);
    CHECK(s.oom_retries == 1);                              /* none counted in the capture */
    CHECK(atomic_load(&ctx.event_queries) == queries);
    CHECK(alloc_mark_capture(a, 0, 0) == 0 && alloc_mark_capture(a, 0, 0) == -1);
    CHECK(alloc_end_pool(a, 0, 8, 0) == 0);
    CHECK(alloc_release_pool(a, 0, 8, 0) == 0);
    finish(a, &ctx);
}

/* torch's reserved_bytes_by_private_pools: per pool, its segments' bytes
 * per kind; after the pool is gone its figures stay (current 0) until the
 * accumulated counts are reset. */
static void
test_pool_figures(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0};
    allocator *a = make(&ctx, 0);
    capture cap = {.streams = {&side}};
    alloc_pool_figures f[4];
    CHECK(alloc_get_pool_figures(a, 0, f, 4) == 0 && alloc_get_pool_figures(a, 9, f, 4) == -1);
    CHECK(alloc_begin_pool(a, 0, 0, 7, captures, &cap) == 0);
    void *small = alloc_malloc(a, 4096, 0, &side, 0);
    void *large = alloc_malloc(a, 3 * MiB, 0, &side, 0);
    CHECK(alloc_end_pool(a, 0, 0, 7) == 0);
    alloc_free(a, alloc_malloc(a, 4096, 0, NULL, 0), 0);      /* the ordinary cache: none */
    CHECK(alloc_get_pool_figures(a, 0, f, 4) == 1 && f[0].pool_a == 0 && f[0].pool_b == 7);
    CHECK(f[0].reserved[ALLOC_POOL_ALL].current == 22 * MiB);
    CHECK(f[0].reserved[ALLOC_POOL_SMALL].current == 2 * MiB);
    CHECK(f[0].reserved[ALLOC_POOL_LARGE].current == 20 * MiB);
    alloc_free(a, small, 0);
    alloc_free(a, large, 0);
    CHECK(alloc_release_pool(a, 0, 0, 7) == 0);
    alloc_empty_cache(a);
    CHECK(alloc_pool_use_count(a, 0, 0, 7) == -1);                /* the pool is gone */
    CHECK(alloc_get_pool_figures(a, 0, f, 4) == 1);
    CHECK(f[0].reserved[ALLOC_POOL_ALL].current == 0 && f[0].reserved[ALLOC_POOL_ALL].peak ==
          22 * MiB && f[0].reserved[ALLOC_POOL_ALL].freed == 22 * MiB);
    CHECK(alloc_reset_device_peaks(a, 0) == 0 && alloc_get_pool_figures(a, 0, f, 4) == 1);
    CHECK(f[0].reserved[ALLOC_POOL_ALL].peak == 0);
    CHECK(alloc_reset_accumulated(a, 0) == 0 && alloc_get_pool_figures(a, 0, f, 4) == 0);
    finish(a, &ctx);
}

/* Nested captures: the pool begun last that takes a stream serves it. */
static void
test_nested_pools_innermost_first(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0}, s2 = {0};
    allocator *a = make(&ctx, 0);
    capture outer = {.streams = {&s1, &s2}}, inner = {.streams = {&s2}};
    CHECK(alloc_begin_pool(a, 0, 10, 0, captures, &outer) == 0);
    CHECK(alloc_begin_pool(a, 0, 0, 11, captures, &inner) == 0);
    CHECK(alloc_begin_pool(a, 0, 10, 0, captures, &outer) == ALLOC_BEGIN_BEING_ALLOCATED_TO);
    void *x = alloc_malloc(a, 4096, 0, &s2, 0);     /* inner */
    void *y = alloc_malloc(a, 4096, 0, &s1, 0);     /* outer */
    CHECK(alloc_end_pool(a, 0, 0, 11) == 0);
    CHECK(alloc_end_pool(a, 0, 0, 11) == -1);
    void *z = alloc_malloc(a, 4096, 0, &s2, 0);     /* outer now */
    CHECK(alloc_end_pool(a, 0, 10, 0) == 0);
    alloc_free(a, x, 0);
    alloc_free(a, y, 0);
    alloc_free(a, z, 0);
    CHECK(alloc_get_stats(a, 0).device_allocs == 3);  /* a pool's segments are per stream too */
    CHECK(alloc_release_pool(a, 0, 0, 11) == 0);
    alloc_empty_cache(a);                           /* x's segment goes, the outer's stay */
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 4 * MiB);
    CHECK(alloc_release_pool(a, 0, 10, 0) == 0);
    CHECK(alloc_release_pool(a, 0, 10, 0) == -1);
    CHECK(alloc_release_pool(a, 0, 99, 0) == -1 && alloc_end_pool(a, 0, 99, 0) == -1);
    CHECK(alloc_begin_pool(a, 5, 1, 0, captures, &outer) == ALLOC_BEGIN_NO_DEVICE);
    CHECK(alloc_begin_pool(a, 0, 1, 0, NULL, &outer) == ALLOC_BEGIN_NO_FILTER);
    alloc_empty_cache(a);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 0);
    finish(a, &ctx);
}

/* destroy gives back a pool still in use too. */
static void
test_destroy_with_a_pool_in_use(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0};
    allocator *a = make(&ctx, 0);
    capture cap = {.streams = {&side}};
    CHECK(alloc_begin_pool(a, 0, 1, 0, captures, &cap) == 0);
    alloc_free(a, alloc_malloc(a, 4096, 0, &side, 0), 0);
    finish(a, &ctx);   /* begun, never ended nor released */
}

/* torch's cacheInfo: the largest free block cached, pools included. */
static void
test_largest_free_block(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0};
    allocator *a = make(&ctx, 0);
    capture cap = {.streams = {&side}};
    CHECK(alloc_largest_free_block(a, 0) == 0 && alloc_largest_free_block(a, 9) == 0);
    void *small = alloc_malloc(a, 1000, 0, NULL, 0);
    CHECK(alloc_largest_free_block(a, 0) == 2 * MiB - 1024);    /* the segment's rest */
    void *mid = alloc_malloc(a, 3 * MiB, 0, NULL, 0);
    CHECK(alloc_largest_free_block(a, 0) == 17 * MiB);
    CHECK(alloc_begin_pool(a, 0, 1, 0, captures, &cap) == 0);
    void *big = alloc_malloc(a, 24 * MiB, 0, &side, 0);
    CHECK(alloc_end_pool(a, 0, 1, 0) == 0);
    CHECK(alloc_largest_free_block(a, 0) == 17 * MiB);
    alloc_free(a, big, 0);
    CHECK(alloc_largest_free_block(a, 0) == 24 * MiB);          /* a pool's counts */
    CHECK(alloc_largest_free_block(a, 1) == 0);
    alloc_free(a, mid, 0);
    alloc_free(a, small, 0);
    CHECK(alloc_release_pool(a, 0, 1, 0) == 0);
    CHECK(alloc_largest_free_block(a, 0) == 24 * MiB);          /* released: still cached */
    alloc_empty_cache(a);
    CHECK(alloc_largest_free_block(a, 0) == 0);
    finish(a, &ctx);
}

/* torch's getBaseAllocation: the segment a live block (or a pointer into
 * it, a view) is carved from, which CUDA IPC shares whole. */
static void
test_base_allocation(void)
{
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 0);
    char *first = alloc_malloc(a, 4096, 1, NULL, 0);
    char *second = alloc_malloc(a, 8192, 1, NULL, 0);
    CHECK(second == first + 4096);
    uint64_t size = 0;
    CHECK(alloc_base_allocation(a, second, &size) == first && size == 2 * MiB);
    size = 0;
    CHECK(alloc_base_allocation(a, second + 100, &size) == first && size == 2 * MiB);
    char *large = alloc_malloc(a, 11 * MiB, 0, NULL, 0);
    CHECK(alloc_base_allocation(a, large + 5 * MiB, &size) == large && size == 12 * MiB);
    size = 77;
    CHECK(alloc_base_allocation(a, second + 8192, &size) == NULL && size == 77);  /* free rest */
    alloc_free(a, second, 1);
    CHECK(alloc_base_allocation(a, second, &size) == NULL && size == 77);
    CHECK(alloc_base_allocation(a, (void *)64, &size) == NULL);
    alloc_free(a, first, 1);
    alloc_free(a, large, 0);
    finish(a, &ctx);
}

/* torch.cuda.MemPool: made with one use, one more while allocated to
 * (use_mem_pool), its memory kept until its last use goes; a snapshot of
 * the pool shows its segments only. */
static void
test_a_mem_pool_lives_by_its_uses(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0};
    allocator *a = make(&ctx, 0);
    capture cap = {.streams = {&side}};
    void *cached = alloc_malloc(a, 4096, 0, &side, 0);
    alloc_free(a, cached, 0);                      /* the ordinary cache's segment */
    CHECK(alloc_create_pool(a, 0, 0, 9) == 0 && alloc_pool_use_count(a, 0, 0, 9) == 1);
    CHECK(alloc_create_pool(a, 7, 0, 9) == -1);
    CHECK(alloc_begin_pool(a, 0, 0, 9, captures, &cap) == 0);
    CHECK(alloc_pool_use_count(a, 0, 0, 9) == 2);
    void *inside = alloc_malloc(a, 4096, 0, &side, 0);
    CHECK(alloc_end_pool(a, 0, 0, 9) == 0 && alloc_release_pool(a, 0, 0, 9) == 0);
    CHECK(inside != cached && alloc_pool_use_count(a, 0, 0, 9) == 1);
    alloc_snapshot snap;
    CHECK(alloc_take_pool_snapshot(a, 0, 0, 9, &snap) == 0 && snap.segment_count == 1);
    CHECK(snap.segments[0].address <= (uintptr_t)inside && snap.segments[0].pool_b == 9);
    alloc_snapshot_free(a, &snap);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.segment_count == 2);
    alloc_snapshot_free(a, &snap);
    alloc_free(a, inside, 0);
    alloc_empty_pool(a, 0, 9);                     /* in use: its segment stays */
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 4 * MiB);
    CHECK(alloc_release_pool(a, 0, 0, 9) == 0);    /* the MemPool's end */
    alloc_empty_pool(a, 0, 9);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 2 * MiB);   /* the ordinary cache stays */
    CHECK(alloc_pool_use_count(a, 0, 0, 9) == -1);
    finish(a, &ctx);
}

int
main(void)
{
    test_capture_allocates_from_its_pool();
    test_pools_share_nothing_unless_asked();
    test_released_pool_keeps_live_blocks_until_freed();
    test_capture_marks_tell_routing_from_capture();
    test_pool_figures();
    test_pool_block_used_on_another_stream();
    test_no_forbidden_calls_during_a_capture();
    test_cross_stream_free_during_a_capture_is_deferred();
    test_nested_pools_innermost_first();
    test_destroy_with_a_pool_in_use();
    test_largest_free_block();
    test_base_allocation();
    test_a_mem_pool_lives_by_its_uses();
    return check_report("test_alloc_pools");
}
