#define _GNU_SOURCE /* rand_r */
/* Unit tests of the caching allocator (csrc/alloc) on its host backend. */
#include "alloc/alloc.h"
#include "alloc/alloc_cuda.h"
#include "alloc/alloc_history.h"
#include "alloc/alloc_host.h"
#include "alloc/alloc_internal.h"   /* to break an invariant on purpose */
#include "check.h"
#include "cuda/cudart.h"
#include "lock_probe.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define MiB (1ull << 20)

static allocator *
make(alloc_host_ctx *ctx, uint64_t capacity, int devices)
{
    alloc_host_init(ctx, capacity);
    return alloc_create(alloc_host_backend(ctx), devices);
}

static void
finish(allocator *a, alloc_host_ctx *ctx)
{
    alloc_destroy(a);
    CHECK(ctx->live_bytes == 0);
    CHECK(atomic_load(&ctx->live_events) == 0);
}

static void
test_rounding_and_size_zero(void)
{
    CHECK(alloc_round_size(0) == 512 && alloc_round_size(1) == 512);
    CHECK(alloc_round_size(513) == 1024 && alloc_round_size(4096) == 4096);
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 0, 1);
    void *p = alloc_malloc(a, 0, 0, NULL, 0);
    void *q = alloc_malloc(a, 0, 0, NULL, 0);
    CHECK(p != NULL && q != NULL && p != q);
    CHECK(alloc_get_stats(a, 0).allocated_bytes == 1024);
    CHECK(alloc_free(a, p, 0) == 0 && alloc_free(a, q, 0) == 0);
    CHECK(alloc_free(a, q, 0) == -1);        /* double free is refused */
    CHECK(alloc_free(a, (void *)16, 0) == -1);
    CHECK(alloc_malloc(a, 10, 7, NULL, 0) == NULL);   /* no such device */
    CHECK(alloc_check(a, 0) == 0);
    finish(a, &ctx);
}

static void
test_split_and_coalesce(void)
{
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 0, 1);
    char *x = alloc_malloc(a, 1000, 0, NULL, 0);
    char *y = alloc_malloc(a, 3000, 0, NULL, 0);
    char *z = alloc_malloc(a, 500, 0, NULL, 0);
    CHECK(y == x + 1024 && z == y + 3072);    /* carved from one segment */
    alloc_stats s = alloc_get_stats(a, 0);
    CHECK(s.device_allocs == 1 && s.reserved_bytes == 2 * MiB && s.cache_hits == 2);
    CHECK(alloc_check(a, 0) == 0);
    alloc_free(a, y, 0);
    CHECK(alloc_check(a, 0) == 0);
    char *w = alloc_malloc(a, 2500, 0, NULL, 0);
    CHECK(w == y);                            /* best fit: the hole left by y */
    alloc_free(a, w, 0);
    alloc_free(a, x, 0);
    alloc_free(a, z, 0);
    CHECK(alloc_check(a, 0) == 0);
    s = alloc_get_stats(a, 0);
    CHECK(s.allocated_bytes == 0 && s.live_blocks == 0 && s.requested_bytes == 0);
    /* everything coalesced back: the whole segment serves one request */
    char *whole = alloc_malloc(a, MiB, 0, NULL, 0);
    char *other = alloc_malloc(a, MiB, 0, NULL, 0);
    CHECK(whole == x && other == x + MiB && alloc_get_stats(a, 0).device_allocs == 1);
    alloc_free(a, whole, 0);
    alloc_free(a, other, 0);
    alloc_empty_cache(a);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 0 && ctx.live_bytes == 0);
    finish(a, &ctx);
}

static void
test_large_pool_sizes(void)
{
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 0, 1);
    void *mid = alloc_malloc(a, 3 * MiB, 0, NULL, 0);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 20 * MiB);
    void *big = alloc_malloc(a, 25 * MiB + 1, 0, NULL, 0);   /* own segment, 2 MiB rounding */
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 20 * MiB + 26 * MiB);
    void *again = alloc_malloc(a, 5 * MiB, 0, NULL, 0);   /* fits in the 20 MiB segment */
    CHECK(alloc_get_stats(a, 0).device_allocs == 2 && again == (char *)mid + 3 * MiB);
    alloc_free(a, mid, 0);
    alloc_free(a, big, 0);
    alloc_free(a, again, 0);
    CHECK(alloc_check(a, 0) == 0);
    finish(a, &ctx);
}

static void
test_stream_ordered_reuse(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0}, s2 = {0}, s3 = {0};
    allocator *a = make(&ctx, 0, 1);
    void *p = alloc_malloc(a, 4096, 0, &s1, 0);
    alloc_host_submit(&s1);                   /* a kernel uses p on s1 */
    alloc_free(a, p, 0);
    void *same = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(same == p);                         /* same stream: at once */
    alloc_host_submit(&s1);
    alloc_free(a, same, 0);
    void *other = alloc_malloc(a, 4096, 0, &s2, 0);
    CHECK(other != p);                        /* p serves s1 only */
    CHECK(alloc_get_stats(a, 0).device_allocs == 2);
    alloc_host_submit(&s2);
    alloc_free(a, other, 0);
    alloc_host_complete(&s1);
    void *third = alloc_malloc(a, 4096, 0, &s3, 0);
    CHECK(third != p && third != other);      /* even with s1 idle: torch's rule */
    CHECK(alloc_get_stats(a, 0).device_allocs == 3);
    /* a miss on another stream made no event and queried none */
    CHECK(atomic_load(&ctx.events_recorded) == 0 && atomic_load(&ctx.event_queries) == 0);
    CHECK(alloc_malloc(a, 4096, 0, &s1, 0) == p);
    alloc_free(a, p, 0);
    alloc_free(a, third, 0);
    CHECK(alloc_check(a, 0) == 0);
    finish(a, &ctx);
}

/* A cached block keeps no stream to record on later: a stream destroyed
 * after its last free is never touched again (ASan sees a use). */
static void
test_destroyed_stream_is_never_used(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0};
    alloc_host_stream *gone = calloc(1, sizeof(*gone));
    allocator *a = make(&ctx, 0, 1);
    void *p = alloc_malloc(a, 8192, 0, gone, 0);
    alloc_host_submit(gone);
    alloc_free(a, p, 0);
    free(gone);
    void *q = alloc_malloc(a, 8192, 0, &s1, 0);
    CHECK(q != NULL && q != p);
    CHECK(atomic_load(&ctx.events_recorded) == 0);
    alloc_free(a, q, 0);
    alloc_empty_cache(a);                     /* the dead stream's segment goes too */
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 0);
    CHECK(alloc_check(a, 0) == 0);
    finish(a, &ctx);
}

/* Events of one stream complete in order: a malloc queries each stream's
 * oldest pending event and stops there (torch's process_events). */
static void
test_events_queried_per_stream_in_order(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0}, s2 = {0}, s3 = {0};
    allocator *a = make(&ctx, 0, 1);
    void *p[3], *q = alloc_malloc(a, 4096, 0, &s1, 0);
    for (int i = 0; i < 3; i++) {
        p[i] = alloc_malloc(a, 8192, 0, &s1, 0);
        CHECK(alloc_record_stream(a, p[i], &s2) == 0);
    }
    CHECK(alloc_record_stream(a, q, &s1) == 0);   /* its own stream: no event needed */
    CHECK(alloc_record_stream(a, q, &s3) == 0);
    for (int i = 0; i < 3; i++) {
        alloc_host_submit(&s2);               /* s2 reads p[i], then it is freed */
        alloc_free(a, p[i], 0);
    }
    alloc_host_submit(&s3);
    alloc_free(a, q, 0);
    CHECK(atomic_load(&ctx.events_recorded) == 4);
    CHECK(alloc_check(a, 0) == 0);
    uint64_t queries = atomic_load(&ctx.event_queries);
    void *x = alloc_malloc(a, 8192, 0, &s1, 0);
    CHECK(x != p[0] && x != p[1] && x != p[2]);
    CHECK(atomic_load(&ctx.event_queries) - queries == 2);   /* one per stream */
    atomic_store(&s2.completed, 2);           /* s2 finished reading p[0] and p[1] */
    alloc_host_complete(&s3);
    queries = atomic_load(&ctx.event_queries);
    void *y = alloc_malloc(a, 8192, 0, &s1, 0);
    CHECK(atomic_load(&ctx.event_queries) - queries == 4);   /* 2 done + 1 not on s2, 1 on s3 */
    /* from the blocks whose events completed (q, p[0], p[1], coalesced) */
    CHECK((char *)y >= (char *)q && (char *)y < (char *)p[2]);
    CHECK(alloc_check(a, 0) == 0);
    alloc_host_complete(&s2);
    alloc_free(a, x, 0);
    alloc_free(a, y, 0);
    CHECK(alloc_check(a, 0) == 0);
    CHECK(atomic_load(&ctx.events_recorded) == 4);
    finish(a, &ctx);
}

/* A cross-stream free records an event; once it completed, the next such
 * free records the same event again (torch's event pool): a steady loop
 * makes no new event. A block used on more streams than it keeps inline
 * waits for all of them. empty_cache gives the spare events back. */
static void
test_events_are_reused_across_frees(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0}, s2 = {0}, s3 = {0}, s4 = {0};
    allocator *a = make(&ctx, 0, 1);
    for (int step = 0; step < 10; step++) {
        void *p = alloc_malloc(a, 8192, 0, &s1, 0);
        CHECK(alloc_record_stream(a, p, &s2) == 0);
        alloc_host_submit(&s2);
        alloc_free(a, p, 0);
        alloc_host_complete(&s2);
        void *q = alloc_malloc(a, 8192, 0, &s1, 0);
        CHECK(q == p);                          /* the event completed: reused at once */
        alloc_free(a, q, 0);
    }
    CHECK(atomic_load(&ctx.events_recorded) == 10 && atomic_load(&ctx.events_created) == 1);
    CHECK(atomic_load(&ctx.live_events) == 1);  /* the spare */
    /* three extra streams: past the two kept in the block */
    void *p = alloc_malloc(a, 8192, 0, &s1, 0);
    CHECK(alloc_record_stream(a, p, &s2) == 0 && alloc_record_stream(a, p, &s3) == 0);
    CHECK(alloc_record_stream(a, p, &s4) == 0 && alloc_record_stream(a, p, &s3) == 0);
    alloc_host_submit(&s2);
    alloc_host_submit(&s3);
    alloc_host_submit(&s4);
    alloc_free(a, p, 0);
    CHECK(atomic_load(&ctx.events_recorded) == 13 && atomic_load(&ctx.events_created) == 3);
    alloc_host_complete(&s2);
    alloc_host_complete(&s4);
    void *q = alloc_malloc(a, 8192, 0, &s1, 0);
    CHECK(q != p);                              /* s3 has not finished with it */
    alloc_host_complete(&s3);
    void *r = alloc_malloc(a, 8192, 0, &s1, 0);
    CHECK(r == p);
    CHECK(alloc_check(a, 0) == 0);
    alloc_free(a, q, 0);
    alloc_free(a, r, 0);
    alloc_empty_cache(a);
    CHECK(atomic_load(&ctx.live_events) == 0);
    finish(a, &ctx);
}

/* Memory cached for one stream reaches another through the out-of-memory
 * path: pending events waited for, free segments released, retried. */
static void
test_out_of_memory_moves_memory_between_streams(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0}, s2 = {0}, s3 = {0};
    allocator *a = make(&ctx, 2 * MiB, 1);
    void *p = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(alloc_record_stream(a, p, &s3) == 0);
    alloc_host_submit(&s3);
    alloc_free(a, p, 0);                      /* pending on s3 */
    void *q = alloc_malloc(a, 4096, 0, &s2, 0);
    alloc_stats s = alloc_get_stats(a, 0);
    CHECK(q != NULL && s.oom_retries == 1 && s.device_frees == 1 && s.device_allocs == 2);
    CHECK(atomic_load(&ctx.live_events) == 0);
    alloc_free(a, q, 0);
    CHECK(alloc_check(a, 0) == 0);
    finish(a, &ctx);
}

static void
test_record_stream_defers_reuse(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0}, s2 = {0};
    allocator *a = make(&ctx, 0, 1);
    void *p = alloc_malloc(a, 8192, 0, &s1, 0);
    CHECK(alloc_record_stream(a, p, &s2) == 0);
    CHECK(alloc_record_stream(a, (void *)64, &s2) == 1);    /* not ours: skipped */
    alloc_host_submit(&s2);                   /* s2 reads p */
    alloc_free(a, p, 0);
    void *q = alloc_malloc(a, 8192, 0, &s1, 0);
    CHECK(q != p);                            /* pending on s2's event */
    CHECK(alloc_check(a, 0) == 0);
    alloc_host_complete(&s2);
    void *r = alloc_malloc(a, 8192, 0, &s1, 0);
    CHECK(r == p);
    alloc_free(a, q, 0);
    alloc_free(a, r, 0);
    CHECK(alloc_check(a, 0) == 0);
    finish(a, &ctx);
}

/* Emptying the cache retires every stream's pending events by waiting for
 * them: a block another stream still reads becomes free only once that
 * stream is done, so the next request, on any stream, may take it. (Its
 * segment stays: another block of it is in use.) */
static void
test_empty_cache_waits_for_the_streams_using_a_block(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0}, s2 = {0};
    allocator *a = make(&ctx, 0, 1);
    void *p = alloc_malloc(a, 8192, 0, &s1, 0);
    void *kept = alloc_malloc(a, 8192, 0, &s1, 0);
    CHECK(alloc_record_stream(a, p, &s2) == 0);
    alloc_host_submit(&s2);                   /* s2 reads p */
    alloc_free(a, p, 0);
    CHECK(atomic_load(&s2.completed) < atomic_load(&s2.submitted));    /* premise */
    alloc_empty_cache(a);
    CHECK(alloc_get_stats(a, 0).reserved_bytes > 0);                     /* premise: kept's */
    void *q = alloc_malloc(a, 8192, 0, &s1, 0);
    CHECK(q == p);
    CHECK(atomic_load(&s2.completed) == atomic_load(&s2.submitted));
    alloc_free(a, q, 0);
    alloc_free(a, kept, 0);
    CHECK(alloc_check(a, 0) == 0);
    finish(a, &ctx);
}

static void
test_out_of_memory_releases_cache_then_fails_cleanly(void)
{
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 22 * MiB, 1);
    void *small[6];
    for (int i = 0; i < 6; i++)
        small[i] = alloc_malloc(a, MiB, 0, NULL, 0);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 6 * MiB);
    for (int i = 0; i < 6; i++)
        alloc_free(a, small[i], 0);
    void *big = alloc_malloc(a, 4 * MiB, 0, NULL, 0);   /* needs a 20 MiB segment */
    alloc_stats s = alloc_get_stats(a, 0);
    CHECK(big != NULL && s.oom_retries == 1 && s.device_frees == 3);
    CHECK(s.reserved_bytes == 20 * MiB && s.ooms == 0);
    void *too_much = alloc_malloc(a, 30 * MiB, 0, NULL, 0);
    CHECK(too_much == NULL);
    alloc_oom_info oom = alloc_last_oom(a);
    CHECK(oom.requested == 30 * MiB && oom.reserved == 20 * MiB && oom.allocated == 4 * MiB);
    CHECK(oom.segment_bytes == 30 * MiB && oom.limit == UINT64_MAX);
    CHECK(alloc_get_stats(a, 0).ooms == 1);
    alloc_free(a, big, 0);
    alloc_set_limit(a, 0, 1 * MiB);
    alloc_empty_cache(a);
    CHECK(alloc_malloc(a, 600 * 1024, 0, NULL, 0) == NULL);   /* 2 MiB segment > limit */
    alloc_set_limit(a, 0, UINT64_MAX);
    CHECK(alloc_check(a, 0) == 0);
    finish(a, &ctx);
}

/* The numbers of an out of memory are the failing thread's own: another
 * thread's failure meanwhile (DataParallel's replicas, a thread per GPU,
 * run out of memory together) must not reach this one's message and
 * torch's observers, which matepoint_malloc reads after the lock is gone. */
typedef struct {
    allocator *a;
    void *got;
    alloc_oom_info oom;
} oom_elsewhere;

static void *
run_out_on_device_1(void *arg)
{
    oom_elsewhere *other = arg;
    other->got = alloc_malloc(other->a, 7 * MiB, 1, NULL, 0);
    other->oom = alloc_last_oom(other->a);
    return NULL;
}

static void
test_out_of_memory_numbers_are_the_threads_own(void)
{
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 4 * MiB, 2);
    CHECK(alloc_last_oom(a).limit == UINT64_MAX && alloc_last_oom(a).requested == 0);
    alloc_set_limit(a, 0, 2 * MiB);
    CHECK(alloc_malloc(a, 3 * MiB, 0, NULL, 0) == NULL);       /* a 20 MiB segment */
    oom_elsewhere other = {.a = a};
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, run_out_on_device_1, &other) == 0);
    pthread_join(thread, NULL);
    CHECK(other.got == NULL && other.oom.device == 1 && other.oom.requested == 7 * MiB);
    alloc_oom_info mine = alloc_last_oom(a);
    CHECK(mine.device == 0 && mine.requested == 3 * MiB && mine.limit == 2 * MiB);
    CHECK(mine.segment_bytes == 20 * MiB);
    finish(a, &ctx);
    /* another allocator: none of this thread's failures are its */
    a = make(&ctx, 4 * MiB, 1);
    CHECK(alloc_last_oom(a).requested == 0 && alloc_last_oom(a).limit == UINT64_MAX);
    finish(a, &ctx);
}

/* A stream of another device that used a block (record_stream of a tensor
 * of GPU 0 on a stream of GPU 1): the same handle on two devices is two
 * streams, its event is made for it (never a spare of the block's device,
 * made there) and is not kept as a spare after. */
static void
test_record_stream_of_another_device(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0};
    allocator *a = make(&ctx, 0, 2);
    void *p = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(alloc_record_stream_on(a, p, &s1, 0) == 0);     /* its own stream: nothing to do */
    CHECK(alloc_record_stream_on(a, (void *)64, &s1, 1) == 1);
    alloc_free(a, p, 0);
    CHECK(atomic_load(&ctx.events_recorded) == 0);
    void *q = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(q == p && alloc_record_stream_on(a, q, &s1, 1) == 0);
    alloc_host_submit(&s1);
    alloc_free(a, q, 0);
    CHECK(atomic_load(&ctx.events_recorded) == 1 && atomic_load(&ctx.events_created) == 1);
    void *r = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(r != q && alloc_check(a, 0) == 0);               /* pending on device 1's stream */
    alloc_host_complete(&s1);
    alloc_free(a, alloc_malloc(a, 8, 0, NULL, 0), 0);      /* retires the event */
    CHECK(atomic_load(&ctx.live_events) == 0);             /* not kept: made for device 1 */
    void *again = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(again == q);
    alloc_free(a, again, 0);
    alloc_free(a, r, 0);
    finish(a, &ctx);
}

/* torch's memory fraction: a cap of that share of the device's memory,
 * 0.0 a cap at nothing; NaN, a fraction outside [0, 1] or a device out of
 * range change nothing. */
static void
test_memory_fraction(void)
{
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 0, 2);
    CHECK(alloc_fraction(a, 0) == 1.0 && alloc_fraction(a, 2) == -1.0);
    CHECK(alloc_set_fraction(a, 0, 0.25, 16 * MiB) == 0 && alloc_fraction(a, 0) == 0.25);
    void *fits = alloc_malloc(a, 1000, 0, NULL, 0);            /* a 2 MiB segment of 4 */
    CHECK(fits != NULL && alloc_malloc(a, 3 * MiB, 0, NULL, 0) == NULL);
    double nan = NAN;
    CHECK(alloc_set_fraction(a, 0, nan, 16 * MiB) == -1 && alloc_fraction(a, 0) == 0.25);
    CHECK(alloc_set_fraction(a, 0, 1.5, 16 * MiB) == -1 && alloc_set_fraction(a, 0, -0.1, 0) == -1);
    CHECK(alloc_set_fraction(a, 2, 0.5, 16 * MiB) == -1);
    CHECK(alloc_malloc(a, 3 * MiB, 0, NULL, 0) == NULL);        /* the cap stayed */
    CHECK(alloc_last_oom(a).limit == 4 * MiB);
    alloc_free(a, fits, 0);
    alloc_empty_cache(a);
    CHECK(alloc_set_fraction(a, 0, 0.0, 16 * MiB) == 0 && alloc_fraction(a, 0) == 0.0);
    CHECK(alloc_malloc(a, 512, 0, NULL, 0) == NULL && alloc_last_oom(a).limit == 0);
    void *other = alloc_malloc(a, 512, 1, NULL, 0);              /* another device's own */
    CHECK(other != NULL);
    alloc_free(a, other, 1);
    CHECK(alloc_set_fraction(a, 0, 1.0, 64 * MiB) == 0);
    void *again = alloc_malloc(a, 3 * MiB, 0, NULL, 0);
    CHECK(again != NULL);
    alloc_free(a, again, 0);
    /* a total whose product rounds to 2^64 (no uint64_t holds it): the
     * whole of it, not a wrapped cap */
    alloc_empty_cache(a);                                        /* a new segment is asked */
    CHECK(alloc_set_fraction(a, 0, 1.0, UINT64_MAX) == 0);
    again = alloc_malloc(a, 3 * MiB, 0, NULL, 0);
    CHECK(again != NULL);
    alloc_free(a, again, 0);
    CHECK(alloc_set_fraction(a, 0, 0.5, UINT64_MAX) == 0);
    alloc_free(a, alloc_malloc(a, 8, 0, NULL, 0), 0);
    CHECK(alloc_malloc(a, UINT64_MAX / 2 + 2 * MiB, 0, NULL, 0) == NULL);
    CHECK(alloc_last_oom(a).limit == 1ull << 63);
    alloc_empty_cache(a);
    finish(a, &ctx);
}

/* Sizes near UINT64_MAX: rounding must not wrap to a small block. */
static void
test_huge_requests_are_out_of_memory(void)
{
    CHECK(alloc_round_size(UINT64_MAX) == 0 && alloc_round_size(UINT64_MAX - 510) == 0);
    CHECK(alloc_round_size(UINT64_MAX - 511) == UINT64_MAX - 511);
    CHECK(alloc_round_size((1ull << 63) + 1) == (1ull << 63) + 512);
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 64 * MiB, 1);
    void *small = alloc_malloc(a, 100, 0, NULL, 0);
    uint64_t huge[] = {UINT64_MAX, UINT64_MAX - 511, UINT64_MAX - 2 * MiB + 2,
                       UINT64_MAX - 4 * MiB, 1ull << 63, 65 * MiB};
    for (int i = 0; i < 6; i++) {
        CHECK(alloc_malloc(a, huge[i], 0, NULL, 0) == NULL);
        CHECK(alloc_malloc(a, huge[i], 0, NULL, 0) == NULL);
        alloc_oom_info oom = alloc_last_oom(a);
        CHECK(oom.requested == huge[i] && oom.allocated == 512 && oom.reserved == 2 * MiB);
    }
    alloc_stats s = alloc_get_stats(a, 0);
    CHECK(s.ooms == 12 && s.live_blocks == 1 && s.allocated_bytes == 512 && s.mallocs == 1);
    /* a limit near UINT64_MAX: reserved + segment must not wrap under it */
    alloc_set_limit(a, 0, UINT64_MAX - MiB);
    CHECK(alloc_malloc(a, UINT64_MAX - 4 * MiB, 0, NULL, 0) == NULL);
    CHECK(ctx.live_bytes == 2 * MiB);
    CHECK(alloc_check(a, 0) == 0);
    alloc_free(a, small, 0);
    finish(a, &ctx);
}

static struct {
    allocator *a;
    int calls, lock_free, device;
    void *stream, *ptr;
    uint64_t bytes;
    lock_probe probe;
} handout;

static void
read_stats_of_device0(void *a)
{
    (void)alloc_get_stats(a, 0);
}

static void
record_handout(void *ctx, int device, void *stream, void *ptr, uint64_t bytes)
{
    (void)ctx;
    if (handout.calls++ == 0)
        handout.lock_free = probe_lock_free(&handout.probe);
    handout.device = device;
    handout.stream = stream;
    handout.ptr = ptr;
    handout.bytes = bytes;
}

static void
test_on_handout_hook_runs_after_the_lock(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0};
    alloc_host_init(&ctx, 64 * MiB);
    alloc_backend backend = alloc_host_backend(&ctx);
    CHECK(backend.on_handout == NULL);
    backend.on_handout = record_handout;
    allocator *a = alloc_create(backend, 2);
    handout.probe = (lock_probe){.fn = read_stats_of_device0, .arg = a};
    void *p = alloc_malloc(a, 1000, 0, &s1, 0);
    probe_join(&handout.probe);
    CHECK(handout.calls == 1 && handout.lock_free);
    CHECK(handout.device == 0 && handout.stream == &s1 && handout.ptr == p && handout.bytes == 1024);
    void *q = alloc_malloc(a, 3 * MiB + 1, 1, NULL, 0);
    CHECK(handout.calls == 2 && handout.device == 1 && handout.stream == NULL);
    CHECK(handout.ptr == q && handout.bytes == 3 * MiB + 512);
    CHECK(alloc_malloc(a, UINT64_MAX, 0, NULL, 0) == NULL && handout.calls == 2);
    alloc_free(a, p, 0);
    alloc_free(a, q, 1);
    finish(a, &ctx);
}

/* ---- CUDA backend over a fake runtime that keeps a per-thread last error */

static _Thread_local int fake_last_error;
static int fake_events_pending, fake_fail_record, fake_records_failed;
static char fake_memory[4][2 << 20];
static int fake_segments, fake_events_live, fake_device_syncs;

static int
fake_fail(int status)
{
    fake_last_error = status;
    return status;
}

static int fake_get_device(int *device) { *device = 0; return CUDART_SUCCESS; }
static int fake_set_device(int device) { (void)device; return CUDART_SUCCESS; }
static int fake_free(void *ptr) { (void)ptr; fake_segments--; return CUDART_SUCCESS; }
static int
fake_synchronize(void)
{
    fake_device_syncs++;
    fake_events_pending = 0;
    return CUDART_SUCCESS;
}
static int fake_get_last_error(void) { int e = fake_last_error; fake_last_error = 0; return e; }
static const char *fake_error_string(int status) { (void)status; return "fake error"; }

static int
fake_malloc(void **ptr, size_t bytes)
{
    if (bytes > sizeof(fake_memory[0]) || fake_segments == 4)
        return fake_fail(CUDART_ERROR_MEMORY_ALLOCATION);
    *ptr = fake_memory[fake_segments++];
    return CUDART_SUCCESS;
}

static int
fake_event_create(void **event, unsigned flags)
{
    (void)flags;
    fake_events_live++;
    *event = malloc(1);
    return CUDART_SUCCESS;
}

static int
fake_event_destroy(void *event)
{
    fake_events_live--;
    free(event);
    return CUDART_SUCCESS;
}

static int
fake_event_record(void *event, void *stream)
{
    (void)event;
    (void)stream;
    fake_records_failed += fake_fail_record;
    return fake_fail_record ? fake_fail(700) : CUDART_SUCCESS;
}

static int
fake_event_query(void *event)
{
    (void)event;
    return fake_events_pending ? fake_fail(CUDART_ERROR_NOT_READY) : CUDART_SUCCESS;
}

static int
fake_event_synchronize(void *event)
{
    (void)event;
    fake_events_pending = 0;
    return CUDART_SUCCESS;
}

static const cudart fake_runtime = {
    .get_device = fake_get_device, .set_device = fake_set_device, .malloc = fake_malloc,
    .free = fake_free, .event_create = fake_event_create, .event_destroy = fake_event_destroy,
    .event_record = fake_event_record, .event_query = fake_event_query,
    .event_synchronize = fake_event_synchronize, .device_synchronize = fake_synchronize,
    .get_last_error = fake_get_last_error, .get_error_string = fake_error_string,
};

/* Every failure the CUDA backend goes on from leaves no last error behind
 * for torch's next launch check to raise. */
static void
test_cuda_backend_clears_recovered_errors(void)
{
    char s1, s2;
    printf("test_alloc: a failing cudaEventRecord, on purpose: the allocator's report of it "
           "below is expected\n");
    fflush(stdout);
    alloc_backend backend = alloc_cuda_backend(&fake_runtime);
    CHECK(backend.on_handout == NULL);
    allocator *a = alloc_create(backend, 1);
    void *p = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(alloc_record_stream(a, p, &s2) == 0);
    alloc_free(a, p, 0);
    fake_events_pending = 1;
    void *q = alloc_malloc(a, 4096, 0, &s1, 0);     /* cudaEventQuery: not ready */
    CHECK(q != NULL && q != p && fake_last_error == 0);
    fake_fail_record = 1;                           /* cudaEventRecord fails at the free */
    CHECK(alloc_record_stream(a, q, &s2) == 0);
    alloc_free(a, q, 0);
    /* no device-wide wait instead (it would break a capture another thread
     * runs): q waits, deferred, for a record that works */
    CHECK(fake_last_error == 0 && fake_events_live == 1 && fake_device_syncs == 0);
    void *r = alloc_malloc(a, 4096, 0, &s1, 0);     /* q's record fails again */
    CHECK(r != NULL && r != q && fake_last_error == 0);
    fake_fail_record = 0;
    alloc_free(a, r, 0);
    void *again = alloc_malloc(a, 4096, 0, &s1, 0); /* q recorded now, not complete yet */
    CHECK(again == r && fake_last_error == 0);
    alloc_free(a, again, 0);
    fake_events_pending = 0;
    void *half[9];
    for (int i = 0; i < 9; i++)                     /* 4 segments: cudaMalloc fails for the last */
        half[i] = alloc_malloc(a, MiB, 0, &s1, 0);
    CHECK(half[7] != NULL && half[8] == NULL && fake_last_error == 0);
    CHECK(alloc_get_stats(a, 0).oom_retries == 1 && fake_events_live == 0);
    for (int i = 0; i < 8; i++)
        alloc_free(a, half[i], 0);
    alloc_destroy(a);
    CHECK(fake_segments == 0 && fake_events_live == 0 && fake_last_error == 0);
}

/* A record that keeps failing (its stream destroyed since) is tried again
 * after ever longer gaps, not at every malloc, where each try is reported
 * (a flood on stderr, and an event made and destroyed per malloc); it is
 * tried at once when memory is wanted, and its block comes back once a
 * record works. */
static void
test_a_failing_record_is_tried_ever_less_often(void)
{
    char s1, s2;
    printf("test_alloc: a cudaEventRecord failing on, on purpose: a few reports of it below "
           "are expected\n");
    fflush(stdout);
    allocator *a = alloc_create(alloc_cuda_backend(&fake_runtime), 1);
    void *p = alloc_malloc(a, 4096, 0, &s1, 0);
    CHECK(alloc_record_stream(a, p, &s2) == 0);
    fake_fail_record = 1;
    int failed_before = fake_records_failed;
    alloc_free(a, p, 0);
    int reused = 0;
    for (int i = 0; i < 200; i++) {
        void *q = alloc_malloc(a, 4096, 0, &s1, 0);
        reused += q == p;
        alloc_free(a, q, 0);
    }
    /* the free's, then tries at mallocs 1, 3, 6, 11, 20, 37, 70, 135 */
    int failed = fake_records_failed - failed_before;
    CHECK(reused == 0 && failed >= 2 && failed <= 9 && fake_last_error == 0);
    /* once records work again, the block comes back within one backoff
     * (the next try at malloc 264), not thousands of mallocs later */
    fake_fail_record = 0;
    int waited = 0;
    for (void *q = NULL; q != p && waited < 1000; waited++) {
        q = alloc_malloc(a, 4096, 0, &s1, 0);
        alloc_free(a, q, 0);
    }
    CHECK(waited <= 2 * 135);
    alloc_empty_cache(a);               /* its segment released */
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 0 && alloc_check(a, 0) == 0);
    alloc_destroy(a);
    CHECK(fake_segments == 0 && fake_events_live == 0 && fake_last_error == 0);
}

static void
test_tags_are_exact(void)
{
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 0, 2);
    void *f1 = alloc_malloc(a, 1000, 0, NULL, 7);
    void *f2 = alloc_malloc(a, 3000, 0, NULL, 7);
    void *r1 = alloc_malloc(a, 512, 0, NULL, 9);
    void *d1 = alloc_malloc(a, 100, 1, NULL, 7);   /* other device, own table */
    alloc_tag_stats tags[8];
    int n = alloc_get_tag_stats(a, 0, tags, 8);
    CHECK(n == 2);
    for (int i = 0; i < n; i++) {
        if (tags[i].tag == 7)
            CHECK(tags[i].live_bytes == 4096 && tags[i].peak_bytes == 4096 && tags[i].allocations == 2);
        else
            CHECK(tags[i].tag == 9 && tags[i].live_bytes == 512);
    }
    alloc_free(a, f1, 0);
    alloc_free(a, f2, 0);
    n = alloc_get_tag_stats(a, 0, tags, 8);
    for (int i = 0; i < n; i++) {
        if (tags[i].tag == 7)
            CHECK(tags[i].live_bytes == 0 && tags[i].peak_bytes == 4096);
    }
    alloc_reset_peaks(a);
    CHECK(alloc_get_tag_stats(a, 0, tags, 8) == 1);   /* tag 7 now has neither */
    CHECK(alloc_get_stats(a, 0).peak_allocated_bytes == 512);
    CHECK(alloc_get_tag_stats(a, 1, tags, 8) == 1 && tags[0].live_bytes == 512);
    alloc_free(a, r1, 0);
    alloc_free(a, d1, 1);
    finish(a, &ctx);
}

typedef struct {
    char *ptr;
    uint64_t size;
    unsigned char pattern;
    int device;
} live_alloc;

static int
ranges_overlap(live_alloc *live, int n)
{
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            if (live[i].device == live[j].device && live[i].ptr < live[j].ptr + live[j].size &&
                live[j].ptr < live[i].ptr + live[i].size)
                return 1;
    return 0;
}

static int
pattern_intact(const live_alloc *l)
{
    return l->size == 0 || (l->ptr[0] == (char)l->pattern && l->ptr[l->size - 1] == (char)l->pattern &&
                            l->ptr[l->size / 2] == (char)l->pattern);
}

static void
test_randomized_operations_keep_invariants(void)
{
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 200 * MiB, 2);
    alloc_host_stream streams[3] = {{0}};
    live_alloc live[64];
    int n = 0, bad_pattern = 0, bad_check = 0;
    unsigned seed = 12345;
    for (int step = 0; step < 6000; step++) {
        int op = rand_r(&seed) % 10;
        alloc_host_stream *stream = &streams[rand_r(&seed) % 3];
        if (op < 5 && n < 64) {
            uint64_t sizes[] = {0, 1, 700, 4096, 100000, MiB, 3 * MiB, 12 * MiB};
            uint64_t size = sizes[rand_r(&seed) % 8] + (uint64_t)(rand_r(&seed) % 3000);
            int device = rand_r(&seed) % 2;
            char *p = alloc_malloc(a, size, device, stream, (uint64_t)(rand_r(&seed) % 4));
            if (p != NULL) {
                live[n] = (live_alloc){p, size, (unsigned char)(step & 0xff), device};
                memset(p, live[n].pattern, size);
                n++;
            }
        } else if (op < 8 && n > 0) {
            int i = rand_r(&seed) % n;
            bad_pattern += !pattern_intact(&live[i]);
            alloc_host_submit(stream);
            CHECK(alloc_free(a, live[i].ptr, live[i].device) == 0);
            live[i] = live[--n];
        } else if (op == 8 && n > 0) {
            int i = rand_r(&seed) % n;
            CHECK(alloc_record_stream(a, live[i].ptr, stream) == 0);
            alloc_host_submit(stream);
        } else {
            alloc_host_complete(stream);
        }
        if (step % 50 == 0) {
            bad_check += alloc_check(a, 0) != 0 || alloc_check(a, 1) != 0;
            bad_check += ranges_overlap(live, n);
        }
    }
    CHECK(bad_pattern == 0);
    CHECK(bad_check == 0);
    for (int i = 0; i < n; i++) {
        bad_pattern += !pattern_intact(&live[i]);
        alloc_free(a, live[i].ptr, live[i].device);
    }
    CHECK(bad_pattern == 0);
    for (int i = 0; i < 3; i++)
        alloc_host_complete(&streams[i]);
    alloc_empty_cache(a);
    for (int d = 0; d < 2; d++) {
        alloc_stats s = alloc_get_stats(a, d);
        CHECK(s.allocated_bytes == 0 && s.reserved_bytes == 0 && s.live_blocks == 0);
        CHECK(s.mallocs == s.frees);
        CHECK(alloc_check(a, d) == 0);
    }
    CHECK(ctx.live_bytes == 0);
    finish(a, &ctx);
}

typedef struct {
    allocator *a;
    alloc_host_stream stream;
    unsigned seed;
    int corrupted;
} worker;

static void *
stress_worker(void *arg)
{
    worker *w = arg;
    live_alloc live[16];
    int n = 0;
    for (int step = 0; step < 5000; step++) {
        if (n < 16 && rand_r(&w->seed) % 2) {
            uint64_t size = (uint64_t)(rand_r(&w->seed) % (3 * MiB));
            char *p = alloc_malloc(w->a, size, 0, &w->stream, 1);
            if (p != NULL) {
                live[n] = (live_alloc){p, size, (unsigned char)(w->seed & 0xff), 0};
                memset(p, live[n].pattern, size);
                n++;
            }
        } else if (n > 0) {
            int i = rand_r(&w->seed) % n;
            w->corrupted |= !pattern_intact(&live[i]);
            alloc_host_submit(&w->stream);
            alloc_free(w->a, live[i].ptr, 0);
            live[i] = live[--n];
            if (step % 7 == 0)
                alloc_host_complete(&w->stream);
        }
    }
    for (int i = 0; i < n; i++) {
        w->corrupted |= !pattern_intact(&live[i]);
        alloc_free(w->a, live[i].ptr, 0);
    }
    alloc_host_complete(&w->stream);
    return NULL;
}

static void
test_threads_stress(void)
{
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 0, 1);
    pthread_t threads[4];
    worker workers[4];
    for (int i = 0; i < 4; i++) {
        workers[i] = (worker){.a = a, .seed = (unsigned)(i + 1) * 2654435761u};
        pthread_create(&threads[i], NULL, stress_worker, &workers[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(threads[i], NULL);
        CHECK(!workers[i].corrupted);
    }
    alloc_stats s = alloc_get_stats(a, 0);
    CHECK(s.allocated_bytes == 0 && s.live_blocks == 0 && s.mallocs == s.frees);
    CHECK(alloc_check(a, 0) == 0);
    alloc_empty_cache(a);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 0);
    finish(a, &ctx);
}

/* Counters that would go below zero stop a debug build where they change. */
static void
free_with_a_corrupted_counter(void)
{
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 0, 1);
    void *p = alloc_malloc(a, 4096, 0, NULL, 0);
    a->devices[0].stats.live_blocks = 0;
    alloc_free(a, p, 0);
}

/* A free block linked into its bucket twice: the list links disagree. */
static void
free_list_link_broken(void)
{
    alloc_host_ctx ctx;
    allocator *a = make(&ctx, 0, 1);
    void *p = alloc_malloc(a, 4096, 0, NULL, 0);
    void *q = alloc_malloc(a, 4096, 0, NULL, 0);
    alloc_free(a, p, 0);
    block *b = a->devices[0].streams->buckets[1][12]; /* small, floor(log2 4096) */
    b->list_prev = b;       /* the head with a predecessor */
    alloc_free(a, q, 0);
}

static void
test_broken_invariants_stop_a_debug_build(void)
{
    if (!MP_ASSERTS_ACTIVE)
        return;     /* a release build (the valgrind run) checks nothing */
    printf("test_alloc: allocator state broken on purpose: the invariant reports below are "
           "expected\n");
    CHECK(aborts_on_invariant(free_with_a_corrupted_counter));
    CHECK(aborts_on_invariant(free_list_link_broken));
}


/* torch's figures (alloc_device_stats): per pool, active through a free
 * that waits for another stream, inactive split, peak and accumulated
 * resets per device. */
static void
test_torch_figures(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0}, s2 = {0};
    allocator *a = make(&ctx, 0, 2);
    alloc_device_stats t;
    void *small = alloc_malloc(a, 1000, 1, &s1, 0);
    void *large = alloc_malloc(a, 3 * MiB, 1, &s1, 0);
    CHECK(alloc_get_device_stats(a, 1, &t) == 0);
    CHECK(t.arrays[ALLOC_STAT_ALLOCATION][ALLOC_POOL_SMALL].current == 1);
    CHECK(t.arrays[ALLOC_STAT_ALLOCATION][ALLOC_POOL_LARGE].current == 1);
    CHECK(t.arrays[ALLOC_STAT_ALLOCATED_BYTES][ALLOC_POOL_ALL].current == 1024 + 3 * MiB);
    CHECK(t.arrays[ALLOC_STAT_REQUESTED_BYTES][ALLOC_POOL_SMALL].current == 1000);
    CHECK(t.arrays[ALLOC_STAT_SEGMENT][ALLOC_POOL_ALL].current == 2 && t.num_device_alloc == 2);
    CHECK(t.arrays[ALLOC_STAT_INACTIVE_SPLIT][ALLOC_POOL_ALL].current == 2);
    CHECK(t.arrays[ALLOC_STAT_INACTIVE_SPLIT_BYTES][ALLOC_POOL_LARGE].current == 17 * MiB);
    CHECK(t.max_split_size == -1 && t.num_sync_all_streams == 0);
    /* torch counts each wait for every stream's pending frees: empty_cache
     * makes one per device */
    alloc_empty_cache(a);
    CHECK(alloc_get_device_stats(a, 1, &t) == 0 && t.num_sync_all_streams == 1);
    /* a free that another stream still reads: not allocated, still active */
    CHECK(alloc_record_stream(a, large, &s2) == 0);
    alloc_host_submit(&s2);
    alloc_free(a, large, 1);
    CHECK(alloc_get_device_stats(a, 1, &t) == 0);
    CHECK(t.arrays[ALLOC_STAT_ALLOCATED_BYTES][ALLOC_POOL_LARGE].current == 0);
    CHECK(t.arrays[ALLOC_STAT_ACTIVE_BYTES][ALLOC_POOL_LARGE].current == 3 * MiB);
    CHECK(t.arrays[ALLOC_STAT_REQUESTED_BYTES][ALLOC_POOL_LARGE].current == 3 * MiB);
    CHECK(alloc_check(a, 1) == 0);
    alloc_host_complete(&s2);
    alloc_free(a, small, 1);                  /* the next malloc retires the event */
    void *again = alloc_malloc(a, 1000, 1, &s1, 0);
    CHECK(alloc_get_device_stats(a, 1, &t) == 0);
    CHECK(t.arrays[ALLOC_STAT_ACTIVE_BYTES][ALLOC_POOL_LARGE].current == 0);
    CHECK(t.arrays[ALLOC_STAT_ACTIVE_BYTES][ALLOC_POOL_LARGE].freed == 3 * MiB);
    CHECK(t.arrays[ALLOC_STAT_REQUESTED_BYTES][ALLOC_POOL_LARGE].current == 0);
    CHECK(t.arrays[ALLOC_STAT_REQUESTED_BYTES][ALLOC_POOL_SMALL].current == 1000);  /* again */
    CHECK(t.arrays[ALLOC_STAT_INACTIVE_SPLIT][ALLOC_POOL_LARGE].current == 0);   /* merged */
    CHECK(t.arrays[ALLOC_STAT_ALLOCATED_BYTES][ALLOC_POOL_ALL].peak == 1024 + 3 * MiB);
    /* resets: peaks of device 1 only; accumulated counts restart */
    void *other = alloc_malloc(a, 5 * MiB, 0, &s1, 0);
    alloc_free(a, other, 0);
    CHECK(alloc_reset_device_peaks(a, 1) == 0 && alloc_reset_device_peaks(a, 2) == -1);
    CHECK(alloc_get_device_stats(a, 1, &t) == 0);
    CHECK(t.arrays[ALLOC_STAT_ALLOCATED_BYTES][ALLOC_POOL_ALL].peak == 1024);
    CHECK(alloc_get_stats(a, 1).peak_allocated_bytes == 1024);
    CHECK(alloc_get_device_stats(a, 0, &t) == 0);
    CHECK(t.arrays[ALLOC_STAT_ALLOCATED_BYTES][ALLOC_POOL_ALL].peak == 5 * MiB);
    CHECK(alloc_reset_accumulated(a, 1) == 0 && alloc_reset_accumulated(a, -1) == -1);
    CHECK(alloc_get_device_stats(a, 1, &t) == 0);
    CHECK(t.arrays[ALLOC_STAT_ALLOCATION][ALLOC_POOL_ALL].allocated == 0);
    CHECK(t.arrays[ALLOC_STAT_ALLOCATION][ALLOC_POOL_ALL].freed == 0);
    CHECK(t.arrays[ALLOC_STAT_ALLOCATION][ALLOC_POOL_ALL].current == 1 && t.num_device_alloc == 0);
    /* every accumulated count restarts, those of oversize blocks too */
    CHECK(t.oversize_allocations.allocated == 0 && t.oversize_allocations.freed == 0);
    CHECK(t.oversize_segments.allocated == 0 && t.oversize_segments.freed == 0);
    CHECK(t.num_alloc_retries == 0 && t.num_ooms == 0 && t.num_sync_all_streams == 0);
    CHECK(t.num_device_free == 0);
    CHECK(alloc_get_device_stats(a, 9, &t) == -1);
    alloc_free(a, again, 1);
    alloc_empty_cache(a);
    CHECK(alloc_get_device_stats(a, 1, &t) == 0);
    CHECK(t.arrays[ALLOC_STAT_RESERVED_BYTES][ALLOC_POOL_ALL].current == 0 && t.num_device_free == 2);
    CHECK(alloc_check(a, 0) == 0 && alloc_check(a, 1) == 0);
    finish(a, &ctx);
}

/* Contexts are counted: each gather makes one, retain adds, release takes;
 * the test's cells count what is alive. */
static _Atomic int64_t contexts_alive;
static _Atomic int64_t contexts_gathered;
static uint64_t last_gather_tag;

typedef struct {
    _Atomic int references;
    uint64_t tag;
} test_context;

static void *
test_gather(uint64_t tag)
{
    test_context *c = malloc(sizeof(*c));
    if (c == NULL)
        return NULL;
    atomic_store(&c->references, 1);
    c->tag = tag;
    last_gather_tag = tag;
    atomic_fetch_add(&contexts_alive, 1);
    atomic_fetch_add(&contexts_gathered, 1);
    return c;
}

static void
test_retain(void *context)
{
    atomic_fetch_add(&((test_context *)context)->references, 1);
}

static void
test_release(void *context)
{
    test_context *c = context;
    if (atomic_fetch_sub(&c->references, 1) == 1) {
        free(c);
        atomic_fetch_sub(&contexts_alive, 1);
    }
}

static int64_t
test_clock(void)
{
    static _Atomic int64_t now;
    return atomic_fetch_add(&now, 1) + 1;
}

static void
history(allocator *a, int enabled, uint64_t max, int when, int clear)
{
    alloc_history_config config = {.enabled = enabled, .max_entries = max, .when = when,
                                   .clear = clear, .gather = test_gather, .retain = test_retain,
                                   .release = test_release, .clock = test_clock};
    alloc_history_configure(a, &config);
}

static void
test_history_records_and_snapshot(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0};
    allocator *a = make(&ctx, 0, 1);
    history(a, 1, 100, ALLOC_CONTEXT_ALLOC, 1);
    void *x = alloc_malloc(a, 1000, 0, &s1, alloc_region_tag(3, TAG_FORWARD));
    CHECK(last_gather_tag == alloc_region_tag(3, TAG_FORWARD));
    void *y = alloc_malloc(a, 3 * MiB, 0, &s1, alloc_region_tag(3, TAG_RECOMPUTE));
    alloc_free(a, x, 0);
    alloc_snapshot snap;
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0);
    int actions[] = {ALLOC_TRACE_SEGMENT_ALLOC, ALLOC_TRACE_ALLOC, ALLOC_TRACE_SEGMENT_ALLOC,
                     ALLOC_TRACE_ALLOC, ALLOC_TRACE_FREE_REQUESTED, ALLOC_TRACE_FREE_COMPLETED};
    CHECK(snap.trace_count == 6);
    for (uint64_t i = 0; i < snap.trace_count && i < 6; i++) {
        CHECK(snap.trace[i].action == actions[i]);
        CHECK(i == 0 || snap.trace[i].time > snap.trace[i - 1].time);
    }
    /* a block's records carry the bytes requested, as torch's (1024 handed out) */
    CHECK(snap.trace[1].address == (uintptr_t)x && snap.trace[1].size == 1000);
    CHECK(snap.trace[4].size == 1000 && snap.trace[5].size == 1000);
    CHECK(snap.trace[0].size == 2 * MiB && snap.trace[1].pool_a == 0 && snap.trace[1].pool_b == 0);
    CHECK(snap.trace[1].tag == alloc_region_tag(3, TAG_FORWARD) && snap.trace[1].context);
    /* stacks of allocations only (torch's context="alloc"): a free's records
     * carry the block's stack from its allocation, as torch's */
    CHECK(snap.trace[4].tag == alloc_region_tag(3, TAG_FORWARD));
    CHECK(snap.trace[4].context == snap.trace[1].context);
    CHECK(snap.trace[5].context == snap.trace[1].context);
    CHECK(snap.trace[3].stream == &s1 && snap.trace[3].size == 3 * MiB);
    /* segments oldest first, blocks in address order with state and tag */
    CHECK(snap.segment_count == 2 && snap.segments[0].small && !snap.segments[1].small);
    CHECK(snap.segments[1].block_count == 2 && snap.block_count == 3);
    alloc_block_record *big = &snap.blocks[snap.segments[1].first_block];
    CHECK(big->state == ALLOC_BLOCK_ALLOCATED && big->address == (uintptr_t)y);
    CHECK(big->tag == alloc_region_tag(3, TAG_RECOMPUTE) && big->context != NULL);
    CHECK(big->requested == 3 * MiB);
    CHECK(snap.blocks[0].state == ALLOC_BLOCK_INACTIVE && snap.blocks[0].context == NULL);
    alloc_snapshot_free(a, &snap);
    /* the ring keeps the newest max_entries */
    history(a, 1, 3, ALLOC_CONTEXT_ALLOC, 0);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0);
    CHECK(snap.trace_count == 3 && snap.trace[2].action == ALLOC_TRACE_FREE_COMPLETED);
    alloc_snapshot_free(a, &snap);
    for (int i = 0; i < 10; i++)
        alloc_free(a, alloc_malloc(a, 512, 0, &s1, 0), 0);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0);
    CHECK(snap.trace_count == 3 && snap.trace[2].action == ALLOC_TRACE_FREE_COMPLETED);
    alloc_snapshot_free(a, &snap);
    /* off: nothing recorded, nothing gathered, and what was kept goes (torch
     * clears its ring then): it does not come back at the next start */
    CHECK(alloc_history_enabled(a));
    history(a, 0, 0, ALLOC_CONTEXT_NEVER, 0);
    CHECK(!alloc_history_enabled(a));
    int64_t gathered = atomic_load(&contexts_gathered);
    alloc_free(a, alloc_malloc(a, 512, 0, &s1, 0), 0);
    CHECK(atomic_load(&contexts_gathered) == gathered);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 0);
    alloc_snapshot_free(a, &snap);
    history(a, 1, 10, ALLOC_CONTEXT_NEVER, 0);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 0);
    alloc_snapshot_free(a, &snap);
    /* clear: the records and their contexts go */
    history(a, 1, 10, ALLOC_CONTEXT_ALL, 1);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 0);
    alloc_snapshot_free(a, &snap);
    alloc_free(a, y, 0);                      /* ALL: the free gathers its own stack */
    CHECK(last_gather_tag == ALLOC_TAG_NONE);
    alloc_empty_cache(a);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 4);
    CHECK(snap.trace[0].action == ALLOC_TRACE_FREE_REQUESTED && snap.trace[0].context != NULL);
    CHECK(((test_context *)snap.trace[0].context)->tag == ALLOC_TAG_NONE);
    CHECK(snap.trace[1].action == ALLOC_TRACE_FREE_COMPLETED);
    CHECK(snap.trace[1].context == snap.trace[0].context);     /* the free's own stack */
    CHECK(snap.trace[2].action == ALLOC_TRACE_SEGMENT_FREE);
    CHECK(snap.trace[3].action == ALLOC_TRACE_SEGMENT_FREE && snap.segment_count == 0);
    alloc_snapshot_free(a, &snap);
    CHECK(alloc_check(a, 0) == 0);
    /* stacks of live blocks only (torch's context="state"): no record keeps one */
    history(a, 1, 10, ALLOC_CONTEXT_STATE, 1);
    alloc_free(a, alloc_malloc(a, 512, 0, &s1, 0), 0);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 4);
    for (uint64_t i = 0; i < snap.trace_count; i++)
        CHECK(snap.trace[i].context == NULL);
    alloc_snapshot_free(a, &snap);
    /* out of memory is a record too */
    CHECK(alloc_malloc(a, UINT64_MAX - 100, 0, &s1, 0) == NULL);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0);
    CHECK(snap.trace[snap.trace_count - 1].action == ALLOC_TRACE_OOM);
    alloc_snapshot_free(a, &snap);
    finish(a, &ctx);
    CHECK(atomic_load(&contexts_alive) == 0);  /* every reference given back */
}

/* torch's default bound is sys.maxsize: the ring grows as records come,
 * nothing is reserved for the bound, and every record is kept; a bound of
 * 0 keeps one record, as torch's. */
static void
test_history_ring_grows_to_its_bound(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0};
    allocator *a = make(&ctx, 0, 1);
    history(a, 1, UINT64_MAX, ALLOC_CONTEXT_NEVER, 1);
    enum { PAIRS = 700 };       /* past the first ring's 64 records and several doublings */
    for (int i = 0; i < PAIRS; i++)
        alloc_free(a, alloc_malloc(a, 1000 + (uint64_t)i, 0, &s1, 0), 0);
    alloc_snapshot snap;
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0);
    CHECK(snap.trace_count == 1 + 3 * PAIRS);           /* a segment, then 3 a pair */
    CHECK(snap.trace[0].action == ALLOC_TRACE_SEGMENT_ALLOC);
    for (uint64_t i = 0; i < PAIRS && snap.trace_count == 1 + 3 * PAIRS; i++)
        CHECK(snap.trace[1 + 3 * i].action == ALLOC_TRACE_ALLOC &&
              snap.trace[1 + 3 * i].size == 1000 + i);
    alloc_snapshot_free(a, &snap);
    /* a smaller bound keeps the newest */
    history(a, 1, 5, ALLOC_CONTEXT_NEVER, 0);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 5);
    CHECK(snap.trace[4].action == ALLOC_TRACE_FREE_COMPLETED &&
          snap.trace[4].size == 1000 + PAIRS - 1);
    alloc_snapshot_free(a, &snap);
    history(a, 1, 0, ALLOC_CONTEXT_NEVER, 1);
    alloc_free(a, alloc_malloc(a, 77, 0, &s1, 0), 0);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 1);
    CHECK(snap.trace[0].action == ALLOC_TRACE_FREE_COMPLETED && snap.trace[0].size == 77);
    alloc_snapshot_free(a, &snap);
    history(a, 0, 0, ALLOC_CONTEXT_NEVER, 0);
    finish(a, &ctx);
}

/* Out of memory is recorded as torch records it: the device's free bytes
 * and the request rounded, of the pool asked. */
static void
test_history_records_out_of_memory(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0};
    allocator *a = make(&ctx, 4 * MiB, 1);
    history(a, 1, 100, ALLOC_CONTEXT_NEVER, 1);
    void *held = alloc_malloc(a, 1000, 0, &s1, 0);     /* a 2 MiB segment: 2 MiB free */
    CHECK(held != NULL && alloc_malloc(a, 3 * MiB - 100, 0, &s1, 0) == NULL);
    alloc_snapshot snap;
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 3);
    alloc_trace_record *oom = &snap.trace[2];
    CHECK(oom->action == ALLOC_TRACE_OOM && oom->address == 2 * MiB);
    CHECK(oom->size == 3 * MiB && oom->stream == &s1 && oom->pool_a == 0);
    alloc_snapshot_free(a, &snap);
    alloc_free(a, held, 0);
    history(a, 0, 0, ALLOC_CONTEXT_NEVER, 0);
    finish(a, &ctx);
}

/* A backend error (a CUDA error other than out of memory: a faulting
 * kernel's sticky 700 fails cudaMalloc too) is no lack of memory: torch's
 * allocator raises it as it is, before its out-of-memory path, so it
 * counts no out of memory (num_ooms), no retry, and records no "oom" in
 * the memory history. */
static int
failing_device_malloc(void *ctx, int device, uint64_t bytes, void **ptr)
{
    (void)ctx;
    (void)device;
    (void)bytes;
    *ptr = NULL;
    return ALLOC_ERROR;
}

static void
test_backend_error_is_no_out_of_memory(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0};
    alloc_host_init(&ctx, 4 * MiB);
    alloc_backend failing = alloc_host_backend(&ctx);
    failing.device_malloc = failing_device_malloc;
    allocator *a = alloc_create(failing, 1);
    history(a, 1, 100, ALLOC_CONTEXT_NEVER, 1);
    int why = ALLOC_OK;
    CHECK(alloc_malloc_why(a, 1000, 0, &s1, 0, &why) == NULL && why == ALLOC_ERROR);
    alloc_device_stats torch;
    CHECK(alloc_get_device_stats(a, 0, &torch) == 0);
    CHECK(torch.num_ooms == 0 && torch.num_alloc_retries == 0);
    CHECK(alloc_get_stats(a, 0).ooms == 0);
    alloc_snapshot snap;
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 0);
    alloc_snapshot_free(a, &snap);
    history(a, 0, 0, ALLOC_CONTEXT_NEVER, 0);
    finish(a, &ctx);
    /* premise: the same request out of memory is counted and recorded */
    a = make(&ctx, MiB, 1);
    history(a, 1, 100, ALLOC_CONTEXT_NEVER, 1);
    CHECK(alloc_malloc_why(a, 1000, 0, &s1, 0, &why) == NULL && why == ALLOC_OUT_OF_MEMORY);
    CHECK(alloc_get_device_stats(a, 0, &torch) == 0 && torch.num_ooms == 1);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 1);
    CHECK(snap.trace_count == 1 && snap.trace[0].action == ALLOC_TRACE_OOM);
    alloc_snapshot_free(a, &snap);
    history(a, 0, 0, ALLOC_CONTEXT_NEVER, 0);
    finish(a, &ctx);
}

/* torch's skip_actions: the actions named are not recorded, the others are. */
static void
test_history_skips_actions(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream s1 = {0};
    allocator *a = make(&ctx, 0, 1);
    CHECK(alloc_trace_action("free_requested") == ALLOC_TRACE_FREE_REQUESTED);
    CHECK(alloc_trace_action("oom") == ALLOC_TRACE_OOM && alloc_trace_action("annotate") == 9);
    CHECK(alloc_trace_action("free") == -1 && alloc_trace_action("") == -1);
    alloc_history_config config = {
        .enabled = 1, .max_entries = 100, .when = ALLOC_CONTEXT_NEVER, .clear = 1,
        .skip = 1u << ALLOC_TRACE_FREE_REQUESTED | 1u << ALLOC_TRACE_SEGMENT_ALLOC};
    alloc_history_configure(a, &config);
    alloc_free(a, alloc_malloc(a, 1000, 0, &s1, 0), 0);
    alloc_snapshot snap;
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 2);
    CHECK(snap.trace_count == 2 && snap.trace[0].action == ALLOC_TRACE_ALLOC &&
          snap.trace[1].action == ALLOC_TRACE_FREE_COMPLETED);
    alloc_snapshot_free(a, &snap);
    config.skip = 0;                         /* a later call records them again */
    config.clear = 0;
    alloc_history_configure(a, &config);
    alloc_free(a, alloc_malloc(a, 1000, 0, &s1, 0), 0);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == 5);
    CHECK(snap.trace_count == 5 && snap.trace[3].action == ALLOC_TRACE_FREE_REQUESTED);
    alloc_snapshot_free(a, &snap);
    finish(a, &ctx);
}

int
main(void)
{
    test_rounding_and_size_zero();
    test_split_and_coalesce();
    test_large_pool_sizes();
    test_stream_ordered_reuse();
    test_destroyed_stream_is_never_used();
    test_events_queried_per_stream_in_order();
    test_out_of_memory_moves_memory_between_streams();
    test_record_stream_defers_reuse();
    test_empty_cache_waits_for_the_streams_using_a_block();
    test_events_are_reused_across_frees();
    test_out_of_memory_releases_cache_then_fails_cleanly();
    test_huge_requests_are_out_of_memory();
    test_out_of_memory_numbers_are_the_threads_own();
    test_memory_fraction();
    test_record_stream_of_another_device();
    test_on_handout_hook_runs_after_the_lock();
    test_cuda_backend_clears_recovered_errors();
    test_a_failing_record_is_tried_ever_less_often();
    test_tags_are_exact();
    test_torch_figures();
    test_history_records_and_snapshot();
    test_history_skips_actions();
    test_history_ring_grows_to_its_bound();
    test_history_records_out_of_memory();
    test_backend_error_is_no_out_of_memory();
    test_randomized_operations_keep_invariants();
    test_threads_stress();
    test_broken_invariants_stop_a_debug_build();
    return check_report("test_alloc");
}
