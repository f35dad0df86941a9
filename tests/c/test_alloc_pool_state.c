/* Unit tests of a private pool's checkpointed state and its restore
 * (torch's getCheckpointState / setCheckpointPoolState, for torch.compile's
 * CUDA graph trees), on the host backend (csrc/alloc/alloc_pool_state.c). */
#include "alloc/alloc.h"
#include "alloc/alloc_history.h"
#include "alloc/alloc_host.h"
#include "check.h"

#include <stdlib.h>
#include <string.h>

#define MiB (1ull << 20)

static int
every_stream(void *filter, void *stream)
{
    (void)filter;
    (void)stream;
    return 1;
}

static allocator *
make(alloc_host_ctx *ctx)
{
    alloc_host_init(ctx, 0);
    return alloc_create(alloc_host_backend(ctx), 1);
}

static void
finish(allocator *a, alloc_host_ctx *ctx)
{
    CHECK(alloc_check(a, 0) == 0);
    alloc_destroy(a);
    CHECK(ctx->live_bytes == 0);
    CHECK(atomic_load(&ctx->live_events) == 0);
}

static int
contains(void *const *list, uint64_t count, const void *ptr)
{
    for (uint64_t i = 0; i < count; i++) {
        if (list[i] == ptr)
            return 1;
    }
    return 0;
}

static int
restored(const alloc_pool_delta *delta, const void *ptr, uint64_t size)
{
    for (uint64_t i = 0; i < delta->allocated_count; i++) {
        if (delta->allocated[i].ptr == ptr)
            return delta->allocated[i].size == size;
    }
    return 0;
}

/* The allocator's own view of the pool's segments (a snapshot) is the
 * state's layout: the same segments, the same blocks, allocated alike. */
static int
layout_is(allocator *a, const alloc_pool_state *state)
{
    alloc_snapshot snap;
    if (alloc_take_snapshot(a, 0, &snap) != 0)
        return 0;
    int same = 1;
    for (uint64_t i = 0; i < state->segment_count && same; i++) {
        const alloc_segment_state *want = &state->segments[i];
        const alloc_segment_record *seg = NULL;
        for (uint64_t j = 0; j < snap.segment_count; j++) {
            if (snap.segments[j].address == want->base)
                seg = &snap.segments[j];
        }
        same = seg != NULL && seg->size == want->size && seg->block_count == want->block_count;
        for (uint64_t k = 0; same && k < want->block_count; k++) {
            const alloc_block_record *b = &snap.blocks[seg->first_block + k];
            const alloc_block_state *w = &state->blocks[want->first_block + k];
            same = b->address == w->ptr && b->size == w->size &&
                   (b->state == ALLOC_BLOCK_ALLOCATED) == (w->allocated != 0) &&
                   (!w->allocated || (b->requested == w->requested && b->tag == w->tag));
        }
    }
    alloc_snapshot_free(a, &snap);
    return same;
}

/* Graph trees' walk: record A, record B after it (same pool), replay A and
 * record C from there, go back to B. Each restore leaves exactly the
 * state's live blocks, frees what was live, and keeps every figure. */
static void
test_switching_between_two_recordings(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0};
    allocator *a = make(&ctx);
    /* recording A: an output in each pool size, a scratch block freed */
    CHECK(alloc_begin_pool(a, 0, 1, 0, every_stream, NULL) == 0);
    char *a1 = alloc_malloc(a, 4000, 0, &side, 7);
    void *scratch = alloc_malloc(a, 8192, 0, &side, 7);
    char *a2 = alloc_malloc(a, 3 * MiB, 0, &side, 9);
    alloc_free(a, scratch, 0);
    CHECK(alloc_end_pool(a, 0, 1, 0) == 0);
    memset(a1, 0xA1, 4000);
    alloc_pool_state after_a;
    CHECK(alloc_pool_checkpoint(a, 0, 1, 0, &after_a) == ALLOC_RESTORE_OK);
    CHECK(after_a.segment_count == 2 && after_a.block_count == 4);
    CHECK(layout_is(a, &after_a));
    /* recording B, after A, in the same pool */
    CHECK(alloc_begin_pool(a, 0, 1, 0, every_stream, NULL) == 0);
    char *b1 = alloc_malloc(a, 4096, 0, &side, 11);
    CHECK(b1 == a1 + 4096);                      /* just past A's live output */
    CHECK(alloc_end_pool(a, 0, 1, 0) == 0);
    alloc_pool_state after_b;
    CHECK(alloc_pool_checkpoint(a, 0, 1, 0, &after_b) == ALLOC_RESTORE_OK);
    /* B's output and A's second die; A replays: back to A's state */
    alloc_free(a, b1, 0);
    alloc_free(a, a2, 0);
    alloc_stats before = alloc_get_stats(a, 0);
    alloc_pool_delta delta;
    CHECK(alloc_pool_restore(a, &after_a, &delta) == ALLOC_RESTORE_OK);
    CHECK(delta.freed_count == 1 && delta.freed[0] == a1);     /* live before: a1 only */
    CHECK(delta.allocated_count == 2 && restored(&delta, a1, 4096) &&
          restored(&delta, a2, 3 * MiB));
    CHECK(delta.allocated[0].stream == &side);
    alloc_pool_delta_free(&delta);
    CHECK(layout_is(a, &after_a) && alloc_check(a, 0) == 0);
    void *live[3] = {a2, a1, b1};
    CHECK(alloc_pool_live_is(a, 0, 1, 0, live, 2) == 1);
    CHECK(alloc_pool_live_is(a, 0, 1, 0, live, 1) == 0);       /* a1 missing */
    CHECK(alloc_pool_live_is(a, 0, 1, 0, live, 3) == 0);       /* b1 is not live */
    CHECK(alloc_pool_live_is(a, 0, 8, 0, live, 2) == ALLOC_RESTORE_NO_POOL);
    alloc_stats now = alloc_get_stats(a, 0);
    CHECK(now.live_blocks == 2 && now.allocated_bytes == 4096 + 3 * MiB);
    CHECK(now.requested_bytes == 4000 + 3 * MiB);
    CHECK(now.reserved_bytes == before.reserved_bytes && now.device_allocs == before.device_allocs);
    CHECK(now.mallocs == before.mallocs + 2 && now.frees == before.frees + 1);
    alloc_device_stats figures;
    CHECK(alloc_get_device_stats(a, 0, &figures) == 0);
    CHECK(figures.arrays[ALLOC_STAT_ALLOCATION][ALLOC_POOL_ALL].current == 2);
    CHECK(figures.arrays[ALLOC_STAT_ACTIVE_BYTES][ALLOC_POOL_ALL].current == 4096 + 3 * MiB);
    /* recording C from A's state: it never lands on A's outputs */
    CHECK(alloc_begin_pool(a, 0, 1, 0, every_stream, NULL) == 0);
    char *c1 = alloc_malloc(a, 16384, 0, &side, 13);
    char *c2 = alloc_malloc(a, 18 * MiB, 0, &side, 13);     /* a segment of its own */
    CHECK(alloc_end_pool(a, 0, 1, 0) == 0);
    CHECK(c1 == b1 && c2 != NULL && (c2 + 18 * MiB <= a2 || c2 >= a2 + 20 * MiB));
    memset(c1, 0xC1, 16384);
    CHECK((unsigned char)a1[3999] == 0xA1);
    CHECK(alloc_get_stats(a, 0).device_allocs == before.device_allocs + 1);   /* c2's segment */
    /* back to B: C's outputs go, B's comes back, C's segment stays free */
    CHECK(alloc_pool_restore(a, &after_b, &delta) == ALLOC_RESTORE_OK);
    CHECK(delta.freed_count == 4 && contains(delta.freed, 4, a1) && contains(delta.freed, 4, a2) &&
          contains(delta.freed, 4, c1) && contains(delta.freed, 4, c2));
    CHECK(delta.allocated_count == 3 && restored(&delta, b1, 4096));
    alloc_pool_delta_free(&delta);
    CHECK(layout_is(a, &after_b) && alloc_check(a, 0) == 0);
    now = alloc_get_stats(a, 0);
    CHECK(now.live_blocks == 3 && now.allocated_bytes == 2 * 4096 + 3 * MiB);
    CHECK(now.reserved_bytes == before.reserved_bytes + 18 * MiB);
    CHECK(alloc_pool_use_count(a, 0, 1, 0) == 3);
    alloc_pool_state_free(&after_a);
    alloc_pool_state_free(&after_b);
    alloc_free(a, a1, 0);
    alloc_free(a, a2, 0);
    alloc_free(a, b1, 0);
    for (int i = 0; i < 3; i++)
        CHECK(alloc_release_pool(a, 0, 1, 0) == 0);
    alloc_empty_cache(a);                   /* a released pool's memory goes here */
    now = alloc_get_stats(a, 0);
    CHECK(now.reserved_bytes == 0 && now.live_blocks == 0 && ctx.live_bytes == 0);
    finish(a, &ctx);
}

/* A state whose pool is gone, or whose segments are no longer the pool's,
 * is refused and nothing changes. */
static void
test_a_state_of_gone_segments_is_refused(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0};
    allocator *a = make(&ctx);
    alloc_pool_state state, missing;
    alloc_pool_delta delta;
    CHECK(alloc_pool_checkpoint(a, 0, 2, 0, &missing) == ALLOC_RESTORE_NO_POOL);
    CHECK(missing.segment_count == 0 && missing.segments == NULL);
    CHECK(alloc_pool_checkpoint(a, 5, 2, 0, &missing) == ALLOC_RESTORE_NO_POOL);
    CHECK(alloc_begin_pool(a, 0, 2, 0, every_stream, NULL) == 0);
    void *p = alloc_malloc(a, 4096, 0, &side, 0);
    CHECK(alloc_end_pool(a, 0, 2, 0) == 0);
    CHECK(alloc_pool_checkpoint(a, 0, 2, 0, &state) == ALLOC_RESTORE_OK);
    alloc_free(a, p, 0);
    CHECK(alloc_release_pool(a, 0, 2, 0) == 0);
    CHECK(alloc_pool_restore(a, &state, &delta) == ALLOC_RESTORE_NO_POOL);
    alloc_empty_cache(a);                                        /* its segment went */
    CHECK(delta.freed == NULL && delta.allocated == NULL);
    /* the same pool id again, with other segments */
    CHECK(alloc_begin_pool(a, 0, 2, 0, every_stream, NULL) == 0);
    void *q = alloc_malloc(a, 3 * MiB, 0, &side, 0);
    CHECK(alloc_end_pool(a, 0, 2, 0) == 0);
    alloc_stats before = alloc_get_stats(a, 0);
    CHECK(alloc_pool_restore(a, &state, &delta) == ALLOC_RESTORE_SEGMENT_GONE);
    alloc_stats after = alloc_get_stats(a, 0);
    CHECK(after.live_blocks == 1 && after.frees == before.frees && after.mallocs == before.mallocs);
    /* a state whose blocks do not tile its segment */
    alloc_pool_state now;
    CHECK(alloc_pool_checkpoint(a, 0, 2, 0, &now) == ALLOC_RESTORE_OK);
    now.blocks[0].size += 512;
    CHECK(alloc_pool_restore(a, &now, &delta) == ALLOC_RESTORE_SEGMENT_GONE);
    now.blocks[0].size -= 512;
    CHECK(alloc_pool_restore(a, &now, &delta) == ALLOC_RESTORE_OK);
    CHECK(delta.freed_count == 1 && delta.freed[0] == q && restored(&delta, q, 3 * MiB));
    alloc_pool_delta_free(&delta);
    alloc_pool_state_free(&now);
    alloc_pool_state_free(&state);
    alloc_free(a, q, 0);
    CHECK(alloc_release_pool(a, 0, 2, 0) == 0);
    alloc_empty_cache(a);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 0);
    finish(a, &ctx);
}

/* A block of the pool freed after use on another stream is waited for,
 * whatever other pools are being allocated to (a use_mem_pool context, a
 * capture of another stream): its event was recorded outside any capture.
 * A live block used on a stream now capturing cannot be waited for: the
 * restore is refused, nothing changed, until that capture ended. */
static void
test_blocks_in_use_on_other_streams(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0}, reader = {0}, other = {0};
    allocator *a = make(&ctx);
    CHECK(alloc_begin_pool(a, 0, 3, 0, every_stream, NULL) == 0);
    void *kept = alloc_malloc(a, 4096, 0, &side, 0);
    void *read = alloc_malloc(a, 4096, 0, &side, 0);
    CHECK(alloc_end_pool(a, 0, 3, 0) == 0);
    alloc_pool_state state;
    CHECK(alloc_pool_checkpoint(a, 0, 3, 0, &state) == ALLOC_RESTORE_OK);
    CHECK(alloc_record_stream(a, read, &reader) == 0);
    alloc_host_submit(&reader);
    alloc_free(a, read, 0);                                      /* pending on `reader` */
    /* another pool allocated to, as inside use_mem_pool(pool) */
    CHECK(alloc_begin_pool(a, 0, 4, 0, every_stream, NULL) == 0);
    alloc_pool_delta delta;
    CHECK(alloc_pool_restore(a, &state, &delta) == ALLOC_RESTORE_OK);  /* waited */
    CHECK(atomic_load(&reader.completed) == 1);
    CHECK(delta.freed_count == 1 && delta.allocated_count == 2 && restored(&delta, read, 4096));
    alloc_pool_delta_free(&delta);
    CHECK(layout_is(a, &state) && alloc_check(a, 0) == 0);
    /* a live block used on a stream that now captures a graph */
    CHECK(alloc_record_stream(a, kept, &other) == 0);
    alloc_host_submit(&other);
    atomic_store(&other.capturing, 1);
    uint64_t waits = atomic_load(&ctx.event_waits);
    CHECK(alloc_pool_restore(a, &state, &delta) == ALLOC_RESTORE_BUSY);
    CHECK(delta.freed == NULL && atomic_load(&ctx.event_waits) == waits);
    CHECK(atomic_load(&other.completed) == 0 && atomic_load(&ctx.events_recorded) == 1);
    void *live[2] = {kept, read};
    CHECK(alloc_pool_live_is(a, 0, 3, 0, live, 2) == 1);
    atomic_store(&other.capturing, 0);                           /* the capture ended */
    CHECK(alloc_pool_restore(a, &state, &delta) == ALLOC_RESTORE_OK);
    CHECK(atomic_load(&other.completed) == 1);
    alloc_pool_delta_free(&delta);
    CHECK(alloc_end_pool(a, 0, 4, 0) == 0);
    alloc_pool_state_free(&state);
    alloc_free(a, kept, 0);
    alloc_free(a, read, 0);
    CHECK(alloc_release_pool(a, 0, 3, 0) == 0 && alloc_release_pool(a, 0, 4, 0) == 0);
    alloc_empty_cache(a);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 0);
    finish(a, &ctx);
}

/* The state of the block at `ptr` in a snapshot (ALLOC_BLOCK_*), or -1. */
static int
block_state_of(allocator *a, const void *ptr)
{
    alloc_snapshot snap;
    if (alloc_take_snapshot(a, 0, &snap) != 0)
        return -1;
    int state = -1;
    for (uint64_t i = 0; i < snap.block_count; i++) {
        if (snap.blocks[i].address == (uintptr_t)ptr)
            state = snap.blocks[i].state;
    }
    alloc_snapshot_free(a, &snap);
    return state;
}

/* A restore waits for the streams that used the pool's blocks, and only
 * them (the allocator has no device-wide wait), never another cache's
 * pending frees. A failed wait refuses it, nothing
 * changed: the blocks may still be in use. */
static void
test_the_restore_waits_for_the_pools_streams_only(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0}, reader = {0}, user = {0}, busy = {0};
    allocator *a = make(&ctx);
    CHECK(alloc_begin_pool(a, 0, 3, 0, every_stream, NULL) == 0);
    void *kept = alloc_malloc(a, 4096, 0, &side, 0);
    void *read = alloc_malloc(a, 4096, 0, &side, 0);
    CHECK(alloc_end_pool(a, 0, 3, 0) == 0);
    alloc_pool_state state;
    CHECK(alloc_pool_checkpoint(a, 0, 3, 0, &state) == ALLOC_RESTORE_OK);
    /* the ordinary cache: a free pending on `busy`, which nothing here may wait for */
    void *outside = alloc_malloc(a, 4096, 0, &side, 0);
    CHECK(alloc_record_stream(a, outside, &busy) == 0);
    alloc_host_submit(&busy);
    alloc_free(a, outside, 0);
    /* the pool: a free pending on `reader`, a live block used on `user` */
    CHECK(alloc_record_stream(a, read, &reader) == 0);
    alloc_host_submit(&reader);
    alloc_free(a, read, 0);
    CHECK(alloc_record_stream(a, kept, &user) == 0);
    alloc_host_submit(&user);
    CHECK(block_state_of(a, read) == ALLOC_BLOCK_PENDING_FREE);
    /* each wait fails once in turn: refused, the pool as it was */
    alloc_pool_delta delta;
    for (uint64_t fail = 1; fail <= 2; fail++) {
        uint64_t waits = atomic_load(&ctx.event_waits);
        atomic_store(&ctx.fail_wait_at, waits + fail);  /* the first, then the second */
        CHECK(alloc_pool_restore(a, &state, &delta) == ALLOC_RESTORE_WAIT_FAILED);
        CHECK(delta.freed == NULL && delta.allocated == NULL);
        CHECK(atomic_load(&ctx.event_waits) == waits + fail);
        CHECK(alloc_pool_live_is(a, 0, 3, 0, &kept, 1) == 1);
        CHECK(block_state_of(a, read) == ALLOC_BLOCK_PENDING_FREE);
        CHECK(alloc_check(a, 0) == 0);
    }
    CHECK(atomic_load(&reader.completed) == 0);
    atomic_store(&ctx.fail_wait_at, 0);
    /* then it waits for `user` and `reader`, and for nothing else */
    uint64_t waits = atomic_load(&ctx.event_waits);
    CHECK(alloc_pool_restore(a, &state, &delta) == ALLOC_RESTORE_OK);
    CHECK(atomic_load(&ctx.event_waits) == waits + 2);
    CHECK(atomic_load(&reader.completed) == 1 && atomic_load(&user.completed) == 1);
    CHECK(atomic_load(&busy.completed) == 0);
    CHECK(block_state_of(a, outside) == ALLOC_BLOCK_PENDING_FREE);
    CHECK(delta.freed_count == 1 && delta.allocated_count == 2 && restored(&delta, read, 4096));
    alloc_pool_delta_free(&delta);
    CHECK(layout_is(a, &state) && alloc_check(a, 0) == 0);
    alloc_pool_state_free(&state);
    alloc_host_complete(&busy);
    alloc_free(a, kept, 0);
    alloc_free(a, read, 0);
    CHECK(alloc_release_pool(a, 0, 3, 0) == 0);
    alloc_empty_cache(a);
    CHECK(alloc_get_stats(a, 0).reserved_bytes == 0);
    finish(a, &ctx);
}

/* Memory history sees a restore as frees and mallocs. */
static void
test_history_records_the_restore(void)
{
    alloc_host_ctx ctx;
    alloc_host_stream side = {0};
    allocator *a = make(&ctx);
    alloc_history_config config = {.enabled = 1, .max_entries = 64};
    alloc_history_configure(a, &config);
    CHECK(alloc_begin_pool(a, 0, 5, 0, every_stream, NULL) == 0);
    void *p = alloc_malloc(a, 4096, 0, &side, 0);
    CHECK(alloc_end_pool(a, 0, 5, 0) == 0);
    alloc_pool_state state;
    CHECK(alloc_pool_checkpoint(a, 0, 5, 0, &state) == ALLOC_RESTORE_OK);
    alloc_snapshot snap;
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0);
    uint64_t before = snap.trace_count;
    alloc_snapshot_free(a, &snap);
    alloc_pool_delta delta;
    CHECK(alloc_pool_restore(a, &state, &delta) == ALLOC_RESTORE_OK);
    alloc_pool_delta_free(&delta);
    CHECK(alloc_take_snapshot(a, 0, &snap) == 0 && snap.trace_count == before + 3);
    const int expect[3] = {ALLOC_TRACE_FREE_REQUESTED, ALLOC_TRACE_FREE_COMPLETED, ALLOC_TRACE_ALLOC};
    for (int i = 0; i < 3 && snap.trace_count == before + 3; i++) {
        const alloc_trace_record *r = &snap.trace[before + (uint64_t)i];
        CHECK(r->action == expect[i] && r->address == (uintptr_t)p && r->size == 4096);
    }
    alloc_snapshot_free(a, &snap);
    alloc_pool_state_free(&state);
    alloc_free(a, p, 0);
    CHECK(alloc_release_pool(a, 0, 5, 0) == 0);
    config.enabled = 0;
    config.clear = 1;
    alloc_history_configure(a, &config);
    finish(a, &ctx);
}

int
main(void)
{
    test_switching_between_two_recordings();
    test_a_state_of_gone_segments_is_refused();
    test_blocks_in_use_on_other_streams();
    test_the_restore_waits_for_the_pools_streams_only();
    test_history_records_the_restore();
    return check_report("test_alloc_pool_state");
}
