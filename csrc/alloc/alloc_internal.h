/* Private to csrc/alloc: the allocator's data structures and the functions
 * its files share. Not a contract for anything outside the folder.
 *
 * The files, one concept each:
 * - alloc.c          the public API (alloc.h): create, malloc, free,
 *                    record_stream, empty_cache, limits, destroy
 * - alloc_blocks.c   blocks and segments: size classes, the free index
 *                    (buckets), best fit, split and coalesce, segments
 *                    taken from and given back to the backend
 * - alloc_streams.c  per-stream state and the events of cross-stream frees
 * - alloc_pools.c    private pools of CUDA graphs (torch's PrivatePool),
 *                    the largest free block, a pointer's segment
 * - alloc_pool_state.c  a pool's checkpointed state and its restore
 *                    (torch's PrivatePoolState, for CUDA graph trees)
 * - alloc_history.c  the trace ring and the snapshot's enumeration
 *                    (alloc_history.h)
 * - alloc_stats.c    the live-pointer table, per-tag, device and per-pool
 *                    statistics, the last out-of-memory report
 * - alloc_check.c    the invariants the tests check (alloc_check())
 *
 * Locking: every function here runs with the device's mutex held (its
 * `dev->lock`), except where it says otherwise.
 *
 * A block is in exactly one state: allocated (in the live-pointer table),
 * pending (freed, waiting for `event_count` events of other streams),
 * deferred (freed after use on other streams during a capture: its events
 * are recorded at the next processing of events with no capture underway;
 * or when an event could not be recorded: recorded again at later mallocs,
 * ever more spaced, and when memory is wanted), or free (in its stream's
 * bucket, `in_index`). Free neighbours inside a segment are always
 * merged. */
#ifndef MATEPOINT_ALLOC_INTERNAL_H
#define MATEPOINT_ALLOC_INTERNAL_H

#include "alloc.h"
#include "alloc_history.h"
#include "common/mp_assert.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define MIN_BLOCK 512u
#define SMALL_REQUEST (1u << 20)        /* at most this goes to the small pool */
#define SMALL_SEGMENT (2u << 20)
#define LARGE_SEGMENT (20u << 20)       /* shared by requests below MID_LIMIT */
#define MID_LIMIT (10u << 20)
#define LARGE_ROUND (2u << 20)
#define LARGE_SPLIT_MIN (1u << 20)      /* large remainders smaller than this stay attached */
#define BUCKETS 64
#define EXTRA_INLINE 2                  /* record_stream streams kept without a malloc */
#define SPARE_EVENTS_MAX 64             /* completed events kept per device for reuse */
#define SPARE_BLOCKS_MAX 64             /* merged-away block nodes kept per device for reuse */
#define UNRECORDED_BACKOFF_MAX (1u << 16)   /* mallocs between tries of a record that fails */

typedef struct segment segment;
typedef struct block block;
typedef struct stream_state stream_state;
typedef struct pending_event pending_event;
typedef struct private_pool private_pool;
typedef struct device_state device_state;

/* A stream a block is used on (alloc_record_stream): its handle and the
 * device it belongs to, which may be another than the block's (a tensor of
 * one GPU read by a kernel of another): its event is made there. */
typedef struct {
    void *stream;
    int device;
} stream_use;

struct block {
    uintptr_t ptr;
    uint64_t size, requested;
    segment *seg;
    block *prev, *next;             /* address neighbours inside the segment */
    block *list_prev, *list_next;   /* free bucket */
    block *map_next;                /* chain of the live-pointer table */
    uint64_t tag;
    stream_use *extra_streams;      /* streams from alloc_record_stream, recorded on at the free:
                                       extra_inline, or malloc'ed past EXTRA_INLINE */
    stream_use extra_inline[EXTRA_INLINE];
    int n_extra;
    int event_count;                /* events of its free not yet seen complete */
    void *context;                  /* the stack it was allocated with (history), or NULL */
    uint8_t allocated, in_index, deferred;
};

/* Blocks of a segment serve only the stream the segment was allocated on
 * (torch's rule): reuse on that stream is ordered by the stream itself,
 * so no event is needed, and no other stream ever waits on it. A private
 * pool's segment is owned by a stream state of that pool (owner->pool):
 * its blocks serve only allocations into that pool. */
struct segment {
    uintptr_t base;
    uint64_t size;
    int small;
    device_state *dev;
    /* blocks, and how many of them are free and their bytes: the segment's
     * share of torch's inactive_split figures (stats_segment_free,
     * stats_segment_blocks) */
    int64_t n_blocks, free_blocks, free_bytes;
    stream_state *owner;
    block *first;
    segment *prev, *next;
};

/* An event recorded at a free on a stream that used the block; once it
 * completed, the node and its event wait among the device's spares for
 * the next such free (torch's event pool), with `b` NULL: events made on
 * the block's device only, as an event records only on streams of the
 * device it was made on. */
struct pending_event {
    void *event;
    int device;                     /* the one the event was made on */
    block *b;
    pending_event *next;
};

/* One stream of a device, in the ordinary cache (pool NULL, on the
 * device's list) or in a private pool (on the pool's list): the free
 * blocks of its segments, and the events frees recorded on it, oldest
 * first (ordinary ones only: events are queued on the stream that used a
 * block, whatever pool the block is in). A stream of another device
 * that used a block of this one holds only events; `device` tells it
 * apart (handle NULL names each device's own legacy stream). `stream` is a key only: nothing
 * is recorded on it after the call that named it returned, so a stream
 * destroyed since does no harm. Freed once it has neither. */
struct stream_state {
    void *stream;
    int device;                     /* the stream's: this device's, but for events */
    private_pool *pool;
    block *buckets[2][BUCKETS];     /* [small][floor(log2 size)] */
    uint64_t segments;
    pending_event *head, *tail;
    stream_state *next;
};

/* A CUDA graph's private pool on one device (torch's PrivatePool), named
 * by torch's MempoolId_t. Being allocated to while `use_pool` is set
 * (alloc_begin_pool to alloc_end_pool); its segments go back to the
 * backend once `use_count` is 0 and they hold no live block; forgotten
 * once it has no segment left and no use. */
struct private_pool {
    uint64_t id_a, id_b;
    uint64_t use_count;             /* begins not released yet */
    int counted_as_capture;         /* being allocated to counts in dev->captures (no marks) */
    uint64_t segments;              /* segments it holds (torch's cudaMalloc_count) */
    stream_state *streams;          /* the free blocks of its segments, per stream */
    alloc_pool_filter use_pool;     /* non-NULL while being allocated to */
    void *filter;
    private_pool *next;
};

typedef struct {
    uint64_t tag, live_bytes, peak_bytes, allocations;
    int used;
} tag_slot;

struct device_state {
    pthread_mutex_t lock;
    int index;
    stream_state *streams;          /* most recently allocated on first */
    segment *segments;
    block **map;                    /* live blocks by pointer */
    uint64_t map_size, map_count;
    tag_slot *tags;
    uint64_t tag_capacity, tag_count;
    /* the slot of the last tag counted (a region allocates many blocks
     * in a row), NULL once the table moved */
    tag_slot *tag_last;
    alloc_stats stats;
    alloc_device_stats torch;       /* torch's figures (alloc.h), kept with `stats` */
    alloc_pool_figures *pool_figures;   /* torch's reserved bytes per private pool */
    uint64_t pool_figure_count, pool_figure_capacity;
    uint64_t limit;                 /* cap on reserved bytes, UINT64_MAX: none */
    double fraction;                /* of the device's memory, torch's (1.0: none set) */
    uint64_t events_pending;        /* queued on its streams: 0 lets a malloc skip them */
    pending_event *spare_events;    /* completed, ready to be recorded again */
    uint64_t spare_count;
    /* block nodes merged away, ready for the next split (linked by
     * list_next): a split and a merge happen on most malloc+free pairs,
     * and glibc serves a node of this size from its slower bins */
    block *spare_blocks;
    uint64_t spare_block_count;
    private_pool *pools;            /* the one begun last first (torch asks LIFO) */
    block *deferred;                /* deferred blocks, linked by list_next */
    /* deferred blocks whose event could not be recorded (the failure was
     * reported), linked by list_next: tried again at the next malloc, then
     * after gaps that double while they fail (unrecorded_tick), and when
     * memory is wanted (segment_release_cached) */
    block *unrecorded;
    uint64_t unrecorded_skip, unrecorded_backoff;   /* mallocs to the next try, and the step */
    uint64_t active_pools;          /* pools being allocated to */
    /* captures underway, during which no event is queried or waited for
     * and no memory freed: those torch marks (torch 2.13 and later tell a
     * capture apart from pools being allocated to outside one, as under
     * use_mem_pool), else every pool being allocated to */
    uint64_t captures;
    alloc_history_config history;   /* a copy, made under this lock (alloc_history.c) */
    alloc_trace_record *ring;       /* the newest ring_count records from ring_head */
    uint64_t ring_capacity, ring_head, ring_count;
};

struct allocator {
    alloc_backend backend;
    int device_count;
    device_state *devices;
    uint64_t id;                    /* unique in the process: whose failure a thread's is */
    pthread_mutex_t history_lock;   /* guards history; taken after no device lock */
    alloc_history_config history;
    _Atomic int history_when;       /* ALLOC_CONTEXT_* of gathering, 0: none (no lock) */
    _Atomic int capture_marks;      /* the caller marks captures (alloc_use_capture_marks) */
};

/* The device's state; NULL when `device` is out of range (no lock).
 * Inline: on every malloc and free. */
static inline device_state *
device_of(allocator *a, int device)
{
    return device >= 0 && device < a->device_count ? &a->devices[device] : NULL;
}

/* The stream states of the ordinary cache (`pool` NULL) or of a pool. */
static inline stream_state **
stream_list(device_state *dev, private_pool *pool)
{
    return pool != NULL ? &pool->streams : &dev->streams;
}

/* The state of `stream` of `device` in `list`, moved to the front: a
 * device mostly allocates on one or two streams. NULL when the list has
 * none for it. Inline: on every malloc. */
static inline stream_state *
stream_find_in(stream_state **list, void *stream, int device)
{
    for (stream_state **link = list; *link != NULL; link = &(*link)->next) {
        stream_state *s = *link;
        if (s->stream != stream || s->device != device)
            continue;
        *link = s->next;
        s->next = *list;
        *list = s;
        return s;
    }
    return NULL;
}

/* The state of `stream` of `device` in the ordinary cache of `dev`, or NULL. */
static inline stream_state *
stream_find(device_state *dev, void *stream, int device)
{
    return stream_find_in(&dev->streams, stream, device);
}

/* ---- alloc.c ------------------------------------------------------------ */

/* A block just freed (taken from the live-pointer table): queued behind
 * events of the streams it was used on, else free at once; `context` is
 * the free's stack (NULL: none), for the record of its completion. */
void block_retire(allocator *a, device_state *dev, block *b, void *context);

/* ---- alloc_history.c ---------------------------------------------------- */

/* A new context for an event of a block tagged `tag` when history
 * gathers for events of `at_least` (ALLOC_CONTEXT_STATE: allocations,
 * ALLOC_CONTEXT_ALL: frees too), else NULL. No lock held: it may take the
 * GIL. history_gather_now() asks without looking at `at_least`. */
void *history_gather_now(allocator *a, uint64_t tag);

/* Inline: with history off, one atomic load and a predictable branch. */
static inline void *
history_gather(allocator *a, int at_least, uint64_t tag)
{
    if (__builtin_expect(atomic_load(&a->history_when) < at_least, 1))
        return NULL;
    return history_gather_now(a, tag);
}
/* Adds a record to the ring of a recording device (history_record), of
 * memory of `pool` (NULL: the ordinary cache); takes its own reference to
 * `context`. */
void history_append(device_state *dev, int action, uint64_t address, uint64_t size,
                    void *stream, const private_pool *pool, uint64_t tag, void *context);
/* The record of a request of `rounded` bytes on `stream` into `pool` that
 * got nothing: the device's free bytes as the backend tells them. */
void history_record_oom(allocator *a, device_state *dev, uint64_t rounded, void *stream,
                        const private_pool *pool, uint64_t tag, void *context);

/* Gives up one reference to `context` (NULL: nothing). Inline: with
 * history off every malloc and free passes here with NULL. */
static inline void
history_drop(device_state *dev, void *context)
{
    if (context != NULL && dev->history.release != NULL)
        dev->history.release(context);
}

/* The context the record of a free of `b` carries, as torch's: the free's
 * own (`context`, gathered when frees keep a stack), else the block's from
 * its allocation; none unless records keep stacks (ALLOC_CONTEXT_ALLOC and
 * up). Inline: on every free. */
static inline void *
history_free_context(const device_state *dev, const block *b, void *context)
{
    if (dev->history.when < ALLOC_CONTEXT_ALLOC)
        return NULL;
    return context != NULL ? context : b->context;
}

/* Adds a record (ALLOC_TRACE_*) of memory of `owner`'s segments when
 * recording. Inline: one predictable branch when history is off. */
static inline void
history_record(device_state *dev, int action, uint64_t address, uint64_t size,
               const stream_state *owner, uint64_t tag, void *context)
{
    if (__builtin_expect(dev->history.enabled != 0, 0))
        history_append(dev, action, address, size, owner->stream, owner->pool, tag, context);
}

/* ---- alloc_blocks.c ----------------------------------------------------- */
/* The bucket a free block of `b`'s size and stream lives in. */
block **block_bucket(block *b);
/* A block becomes free: merged with its free neighbours, indexed. */
void block_insert_free(block *b);
/* Best fit among the free blocks of the segments of `stream` (of `device`)
 * in `list` (a stream_list()); NULL if none. */
block *block_find_free(stream_state **list, uint64_t size, int small, void *stream, int device);
/* Takes `b` for `size` bytes, splitting the rest off as a free block;
 * 0, or -1 without memory (then `b` is indexed again). */
int block_take(block *b, uint64_t size);
/* Takes free block `b` (indexed or not) for exactly `size` bytes, the
 * rest, if any, split off as its next block, neither indexed nor merged
 * (alloc_pool_state.c lays a segment out block by block). Needs a spare
 * node when it splits (blocks_reserve_spares); 0, or -1 without one. */
int block_carve(block *b, uint64_t size);
/* Keeps at least `count` spare block nodes on `dev`; 0, or -1 without memory. */
int blocks_reserve_spares(device_state *dev, uint64_t count);
/* The size of the segment a request of `rounded` bytes takes (0: none can
 * be represented). */
uint64_t segment_size_for(uint64_t rounded);
/* A new segment of `stream` for a request of `rounded` bytes, in `pool`
 * (NULL: the ordinary cache), holding one free block (not indexed); on
 * out-of-memory it frees what it may (segment_release_cached) and retries
 * once, when no capture is underway. NULL when out of memory or on a
 * backend error: then *status says which (ALLOC_OUT_OF_MEMORY,
 * ALLOC_ERROR). */
block *segment_new(allocator *a, device_state *dev, uint64_t rounded, void *stream,
                   private_pool *pool, int *status);
/* 1 when no block of `seg` is live or pending. */
int segment_all_free(const segment *seg);
/* Gives `seg`, all free, back to the backend. */
void segment_release(allocator *a, device_state *dev, segment *seg);

/* Which segments with no live or pending block segment_release_free gives
 * back: those of the ordinary cache and of released pools, or every one
 * (alloc_destroy). */
typedef enum { RELEASE_CACHE, RELEASE_ALL } release_scope;
void segment_release_free(allocator *a, device_state *dev, release_scope scope);
/* Tries the unrecorded blocks' records again, waits for pending frees and
 * releases every cached segment of the ordinary cache and of released
 * pools (emptyCache, and the retry after out of memory); while a capture
 * is underway nothing, as torch (a wait or a cudaFree would break it). */
void segment_release_cached(allocator *a, device_state *dev);

/* ---- alloc_streams.c ---------------------------------------------------- */

/* The state of `stream` of `device` in `pool` (NULL: the ordinary cache),
 * made when missing; NULL without memory. */
stream_state *stream_get(device_state *dev, private_pool *pool, void *stream, int device);
/* Frees `s` when it has neither segments nor pending events. */
void stream_drop_if_unused(device_state *dev, stream_state *s);
/* Records the deferred blocks' events, then retires completed events of
 * every stream (all of them, waiting, if `wait`) and forgets the streams
 * left with nothing. No capture may be underway. */
void events_process(allocator *a, device_state *dev, int wait);
/* Retires the events of `s` from its oldest through `last`, known
 * complete (`last` waited for: the events of one stream complete in the
 * order they were recorded), with no query. */
void events_retire_through(allocator *a, device_state *dev, stream_state *s,
                           const pending_event *last);
/* Records an event on each extra stream of `b` and queues it there; -1
 * (nothing queued) when one could not be made. */
int events_insert(allocator *a, device_state *dev, block *b);
/* Frees a chain of events not queued on any stream. */
void events_free_chain(allocator *a, pending_event *e);
/* Frees the device's spare events (memory pressure, empty_cache). */
void events_free_spares(allocator *a, device_state *dev);
/* Forgets the streams `b` was used on (after its free recorded on them). */
void block_forget_streams(block *b);

/* ---- alloc_pools.c ------------------------------------------------------ */

/* The pool of `dev` named (pool_a, pool_b), or NULL. */
private_pool *pool_find(device_state *dev, uint64_t pool_a, uint64_t pool_b);
/* The pool an allocation on `stream` goes to while pools are being
 * allocated to: the one begun last whose filter takes the stream; NULL
 * for the ordinary cache. */
private_pool *pool_for_stream(device_state *dev, void *stream);
/* 1 when the segments of `pool` may go back to the backend once free: no
 * use is left and nothing allocates to it. */
int pool_released(const private_pool *pool);
/* Forgets released pools left without segments. */
void pools_forget_done(device_state *dev);
/* Frees every pool's books (alloc_destroy; their segments are gone). */
void pools_free_all(device_state *dev);
/* One capture fewer on `dev`: once none is left, the deferred blocks
 * record their events. */
void captures_end_one(allocator *a, device_state *dev);
/* A block used on other streams freed while a capture is underway (an
 * event recorded now on a capturing stream could never be queried): its
 * events wait for the next processing of events with no capture underway
 * (torch's needs_events_deferred_until_no_capture). */
void block_defer(device_state *dev, block *b);
/* A freed block whose event could not be recorded waits among the
 * unrecorded blocks. */
void block_defer_unrecorded(device_state *dev, block *b);
/* Records the deferred blocks' events (or frees them); no capture may be
 * underway. A block whose record fails is unrecorded. */
void deferred_process(allocator *a, device_state *dev);
/* The unrecorded blocks are deferred again: the next processing of events
 * tries their records once more. */
void unrecorded_retry(device_state *dev);
/* A malloc with unrecorded blocks and no capture underway: tries their
 * records again when due, at the next malloc and then after gaps that
 * double each time they fail again (up to UNRECORDED_BACKOFF_MAX). A
 * failure that lasts (a stream destroyed since, or one of another device
 * where no adapter passes its device) costs a try and its report a
 * doubling, not a malloc; one that passes is tried again soon. */
void unrecorded_tick(allocator *a, device_state *dev);
/* Frees the spare block nodes of `dev` (empty_cache, destroy). */
void blocks_free_spares(device_state *dev);

/* ---- alloc_stats.c ------------------------------------------------------ */

/* The live-pointer table: 0, or -1 without memory. */
int map_insert(device_state *dev, block *b);
block *map_take(device_state *dev, uintptr_t ptr);
/* Grows the table so that `count` live blocks fit without growing; 0, or
 * -1 without memory. */
int map_reserve(device_state *dev, uint64_t count);
block *map_find(device_state *dev, uintptr_t ptr);
/* Counts a block handed out for `size` requested bytes, under `tag`. */
void stats_account_malloc(device_state *dev, block *b, uint64_t size, uint64_t tag);
/* Counts the free of an allocated block. */
void stats_account_free(device_state *dev, block *b);
/* Counts a segment of `size` bytes taken from, or given back to, the backend. */
void stats_segment_added(device_state *dev, segment *seg);
void stats_segment_released(device_state *dev, segment *seg);
/* Counts a failed request of `size` bytes (`rounded`, 0: too large to
 * round) and keeps its numbers, the calling thread's, for alloc_last_oom(). */
void stats_record_oom(allocator *a, device_state *dev, uint64_t size, uint64_t rounded);
/* A freed block stops being active: at its free (`context`: the free's
 * stack, or NULL), or once the events of the other streams that used it
 * completed (NULL). */
void stats_block_inactive(device_state *dev, block *b, void *context);
/* A retry after releasing the cache (torch's num_alloc_retries). */
void stats_count_retry(device_state *dev);

/* torch's figures change on every malloc, free, split and merge: the
 * updates below are inline (headers, not LTO, decide that) and touch one
 * pool's stat and the aggregate's, by index, without a loop. A peak moves
 * only where `current` rises. */
static inline void
stat_increase(alloc_stat *stat, int64_t amount)
{
    stat->current += amount;
    stat->allocated += amount;
    if (stat->current > stat->peak)
        stat->peak = stat->current;
}

static inline void
stat_decrease(alloc_stat *stat, int64_t amount)
{
    MP_ASSERT(stat->current >= amount);
    stat->current -= amount;
    stat->freed += amount;
}

/* Index of a segment's pool in alloc_device_stats.arrays. */
static inline int
stat_pool(const segment *seg)
{
    return seg->small ? ALLOC_POOL_SMALL : ALLOC_POOL_LARGE;
}

/* Adds `amount` >= 0 to `kind` of `pool` and of all pools. */
static inline void
stat_add(device_state *dev, int kind, int pool, int64_t amount)
{
    MP_ASSERT(amount >= 0);
    stat_increase(&dev->torch.arrays[kind][ALLOC_POOL_ALL], amount);
    stat_increase(&dev->torch.arrays[kind][pool], amount);
}

/* Takes `amount` >= 0 from `kind` of `pool` and of all pools. */
static inline void
stat_sub(device_state *dev, int kind, int pool, int64_t amount)
{
    MP_ASSERT(amount >= 0);
    stat_decrease(&dev->torch.arrays[kind][ALLOC_POOL_ALL], amount);
    stat_decrease(&dev->torch.arrays[kind][pool], amount);
}

/* A free block of `bytes` joins (`joins`) or leaves the free blocks of
 * `seg`: torch's inactive_split counts it while `seg` has more than one
 * block. */
static inline void
stats_segment_free(segment *seg, int joins, int64_t bytes)
{
    device_state *dev = seg->dev;
    int pool = stat_pool(seg);
    if (joins) {
        seg->free_blocks++;
        seg->free_bytes += bytes;
        if (seg->n_blocks > 1) {
            stat_add(dev, ALLOC_STAT_INACTIVE_SPLIT, pool, 1);
            stat_add(dev, ALLOC_STAT_INACTIVE_SPLIT_BYTES, pool, bytes);
        }
    } else {
        seg->free_blocks--;
        seg->free_bytes -= bytes;
        MP_ASSERT(seg->free_blocks >= 0 && seg->free_bytes >= 0);
        if (seg->n_blocks > 1) {
            stat_sub(dev, ALLOC_STAT_INACTIVE_SPLIT, pool, 1);
            stat_sub(dev, ALLOC_STAT_INACTIVE_SPLIT_BYTES, pool, bytes);
        }
    }
}

/* `seg` gains (split) or loses (merge) one block. Only the step between
 * one and two blocks changes whether its free blocks are inactive split,
 * so no neighbour is walked: the segment keeps their count and bytes. */
static inline void
stats_segment_blocks(segment *seg, int gains)
{
    device_state *dev = seg->dev;
    int pool = stat_pool(seg);
    if (gains) {
        if (++seg->n_blocks == 2) {
            stat_add(dev, ALLOC_STAT_INACTIVE_SPLIT, pool, seg->free_blocks);
            stat_add(dev, ALLOC_STAT_INACTIVE_SPLIT_BYTES, pool, seg->free_bytes);
        }
    } else {
        MP_ASSERT(seg->n_blocks >= 2);
        if (--seg->n_blocks == 1) {
            stat_sub(dev, ALLOC_STAT_INACTIVE_SPLIT, pool, seg->free_blocks);
            stat_sub(dev, ALLOC_STAT_INACTIVE_SPLIT_BYTES, pool, seg->free_bytes);
        }
    }
}

#endif
