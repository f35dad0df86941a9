#define _GNU_SOURCE /* rand_r */
/* Fuzz harness over operation sequences of the allocator and the host pool.
 *
 * LLVMFuzzerTestOneInput reads bytes as operations (malloc, free,
 * record_stream, stream progress, empty cache, a CUDA graph's pool begun,
 * ended, released, checkpointed or restored to its checkpoint; pool
 * acquire/release/empty)
 * and aborts on any broken invariant or corrupted block. Built with clang
 * -fsanitize=fuzzer it is a libFuzzer target; built without (FUZZ_DRIVER),
 * main() feeds it random inputs for a bounded number of seconds, which is
 * what CI runs under ASan/UBSan. */
#include "alloc/alloc.h"
#include "alloc/alloc_host.h"
#include "pool/pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SLOTS 32

typedef struct {
    char *ptr;
    uint64_t size;
    int device;
    unsigned char pattern;
} slot;

static void
require(int cond, const char *what)
{
    if (!cond) {
        fprintf(stderr, "fuzz_ops: invariant broken: %s\n", what);
        abort();
    }
}

/* Marks both ends of a block: enough to see a neighbour write over it,
 * cheap enough to run many inputs. */
static void
fill_pattern(slot *s)
{
    uint64_t edge = s->size < 4096 ? s->size : 4096;
    memset(s->ptr, s->pattern, edge);
    memset(s->ptr + s->size - edge, s->pattern, edge);
}

static void
check_pattern(const slot *s)
{
    if (s->ptr == NULL || s->size == 0)
        return;
    require(s->ptr[0] == (char)s->pattern && s->ptr[s->size - 1] == (char)s->pattern,
            "block contents changed while it was live");
}

/* One size in 16 is past anything a device or host holds: near UINT64_MAX
 * (or, where `past_2_63`, just past 2^63), where rounding must fail, not
 * wrap to a small block. */
static uint64_t
size_from(const uint8_t *data, int past_2_63)
{
    static const uint64_t scales[] = {1, 512, 4096, 65536, 1 << 20, 3 << 20, 12 << 20, 0};
    if ((data[1] & 0xf0) == 0xf0) {
        uint64_t offset = (uint64_t)(data[0] >> 1) * 4093;
        return past_2_63 && (data[0] & 1) ? ((uint64_t)1 << 63) + offset : UINT64_MAX - offset;
    }
    return scales[data[0] & 7] * (1 + (data[1] & 3)) + (uint64_t)(data[0] >> 3);
}

#define ALLOC_CAPACITY (256ull << 20)
#define GRAPH_POOLS 4

/* A graph pool's filter: `filter` is the one stream it takes. */
static int
takes_stream(void *filter, void *stream)
{
    return filter == stream;
}

/* What the fuzzer knows of each graph pool (ids 1..GRAPH_POOLS) per device. */
typedef struct {
    int active;         /* begun, not ended */
    int uses;           /* begun, not released */
    int checkpointed;   /* `state` holds its last checkpoint */
    alloc_pool_state state;
} graph_pool;

/* Restores done and the blocks they freed and allocated, reported at the
 * end (the fuzzer's premise: restores really happen). One thread only. */
static long restores_done, restored_freed, restored_allocated;

/* Sets pool `g` back to its checkpoint, as CUDA graph trees do: the slots
 * whose blocks it freed are forgotten (their memory may be handed out
 * again), the blocks it allocated are adopted by free slots, or freed at
 * once (an output dead since). Every other slot keeps its contents. */
static void
graph_pool_restore(allocator *a, graph_pool *g, slot slots[SLOTS], int device)
{
    alloc_pool_delta delta;
    int result = alloc_pool_restore(a, &g->state, &delta);
    if (g->uses == 0)
        require(result == ALLOC_RESTORE_NO_POOL, "a released pool restored");
    else
        require(result == ALLOC_RESTORE_OK || result == ALLOC_RESTORE_BUSY ||
                    result == ALLOC_RESTORE_SEGMENT_GONE, "a restore refused for no reason");
    if (result != ALLOC_RESTORE_OK)
        return;
    restores_done++;
    restored_freed += (long)delta.freed_count;
    restored_allocated += (long)delta.allocated_count;
    for (uint64_t i = 0; i < delta.freed_count; i++) {
        int owned = 0;
        for (int k = 0; k < SLOTS; k++) {
            if (slots[k].ptr == (char *)delta.freed[i]) {
                slots[k] = (slot){0};
                owned = 1;
            }
        }
        require(owned, "a restore freed a block nobody held");
    }
    for (uint64_t i = 0; i < delta.allocated_count; i++) {
        const alloc_restored_block *b = &delta.allocated[i];
        slot *free_slot = NULL;
        for (int k = 0; k < SLOTS && free_slot == NULL; k++)
            free_slot = slots[k].ptr == NULL ? &slots[k] : NULL;
        if (free_slot == NULL) {
            require(alloc_free(a, b->ptr, device) == 0, "free of a restored block failed");
            continue;
        }
        *free_slot = (slot){b->ptr, b->size, device, (unsigned char)(0x5a + i)};
        fill_pattern(free_slot);
    }
    alloc_pool_delta_free(&delta);
}

/* Begins, ends, releases, checkpoints or restores graph pool
 * `op[1] % GRAPH_POOLS` of a device; the allocator must refuse exactly
 * what torch refuses. */
static void
graph_pool_op(allocator *a, graph_pool pools[2][GRAPH_POOLS], const uint8_t *op,
              alloc_host_stream *stream, slot slots[SLOTS])
{
    int device = op[2] & 1, id = op[1] % GRAPH_POOLS;
    graph_pool *g = &pools[device][id];
    switch ((op[1] / GRAPH_POOLS) % 5) {
    case 3: {
        alloc_pool_state_free(&g->state);
        int result = alloc_pool_checkpoint(a, device, (uint64_t)id + 1, 0, &g->state);
        require(result == (g->uses > 0 ? ALLOC_RESTORE_OK : ALLOC_RESTORE_NO_POOL),
                "checkpoint of a pool in use refused, or of none taken");
        g->checkpointed = result == ALLOC_RESTORE_OK;
        break;
    }
    case 4:
        if (g->checkpointed)
            graph_pool_restore(a, g, slots, device);
        break;
    case 0: {
        int result = alloc_begin_pool(a, device, (uint64_t)id + 1, 0, takes_stream, stream);
        require(!g->active || result == ALLOC_BEGIN_BEING_ALLOCATED_TO, "a pool begun twice");
        /* a released pool with memory left is refused too: not modelled */
        if (result == 0) {
            g->active = 1;
            g->uses++;
        }
        break;
    }
    case 1:
        require(alloc_end_pool(a, device, (uint64_t)id + 1, 0) == (g->active ? 0 : -1),
                "end of a pool not begun");
        g->active = 0;
        break;
    default:
        require(alloc_release_pool(a, device, (uint64_t)id + 1, 0) == (g->uses > 0 ? 0 : -1),
                "release of a pool without uses");
        if (g->uses > 0)
            g->uses--;
        break;
    }
}

static void
run_allocator(const uint8_t *data, size_t size)
{
    alloc_host_ctx ctx;
    alloc_host_init(&ctx, ALLOC_CAPACITY);
    allocator *a = alloc_create(alloc_host_backend(&ctx), 2);
    alloc_host_stream streams[3] = {{0}};
    slot slots[SLOTS] = {{0}};
    graph_pool graphs[2][GRAPH_POOLS] = {{{0}}};
    for (size_t i = 0; i + 3 <= size; i += 3) {
        const uint8_t *op = data + i;
        slot *s = &slots[op[1] % SLOTS];
        alloc_host_stream *stream = &streams[op[2] % 3];
        switch (op[0] % 7) {
        case 0:
        case 1:
            if (s->ptr == NULL) {
                uint64_t bytes = size_from(op + 1, 1);
                int device = op[2] & 1;
                s->ptr = alloc_malloc(a, bytes, device, stream, op[2] >> 4);
                require(s->ptr == NULL || bytes <= ALLOC_CAPACITY, "a huge request served");
                if (s->ptr != NULL) {
                    *s = (slot){s->ptr, bytes, device, (unsigned char)(i & 0xff)};
                    fill_pattern(s);
                }
            }
            break;
        case 2:
            if (s->ptr != NULL) {
                check_pattern(s);
                alloc_host_submit(stream);
                require(alloc_free(a, s->ptr, s->device) == 0, "free of a live block failed");
                require(alloc_free(a, s->ptr, s->device) == -1, "double free accepted");
                *s = (slot){0};
            }
            break;
        case 3:
            if (s->ptr != NULL)
                require(alloc_record_stream(a, s->ptr, stream) == 0, "record_stream failed");
            alloc_host_submit(stream);
            break;
        case 4:
            alloc_host_complete(stream);
            break;
        case 5:
            graph_pool_op(a, graphs, op, &streams[op[2] / 2 % 3], slots);
            break;
        default:
            alloc_empty_cache(a);
            break;
        }
        require(alloc_check(a, 0) == 0 && alloc_check(a, 1) == 0, "allocator invariants");
    }
    for (int i = 0; i < SLOTS; i++) {
        check_pattern(&slots[i]);
        if (slots[i].ptr != NULL)
            alloc_free(a, slots[i].ptr, slots[i].device);
    }
    for (int i = 0; i < 3; i++)
        alloc_host_complete(&streams[i]);
    for (int d = 0; d < 2; d++) {
        for (int id = 0; id < GRAPH_POOLS; id++) {
            graph_pool *g = &graphs[d][id];
            if (g->active)
                require(alloc_end_pool(a, d, (uint64_t)id + 1, 0) == 0, "end of a pool failed");
            for (; g->uses > 0; g->uses--)
                require(alloc_release_pool(a, d, (uint64_t)id + 1, 0) == 0, "release failed");
            alloc_pool_state_free(&g->state);
        }
    }
    alloc_empty_cache(a);
    require(alloc_get_stats(a, 0).reserved_bytes == 0 && alloc_get_stats(a, 1).reserved_bytes == 0,
            "segments left after empty_cache");
    alloc_destroy(a);
    require(ctx.live_bytes == 0, "backend memory leaked");
}

static void
run_pool(const uint8_t *data, size_t size)
{
    pool_host_ctx ctx = {.capacity_bytes = 64u << 20};
    pool *p = pool_create(pool_host_backend(&ctx), (uint64_t)(data[0] & 3) << 23);
    pool_block blocks[SLOTS] = {{0}};
    for (size_t i = 0; i + 3 <= size; i += 3) {
        pool_block *b = &blocks[data[i + 1] % SLOTS];
        switch (data[i] % 4) {
        case 0:
        case 1:
            /* near UINT64_MAX only: the pool has no class for those, while
             * 2^63 would try (and fail) a pageable allocation */
            if (b->ptr == NULL && pool_acquire(p, size_from(data + i + 1, 0), b) == 0) {
                require(b->size >= b->requested && b->size < (64u << 20), "pool block size");
                memset(b->ptr, 0x5a, b->requested < 4096 ? b->requested : 4096);
            }
            break;
        case 2:
            pool_release(p, b);
            break;
        default:
            pool_empty(p);
            break;
        }
        pool_stats st = pool_get_stats(p);
        require(st.bytes_in_use >= st.bytes_requested, "pool accounting");
        require(st.misses == st.host_allocations + st.fallbacks + st.failures, "pool counters");
    }
    for (int i = 0; i < SLOTS; i++)
        pool_release(p, &blocks[i]);
    require(pool_get_stats(p).bytes_in_use == 0, "pool bytes left in use");
    pool_destroy(p);
    require(ctx.live_bytes == 0, "pool memory leaked");
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 4)
        return 0;
    if (data[0] & 1)
        run_pool(data + 1, size - 1);
    else
        run_allocator(data + 1, size - 1);
    return 0;
}

#ifdef FUZZ_DRIVER
int
main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 10.0;
    unsigned first_seed = argc > 2 ? (unsigned)atoi(argv[2]) : (unsigned)time(NULL);
    unsigned seed = first_seed;
    uint8_t buffer[3 * 400 + 1];
    clock_t start = clock();
    long runs = 0;
    while ((double)(clock() - start) / CLOCKS_PER_SEC < seconds) {
        size_t size = 4 + (size_t)(rand_r(&seed) % (sizeof(buffer) - 4));
        for (size_t i = 0; i < size; i++)
            buffer[i] = (uint8_t)rand_r(&seed);
        LLVMFuzzerTestOneInput(buffer, size);
        runs++;
    }
    printf("fuzz_ops: %ld inputs in %.0f s (seed %u), no invariant broken; %ld graph pool "
           "restores (%ld blocks freed, %ld allocated)\n", runs, seconds, first_seed,
           restores_done, restored_freed, restored_allocated);
    return 0;
}
#endif
