/* The offload engine's private functions, shared by the files of
 * csrc/offload (and read by csrc/testing, which includes this header for
 * all of them); the rest of the extension sees only offload.h. Its structs,
 * who owns what and the three kinds of "release" are in offload_types.h.
 *
 * The files are in floors, and a file calls only functions of its own floor
 * or of the floors below it, with no circle of calls between files
 * (tests/test_layout.py, OFFLOAD_LAYERS, checks both; docs/architecture.md
 * draws them). The sections below follow them, bottom first:
 *   contract    offload.h, this header, offload_types.h, offload_runtime.h,
 *               offload_sites.h: types, declarations, constant tables
 *   gpu         offload_runtime_torch.c, streams.c: the runtime seam and
 *               its checked stream and event calls
 *   limits      offload_limits.c: the pool's limits and the fallback warning
 *   device      offload_device.c: the runtime's table, the pool, each
 *               device's streams and events, entering and leaving a device
 *   records     offload_records.c: records, groups, the packer, new copies
 *   return      offload_return.c: host buffers back to the pool in stream
 *               order
 *   window      offload_window.c: copies in flight, sources retired
 *   spill       offload_spill_fork.c, offload_spill.c, offload_spill_retire.c:
 *               the disk tier
 *   copy        offload_copy.c: a StorageCopy's type, and its end
 *   inspect     offload_inspect.c: which inputs move
 *   directions  offload_save.c, offload_restore.c: saving and restoring
 *   entry       offload_engine.c, offload_sac.c: what the module calls
 * So the per-device calls sit below every policy, which never calls up
 * into a direction; polling and draining are driven from the top (the
 * directions, the engine's pool API and teardown). GIL held throughout,
 * unless a function says otherwise. */
#ifndef MATEPOINT_OFFLOAD_OFFLOAD_INTERNAL_H
#define MATEPOINT_OFFLOAD_OFFLOAD_INTERNAL_H

#include "offload_types.h"

/* Test builds: named points where the engine is about to let other
 * threads run (it releases the GIL next), after it took what keeps its
 * state alive there. The hook a test set (_set_yield_hook, testing.c) is
 * called with the point's name, GIL held: it may run what another thread
 * could run at that moment (a poll, a spill, set_options), but nothing
 * that waits for this thread. Its errors are reported as unraisable. A
 * plain build has no hook and no call. */
#ifdef MATEPOINT_TESTING
static inline void
offload_yield_point(offload_engine *engine, const char *name)
{
    if (engine->yield_hook == NULL)
        return;
    PyObject *hook = Py_NewRef(engine->yield_hook);
    PyObject *result = PyObject_CallFunction(hook, "s", name);
    if (result == NULL)
        PyErr_WriteUnraisable(hook);
    Py_XDECREF(result);
    Py_DECREF(hook);
}
#define OFFLOAD_YIELD(engine, name) offload_yield_point((engine), (name))
#else
#define OFFLOAD_YIELD(engine, name) ((void)0)
#endif

/* ------------------------------------------------------------------ */
/* limits (offload_limits.c): what the options allow the pool. */

/* Do the options ask for a disk tier (host_limit_bytes and spill_dir)? */
int offload_tier_wanted(const offload_options *options);
/* The pool's limit: the smaller nonzero of pool_limit_bytes and, with a
 * disk tier, host_limit_bytes; 0 for none. */
uint64_t offload_pool_limit(const offload_engine *engine);
/* The option whose limit leaves no room to pin a span of `nbytes` now
 * ("pool_limit_bytes", or "host_limit_bytes" when that one is smaller),
 * or NULL when a failure to pin was the host's. */
const char *offload_limit_reached(offload_engine *engine, uint64_t nbytes);
/* Warns once per process (per direction) that a span of `nbytes` went
 * through pageable memory: offloaded into it, or (`reading`) read back from
 * the disk tier through it. Called where that was decided: the copy out
 * (offload_save.c) and the read back (offload_spill.c). */
void offload_warn_fallback(offload_engine *engine, uint64_t nbytes, int reading);

/* ------------------------------------------------------------------ */
/* device (offload_device.c): the runtime's table, the pool, and the calls
 * every policy and direction makes on a device. Devices: CUDA resolves
 * stream handle NULL (torch's default stream) to the legacy stream of the
 * calling thread's *current* device, so every wait and record on a stream
 * of device d runs with d current (offload_engine_enter_device), and the
 * previous device is given back only where that creates no context. */

/* The engine of the module that owns an offload object. */
offload_engine *offload_engine_of(PyObject *module);

/* Creates the pool on first use: pinned memory when the runtime has a
 * device, else plain host memory. */
int offload_engine_ensure_pool(offload_engine *engine);

/* The copy state of device `index`, made (streams included) on first use;
 * NULL with an error set when no runtime or device is there. */
offload_device *offload_engine_device(mp_state *st, int index);
/* Gives back the device's events, and its copy streams unless
 * `keep_streams`, and frees it: its window and returning buffers were
 * drained first (offload_engine.c). */
void offload_device_free(offload_engine *engine, offload_device *device, int keep_streams);

/* torch's current stream on device `index`. */
int offload_engine_current_stream(mp_state *st, int index, void **stream);

/* Makes `index` the calling thread's current device; *previous receives
 * what offload_engine_leave_device gives back. */
int offload_engine_enter_device(mp_state *st, int index, int *previous);
void offload_engine_leave_device(mp_state *st, int index, int previous);

/* The device pinned host memory is best allocated with: the current one
 * when it has a context, else the first that has one, else -1 (none yet:
 * pinning then creates the current device's). */
int offload_engine_pinning_device(mp_state *st);

/* Orders `waiter` after the work queued on `producer` so far, the wait
 * of `site`; the device is current. */
int offload_device_order(offload_engine *engine, offload_device *device, offload_site site,
                         void *waiter, void *producer);
/* Records a completion event of the device on `stream` (the device is
 * current): a spare one, or a new one. *event stays NULL on error. */
int offload_device_record(offload_engine *engine, offload_device *device, void *stream,
                          void **event);
/* Gives back a completion event no copy needs any more (any thread with
 * the GIL, any current device). */
void offload_device_give_event(offload_engine *engine, offload_device *device, void *event);
/* Has the copy's D2H completed? 1, 0, or -1 with an error. A completed
 * event goes back to the device's spares: nothing waits on it any more. */
int offload_device_d2h_done(offload_engine *engine, StorageCopy *copy);

/* ------------------------------------------------------------------ */
/* records (offload_records.c): the Python objects autograd keeps. */

/* The record of input #input_index, described by `info`, whose bytes are
 * in copies[info->copy_index] (none for an empty tensor). */
TensorRecord *record_new(mp_state *st, input_info *info, PyObject *copies, PyObject *group,
                         PyObject *tensor, Py_ssize_t input_index);
/* A group over `copies` (a list), linked into its device's list. */
PyObject *group_new(mp_state *st, PyObject *module, PyObject *copies);
/* 1 when the record's input, or its view base, is alive with another
 * version than saved, 0 when not (or dead), -1 on error. */
int offload_source_changed(mp_state *st, TensorRecord *record);
/* A pack hook that returns records[0], records[1], ... in turn. */
PyObject *packer_new(mp_state *st, PyObject *records);
/* A copy of `nbytes` on `device` with no pool block yet; at its end
 * (offload_copy.c) its host buffer goes back in stream order. */
StorageCopy *storage_copy_new(mp_state *st, PyObject *module, offload_device *device,
                              PyObject *device_obj, uint64_t nbytes);
/* Calls `visit` on every copy of every device, oldest group first, until
 * it returns nonzero (returned). `visit` must not release the GIL. */
int offload_walk_copies(offload_engine *engine,
                        int (*visit)(offload_engine *, StorageCopy *, void *), void *ctx);

/* ------------------------------------------------------------------ */
/* return (offload_return.c): host buffers given back in stream order. */

/* The pool reuses `block` once `event` completed, recorded on `stream` (a
 * key only; NULL: not known). A buffer whose event is on one stream never
 * waits behind one on another (used in place, its D2H may complete long
 * after the copies back that follow it). The device takes both; *block is
 * zeroed. */
void offload_return_after(offload_engine *engine, offload_device *device, pool_block *block,
                          void *event, void *stream);
/* Gives back the buffers whose event completed, oldest first, on each
 * stream up to the first that has not; returns how many. Never blocks. */
int offload_return_poll(offload_engine *engine, offload_device *device);
void offload_return_poll_all(offload_engine *engine);
/* Waits (GIL released) for the stream of the first buffer given back with
 * a stream key (a copy out still writing the host buffer of an input used
 * in place), then polls that device: 1 when a buffer came back. For a
 * caller that would otherwise fall back to pageable memory. */
int offload_return_wait_stream(offload_engine *engine);
/* Waits (GIL released) for every buffer's event and gives it back: the
 * device is going away. */
void offload_return_drain(offload_engine *engine, offload_device *device);

/* ------------------------------------------------------------------ */
/* window (offload_window.c): the in-flight window of one device:
 * device-to-host copies whose source storage is still referenced, and the
 * rule that bounds them.
 *
 * A copy joins the window when its D2H is queued on the copy-out stream
 * (after an event on the producing stream, the stream current when the
 * region was checkpointed), holding its source storage and tagged with the
 * region (the device's count of offloading checkpoint calls) it belongs to.
 *
 * Invariant: when region r has queued its copies, before its function
 * runs, no source of a region older than r - window + 1 is held. Such a
 * copy either completed (its event queried complete), or, before the
 * reference was dropped, (1) its producing stream was made to wait on its
 * completion event (cudaStreamWaitEvent with the copy's device current: a
 * NULL stream is the current device's), and (2) the source was marked used
 * by the producing stream (record_stream). (1) and (2) are done only when
 * the producer is the current stream then: the producer's handle is kept
 * as a key, never used (a stream may be destroyed meanwhile); else the
 * source is marked used by the copy-out stream, past the copy. A caching allocator hands a freed
 * block out again at once only to work queued later on the stream that
 * allocated it: when that is the producer, the work runs after the copy;
 * when the input came from another stream, (2) keeps the block until the
 * producer passed the copy. So memory is reused on the GPU's timeline,
 * never early, and device memory held by offloaded inputs allocated on the
 * producing stream stays within `window` regions however far the CPU runs
 * ahead of the GPU. The completion event itself stays with the copy until
 * it is seen complete: restoring from the host buffer waits on it.
 *
 * Backward: the first restore on the device (of region r) finds the last
 * regions' sources still held. Those of regions up to r, which backward
 * is about to reach, are used in place (keep_in_place): the source moves
 * to the copy's `fetched` for as long as the copy lives (a second backward
 * over a retained graph finds it there), no copy back is made, and the
 * host buffer goes back to the pool in stream order after the D2H (it
 * still writes it). The D2H may still read the source after backward
 * dropped it, and what it reads lands in a buffer nobody reads; but the
 * memory must still be there: torch's allocator with expandable segments
 * unmaps pages (an OOM retry, empty_cache()) after synchronizing only the
 * segment's own stream, and a D2H reading unmapped memory is an illegal
 * address that loses the CUDA context. So a source whose D2H was not seen
 * complete is first marked used by the copy-out stream (record_stream):
 * its memory goes back only once that stream passed the D2H. The
 * recompute reads the source as torch reads any saved input: on the
 * stream backward runs the region on, after its producer.
 * Sources of later regions (another graph's forward) are retired as
 * above.
 *
 * GIL held; the window is a Python list owned by the device. */

/* Puts a copy whose D2H was queued after work on `producer` into the
 * window of the device's current region; takes a reference to `source`. */
int offload_window_add(offload_engine *engine, offload_device *device, StorageCopy *copy,
                       PyObject *source, void *producer);

/* Ends the device's current region and retires, in stream order, what
 * the window no longer allows. */
int offload_window_end_region(mp_state *st, offload_device *device);

/* Backward of the graph `thread` created begins (or goes on) on the device
 * at region `last_region`: the sources still held of that thread's regions
 * up to it are used in place, the others retired in stream order (autograd
 * graphs are per thread: one thread's backward says nothing of when
 * another's reaches its inputs). */
int offload_window_backward(mp_state *st, offload_device *device, unsigned long thread,
                            uint64_t last_region);

/* Retires the sources of copies that have completed, on every device. */
int offload_window_poll_all(mp_state *st);

/* Blocks until every copy of the window completed and empties it (the
 * engine is going away or changes runtime). */
void offload_window_drain(offload_engine *engine, offload_device *device);

/* ------------------------------------------------------------------ */
/* spill (offload_spill_fork.c below offload_spill.c below
 * offload_spill_retire.c): the disk tier under the pool. With host_limit_bytes
 * and spill_dir set, the pool's pinned bytes stay within the limit (the
 * pool's own limit is the smaller of the two limits), and spans needed
 * last in backward (the oldest groups of a device) move to files on the
 * tier's threads when a span would not fit; where a copy's span is, is its
 * spill_phase (offload_types.h). GIL held; the GIL is released around
 * every wait on the disk.
 *
 * Several threads: while the GIL is released, another thread may poll
 * (finishing a request frees its slot), start spills, or retire the tier
 * (set_options). So (1) a thread waiting on a slot holds it
 * (spill_slot_hold) and waits on the tier it read with the GIL, and every
 * loop re-reads engine->spill and the copy's phase after a wait; (2) a
 * thread copying a span back pins the copy (spill_pins) from before
 * offload_spill_ready() until its copy back is queued: no spill starts on
 * a pinned copy, and a write found finished keeps its block; (3) a tier
 * is taken off the engine under the GIL before it is stopped without it
 * (offload_spill_retire), and spill_destroy() waits for every hold. */

/* In a child forked after the tier started (offload_spill_fork.c): drops
 * the parent's tier, whose threads the child lacks, freeing no file of
 * it; every copy's span stays in its block where the child's memory holds
 * it, else becomes SPILL_FORKED. Called first by every entry point below. */
void offload_spill_leave_forked(offload_engine *engine);
/* The same for one copy, which no walk of the groups may reach; a visitor
 * of offload_walk_copies (`ctx` unused): returns 0. */
int offload_spill_leave_copy(offload_engine *engine, StorageCopy *copy, void *ctx);

/* Before a new span of `nbytes` takes a pool buffer (save): finishes
 * writes, starts spilling the oldest resident spans, and waits for them
 * while the span would not fit under the limit. */
int offload_spill_room(mp_state *st, uint64_t nbytes);
/* Backward reaches `group`: reads spilled spans of it and of the groups
 * before it back into pool buffers, as far as the limit allows. */
int offload_spill_readahead(mp_state *st, OffloadGroup *group);
/* The copy's span in its block, for a copy back: waits for its read (a
 * read stall), or reads it now. -1 with an OSError when the disk failed. */
int offload_spill_ready(mp_state *st, StorageCopy *copy);
/* A dying copy gives up its file; a block the tier still uses goes back to
 * the pool once its request finished (the copy's block is zeroed). */
void offload_spill_forget(offload_engine *engine, StorageCopy *copy);
/* Finishes what the tier completed; refreshes the engine's counters. */
void offload_spill_poll(offload_engine *engine);

/* Waits for every request and stops the tier (offload_spill_retire.c; the
 * engine going away). set_options' own calls are in offload.h. */
void offload_spill_free(offload_engine *engine);

/* ------------------------------------------------------------------ */
/* inspect (offload_inspect.c): a checkpoint's input tensors before they
 * are offloaded: which
 * ones are eligible, where their bytes live, and how inputs that share a
 * storage are grouped into one copied span.
 *
 * An eligible input is a plain strided torch.Tensor (no subclass, no
 * Parameter, no buffer of the checkpointed module, not sparse or nested)
 * of at least min_offload_bytes in a device's memory (as the offload
 * runtime tells: a CUDA tensor on a GPU), or a DTensor (not a parameter)
 * whose local tensor is one: the local tensor is copied, and the input
 * comes back as a DTensor of the same spec (mesh, placements, shape). Its
 * span is the
 * byte range of its storage that it reads: views, non-contiguous and
 * stride-0 tensors read less than their storage. input_info holds strong
 * references, released by input_info_clear. GIL held throughout. */

void input_info_clear(input_info *info);

/* The buffers of `function` when it is a module or a method bound to one
 * (never offloaded), else an empty list. */
PyObject *inspect_module_buffers(mp_state *st, PyObject *function);

/* Fills `info` for an input of `function` worth offloading: 1 if so, 0 if
 * it stays, -1 on error. *buffers caches the function's module buffers
 * (inspect_module_buffers), looked up once an input lives on a device; the
 * caller releases it. */
int inspect_input(mp_state *st, PyObject *function, PyObject *tensor, PyObject **buffers,
                  input_info *info);

/* 1 for a plain strided tensor, the only kind with a byte span to copy;
 * 0 for a sparse, nested or mkldnn one (they stay where they are, and have
 * no storage of their own to ask about), -1 on error. */
int inspect_is_strided(mp_state *st, PyObject *tensor);

/* Do two inspected inputs share one storage? */
int inspect_same_storage(const input_info *a, const input_info *b);

/* ------------------------------------------------------------------ */
/* entry (offload_engine.c): beside offload.h's, for the tests. */

/* Runs the engine over `runtime` from now on. Refused (RuntimeError) while
 * offloaded inputs are alive. */
int offload_engine_use_runtime(offload_engine *engine, const offload_runtime *runtime);

#endif
