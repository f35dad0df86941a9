/* The offload engine's private structs, shared by the files of
 * csrc/offload (and read by csrc/testing); the rest of the extension sees
 * only offload.h. Types only: the functions over them are declared in
 * offload_internal.h, floor by floor, and its sections are the ones named
 * here ("the window section"). Every file of csrc/offload may include this
 * header (the contract floor, tests/test_layout.py).
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
#ifndef MATEPOINT_OFFLOAD_OFFLOAD_TYPES_H
#define MATEPOINT_OFFLOAD_OFFLOAD_TYPES_H

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
 * and a copy-in stream and an in-flight window (the window section). The
 * pool is created on first use: pinned memory when the runtime has a
 * device, else plain host memory.
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

/* ------------------------------------------------------------------ */
/* What the save direction learns about one input tensor: filled by
 * offload_inspect.c, read by offload_save.c and record_new (strong
 * references, released by input_info_clear). */

/* copy_index values beside a real index into the list of copies */
#define UNPLANNED (-1)
#define STAYS (-2)      /* the pool had no memory: saved where it is */
#define NO_DATA (-3)    /* no elements: rebuilt empty */

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

/* ------------------------------------------------------------------ */
/* Where a copy's span is with a disk tier (offload_spill.c; the tier's
 * contract: offload_internal.h, "The disk tier"), as spill_phase says:
 *   SPILL_RESIDENT  in its pool block (the only phase without the tier)
 *   SPILL_WRITING   in its block, being written out (the block is busy)
 *   SPILL_ON_DISK   only in its file; no block
 *   SPILL_READING   being read back into a new block
 *   SPILL_STAYS     in its block: its write failed, and it is not tried again
 *   SPILL_FORKED    (a forked child) only in a file of the parent's tier,
 *                   which the child does not read: a copy back raises
 * A write that fails (ENOSPC, EIO) leaves the span resident: the pool
 * then falls back to pageable memory past the limit, as without a tier. */
enum { SPILL_RESIDENT, SPILL_WRITING, SPILL_ON_DISK, SPILL_READING, SPILL_STAYS, SPILL_FORKED };

/* A dead copy's slot whose request still runs: its block goes back to the
 * pool once the request finished (engine->orphans). */
struct spill_orphan {
    spill_slot *slot;
    pool_block block;
    int writing;
};

#endif
