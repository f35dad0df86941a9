/* The contract between the allocator library (C, entry.c) and the C++
 * adapter that makes it torch's CUDA allocator (torch_adapter.cpp, compiled
 * at run time against the running torch: matepoint/_adapter.py).
 *
 * torch's CUDAPluggableAllocator throws for everything past malloc and
 * free (memory_stats, snapshots, out-of-memory observers, graph pools,
 * cacheInfo, IPC bases). The adapter subclasses it, overrides those, and
 * answers them through this table; it only converts between torch's C++
 * structs and these C types. Every figure and record is made in C.
 *
 * The library exports one function, matepoint_alloc_torch_bridge (its name
 * in _C.ALLOCATOR_SYMBOLS, role "torch_bridge"), returning a pointer to a
 * table that lives as long as the process. A NULL entry means "not
 * supported here": the adapter then keeps torch's own behaviour (its
 * message "CUDAPluggableAllocator does not yet support ...").
 *
 * Threads: every entry may be called from any thread, concurrently; none
 * calls back into torch while holding the allocator's locks. Units: bytes;
 * devices are CUDA ordinals; streams are cudaStream_t as void *.
 * Ownership is stated per entry. */
#ifndef MATEPOINT_ALLOC_TORCH_BRIDGE_H
#define MATEPOINT_ALLOC_TORCH_BRIDGE_H

#include "alloc.h"
#include "alloc_history.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever an entry changes meaning or place; the adapter refuses
 * a table of another version (a stale cached build). */
#define MATEPOINT_TORCH_BRIDGE_VERSION 6

/* Called by the allocator after it released its locks, when a request
 * failed for lack of memory and before it raises torch's
 * OutOfMemoryError, with what torch's allocator passes its
 * OutOfMemoryObservers: the device allocation that failed (a segment's
 * size), the device's total bytes (the memory fraction's cap when one is
 * set) and its free bytes. */
typedef void (*matepoint_oom_observer)(void *ctx, int device, uint64_t alloc_size,
                                       uint64_t device_total, uint64_t device_free);

typedef struct matepoint_torch_bridge {
    uint32_t version;           /* MATEPOINT_TORCH_BRIDGE_VERSION */
    uint32_t size;              /* sizeof(matepoint_torch_bridge) of the library */

    /* torch's pluggable entry points, as CUDAPluggableAllocator takes them */
    void *(*malloc)(size_t size, int device, void *stream);
    void (*free)(void *ptr, size_t size, int device, void *stream);
    void (*init)(int device_count);
    void (*empty_cache)(void);
    void (*record_stream)(void *ptr, void *stream);
    /* record_stream with the stream's device (torch's hook passes none):
     * 0, 1 for memory not the allocator's (skipped), -1 without memory */
    int (*record_stream_on)(void *ptr, void *stream, int device);
    void (*set_memory_fraction)(double fraction, int device);
    /* the fraction set last on `device` (1.0: none set), -1.0 for a
     * device the allocator does not serve */
    double (*get_memory_fraction)(int device);

    /* torch's figures of `device` (alloc.h); -1 when out of range */
    int (*device_stats)(int device, alloc_device_stats *out);
    /* its private pools' reserved bytes (alloc_get_pool_figures): up to
     * `max` copied, how many there are returned; -1 when out of range */
    int (*pool_figures)(int device, alloc_pool_figures *out, int max);
    int (*reset_peaks)(int device);
    int (*reset_accumulated)(int device);

    /* how many devices the allocator serves (snapshots walk them all) */
    int (*device_count)(void);

    /* Memory history (alloc_history.h): torch's recordHistory, and a
     * snapshot of one device, of the segments of pool (pool_a, pool_b)
     * only unless (0, 0), that the caller frees with free_snapshot (it
     * holds context references). take_snapshot: 0, or -1 without
     * memory. */
    void (*configure_history)(const alloc_history_config *config);
    int (*take_snapshot)(int device, uint64_t pool_a, uint64_t pool_b, alloc_snapshot *out);
    void (*free_snapshot)(alloc_snapshot *snapshot);
    /* isHistoryEnabled: 1 while recording */
    int (*history_enabled)(void);
    /* getContextForPointer: the context the live block at `ptr` was
     * allocated with, one reference given back with the history's release;
     * NULL for none */
    void *(*block_context)(void *ptr);

    /* Out-of-memory observers: one observer, replaced by the next call
     * (the adapter keeps torch's list and passes its own trampoline). */
    void (*set_oom_observer)(matepoint_oom_observer observer, void *ctx);
    /* The function that raises torch's RuntimeError with `message` (it
     * throws through the library's malloc and does not return), for the
     * requests refused for another reason than memory (a capture no pool
     * takes, a CUDA error); NULL: none (raised as out of memory). */
    void (*set_error_handler)(void (*raise)(const char *message));

    /* CUDA graph private pools (pool_a, pool_b: torch's MempoolId_t).
     * begin_pool: until end_pool, allocations on `device` whose stream
     * use_pool(filter, stream) accepts come from the pool, or a refusal
     * that changed nothing (ALLOC_POOL_*, alloc_begin_pool_reason says
     * why); release_pool: the pool's memory may go back once its blocks
     * are freed. NULL: not yet. */
    int (*begin_pool)(int device, uint64_t pool_a, uint64_t pool_b,
                       int (*use_pool)(void *filter, void *stream), void *filter);
    void (*end_pool)(int device, uint64_t pool_a, uint64_t pool_b);
    void (*release_pool)(int device, uint64_t pool_a, uint64_t pool_b);
    /* torch 2.13+'s markCaptureBegin/End (alloc.h): use_capture_marks
     * once, before any pool is begun, by an adapter whose torch sends
     * them; then mark_capture for each capture's begin and end */
    void (*use_capture_marks)(void);
    void (*mark_capture)(int device, int begin);
    /* cacheInfo: the largest free cached block of `device`, in bytes */
    uint64_t (*largest_free_block)(int device);
    /* IPC: the segment holding `ptr`, its base returned, its size in *size;
     * NULL when `ptr` is not inside a live block */
    void *(*base_allocation)(void *ptr, uint64_t *size);
    /* torch.compile's CUDA graph trees (alloc.h's checkpointed pool
     * states): checkpoint_pool fills a state the caller frees with
     * free_pool_state; restore_pool fills a delta the caller frees with
     * free_pool_delta. Both return ALLOC_RESTORE_* (alloc_restore_reason
     * says why a refusal). */
    int (*checkpoint_pool)(int device, uint64_t pool_a, uint64_t pool_b, alloc_pool_state *out);
    void (*free_pool_state)(alloc_pool_state *state);
    int (*restore_pool)(const alloc_pool_state *state, alloc_pool_delta *out);
    void (*free_pool_delta)(alloc_pool_delta *delta);
    /* checkPoolLiveAllocations: 1 when the pool's live blocks are exactly
     * `ptrs` (distinct), 0 when not, ALLOC_RESTORE_NO_POOL for no pool */
    int (*pool_live_is)(int device, uint64_t pool_a, uint64_t pool_b, void *const *ptrs,
                        uint64_t count);
    /* torch.cuda.MemPool (alloc.h): create_pool makes a pool or takes one
     * more use of it (0, or -1: released already, no memory, no such
     * device); pool_use_count: its uses, -1 for no such pool; empty_pool:
     * a released pool's free segments go back (emptyCache(mempool_id)). */
    int (*create_pool)(int device, uint64_t pool_a, uint64_t pool_b);
    int (*pool_use_count)(int device, uint64_t pool_a, uint64_t pool_b);
    void (*empty_pool)(uint64_t pool_a, uint64_t pool_b);
} matepoint_torch_bridge;

#ifdef __cplusplus
}
#endif

#endif
