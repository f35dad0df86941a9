/* Private to the allocator library's entry files (entry.c: torch's entry
 * points and the C API; entry_bridge.c: the C++ adapter's table;
 * entry_pools.c: CUDA graph pools, their states and MemPools, cacheInfo and
 * IPC). Not a contract for anything else. */
#ifndef MATEPOINT_ALLOC_ENTRY_H
#define MATEPOINT_ALLOC_ENTRY_H

#include "alloc.h"
#include "torch_bridge.h"

#include <stddef.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))

/* The process's one allocator, created on first use (thread-safe); NULL
 * when it could not be (no CUDA runtime). */
allocator *entry_allocator(void);

/* torch's pluggable entry points (entry.c), also the table's. */
EXPORT void *matepoint_malloc(size_t size, int device, void *stream);
EXPORT void matepoint_free(void *ptr, size_t size, int device, void *stream);
EXPORT void matepoint_init(int device_count);
EXPORT void matepoint_reset(void);
EXPORT void matepoint_record_stream(void *ptr, void *stream);
EXPORT void matepoint_set_memory_fraction(double fraction, int device);
EXPORT int matepoint_alloc_device_count(void);
/* The fraction set last on `device` (1.0: none set), -1.0: no such device. */
double entry_memory_fraction(int device);
/* torch's out-of-memory observers: the adapter's trampoline. */
void entry_set_oom_observer(matepoint_oom_observer observer, void *ctx);
/* torch marks its captures: taken at the allocator's making, or at once
 * when it is made already (never makes it: that initializes CUDA). */
void entry_use_capture_marks(void);
/* The adapter's handler raising torch's RuntimeError (NULL: none). */
void entry_set_error_handler(void (*handler)(const char *message));
/* The C++ adapter's table (entry_bridge.c). */
const matepoint_torch_bridge *entry_bridge(void);

/* The adapter table's graph-pool, cacheInfo and IPC entries (torch_bridge.h). */
int bridge_begin_pool(int device, uint64_t pool_a, uint64_t pool_b, alloc_pool_filter use_pool,
                       void *filter);
void bridge_end_pool(int device, uint64_t pool_a, uint64_t pool_b);
void bridge_release_pool(int device, uint64_t pool_a, uint64_t pool_b);
void bridge_mark_capture(int device, int begin);
uint64_t bridge_largest_free_block(int device);
void *bridge_base_allocation(void *ptr, uint64_t *size);
/* The table's checkpointed pool states (alloc.h). */
int bridge_checkpoint_pool(int device, uint64_t pool_a, uint64_t pool_b, alloc_pool_state *out);
int bridge_restore_pool(const alloc_pool_state *state, alloc_pool_delta *out);
int bridge_pool_live_is(int device, uint64_t pool_a, uint64_t pool_b, void *const *ptrs,
                        uint64_t count);
/* The table's torch.cuda.MemPool entries (alloc.h). */
int bridge_create_pool(int device, uint64_t pool_a, uint64_t pool_b);
int bridge_pool_use_count(int device, uint64_t pool_a, uint64_t pool_b);
void bridge_empty_pool(uint64_t pool_a, uint64_t pool_b);

#endif
