/* The allocator library's entry points for CUDA graph pools (their
 * checkpointed states, torch.cuda.MemPool), cacheInfo and CUDA IPC: the
 * C++ adapter's table entries (torch_bridge.h), the
 * base-allocation hook torch's pluggable allocator takes without the
 * adapter, and, in test builds, the same calls by name for the simulated
 * GPU's tests. Thread-safety: the allocator locks itself. */
#include "alloc.h"
#include "entry.h"

#include <stddef.h>

/* ---- CUDA IPC ------------------------------------------------------------ */

/* torch's base_alloc_fn (CUDAPluggableAllocator::set_base_alloc_fn, behind
 * getBaseAllocation): the segment holding `ptr`, its size in *size. For a
 * pointer the allocator did not hand out, `ptr` itself, *size untouched
 * (torch's answer without the hook). */
EXPORT void *
matepoint_base_allocation(void *ptr, size_t *size)
{
    allocator *a = entry_allocator();
    uint64_t bytes = 0;
    void *base = a ? alloc_base_allocation(a, ptr, &bytes) : NULL;
    if (base == NULL)
        return ptr;
    if (size != NULL)
        *size = (size_t)bytes;
    return base;
}

#ifdef MATEPOINT_TESTING
/* ---- test builds: graph pools and cacheInfo without torch's C++ side -------
 * The C++ adapter reaches these through its table; tests of the simulated
 * GPU (tests/test_gpu_review_capture.py) call them by name, with
 * matepoint_test_stream_filter as the filter: `filter` is the one stream
 * the pool takes (torch's _cuda_beginAllocateCurrentStreamToPool). */

EXPORT int
matepoint_test_stream_filter(void *filter, void *stream)
{
    return filter == stream;
}

EXPORT int
matepoint_test_begin_pool(int device, uint64_t pool_a, uint64_t pool_b,
                          alloc_pool_filter use_pool, void *filter)
{
    allocator *a = entry_allocator();
    return a ? alloc_begin_pool(a, device, pool_a, pool_b, use_pool, filter) : -1;
}

EXPORT int
matepoint_test_end_pool(int device, uint64_t pool_a, uint64_t pool_b)
{
    allocator *a = entry_allocator();
    return a ? alloc_end_pool(a, device, pool_a, pool_b) : -1;
}

EXPORT int
matepoint_test_release_pool(int device, uint64_t pool_a, uint64_t pool_b)
{
    allocator *a = entry_allocator();
    return a ? alloc_release_pool(a, device, pool_a, pool_b) : -1;
}

EXPORT int
matepoint_test_pool_use_count(int device, uint64_t pool_a, uint64_t pool_b)
{
    allocator *a = entry_allocator();
    return a ? alloc_pool_use_count(a, device, pool_a, pool_b) : -1;
}

EXPORT uint64_t
matepoint_test_largest_free_block(int device)
{
    allocator *a = entry_allocator();
    return a ? alloc_largest_free_block(a, device) : 0;
}
#endif

/* CUDA graph pools (alloc.h). torch checks what it asks (a pool begun
 * twice, ended unbegun) itself; a begin the allocator refuses returns why
 * (ALLOC_POOL_*), and the adapter raises it to the caller: torch then
 * neither ends nor releases the pool. */
int
bridge_begin_pool(int device, uint64_t pool_a, uint64_t pool_b, alloc_pool_filter use_pool,
                  void *filter)
{
    allocator *a = entry_allocator();
    if (a == NULL)
        return ALLOC_BEGIN_NO_ALLOCATOR;
    return alloc_begin_pool(a, device, pool_a, pool_b, use_pool, filter);
}

void
bridge_end_pool(int device, uint64_t pool_a, uint64_t pool_b)
{
    allocator *a = entry_allocator();
    if (a != NULL)
        (void)alloc_end_pool(a, device, pool_a, pool_b);
}

void
bridge_release_pool(int device, uint64_t pool_a, uint64_t pool_b)
{
    allocator *a = entry_allocator();
    if (a != NULL)
        (void)alloc_release_pool(a, device, pool_a, pool_b);
}

/* torch marks every capture it begins and ends: one it did not begin
 * cannot end here */
void
bridge_mark_capture(int device, int begin)
{
    allocator *a = entry_allocator();
    if (a != NULL)
        (void)alloc_mark_capture(a, device, begin);
}

uint64_t
bridge_largest_free_block(int device)
{
    allocator *a = entry_allocator();
    return a ? alloc_largest_free_block(a, device) : 0;
}

void *
bridge_base_allocation(void *ptr, uint64_t *size)
{
    allocator *a = entry_allocator();
    return a ? alloc_base_allocation(a, ptr, size) : NULL;
}


/* Checkpointed pool states (alloc.h), for torch.compile's CUDA graph trees. */
int
bridge_checkpoint_pool(int device, uint64_t pool_a, uint64_t pool_b, alloc_pool_state *out)
{
    allocator *a = entry_allocator();
    if (a == NULL) {
        *out = (alloc_pool_state){0};
        return ALLOC_RESTORE_NO_POOL;
    }
    return alloc_pool_checkpoint(a, device, pool_a, pool_b, out);
}

int
bridge_restore_pool(const alloc_pool_state *state, alloc_pool_delta *out)
{
    allocator *a = entry_allocator();
    if (a == NULL) {
        *out = (alloc_pool_delta){0};
        return ALLOC_RESTORE_NO_POOL;
    }
    return alloc_pool_restore(a, state, out);
}

int
bridge_pool_live_is(int device, uint64_t pool_a, uint64_t pool_b, void *const *ptrs,
                    uint64_t count)
{
    allocator *a = entry_allocator();
    return a ? alloc_pool_live_is(a, device, pool_a, pool_b, ptrs, count) : ALLOC_RESTORE_NO_POOL;
}

/* torch.cuda.MemPool: its making, its uses, its end's emptyCache(mempool_id). */
int
bridge_create_pool(int device, uint64_t pool_a, uint64_t pool_b)
{
    allocator *a = entry_allocator();
    return a ? alloc_create_pool(a, device, pool_a, pool_b) : -1;
}

int
bridge_pool_use_count(int device, uint64_t pool_a, uint64_t pool_b)
{
    allocator *a = entry_allocator();
    return a ? alloc_pool_use_count(a, device, pool_a, pool_b) : -1;
}

void
bridge_empty_pool(uint64_t pool_a, uint64_t pool_b)
{
    allocator *a = entry_allocator();
    if (a != NULL)
        alloc_empty_pool(a, pool_a, pool_b);
}
