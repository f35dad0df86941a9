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

#include <stddef.h>
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
    /* waits for the event: ALLOC_OK, or ALLOC_ERROR (reported; the work
     * it stands for may still run) */
    int (*event_wait)(void *ctx, void *event);
    void (*event_free)(void *ctx, void *event);
    /* optional, NULL: no stream ever captures. 1 when `stream` of `device`
     * is being captured into a CUDA graph (no event recorded on it could be
     * waited for), 0 when not, ALLOC_ERROR when that could not be asked */
    int (*stream_capturing)(void *ctx, int device, void *stream);
    /* optional, NULL: unknown. The device's free and total bytes (a trace
     * record of out of memory carries the free ones): ALLOC_OK or ALLOC_ERROR */
    int (*mem_info)(void *ctx, int device, uint64_t *free_bytes, uint64_t *total_bytes);
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

/* An allocation's tag: the checkpointed region (0: outside any) above two
 * bits of phase. The one encoding: matepoint._C makes tags and decodes them
 * for memory_stats(), the torch adapter names them in snapshots. */
enum { TAG_OTHER = 0, TAG_FORWARD = 1, TAG_RECOMPUTE = 2, TAG_PHASE_BITS = 2 };

static inline uint64_t
alloc_region_tag(uint64_t region, int phase)
{
    return region << TAG_PHASE_BITS | (uint64_t)phase;
}

static inline uint64_t
alloc_tag_region(uint64_t tag)
{
    return tag >> TAG_PHASE_BITS;
}

/* "other", "forward" or "recompute" */
static inline const char *
alloc_tag_phase(uint64_t tag)
{
    /* by TAG_OTHER, TAG_FORWARD, TAG_RECOMPUTE (3 is unused); positional:
     * this header is C++'s too (torch_adapter.cpp) */
    static const char *const names[1 << TAG_PHASE_BITS] = {"other", "forward", "recompute",
                                                           "other"};
    return names[tag & ((1u << TAG_PHASE_BITS) - 1)];
}

/* torch's statistics model (c10's DeviceStats), kept beside alloc_stats so
 * that torch.cuda.memory_stats() answers from this allocator. A stat is an
 * amount now (`current`), its highest since the last peak reset (`peak`),
 * and what was added (`allocated`) and taken (`freed`) since the last reset
 * of accumulated counts. Pools as torch's:
 * the small pool serves requests of at most 1 MiB from 2 MiB segments.
 * "active": allocated, or freed but still used by another stream (its
 * events pending); "inactive split": a free block of a segment holding
 * more than one block (cannot be given back to the device). */
typedef struct {
    int64_t current, peak, allocated, freed;
} alloc_stat;

enum { ALLOC_POOL_ALL, ALLOC_POOL_SMALL, ALLOC_POOL_LARGE, ALLOC_POOLS };
enum {
    ALLOC_STAT_ALLOCATION, ALLOC_STAT_SEGMENT, ALLOC_STAT_ACTIVE, ALLOC_STAT_INACTIVE_SPLIT,
    ALLOC_STAT_ALLOCATED_BYTES, ALLOC_STAT_RESERVED_BYTES, ALLOC_STAT_ACTIVE_BYTES,
    ALLOC_STAT_INACTIVE_SPLIT_BYTES, ALLOC_STAT_REQUESTED_BYTES, ALLOC_STAT_ARRAYS
};
enum { ALLOC_STAT_CURRENT, ALLOC_STAT_PEAK, ALLOC_STAT_ALLOCATED, ALLOC_STAT_FREED, ALLOC_STAT_FIELDS };

typedef struct {
    alloc_stat arrays[ALLOC_STAT_ARRAYS][ALLOC_POOLS];
    alloc_stat oversize_allocations, oversize_segments;   /* always 0: no max_split_size */
    int64_t num_alloc_retries, num_ooms, num_sync_all_streams;
    int64_t num_device_alloc, num_device_free;
    int64_t max_split_size;     /* -1: every block may be split (torch's default) */
} alloc_device_stats;

/* torch's names (memory_stats() keys): the one table, read by matepoint._C. */
static inline const char *
alloc_stat_array_name(int kind)
{
    static const char *const names[ALLOC_STAT_ARRAYS] = {
        "allocation", "segment", "active", "inactive_split", "allocated_bytes",
        "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"};
    return kind >= 0 && kind < ALLOC_STAT_ARRAYS ? names[kind] : NULL;
}

static inline const char *
alloc_pool_name(int pool)
{
    static const char *const names[ALLOC_POOLS] = {"all", "small_pool", "large_pool"};
    return pool >= 0 && pool < ALLOC_POOLS ? names[pool] : NULL;
}

static inline const char *
alloc_stat_field_name(int field)
{
    static const char *const names[ALLOC_STAT_FIELDS] = {"current", "peak", "allocated", "freed"};
    return field >= 0 && field < ALLOC_STAT_FIELDS ? names[field] : NULL;
}

static inline int64_t
alloc_stat_field(const alloc_stat *stat, int field)
{
    switch (field) {
    case ALLOC_STAT_CURRENT: return stat->current;
    case ALLOC_STAT_PEAK: return stat->peak;
    case ALLOC_STAT_ALLOCATED: return stat->allocated;
    default: return stat->freed;
    }
}

/* torch's DeviceStats::reserved_bytes_by_private_pools: the bytes reserved
 * in one private pool (named by torch's MempoolId_t), per pool kind. Kept
 * after the pool is gone (current 0), with its peak and counts, until
 * torch's accumulated statistics are reset. */
typedef struct {
    uint64_t pool_a, pool_b;
    alloc_stat reserved[ALLOC_POOLS];
} alloc_pool_figures;

typedef struct {
    uint64_t requested;         /* bytes asked for by the failing call */
    uint64_t segment_bytes;     /* the device allocation it needed (torch's alloc_size) */
    int device;
    uint64_t reserved, allocated;
    uint64_t limit;             /* the device's cap on reserved bytes, UINT64_MAX: none */
} alloc_oom_info;

typedef struct allocator allocator;

allocator *alloc_create(alloc_backend backend, int device_count);
/* Frees cached segments; live blocks are the caller's leak. */
void alloc_destroy(allocator *a);

/* NULL when out of memory (then alloc_last_oom() tells the numbers) or on a
 * backend error (counted and recorded as no out of memory). Size 0 is
 * valid and gives a distinct 512-byte block, as torch's device allocator
 * would (torch's entry, matepoint_malloc, asks for none: zero bytes are a
 * null pointer there); a size too large to round (alloc_round_size() == 0)
 * is out of memory. */
void *alloc_malloc(allocator *a, uint64_t size, int device, void *stream, uint64_t tag);
/* alloc_malloc, saying in *why what a NULL means: ALLOC_OUT_OF_MEMORY, or
 * ALLOC_ERROR for the backend's error (whatever else failed and was
 * reported during the call, such as a record of an earlier free's event);
 * ALLOC_OK with memory. */
void *alloc_malloc_why(allocator *a, uint64_t size, int device, void *stream, uint64_t tag,
                       int *why);
/* -1 when `ptr` is not a live allocation of `device`. */
int alloc_free(allocator *a, void *ptr, int device);
/* Marks a live block as used on `stream` too: 0; 1 when `ptr` is not a
 * live block of this allocator (memory from elsewhere: DLPack, IPC);
 * -1 when no memory was left to remember the stream. `stream` is of the
 * block's device (torch's record_stream hook passes no device). */
int alloc_record_stream(allocator *a, void *ptr, void *stream);
/* The same for `stream` of device `stream_device` (-1: the block's): the
 * event of the free is made and recorded on that device (torch's
 * insert_events), so a kernel of another GPU still using the block keeps
 * it from reuse. */
int alloc_record_stream_on(allocator *a, void *ptr, void *stream, int stream_device);
/* Waits for pending frees and releases every segment with no live block. */
void alloc_empty_cache(allocator *a);
/* Caps reserved bytes of `device` (UINT64_MAX: no cap, the default). */
void alloc_set_limit(allocator *a, int device, uint64_t limit_bytes);
/* torch's setMemoryFraction: caps reserved bytes of `device` at `fraction`
 * of `total_bytes` (0: unknown, the cap stays) and keeps the fraction; 0,
 * or -1 (nothing changed) for a device out of range or a fraction outside
 * [0, 1] (NaN too). */
int alloc_set_fraction(allocator *a, int device, double fraction, uint64_t total_bytes);
/* The fraction set last on `device` (1.0: none set), -1.0 for a device out
 * of range (torch's getMemoryFraction). */
double alloc_fraction(allocator *a, int device);

alloc_stats alloc_get_stats(allocator *a, int device);
void alloc_reset_peaks(allocator *a);
/* torch's figures of `device`; -1 (nothing written) when out of range. */
int alloc_get_device_stats(allocator *a, int device, alloc_device_stats *out);
/* torch.cuda.reset_peak_memory_stats(device): peaks of torch's figures,
 * matepoint's and the tags' restart from now. -1 when out of range. */
int alloc_reset_device_peaks(allocator *a, int device);
/* torch.cuda.reset_accumulated_memory_stats(device): the allocated and
 * freed counts of torch's figures and its num_* counters restart from 0. */
int alloc_reset_accumulated(allocator *a, int device);
/* Copies up to `max` of the private pools' figures of `device` into `out`;
 * returns how many there are in all, -1 for a device out of range. */
int alloc_get_pool_figures(allocator *a, int device, alloc_pool_figures *out, int max);
/* Copies up to `max` tag entries of `device` with live or peak bytes into
 * `out`; returns how many there are in all. */
int alloc_get_tag_stats(allocator *a, int device, alloc_tag_stats *out, int max);
/* The numbers of the calling thread's last request on `a` that got
 * nothing for lack of memory (another thread's failure since does not
 * replace them); zeros, limit UINT64_MAX, when it had none. */
alloc_oom_info alloc_last_oom(allocator *a);
/* Checks internal invariants of `device` (tests); 0 when they hold. */
int alloc_check(allocator *a, int device);

/* ---- private pools (CUDA graphs) ---------------------------------------------
 * torch's graph pools (CUDACachingAllocator's PrivatePool): between
 * alloc_begin_pool and alloc_end_pool, every alloc_malloc on `device`
 * whose stream `use_pool(filter, stream)` accepts (nonzero) is served from
 * the pool's own segments, never from the ordinary cache; with several
 * pools begun, the one begun last that accepts the stream serves it. A
 * pool's blocks, freed, return to the pool (per stream, as everywhere)
 * and are handed out again only to a later allocation into the same pool;
 * the ordinary cache never sees them, and emptying the cache leaves them.
 *
 * A pool is named by torch's MempoolId_t, (pool_a, pool_b), per device.
 * Each alloc_begin_pool takes one use of it (creating it with one use), as
 * torch's capture_begin does, and alloc_release_pool gives one back
 * (torch's CUDAGraph reset). Once no use is left its segments go back to
 * the backend as soon as no block in them is live: at the release, and at
 * the free (or completed cross-stream event) of the last live block.
 *
 * While a capture is underway on a device (alloc_use_capture_marks says
 * which: a marked one, or any pool being allocated to), the allocator
 * makes no call a capture forbids for that device's ordinary cache: no
 * event query or wait, and out of memory releases only released pools'
 * segments (torch's rule: its captures_underway).
 *
 * `use_pool` is called with the device's lock held: it must not call the
 * allocator. `filter` stays the caller's and must stay valid until
 * alloc_end_pool of that pool returned. */
typedef int (*alloc_pool_filter)(void *filter, void *stream);

/* Why alloc_begin_pool refused (nothing changed), or ALLOC_BEGIN_OK. */
enum {
    ALLOC_BEGIN_OK = 0, ALLOC_BEGIN_NO_DEVICE = -1, ALLOC_BEGIN_BEING_ALLOCATED_TO = -2,
    ALLOC_BEGIN_RELEASED = -3, ALLOC_BEGIN_NO_MEMORY = -4, ALLOC_BEGIN_NO_FILTER = -5,
    ALLOC_BEGIN_NO_ALLOCATOR = -6
};

/* A refusal of alloc_begin_pool in the user's terms. */
static inline const char *
alloc_begin_pool_reason(int status)
{
    switch (status) {
    case ALLOC_BEGIN_OK: return "done";
    case ALLOC_BEGIN_NO_DEVICE: return "no such device";
    case ALLOC_BEGIN_BEING_ALLOCATED_TO: return "the pool is being allocated to already";
    case ALLOC_BEGIN_RELEASED:
        return "the pool was released already (its graphs and MemPools are gone)";
    case ALLOC_BEGIN_NO_MEMORY: return "out of host memory for the pool's record";
    case ALLOC_BEGIN_NO_FILTER: return "no stream filter was given";
    case ALLOC_BEGIN_NO_ALLOCATOR: return "the allocator could not be created (no CUDA runtime)";
    default: return "unknown refusal";
    }
}

/* ALLOC_BEGIN_OK, or a refusal (ALLOC_POOL_*) that changed nothing: a
 * device out of range, a pool being allocated to already (as torch
 * refuses), a pool released already, no filter, or no memory. */
int alloc_begin_pool(allocator *a, int device, uint64_t pool_a, uint64_t pool_b,
                     alloc_pool_filter use_pool, void *filter);
/* Stops allocating to the pool; 0, or -1 when it is not being allocated to. */
int alloc_end_pool(allocator *a, int device, uint64_t pool_a, uint64_t pool_b);
/* Gives one use of the pool back; 0, or -1 when the device has no such
 * pool with a use left. */
int alloc_release_pool(allocator *a, int device, uint64_t pool_a, uint64_t pool_b);
/* torch 2.13 and later mark real captures (markCaptureBegin/End) apart
 * from pools being allocated to outside one (use_mem_pool, NCCL
 * registration, cudagraph trees' warmup). Once told (before any pool is
 * begun), only marked captures stop event queries, waits and frees of the
 * cache; else every pool being allocated to does (older torches). */
void alloc_use_capture_marks(allocator *a);
/* A capture on `device` begins (`begin`) or ends; 0, or -1 for a device
 * out of range, an end with none begun, or marks not in use. */
int alloc_mark_capture(allocator *a, int device, int begin);
/* 1 when a pool being allocated to takes `stream`'s requests on `device`
 * (alloc_malloc would serve them from it), else 0. */
int alloc_pool_takes(allocator *a, int device, void *stream);
/* Uses left of a pool (torch's getPoolUseCount); -1: no such pool. */
int alloc_pool_use_count(allocator *a, int device, uint64_t pool_a, uint64_t pool_b);

/* Makes the pool if missing, with one use, else takes one more use of it
 * (torch's createOrIncrefPool: a torch.cuda.MemPool holds one use from its
 * making to its end). 0; -1 for a device out of range, a pool whose uses
 * were all given back (its memory may be on its way back), or no memory. */
int alloc_create_pool(allocator *a, int device, uint64_t pool_a, uint64_t pool_b);
/* Gives back the segments of the pool holding no live block once the pool
 * is released (torch's emptyCache(mempool_id) at a MemPool's end); a pool
 * still in use keeps them, as a graph may replay into them. */
void alloc_empty_pool(allocator *a, uint64_t pool_a, uint64_t pool_b);

/* ---- checkpointed pool states (torch's PrivatePoolState) ---------------------
 * torch.compile's CUDA graph trees record several graphs into one pool and
 * replay them in orders other than their recording's: a replay hands out no
 * memory, so before recording again after replays the pool must be set to
 * the layout it had after the recording replayed last (torch's
 * getCheckpointState, setCheckpointPoolState; its Note "Checkpointing
 * PrivatePoolState").
 *
 * A state lists the pool's segments and, per segment, its blocks in address
 * order: allocated ones as they were handed out (size, requested bytes,
 * tag), and the free space between them (one entry per run of free
 * blocks). Restoring frees every block of the pool allocated now, then
 * allocates exactly the state's allocated blocks at their addresses: after
 * it, the pool's live blocks are the state's, and the segments the pool
 * made since stay, all free. Every figure follows as for frees and
 * mallocs. The caller learns which pointers were freed and which were
 * allocated (a pointer live before and in the state is in both).
 *
 * Refused, nothing changed: a pool missing or released (NO_POOL), a
 * state's segment no longer the pool's, or of another size (SEGMENT_GONE),
 * a live block of the pool used on a stream now capturing a CUDA graph
 * (no wait on it is allowed), or a block freed during a capture (its
 * events wait for the capture's end) (BUSY), no memory, or a failed wait
 * (WAIT_FAILED: the blocks may still be in use). Otherwise restoring
 * waits for the other streams the pool's blocks were used on (their
 * pending frees, recorded outside any capture, and record_stream uses of
 * live blocks), and for nothing else of the device, whatever other pools
 * are being allocated to. */
typedef struct {
    uint64_t ptr, size;
    uint64_t requested, tag;    /* allocated blocks: as handed out */
    int allocated;              /* 0: free space */
} alloc_block_state;

typedef struct {
    uint64_t base, size;
    void *stream;
    uint64_t first_block, block_count;  /* alloc_pool_state.blocks[first_block...] */
} alloc_segment_state;

typedef struct {
    int device;
    uint64_t pool_a, pool_b;
    alloc_segment_state *segments;
    uint64_t segment_count;
    alloc_block_state *blocks;
    uint64_t block_count;
} alloc_pool_state;

/* an allocated block of a restored state: its pointer, size and stream */
typedef struct {
    void *ptr;
    uint64_t size;
    void *stream;
} alloc_restored_block;

typedef struct {
    void **freed;                       /* the pool's live pointers before */
    uint64_t freed_count;
    alloc_restored_block *allocated;    /* the state's allocated blocks */
    uint64_t allocated_count;
} alloc_pool_delta;

enum {
    ALLOC_RESTORE_OK = 0, ALLOC_RESTORE_NO_POOL = -1, ALLOC_RESTORE_SEGMENT_GONE = -2,
    ALLOC_RESTORE_BUSY = -3, ALLOC_RESTORE_NO_MEMORY = -4, ALLOC_RESTORE_WAIT_FAILED = -5
};

/* Why a checkpoint or restore was refused, in the user's terms. */
static inline const char *
alloc_restore_reason(int status)
{
    switch (status) {
    case ALLOC_RESTORE_OK: return "done";
    case ALLOC_RESTORE_NO_POOL: return "the pool does not exist or was released";
    case ALLOC_RESTORE_SEGMENT_GONE:
        return "a segment of the checkpointed state is no longer the pool's (its memory was "
               "given back since)";
    case ALLOC_RESTORE_BUSY:
        return "a block of the pool is still used on another stream that is capturing a CUDA "
               "graph (or whose capture status could not be read), so its use cannot be waited "
               "for, or was freed during a capture";
    case ALLOC_RESTORE_NO_MEMORY: return "out of host memory";
    case ALLOC_RESTORE_WAIT_FAILED:
        return "waiting for another stream's use of a block of the pool failed (the CUDA "
               "error is reported above), so its memory could not be taken back safely";
    default: return "unknown refusal";
    }
}

/* The state of a pool of `device`: 0, or ALLOC_RESTORE_NO_POOL (no such
 * pool, or released), ALLOC_RESTORE_NO_MEMORY; `out` then empty. The
 * caller frees it with alloc_pool_state_free. */
int alloc_pool_checkpoint(allocator *a, int device, uint64_t pool_a, uint64_t pool_b,
                          alloc_pool_state *out);
void alloc_pool_state_free(alloc_pool_state *state);
/* Sets the state's pool to `state`: ALLOC_RESTORE_OK with `out` filled (the
 * caller frees it with alloc_pool_delta_free), else an ALLOC_RESTORE_*
 * refusal with `out` empty and the pool unchanged. */
int alloc_pool_restore(allocator *a, const alloc_pool_state *state, alloc_pool_delta *out);
void alloc_pool_delta_free(alloc_pool_delta *delta);
/* 1 when the live blocks of the pool are exactly the `count` distinct
 * pointers `ptrs` (torch's checkPoolLiveAllocations, which CUDA graph
 * trees ask when checking themselves), 0 when not, ALLOC_RESTORE_NO_POOL
 * for no such pool. */
int alloc_pool_live_is(allocator *a, int device, uint64_t pool_a, uint64_t pool_b,
                       void *const *ptrs, uint64_t count);

/* The largest free block cached on `device`, in the ordinary cache or any
 * pool (what torch's cacheInfo reports beside its guess of free device
 * memory); 0 when none, or for a device out of range. */
uint64_t alloc_largest_free_block(allocator *a, int device);

/* The segment holding live allocation `ptr` (a pointer into its block):
 * its base, and its size in *size (torch's getBaseAllocation; CUDA IPC
 * shares whole segments). NULL, *size untouched, when `ptr` is inside no
 * live block of any device. */
void *alloc_base_allocation(allocator *a, void *ptr, uint64_t *size);

/* Rounding applied to a request (tests and reports); 0 when `size` is
 * within 511 bytes of UINT64_MAX and cannot be rounded up. */
uint64_t alloc_round_size(uint64_t size);

#endif
