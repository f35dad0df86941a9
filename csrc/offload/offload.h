/* The offload path as the rest of the extension sees it: moves checkpoint
 * inputs to host pool buffers after they are saved and brings them back for
 * the recompute, ahead of time.
 *
 * CUDA inputs are copied device-to-host on a per-device copy-out stream
 * that first waits on an event recorded on the producing stream; the source
 * storage stays referenced until the copy's event has completed. In
 * backward, host-to-device copies run on a per-device copy-in stream and the
 * compute stream waits on each copy's event before the data is used. The
 * GPU is reached through an offload runtime (offload_runtime.h); CI runs
 * the same code over a simulated GPU.
 *
 * Inputs sharing a storage are copied once (the byte span the inputs
 * cover), and every input comes back as a view with its exact size, stride,
 * offset and dtype. A frame's inputs form an OffloadGroup; groups of a
 * device are linked in creation order, which is the prefetch order in
 * backward (reverse).
 *
 * Everything here runs with the GIL held, which guards the engine state;
 * the pool has its own lock. The private structs, who owns what and the
 * three kinds of "release" are in offload_types.h; the private functions,
 * floor by floor (which file may call which), in offload_internal.h. The
 * directions, from the top down:
 *   offload_engine.c   the engine's life, runtime and pool API (entry)
 *   offload_sac.c      selective checkpointing's entry points (entry)
 *   offload_save.c     copying inputs out, building the records
 *   offload_restore.c  copying back, prefetch, views of the copies
 * through the policies:
 *   offload_inspect.c  which inputs are eligible, their storage spans
 *   offload_copy.c     a StorageCopy's end: its host buffer handed back
 *   offload_spill*.c   the disk tier under the pool
 *   offload_window.c   copies in flight and when their sources are retired
 *   offload_return.c   host buffers of dead copies back to the pool, in stream order
 * down to the mechanisms:
 *   offload_records.c  the Python objects autograd keeps: records, groups, packer
 *   offload_device.c   the runtime's table, the pool, per-device streams and events
 *   offload_limits.c   the pool's limits, the pageable-fallback warning
 *   streams.c          checked stream and event calls over the runtime's table */
#ifndef MATEPOINT_OFFLOAD_OFFLOAD_H
#define MATEPOINT_OFFLOAD_OFFLOAD_H

#include "base/state.h"

#define OFFLOAD_PATH_MAX 4096

typedef struct {
    int enabled;                /* offload CUDA inputs at all */
    int pipeline;               /* prefetch; else copy back at need */
    int prefetch_depth;         /* groups fetched ahead in backward */
    int window;                 /* regions whose copies out may be in flight (>= 1) */
    int64_t min_offload_bytes;  /* smaller tensors stay where they are */
    uint64_t pool_limit_bytes;  /* 0: no limit */
    uint64_t host_limit_bytes;  /* pinned bytes past which spans spill to disk; 0: none */
    char spill_dir[OFFLOAD_PATH_MAX];   /* the disk tier's directory; "": none */
} offload_options;

/* The disk tier (offload_spill_retire.c): checks a spill directory for
 * set_options (0, or -1 with an error naming the problem), and makes the
 * engine use `options`' tier settings from now on (refused, RuntimeError,
 * while spans of another directory are on disk): a tier to stop is taken
 * off the engine at once, under the GIL, and stopped by the caller once
 * the new options are stored, so another thread running meanwhile starts
 * a tier of the new options, never uses the old one. */
int offload_spill_check_dir(const char *path);

typedef struct offload_engine offload_engine;

offload_engine *offload_engine_new(void);
/* Waits for copies in flight, frees the pool's cache. */
void offload_engine_free(offload_engine *engine);
offload_options *offload_engine_options(offload_engine *engine);
int offload_engine_apply_limit(offload_engine *engine);
/* A tier set_options took off the engine (GIL held), with the busy slots
 * of its dead copies: stopped by offload_spill_retire() once the new
 * options are in place, with the GIL released. */
typedef struct {
    struct spill_tier *tier;
    struct spill_orphan *orphans;
    int orphan_count;
} offload_spill_retired;
int offload_spill_configure(offload_engine *engine, const offload_options *options,
                            offload_spill_retired *retired);
/* Waits for a retired tier's requests and stops it; GIL held on entry,
 * released meanwhile. No-op for an empty `retired`. */
void offload_spill_retire(offload_engine *engine, offload_spill_retired *retired);

/* torch's device type of the tensors the engine moves ("cuda"; "cpu" on the
 * simulated GPU of test builds). */
const char *offload_device_type(mp_state *st);

/* Per tensor of the sequence `tensors`, True where an offload of
 * checkpoint(function, *tensors) leaves it on the device, by the engine's
 * own rule (inspect_input: parameters, module buffers of `function`,
 * nested, sparse and other non-strided tensors, tensors under
 * min_offload_bytes, tensors not on the offload device); a new list, or
 * NULL with an exception. The planner's memory model asks this. */
PyObject *offload_left_on_device(mp_state *st, PyObject *function, PyObject *tensors);

/* Python: dict of pool counters; drop cached buffers. */
PyObject *offload_pool_stats(mp_state *st);
/* pool_stats()'s keys, in order, as a new tuple. */
PyObject *offload_pool_stats_keys(void);
int offload_empty_pool(mp_state *st);
/* Pins up to `count` buffers for spans of `buffer_bytes` ahead of use,
 * without the GIL; *added says how many. -1 with a MemoryError naming the
 * limit reached (or the host) when fewer than `count` were pinned. */
int offload_reserve_pool(mp_state *st, uint64_t buffer_bytes, uint64_t count, uint64_t *added);
/* Tests: the next `count` spans find no host memory at all. */
void offload_fail_next_acquires(mp_state *st, int count);

/* Offloads the eligible ones among the region's input tensors: their slot
 * in `saved` (a list as long as `tensors`) receives a SavedTensor over a
 * record, or the record itself when torch lacks SavedTensor. Other slots
 * are left alone. offload_override: -1 follows the options, 0 offloads
 * nothing, 1 offloads CUDA inputs even with offload off (the planner's
 * per-block choice). *group_out receives the frame's OffloadGroup and
 * *records_out the list of records, or both NULL when nothing moved. */
int offload_save_inputs(mp_state *st, PyObject *module, PyObject *function, PyObject *tensors,
                        int offload_override, PyObject *saved, PyObject **group_out,
                        PyObject **records_out);
/* offload_save_inputs for the outputs of an op that selective
 * checkpointing's policy offloads, saved inside the region (offload_sac.c):
 * follows the options' `enabled`, whatever hooks are around. The window
 * counts them in the region open on their device, ending none;
 * `opens_region` says these are the first outputs of a region (which
 * closes the outputs of the region before, when its inputs did not). */
int offload_save_outputs(mp_state *st, PyObject *module, PyObject *tensors, int opens_region,
                         PyObject *saved, PyObject **group_out, PyObject **records_out);
/* Python: _sac_offload(tensors, opens_region=False, /) -> (group, saved) or
 * None when nothing moved (see offload_save_outputs). */
/* Python: _sac_restore(group, saved) -> the tensors (None where kept);
 * _sac_prefetch(group) starts copying them back on the copy-in stream
 * (when the options pipeline); _sac_discard(group) drops what was copied
 * back but not handed out (the host copy stays). */
PyObject *offload_sac_save_py(PyObject *module, PyObject *args);
PyObject *offload_sac_restore_py(PyObject *module, PyObject *args);
PyObject *offload_sac_prefetch_py(PyObject *module, PyObject *group);
PyObject *offload_sac_discard_py(PyObject *module, PyObject *group);
/* After the forward: marks records whose input the region changed in place
 * (their copy may be torn; restoring them raises). */
int offload_check_forward(mp_state *st, PyObject *records);

/* Restores a region's offloaded inputs, the one entry point of the restore
 * direction: fetches the spans of `group` (NULL: nothing was offloaded)
 * and, when the options pipeline, prefetches the outputs selective
 * checkpointing offloaded in the region and, when prefetch_ahead too, the
 * groups backward reaches next; then calls unpack_inputs(ctx), which unpacks each
 * saved input (an offloaded one through offload_unpack_hook, directly or
 * through SavedTensor); then discards the restored copies, whose views the
 * unpacked inputs hold. Returns what unpack_inputs returned, -1 when the
 * fetch failed. */
int offload_restore_group(mp_state *st, PyObject *group, int prefetch_ahead,
                          int (*unpack_inputs)(void *ctx), void *ctx);

/* Copies `group`'s spans back on the copy-in stream ahead of their use
 * (nothing when the options do not pipeline or the group was handed back);
 * drops the copies back that nothing took (offload_sac.c). */
int offload_prefetch_group(mp_state *st, PyObject *group);
void offload_discard_group(mp_state *st, PyObject *group);

/* The unpack hook of offloaded inputs (st->offload_unpack): restores one
 * record's tensor; raises when the input was changed in place since it was
 * saved. */
PyObject *offload_unpack_hook(PyObject *module, PyObject *record);

extern PyType_Spec storage_copy_spec;
extern PyType_Spec tensor_record_spec;
extern PyType_Spec offload_group_spec;
extern PyType_Spec offload_packer_spec;

#endif
