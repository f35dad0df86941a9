/* The offload engine's private structs, shared by the files of
 * csrc/offload (and read by csrc/testing); the rest of the extension sees
 * only offload.h.
 *
 * Ownership
 *   mp_state.engine owns the engine; the engine owns one offload_device per
 *   device it copied on (streams, events, the in-flight window) and the
 *   pool. A StorageCopy owns its host buffer (pool block), its events, the
 *   device source while its window holds it, and the restored copy while a
 *   recompute uses it. A TensorRecord owns a reference to its copy and its
 *   group; an OffloadGroup owns its copies (a tuple) and borrows its list
 *   neighbours (unlinked at dealloc). Each copy owns a reference to the
 *   module, which keeps the engine alive as long as any copy exists.
 *
 * Threads
 *   Every field below is read and written with the GIL held. The pool has
 *   its own lock. The GIL is released only around calls that may block
 *   (event and stream synchronization, pinning, pageable copies); state is
 *   re-read after each such call, since other threads may have run.
 *   A pointer into state another thread may free (a disk tier slot, a
 *   list being drained) is not kept across such a call unless something
 *   keeps it alive: a hold (spill.h, "Holds"), a pin (spill_pins), or
 *   taking it off the engine first (the drains, a retired tier).
 *
 * Three kinds of "release", each with its own verb:
 *   retire   the device *source* of a copy out: the window drops its
 *            reference to the input's storage, at once once the D2H
 *            completed, else in stream order (see the window's invariant).
 *            offload_window_retire_*(), retire_source().
 *   return   the *host buffer* of a copy: given back when the StorageCopy
 *            dies, with the event of the last copy reading or writing it;
 *            the pool reuses it once that event is seen complete
 *            (storage_copy_dealloc, offload_return.c): no host wait.
 *   discard  the *restored copy*: the device tensor a span was copied back
 *            into, dropped once the recompute took its views, after the
 *            compute stream was ordered behind the H2D (discard_restored()).
 * A source the window still holds when backward reaches its region is not
 * retired: it becomes the copy's restored data for good ("in place", never
 * discarded), and the host buffer is returned instead (the window section).
 *
 * Invariants (MP_ASSERT where they change)
 *   device_bytes_in_flight is the sum of nbytes over all copies whose
 *   source a window holds: it never goes below zero.
 *   The groups of a device form a doubly linked list in creation order:
 *   g->next->prev == g, and first/last are the ends; a group is on the
 *   list iff `linked`.
 *   A copy's state moves only forward (copy_state below), and a copy is
 *   COPY_QUEUED exactly while it holds its D2H's completion event. */
#ifndef MATEPOINT_OFFLOAD_OFFLOAD_INTERNAL_H
#define MATEPOINT_OFFLOAD_OFFLOAD_INTERNAL_H

#include "offload.h"
#include "offload_runtime.h"
#include "common/mp_assert.h"
#include "pool/pool.h"
#include "spill/spill.h"

/* ------------------------------------------------------------------ */
/* The offload engine: per-device copy state, the host pool and counters.
 *
 * One engine per module state (mp_state.engine), created at module exec and
 * freed with the module. It runs over an offload runtime (offload_runtime.h:
 * torch's, or the simulated GPU of test builds), whose CUDA table is loaded
 * at the first offload. Each device gets, on its first offload, a copy-out
 * and a copy-in stream and an in-flight window (the window section below). The pool
 * is created on first use: pinned memory when the runtime has a device,
 * else plain host memory.
 *
 * Devices: CUDA resolves stream handle NULL (torch's default stream) to the
 * legacy stream of the calling thread's *current* device, so every wait and
 * record on a stream of device d runs with d current
 * (offload_engine_enter_device), and the previous device is given back only
 * where that creates no context.
 *
 * Thread-safety: every field is guarded by the GIL; the pool has its own
 * lock. `runtime` and `rt` change only while no copy exists. */

#define MAX_CUDA_DEVICES 64

typedef struct OffloadGroup OffloadGroup;

/* A host buffer of a dead copy on its way back to the pool: `event` is
 * that of the last copy that reads or writes it (offload_return.c),
 * recorded on `stream` (a key only, never used; NULL: not known). */
typedef struct {
    pool_block block;
    void *event;
    void *stream;
} returning_block;

/* Copy state of one device. */
typedef struct {
    int index;
    void *copy_out;             /* cudaStream_t */
    void *copy_in;
    PyObject *in_flight;        /* list of StorageCopy whose source is held (window section) */
    uint64_t regions;           /* checkpoint calls that offloaded here so far */
    int outputs_open;           /* selective-checkpoint outputs joined the open region */
    OffloadGroup *first, *last; /* live groups in creation order (borrowed) */
    /* Events are made once and reused, not created and destroyed per copy:
     * `ordering` is recorded on one stream and waited on by another right
     * away (a wait captures the record it was given, so it is free again at
     * once); `spare` holds completion events no copy needs any more. */
    void *ordering;
    void **spare;
    int spare_count, spare_capacity;
    /* host buffers given back in stream order, oldest first */
    returning_block *returning;
    int returning_count, returning_capacity;
} offload_device;

struct offload_engine {
    offload_options options;
    pool *pool;                 /* created on first use */
    pool_host_ctx host_ctx;
    const offload_runtime *runtime;
    const cudart *rt;           /* runtime->load(), at the first device */
    uint64_t devices_with_context;          /* bit d: device d has a context (cache) */
    uint64_t device_bytes_in_flight;        /* sources held by the windows */
    uint64_t peak_device_bytes_in_flight;
    offload_device *cuda[MAX_CUDA_DEVICES];
    int warned_fallback;        /* offloading went to pageable memory (warned once) */
    int warned_read_fallback;   /* reading a spilled span back did (warned once) */
    uint64_t prefetched;        /* spans copied back ahead of their recompute */
    uint64_t fetched_at_need;   /* spans copied back when the recompute asked */
    uint64_t used_in_place;     /* spans backward found still on the device and used
                                 * there (a restore took them): never copied back */
    int fail_next_acquires;     /* tests: make the pool refuse this many spans */
    /* the disk tier (offload_spill.c): made at the first spill */
    spill_tier *spill;
    char spill_dir[OFFLOAD_PATH_MAX];       /* the tier's directory */
    struct spill_orphan *orphans;           /* slots of dead copies still busy */
    int orphan_count, orphan_capacity;
    int warned_spill_failure;
    int spill_failure_errno;                /* of the first failed write, to warn */
    uint64_t spilled_bytes, peak_spilled_bytes;     /* read from the tier */
    uint64_t spill_writes, spill_reads, spill_read_stalls, spill_failures;
    uint64_t spill_writing_bytes;           /* block bytes of spans being written */
#ifdef MATEPOINT_TESTING
    PyObject *yield_hook;       /* tests: called at OFFLOAD_YIELD points, or NULL */
#endif
};

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

/* The engine of the module that owns an offload object. */
offload_engine *offload_engine_of(PyObject *module);

/* Creates the pool on first use. */
int offload_engine_ensure_pool(offload_engine *engine);

/* The copy state of device `index`, made (streams included) on first use;
 * NULL with an error set when no runtime or device is there. */
offload_device *offload_engine_device(mp_state *st, int index);

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

/* Host buffers given back in stream order (offload_return.c): the pool
 * reuses `block` once `event` completed. The device takes both; *block is
 * zeroed. */
void offload_return_after(offload_engine *engine, offload_device *device, pool_block *block,
                          void *event);
/* The same, for an event recorded on `stream` (a key only): a buffer whose
 * event is on one stream never waits behind one on another (used in place,
 * its D2H may complete long after the copies back that follow it). */
void offload_return_after_on(offload_engine *engine, offload_device *device, pool_block *block,
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

/* Runs the engine over `runtime` from now on. Refused (RuntimeError) while
 * offloaded inputs are alive. */
int offload_engine_use_runtime(offload_engine *engine, const offload_runtime *runtime);

/* ------------------------------------------------------------------ */
/* Inspecting a checkpoint's input tensors before they are offloaded: which
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

/* copy_index values beside a real index into the list of copies */
#define UNPLANNED (-1)
#define STAYS (-2)      /* the pool had no memory: saved where it is */
#define NO_DATA (-3)    /* no elements: rebuilt empty */

/* What the offload path learns about one input tensor. */
typedef struct {
    PyObject *storage;          /* the input's untyped storage */
    PyObject *device_obj;
    PyObject *dtype, *size, *stride;
    int device_index;
    uintptr_t storage_ptr;
    uint64_t byte_offset, byte_extent;
    int64_t itemsize;
    Py_ssize_t copy_index;      /* into the copies list, or one of the values above */
    PyObject *wrapper_type;     /* a DTensor input: its type and spec, else NULL */
    PyObject *wrapper_spec;
} input_info;

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
/* The Python objects of the offload path and who owns what.
 *
 * StorageCopy: one storage span staged in a pool buffer. It owns the pool
 *   block (released at dealloc, after any copy still reading or writing it
 *   has completed), the source storage while the device-to-host copy may
 *   still read it (the window section says when it is retired),
 *   and the device tensor the span was copied back into during a restore.
 * TensorRecord: one offloaded input: which copy holds its bytes and how to
 *   view them (dtype, size, stride, offset), plus what the in-place check
 *   needs. It is what autograd's SavedTensor packs.
 * OffloadGroup: the copies of one checkpointed region. The groups of a
 *   device form a list in creation order (borrowed links, unlinked at
 *   dealloc): backward walks it in reverse to prefetch.
 * OffloadPacker: the pack hook that hands prepared records to SavedTensor.
 *
 * All of them are GC-tracked heap types of the module; GIL held throughout. */

/* The life of a StorageCopy's host buffer, in the only order it moves:
 *   COPY_EMPTY      made; no D2H queued yet (it may hold a pool block)
 *   COPY_QUEUED     the D2H is queued on the copy-out stream; d2h_done is
 *                   its completion event, not yet seen complete
 *   COPY_COMPLETED  the D2H completed (event seen complete, or the host
 *                   waited): the buffer holds the span
 *   COPY_RETURNED   the host buffer went back to the pool, or to its
 *                   device's returning list with its last event (dealloc)
 * A copy that failed before its D2H was queued goes from EMPTY straight
 * to RETURNED, and so does one that dies with its D2H still pending.
 * copy_advance() asserts every transition. */
typedef enum {
    COPY_EMPTY,
    COPY_QUEUED,
    COPY_COMPLETED,
    COPY_RETURNED,
} copy_state;

typedef struct {
    PyObject_HEAD
    PyObject *module;           /* keeps the engine alive */
    copy_state state;
    offload_device *device;
    PyObject *device_obj;       /* torch.device */
    uint64_t nbytes;
    pool_block block;
    PyObject *source;           /* storage kept while the D2H may read it */
    uint64_t source_offset;     /* bytes from the source storage's start to the span */
    void *producer;             /* stream current when the copy was queued: a key
                                 * only, never used after (it may be destroyed) */
    uint64_t region;            /* the device's region count then (window section) */
    unsigned long thread;       /* creator: only its own backward uses it in place */
    void *d2h_done;             /* cudaEvent_t until seen complete, else NULL */
    int producer_waited;        /* the producer stream waits on d2h_done already */
    PyObject *fetched;          /* uint8 tensor holding the span again, or NULL;
                                 * in_place: the source storage itself */
    int in_place;               /* backward uses the source: no copy back, no host buffer */
    int in_place_used;          /* a restore took it: counted in used_in_place once */
    void *fetched_on;           /* the stream whose allocator gave it (a key only) */
    void *h2d_done;             /* the last copy back, until the copy goes */
    void *h2d_stream;           /* the stream it was queued on (a key only) */
    int h2d_awaited;            /* some stream waits on h2d_done already: */
    void *h2d_awaited_on;       /* the last that did (a key only) */
    int restoring;              /* threads taking a view of `fetched` now */
    int discard_pending;        /* discarded meanwhile: the last of them drops it */
    spill_slot *spill;          /* the span in the disk tier, or NULL */
    int spill_phase;            /* where the span is (spill_phase, offload_spill.c) */
    int spill_pins;             /* threads between offload_spill_ready() and their copy
                                 * back queued: no spill starts (the disk tier's rules) */
} StorageCopy;

typedef struct {
    PyObject_HEAD
    StorageCopy *copy;          /* NULL for a tensor with no elements */
    PyObject *group;
    PyObject *dtype, *size, *stride, *device_obj;
    int64_t offset;             /* elements from the start of the span */
    PyObject *wrapper_type;     /* a DTensor input: rebuilt from its type and spec */
    PyObject *wrapper_spec;
    /* in-place checks: torch skips its version check for hooked saved
     * tensors, so the record watches the input while it is alive */
    PyObject *weak_source;      /* weakref to the input, or to its view base
                                 * (which shares its version counter) */
    PyObject *version;          /* the input's version when it was saved */
    Py_ssize_t input_index;     /* position among the region's input tensors */
    int modified_in_forward;
    int requires_grad;          /* restored by hand when no SavedTensor does it */
} TensorRecord;

struct OffloadGroup {
    PyObject_HEAD
    PyObject *module;
    offload_device *device;
    PyObject *copies;           /* tuple of StorageCopy */
    OffloadGroup *prev, *next;
    int linked;
    unsigned long thread;       /* creator: backward order means nothing across threads */
    /* a selectively checkpointed op's outputs (offload_sac.c), linked after
     * the inputs of their region: fetched with that region, not counted in
     * the prefetch depth, and skipped by prefetch once handed back (or once
     * their region's recompute ended without them) */
    int outputs;
    int handed_back;
};

typedef struct {
    PyObject_HEAD
    PyObject *records;
    Py_ssize_t next;
} OffloadPacker;

/* Moves `copy` to state `to`; asserts that it is a step forward allowed by
 * copy_state (QUEUED only from EMPTY, COMPLETED only from QUEUED). */
static inline void
copy_advance(StorageCopy *copy, copy_state to)
{
    MP_ASSERT(to > copy->state);
    MP_ASSERT(to != COPY_QUEUED || copy->state == COPY_EMPTY);
    MP_ASSERT(to != COPY_COMPLETED || copy->state == COPY_QUEUED);
    copy->state = to;
}

/* A copy of `nbytes` on `device` with no pool block yet. */
StorageCopy *storage_copy_new(mp_state *st, PyObject *module, offload_device *device,
                              PyObject *device_obj, uint64_t nbytes);
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

/* ------------------------------------------------------------------ */
/* The in-flight window of one device: device-to-host copies whose source
 * storage is still referenced, and the rule that bounds them.
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
/* The disk tier under the pool (offload_spill.c): with host_limit_bytes
 * and spill_dir set, the pool's pinned bytes stay within the limit (the
 * pool's own limit is the smaller of the two limits), and spans needed
 * last in backward (the oldest groups of a device) move to files on the
 * tier's threads when a span would not fit. A copy's span is where
 * spill_phase says:
 *   SPILL_RESIDENT  in its pool block (the only phase without the tier)
 *   SPILL_WRITING   in its block, being written out (the block is busy)
 *   SPILL_ON_DISK   only in its file; no block
 *   SPILL_READING   being read back into a new block
 *   SPILL_STAYS     in its block: its write failed, and it is not tried again
 *   SPILL_FORKED    (a forked child) only in a file of the parent's tier,
 *                   which the child does not read: a copy back raises
 * A write that fails (ENOSPC, EIO) leaves the span resident: the pool
 * then falls back to pageable memory past the limit, as without a tier.
 * GIL held; the GIL is released around every wait on the disk.
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
enum { SPILL_RESIDENT, SPILL_WRITING, SPILL_ON_DISK, SPILL_READING, SPILL_STAYS, SPILL_FORKED };

/* A dead copy's slot whose request still runs: its block goes back to the
 * pool once the request finished (engine->orphans). */
struct spill_orphan {
    spill_slot *slot;
    pool_block block;
    int writing;
};

/* The pool's limit: the smaller nonzero of pool_limit_bytes and, with a
 * disk tier, host_limit_bytes; 0 for none. */
uint64_t offload_spill_pool_limit(const offload_engine *engine);
/* The option whose value offload_spill_pool_limit() is: "host_limit_bytes"
 * or "pool_limit_bytes" (the pool's when both are equal); NULL for none. */
const char *offload_spill_limit_name(const offload_engine *engine);
/* The option whose limit leaves no room to pin a span of `nbytes` now
 * (offload_spill_limit_name), or NULL when a failure to pin was the host's. */
const char *offload_limit_reached(offload_engine *engine, uint64_t nbytes);
/* Warns once per process (per direction) that a span of `nbytes` went
 * through pageable memory: offloaded into it, or (`reading`) read back from
 * the disk tier through it. GIL held. */
void offload_warn_fallback(offload_engine *engine, uint64_t nbytes, int reading);
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
/* Calls `visit` on every copy of every device, oldest group first, until
 * it returns nonzero (returned). `visit` must not release the GIL. */
int offload_spill_walk(offload_engine *engine,
                       int (*visit)(offload_engine *, StorageCopy *, void *), void *ctx);
/* In a child forked after the tier started (offload_spill_fork.c): drops
 * the parent's tier, whose threads the child lacks, freeing no file of
 * it; every copy's span stays in its block where the child's memory holds
 * it, else becomes SPILL_FORKED. Called first by every entry point above. */
void offload_spill_leave_forked(offload_engine *engine);
/* The same for one copy, which no walk of the groups may reach. */
void offload_spill_leave_copy(offload_engine *engine, StorageCopy *copy);
/* Finishes what the tier completed; refreshes the engine's counters. */
void offload_spill_poll(offload_engine *engine);
/* Waits for every request and stops the tier (engine going away). */
void offload_spill_free(offload_engine *engine);
/* Takes the tier and its orphans off the engine, GIL held: from here no
 * other thread reaches them (spill_destroy's rule, spill.h); the caller
 * stops them with offload_spill_retire() (offload_spill_retire.c). */
void offload_spill_detach(offload_engine *engine, offload_spill_retired *retired);

#endif
