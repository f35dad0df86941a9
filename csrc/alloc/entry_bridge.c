/* The allocator library's table for the C++ adapter (torch_bridge.h):
 * the entries past torch's pluggable ones (entry.c), which the adapter
 * converts into torch's C++ structs: figures, memory history and
 * snapshots, and the entries of entry_pools.c. Thread-safety: the
 * allocator locks itself. */
#include "alloc.h"
#include "alloc_history.h"
#include "entry.h"
#include "torch_bridge.h"

#include <string.h>

static int
bridge_device_stats(int device, alloc_device_stats *out)
{
    allocator *a = entry_allocator();
    return a ? alloc_get_device_stats(a, device, out) : -1;
}

static int
bridge_pool_figures(int device, alloc_pool_figures *out, int max)
{
    allocator *a = entry_allocator();
    return a ? alloc_get_pool_figures(a, device, out, max) : -1;
}

static int
bridge_reset_peaks(int device)
{
    allocator *a = entry_allocator();
    return a ? alloc_reset_device_peaks(a, device) : -1;
}

static int
bridge_reset_accumulated(int device)
{
    allocator *a = entry_allocator();
    return a ? alloc_reset_accumulated(a, device) : -1;
}

static void
bridge_configure_history(const alloc_history_config *config)
{
    allocator *a = entry_allocator();
    if (a != NULL)
        alloc_history_configure(a, config);
}

static int
bridge_take_snapshot(int device, uint64_t pool_a, uint64_t pool_b, alloc_snapshot *out)
{
    allocator *a = entry_allocator();
    if (a == NULL) {
        memset(out, 0, sizeof(*out));
        return 0;
    }
    return alloc_take_pool_snapshot(a, device, pool_a, pool_b, out);
}

static void
bridge_free_snapshot(alloc_snapshot *snapshot)
{
    alloc_snapshot_free(entry_allocator(), snapshot);
}

static int
bridge_record_stream_on(void *ptr, void *stream, int device)
{
    allocator *a = entry_allocator();
    return a ? alloc_record_stream_on(a, ptr, stream, device) : 1;
}

static int
bridge_history_enabled(void)
{
    allocator *a = entry_allocator();
    return a ? alloc_history_enabled(a) : 0;
}

static void *
bridge_block_context(void *ptr)
{
    allocator *a = entry_allocator();
    return a ? alloc_block_context(a, ptr) : NULL;
}

/* Constant: every entry is the library's for the process. */
static const matepoint_torch_bridge bridge = {
    .version = MATEPOINT_TORCH_BRIDGE_VERSION,
    .size = sizeof(matepoint_torch_bridge),
    .malloc = matepoint_malloc,
    .free = matepoint_free,
    .init = matepoint_init,
    .empty_cache = matepoint_reset,
    .record_stream = matepoint_record_stream,
    .record_stream_on = bridge_record_stream_on,
    .set_memory_fraction = matepoint_set_memory_fraction,
    .get_memory_fraction = entry_memory_fraction,
    .device_stats = bridge_device_stats,
    .pool_figures = bridge_pool_figures,
    .reset_peaks = bridge_reset_peaks,
    .reset_accumulated = bridge_reset_accumulated,
    .device_count = matepoint_alloc_device_count,
    .configure_history = bridge_configure_history,
    .take_snapshot = bridge_take_snapshot,
    .free_snapshot = bridge_free_snapshot,
    .history_enabled = bridge_history_enabled,
    .block_context = bridge_block_context,
    .set_oom_observer = entry_set_oom_observer,
    .set_error_handler = entry_set_error_handler,
    .begin_pool = bridge_begin_pool,
    .end_pool = bridge_end_pool,
    .release_pool = bridge_release_pool,
    .use_capture_marks = entry_use_capture_marks,
    .mark_capture = bridge_mark_capture,
    .largest_free_block = bridge_largest_free_block,
    .base_allocation = bridge_base_allocation,
    .checkpoint_pool = bridge_checkpoint_pool,
    .free_pool_state = alloc_pool_state_free,
    .restore_pool = bridge_restore_pool,
    .free_pool_delta = alloc_pool_delta_free,
    .pool_live_is = bridge_pool_live_is,
    .create_pool = bridge_create_pool,
    .pool_use_count = bridge_pool_use_count,
    .empty_pool = bridge_empty_pool,
};

const matepoint_torch_bridge *
entry_bridge(void)
{
    return &bridge;
}
