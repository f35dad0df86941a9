/* A private pool's checkpointed state and its restore (torch's
 * PrivatePoolState, getCheckpointState and setCheckpointPoolState, for
 * torch.compile's CUDA graph trees). Contract: alloc.h; the structures:
 * alloc_internal.h.
 *
 * Why: a graph's replay writes its outputs into the addresses its
 * recording was handed, but hands nothing out, so after replays the
 * allocator's books no longer say which of the pool's blocks hold live
 * outputs. Before a new recording the tree sets the pool back to the
 * state taken after the recording it replayed last, whose live blocks are
 * exactly the outputs that may still be alive; a new recording then never
 * lands on them. */
#include "alloc_internal.h"

#include <stdlib.h>

/* How many segments, blocks and live blocks `pool` holds in `dev`. */
static void
count_pool(const device_state *dev, const private_pool *pool, uint64_t *segments,
           uint64_t *blocks, uint64_t *live)
{
    *segments = *blocks = *live = 0;
    for (const segment *seg = dev->segments; seg != NULL; seg = seg->next) {
        if (seg->owner->pool != pool)
            continue;
        (*segments)++;
        for (const block *b = seg->first; b != NULL; b = b->next) {
            (*blocks)++;
            *live += b->allocated;
        }
    }
}

/* Appends the blocks of `seg` to `out`: allocated ones as handed out, each
 * run of others (free, or freed and pending) as one entry of free space. */
static void
record_segment(const segment *seg, alloc_pool_state *out)
{
    alloc_segment_state *s = &out->segments[out->segment_count++];
    *s = (alloc_segment_state){.base = seg->base, .size = seg->size,
                               .stream = seg->owner->stream, .first_block = out->block_count};
    for (const block *b = seg->first; b != NULL; b = b->next) {
        alloc_block_state *last = s->block_count ? &out->blocks[out->block_count - 1] : NULL;
        if (!b->allocated && last != NULL && !last->allocated) {
            last->size += b->size;
            continue;
        }
        out->blocks[out->block_count++] = (alloc_block_state){
            .ptr = b->ptr, .size = b->size, .allocated = b->allocated,
            .requested = b->allocated ? b->requested : 0, .tag = b->allocated ? b->tag : 0};
        s->block_count++;
    }
}

int
alloc_pool_checkpoint(allocator *a, int device, uint64_t pool_a, uint64_t pool_b,
                      alloc_pool_state *out)
{
    *out = (alloc_pool_state){.device = device, .pool_a = pool_a, .pool_b = pool_b};
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return ALLOC_RESTORE_NO_POOL;
    pthread_mutex_lock(&dev->lock);
    int result = ALLOC_RESTORE_NO_POOL;
    private_pool *pool = pool_find(dev, pool_a, pool_b);
    if (pool == NULL || pool->use_count == 0)
        goto done;
    uint64_t segments, blocks, live;
    count_pool(dev, pool, &segments, &blocks, &live);
    result = ALLOC_RESTORE_NO_MEMORY;
    out->segments = calloc(segments ? segments : 1, sizeof(*out->segments));
    out->blocks = calloc(blocks ? blocks : 1, sizeof(*out->blocks));
    if (out->segments == NULL || out->blocks == NULL)
        goto done;
    for (const segment *seg = dev->segments; seg != NULL; seg = seg->next) {
        if (seg->owner->pool == pool)
            record_segment(seg, out);
    }
    result = ALLOC_RESTORE_OK;
done:
    pthread_mutex_unlock(&dev->lock);
    if (result != ALLOC_RESTORE_OK)
        alloc_pool_state_free(out);
    return result;
}

void
alloc_pool_state_free(alloc_pool_state *state)
{
    free(state->segments);
    free(state->blocks);
    *state = (alloc_pool_state){.device = state->device, .pool_a = state->pool_a,
                                .pool_b = state->pool_b};
}

void
alloc_pool_delta_free(alloc_pool_delta *delta)
{
    free(delta->freed);
    free(delta->allocated);
    *delta = (alloc_pool_delta){0};
}

/* The pool's segment at `base`, or NULL. Lock held. */
static segment *
pool_segment_at(device_state *dev, const private_pool *pool, uint64_t base)
{
    for (segment *seg = dev->segments; seg != NULL; seg = seg->next) {
        if (seg->owner->pool == pool && seg->base == base)
            return seg;
    }
    return NULL;
}

/* 1 when the state's blocks of `s` tile a segment of its size. */
static int
segment_state_whole(const alloc_pool_state *state, const alloc_segment_state *s)
{
    if (s->block_count == 0 || s->first_block + s->block_count > state->block_count)
        return 0;
    uint64_t at = s->base;
    for (uint64_t i = 0; i < s->block_count; i++) {
        const alloc_block_state *b = &state->blocks[s->first_block + i];
        if (b->ptr != at || b->size == 0 || b->size % MIN_BLOCK != 0 ||
            b->size > s->base + s->size - at)
            return 0;
        at += b->size;
    }
    return at == s->base + s->size;
}

/* 1 when the work of `use` may be waited for now: its stream is not being
 * captured (an event recorded on it would join the capture and could not
 * be waited for). */
static int
stream_waitable(allocator *a, const stream_use *use)
{
    if (a->backend.stream_capturing == NULL)
        return 1;
    return a->backend.stream_capturing(a->backend.ctx, use->device, use->stream) == 0;
}

/* What a restore needs, checked before anything changes. Lock held.
 * Other pools being allocated to (a capture elsewhere, a use_mem_pool
 * context) do not matter: the frees pending on other streams had their
 * events recorded outside any capture (alloc_pools.c defers the others),
 * and waiting for those is allowed during a capture (relaxed mode,
 * alloc_cuda.c); only a live block's stream now capturing cannot be
 * waited for. */
static int
restore_check(allocator *a, device_state *dev, private_pool *pool, const alloc_pool_state *state)
{
    if (pool == NULL || pool->use_count == 0)
        return ALLOC_RESTORE_NO_POOL;
    for (uint64_t i = 0; i < state->segment_count; i++) {
        const alloc_segment_state *s = &state->segments[i];
        segment *seg = pool_segment_at(dev, pool, s->base);
        if (seg == NULL || seg->size != s->size || !segment_state_whole(state, s))
            return ALLOC_RESTORE_SEGMENT_GONE;
    }
    for (const segment *seg = dev->segments; seg != NULL; seg = seg->next) {
        if (seg->owner->pool != pool)
            continue;
        for (const block *b = seg->first; b != NULL; b = b->next) {
            /* a deferred block has no event to wait on before the capture's end */
            if (b->deferred)
                return ALLOC_RESTORE_BUSY;
            for (int i = 0; b->allocated && i < b->n_extra; i++) {
                if (!stream_waitable(a, &b->extra_streams[i]))
                    return ALLOC_RESTORE_BUSY;
            }
        }
    }
    return ALLOC_RESTORE_OK;
}

/* Waits for the work of `use`'s stream so far: an event recorded there
 * now. Lock held. */
static int
wait_stream(allocator *a, const stream_use *use)
{
    void *event = NULL;
    if (a->backend.event_record(a->backend.ctx, use->device, use->stream, &event) != ALLOC_OK)
        return -1;
    int status = a->backend.event_wait(a->backend.ctx, event);
    a->backend.event_free(a->backend.ctx, event);
    return status == ALLOC_OK ? 0 : -1;
}

/* The newest event queued on `s` for a block of `pool`, or NULL. */
static const pending_event *
last_pool_event(const stream_state *s, const private_pool *pool)
{
    const pending_event *last = NULL;
    for (const pending_event *e = s->head; e != NULL; e = e->next) {
        if (e->b->seg->owner->pool == pool)
            last = e;
    }
    return last;
}

/* Waits for the other streams that used the pool's blocks, and for them
 * only (never the whole device): those a live block was used on
 * (record_stream), then on each stream the newest event of a pending
 * block of the pool. Every wait happens before anything changes: -1 (a
 * wait failed, reported) leaves the allocator as it was. Then the
 * pending blocks retire. Lock held. */
static int
restore_wait(allocator *a, device_state *dev, private_pool *pool)
{
    for (const segment *seg = dev->segments; seg != NULL; seg = seg->next) {
        for (const block *b = seg->first; b != NULL && seg->owner->pool == pool; b = b->next) {
            for (int i = 0; b->allocated && i < b->n_extra; i++) {
                if (wait_stream(a, &b->extra_streams[i]) < 0)
                    return -1;
            }
        }
    }
    for (const stream_state *s = dev->streams; s != NULL; s = s->next) {
        const pending_event *last = last_pool_event(s, pool);
        if (last != NULL && a->backend.event_wait(a->backend.ctx, last->event) != ALLOC_OK)
            return -1;
    }
    for (stream_state *s = dev->streams, *next; s != NULL; s = next) {
        next = s->next;
        const pending_event *last = last_pool_event(s, pool);
        if (last != NULL) {
            events_retire_through(a, dev, s, last);
            stream_drop_if_unused(dev, s);
        }
    }
    return 0;
}

/* Frees the block at `ptr`, live in the pool, at once (its other streams'
 * uses waited for). Lock held. */
static void
free_now(device_state *dev, uintptr_t ptr)
{
    block *b = map_take(dev, ptr);
    MP_ASSERT(b != NULL && b->seg->owner->pool != NULL);
    stats_account_free(dev, b);
    history_record(dev, ALLOC_TRACE_FREE_REQUESTED, b->ptr, b->requested, b->seg->owner, b->tag,
                   history_free_context(dev, b, NULL));
    block_forget_streams(b);
    stats_block_inactive(dev, b, NULL);
    block_insert_free(b);
}

/* Lays out `seg`, all free, as `s` says; the allocated blocks go to
 * `delta`. Memory was reserved (nodes, table). Lock held. */
static void
lay_out_segment(device_state *dev, segment *seg, const alloc_pool_state *state,
                const alloc_segment_state *s, alloc_pool_delta *delta)
{
    MP_ASSERT(seg->first->next == NULL && seg->first->in_index);
    block *b = seg->first;
    for (uint64_t i = 0; i < s->block_count; i++, b = b->next) {
        const alloc_block_state *want = &state->blocks[s->first_block + i];
        int carved = block_carve(b, want->size);
        MP_ASSERT(carved == 0 && b->ptr == want->ptr);
        (void)carved;
        if (!want->allocated)
            continue;
        int inserted = map_insert(dev, b);
        MP_ASSERT(inserted == 0);
        (void)inserted;
        stats_account_malloc(dev, b, want->requested, want->tag);
        history_record(dev, ALLOC_TRACE_ALLOC, b->ptr, want->requested, seg->owner, want->tag,
                       NULL);
        delta->allocated[delta->allocated_count++] =
            (alloc_restored_block){(void *)b->ptr, b->size, seg->owner->stream};
    }
    MP_ASSERT(b == NULL);
    /* then the free space: never two runs side by side, so nothing merges */
    for (b = seg->first; b != NULL; b = b->next) {
        if (!b->allocated)
            block_insert_free(b);
    }
}

/* Reserves what the restore allocates, so that it cannot fail halfway:
 * the delta's lists, block nodes for the splits, the live-pointer table's
 * room. Lock held. */
static int
restore_reserve(device_state *dev, private_pool *pool, const alloc_pool_state *state,
                alloc_pool_delta *delta)
{
    uint64_t segments, blocks, live, allocated = 0;
    count_pool(dev, pool, &segments, &blocks, &live);
    for (uint64_t i = 0; i < state->block_count; i++)
        allocated += state->blocks[i].allocated != 0;
    delta->freed = calloc(live ? live : 1, sizeof(*delta->freed));
    delta->allocated = calloc(allocated ? allocated : 1, sizeof(*delta->allocated));
    if (delta->freed == NULL || delta->allocated == NULL)
        return -1;
    /* each segment, all free once its live blocks went, is one block:
     * laying out its s->block_count blocks (at least one each,
     * segment_state_whole) takes s->block_count - 1 splits */
    MP_ASSERT(state->block_count >= state->segment_count);
    if (blocks_reserve_spares(dev, state->block_count - state->segment_count) < 0)
        return -1;
    return map_reserve(dev, dev->map_count - live + allocated);
}

int
alloc_pool_restore(allocator *a, const alloc_pool_state *state, alloc_pool_delta *out)
{
    *out = (alloc_pool_delta){0};
    device_state *dev = device_of(a, state->device);
    if (dev == NULL)
        return ALLOC_RESTORE_NO_POOL;
    pthread_mutex_lock(&dev->lock);
    private_pool *pool = pool_find(dev, state->pool_a, state->pool_b);
    int result = restore_check(a, dev, pool, state);
    if (result == ALLOC_RESTORE_OK && restore_reserve(dev, pool, state, out) < 0)
        result = ALLOC_RESTORE_NO_MEMORY;
    if (result == ALLOC_RESTORE_OK && restore_wait(a, dev, pool) < 0)
        result = ALLOC_RESTORE_WAIT_FAILED;
    if (result != ALLOC_RESTORE_OK)
        goto done;
    /* every live block of the pool goes (its pointer noted first: freeing
     * merges neighbours, so the walk restarts from the table) */
    for (segment *seg = dev->segments; seg != NULL; seg = seg->next) {
        for (block *b = seg->first; b != NULL && seg->owner->pool == pool; b = b->next) {
            if (b->allocated)
                out->freed[out->freed_count++] = (void *)b->ptr;
        }
    }
    for (uint64_t i = 0; i < out->freed_count; i++)
        free_now(dev, (uintptr_t)out->freed[i]);
    for (uint64_t i = 0; i < state->segment_count; i++) {
        const alloc_segment_state *s = &state->segments[i];
        lay_out_segment(dev, pool_segment_at(dev, pool, s->base), state, s, out);
    }
done:
    pthread_mutex_unlock(&dev->lock);
    if (result != ALLOC_RESTORE_OK)
        alloc_pool_delta_free(out);
    return result;
}

int
alloc_pool_live_is(allocator *a, int device, uint64_t pool_a, uint64_t pool_b,
                   void *const *ptrs, uint64_t count)
{
    device_state *dev = device_of(a, device);
    if (dev == NULL)
        return ALLOC_RESTORE_NO_POOL;
    pthread_mutex_lock(&dev->lock);
    private_pool *pool = pool_find(dev, pool_a, pool_b);
    int result = ALLOC_RESTORE_NO_POOL;
    if (pool != NULL) {
        uint64_t segments, blocks, live;
        count_pool(dev, pool, &segments, &blocks, &live);
        result = live == count;
        for (uint64_t i = 0; i < count && result; i++) {
            const block *b = map_find(dev, (uintptr_t)ptrs[i]);
            result = b != NULL && b->seg->owner->pool == pool;
        }
    }
    pthread_mutex_unlock(&dev->lock);
    return result;
}
