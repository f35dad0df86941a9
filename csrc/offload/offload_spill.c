/* The disk tier under the pool: spans backward needs last go to files when
 * pinned memory would pass host_limit_bytes, and come back ahead of their
 * recompute (the contract: offload_internal.h, the spill section).
 *
 * Owns the engine's running tier (`spill`, started at the first spill),
 * its orphans, its counters, and each copy's `spill` slot and
 * `spill_phase`; the tier's settings and its stop are
 * offload_spill_retire.c's, a forked child's leaving offload_spill_fork.c's.
 * Floor `spill`: called by the save and restore directions (room for a
 * span, readahead, a span ready), the copy file (forget) and the engine
 * (poll); calls spill_fork, return, records, device, limits and streams.
 * Raises its own warnings (a failed write, a read back through pageable
 * memory), where it decides. GIL held; released around every wait. */
#include "offload_internal.h"
#include "streams.h"

#include <errno.h>
#include <string.h>

#define SPILL_WORKERS 2

/* The tier, started at the first spill. */
static int
ensure_tier(offload_engine *engine)
{
    offload_spill_leave_forked(engine);
    if (engine->spill != NULL)
        return 0;
    char why[512];
    engine->spill = spill_create(engine->options.spill_dir, SPILL_WORKERS, why, sizeof why);
    if (engine->spill == NULL) {
        PyErr_Format(PyExc_OSError, "matepoint: the disk tier cannot start: %s", why);
        return -1;
    }
    memcpy(engine->spill_dir, engine->options.spill_dir, sizeof engine->spill_dir);
    return 0;
}

/* The first failed write warns, once: after the walk that found it, since
 * a warning runs Python code (filters, showwarning) that may free groups. */
static void
warn_failure_once(offload_engine *engine)
{
    int error = engine->spill_failure_errno;
    if (error == 0 || engine->warned_spill_failure)
        return;
    engine->warned_spill_failure = 1;
    if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                         "matepoint: writing to spill_dir %s failed (%s): the inputs that did "
                         "not fit stay in host memory (pageable past host_limit_bytes); "
                         "pool_stats()['spill_failures'] counts them",
                         engine->spill_dir, strerror(error)) < 0)
        PyErr_WriteUnraisable(NULL);
}

/* The write of a spilling copy finished: its block goes back to the pool
 * (0), or, when it failed, the span stays in it. */
static void
finish_write(offload_engine *engine, StorageCopy *copy, int keep_block)
{
    int status = spill_status(engine->spill, copy->spill);
    mp_counter_sub(&engine->spill_writing_bytes, copy->block.size);
    if (status == 0 && !keep_block) {
        pool_release(engine->pool, &copy->block);
        copy->spill_phase = SPILL_ON_DISK;
        return;
    }
    spill_slot_free(engine->spill, copy->spill);
    copy->spill = NULL;
    copy->spill_phase = status == 0 ? SPILL_RESIDENT : SPILL_STAYS;
    if (status != 0) {
        engine->spill_failures++;
        engine->spill_failure_errno = status;   /* warned by the caller's caller */
    }
}

/* A read that finished well: the span is in its block again. A failed one
 * stays READING for offload_spill_ready to report. */
static void
finish_read(offload_engine *engine, StorageCopy *copy)
{
    if (spill_status(engine->spill, copy->spill) != 0)
        return;
    spill_slot_free(engine->spill, copy->spill);
    copy->spill = NULL;
    copy->spill_phase = SPILL_RESIDENT;
}

static int
poll_copy(offload_engine *engine, StorageCopy *copy, void *ctx)
{
    (void)ctx;
    if (copy->spill == NULL || copy->spill_phase == SPILL_ON_DISK ||
        !spill_done(engine->spill, copy->spill))
        return 0;
    if (copy->spill_phase == SPILL_WRITING)
        finish_write(engine, copy, copy->spill_pins > 0);  /* pinned: it is wanted back */
    else
        finish_read(engine, copy);
    return 0;
}

static void
poll_orphans(offload_engine *engine)
{
    int kept = 0;
    for (int i = 0; i < engine->orphan_count; i++) {
        struct spill_orphan *orphan = &engine->orphans[i];
        if (!spill_done(engine->spill, orphan->slot)) {
            engine->orphans[kept++] = *orphan;
            continue;
        }
        if (orphan->writing)
            mp_counter_sub(&engine->spill_writing_bytes, orphan->block.size);
        spill_slot_free(engine->spill, orphan->slot);
        if (orphan->block.ptr != NULL)
            pool_release(engine->pool, &orphan->block);
    }
    engine->orphan_count = kept;
}

void
offload_spill_poll(offload_engine *engine)
{
    offload_spill_leave_forked(engine);
    if (engine->spill == NULL)
        return;
    offload_walk_copies(engine, poll_copy, NULL);
    poll_orphans(engine);
    warn_failure_once(engine);
    spill_stats stats = spill_get_stats(engine->spill);
    engine->spilled_bytes = stats.bytes_on_disk;
    engine->peak_spilled_bytes = stats.peak_bytes_on_disk;
    engine->spill_writes = stats.writes;
    engine->spill_reads = stats.reads;
}

/* What start_spills stops at: bytes still to move off the pool. */
typedef struct {
    uint64_t excess;
    int pending_d2h;    /* a candidate waits for its copy out */
} spill_goal;

/* Starts writing the oldest resident spans until `excess` bytes are being
 * written; a span whose copy out is still queued stops the walk of the
 * GPU's order (the ones after it are queued later). */
static int
start_one(offload_engine *engine, StorageCopy *copy, void *ctx)
{
    spill_goal *goal = ctx;
    if (goal->excess == 0)
        return 1;
    if (copy->spill_phase != SPILL_RESIDENT || copy->block.ptr == NULL ||
        copy->block.fallback || copy->fetched != NULL || copy->restoring > 0 ||
        copy->spill_pins > 0 || copy->h2d_done != NULL || copy->nbytes == 0)
        return 0;
    /* a failed query counts as not completed (the walk goes on later) */
    int done = offload_device_d2h_done(engine, copy);
    if (done < 0)
        PyErr_Clear();
    if (done <= 0) {
        goal->pending_d2h = 1;
        return 1;
    }
    copy->spill = spill_submit_write(engine->spill, copy->block.ptr, copy->nbytes);
    if (copy->spill == NULL)
        return 1;   /* no memory for a slot: the pool falls back */
    copy->spill_phase = SPILL_WRITING;
    engine->spill_writing_bytes += copy->block.size;
    goal->excess = copy->block.size >= goal->excess ? 0 : goal->excess - copy->block.size;
    return 0;
}

static int
oldest_writing(offload_engine *engine, StorageCopy *copy, void *ctx)
{
    (void)engine;
    if (copy->spill_phase != SPILL_WRITING)
        return 0;
    *(StorageCopy **)ctx = copy;
    return 1;
}

/* Blocks, GIL released, until the oldest spilling copy's write finished,
 * or else the copies out queued so far: 0, or 1 when there is nothing to
 * wait for. */
static int
wait_for_room(offload_engine *engine, int pending_d2h)
{
    StorageCopy *copy = NULL;
    offload_walk_copies(engine, oldest_writing, &copy);
    if (copy != NULL) {
        /* another thread may free the slot (a copy of its own dying, a
         * failed write polled) or retire the tier while this one waits */
        spill_tier *tier = engine->spill;
        spill_slot *slot = copy->spill;
        spill_slot_hold(tier, slot);
        OFFLOAD_YIELD(engine, "spill.wait_for_room");
        Py_BEGIN_ALLOW_THREADS
        (void)spill_wait(tier, slot);
        spill_slot_unhold(tier, slot);
        Py_END_ALLOW_THREADS
        return 0;
    }
    if (!pending_d2h)
        return 1;
    for (int d = 0; d < MAX_CUDA_DEVICES; d++) {
        void *stream = engine->cuda[d] != NULL ? engine->cuda[d]->copy_out : NULL;
        if (stream != NULL)
            streams_wait_stream_quietly(engine->rt, stream);
    }
    return 0;
}

int
offload_spill_room(mp_state *st, uint64_t nbytes)
{
    offload_engine *engine = st->engine;
    uint64_t need = pool_class_size(nbytes);
    int synced = 0;     /* waited for the copies out once: a second time buys nothing */
    for (;;) {
        /* every turn: while this thread waited, another may have changed
         * the options or retired the tier (set_options) */
        if (!offload_tier_wanted(&engine->options) || engine->pool == NULL)
            return 0;
        if (ensure_tier(engine) < 0)
            return -1;
        uint64_t limit = engine->options.host_limit_bytes;
        offload_spill_poll(engine);
        offload_return_poll_all(engine);
        uint64_t in_use = pool_get_stats(engine->pool).bytes_in_use;
        /* spill ahead down to half the limit: the writes run beside the
         * forward, and backward reads back into the other half */
        uint64_t after = in_use - engine->spill_writing_bytes + need;
        spill_goal goal = {after > limit / 2 ? after - limit / 2 : 0, 0};
        offload_walk_copies(engine, start_one, &goal);
        if (in_use + need <= limit || wait_for_room(engine, goal.pending_d2h && !synced) != 0)
            return 0;
        synced |= goal.pending_d2h;
    }
}

/* A pool buffer for reading `copy` back: a cached one with the GIL held,
 * else one allocated without it. 0, or -1 when the pool had none. */
static int
acquire_for_read(offload_engine *engine, StorageCopy *copy, pool_block *block)
{
    if (pool_acquire_cached(engine->pool, copy->nbytes, block) == 0)
        return 0;
    /* pinned memory at the limit while buffers of inputs used in place
     * wait on their copies out: wait for those copies rather than read
     * into pageable memory */
    uint64_t limit = offload_pool_limit(engine);
    while (limit != 0 &&
           pool_get_stats(engine->pool).bytes_reserved + pool_class_size(copy->nbytes) > limit &&
           offload_return_wait_stream(engine) > 0) {
        if (pool_acquire_cached(engine->pool, copy->nbytes, block) == 0)
            return 0;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = pool_acquire(engine->pool, copy->nbytes, block);
    Py_END_ALLOW_THREADS
    return status;
}

/* Queues reading an on-disk copy back into `block` (the copy takes it). */
static void
start_read(offload_engine *engine, StorageCopy *copy, pool_block *block)
{
    MP_ASSERT(copy->spill_phase == SPILL_ON_DISK && copy->block.ptr == NULL);
    copy->block = *block;
    memset(block, 0, sizeof *block);
    if (spill_submit_read(engine->spill, copy->spill, copy->block.ptr) == 0)
        copy->spill_phase = SPILL_READING;
    else    /* cannot happen: an on-disk slot is idle and written */
        MP_ASSERT(0);
}

/* Reads the group's on-disk spans back while they fit under the limit:
 * 1 when one did not (stop), 0 to go on, -1 on error. Acquiring a buffer
 * lets other threads run: the group is held, and a copy read back by
 * another thread meanwhile gives the buffer back. */
static int
read_group(offload_engine *engine, OffloadGroup *group)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(group->copies); i++) {
        StorageCopy *copy = (StorageCopy *)PyTuple_GET_ITEM(group->copies, i);
        if (copy->spill_phase != SPILL_ON_DISK)
            continue;
        uint64_t in_use = pool_get_stats(engine->pool).bytes_in_use;
        if (in_use + pool_class_size(copy->nbytes) > engine->options.host_limit_bytes)
            return 1;
        pool_block block = {0};
        if (acquire_for_read(engine, copy, &block) < 0)
            return 1;
        if (block.fallback || copy->spill_phase != SPILL_ON_DISK) {
            pool_release(engine->pool, &block);
            if (block.fallback)
                return 1;
            continue;
        }
        start_read(engine, copy, &block);
    }
    return 0;
}

int
offload_spill_readahead(mp_state *st, OffloadGroup *group)
{
    offload_engine *engine = st->engine;
    offload_spill_leave_forked(engine);
    if (engine->spill == NULL || engine->pool == NULL)
        return 0;
    offload_spill_poll(engine);
    offload_return_poll_all(engine);
    /* backward runs this thread's groups newest first: read the ones it
     * reaches next, as far as the limit allows */
    OffloadGroup *at = (OffloadGroup *)Py_NewRef(group);
    int stop = 0;
    while (at != NULL && !stop) {
        if (at->thread == group->thread && !at->handed_back)
            stop = read_group(engine, at);
        OffloadGroup *prev = at->linked ? at->prev : NULL;
        Py_XINCREF(prev);
        Py_SETREF(at, prev);
    }
    Py_XDECREF(at);
    return 0;
}

/* Waits, GIL released, for the copy's request; counts a read stall when
 * the copy back had to wait for the disk. */
static void
wait_request(offload_engine *engine, StorageCopy *copy)
{
    spill_tier *tier = engine->spill;
    spill_slot *slot = copy->spill;
    if (spill_done(tier, slot))
        return;
    engine->spill_read_stalls++;
    /* another thread's poll may finish the request and free the slot
     * while this one waits (spill.h, "Holds") */
    spill_slot_hold(tier, slot);
    OFFLOAD_YIELD(engine, "spill.wait_request");
    Py_BEGIN_ALLOW_THREADS
    (void)spill_wait(tier, slot);
    spill_slot_unhold(tier, slot);
    Py_END_ALLOW_THREADS
}

/* One step of offload_spill_ready: 1 when the span is in its block, 0 to
 * look again (the GIL was released), -1 with an error. The caller holds
 * the copy. */
static int
ready_step(offload_engine *engine, StorageCopy *copy)
{
    pool_block block = {0};
    switch (copy->spill_phase) {
    case SPILL_WRITING:     /* still in its block: keep it there */
        wait_request(engine, copy);
        if (copy->spill_phase == SPILL_WRITING)
            finish_write(engine, copy, 1);
        return 0;
    case SPILL_ON_DISK:
        engine->spill_read_stalls++;
        if (acquire_for_read(engine, copy, &block) < 0) {
            PyErr_NoMemory();
            return -1;
        }
        if (block.fallback)
            offload_warn_fallback(engine, copy->nbytes, 1);
        if (copy->spill_phase != SPILL_ON_DISK)
            pool_release(engine->pool, &block);
        else
            start_read(engine, copy, &block);
        return 0;
    case SPILL_FORKED:
        PyErr_Format(PyExc_RuntimeError,
                     "matepoint: this process was forked after a forward that sent offloaded "
                     "inputs to spill_dir %s; a forked child cannot read them back (the disk "
                     "tier and its threads stay with the parent): run backward in the "
                     "process that ran the forward, or start workers with the spawn or "
                     "forkserver method", engine->spill_dir);
        return -1;
    case SPILL_READING:
        wait_request(engine, copy);
        if (copy->spill_phase != SPILL_READING)
            return 0;
        int status = spill_status(engine->spill, copy->spill);
        if (status == EBADMSG) {
            PyErr_Format(PyExc_RuntimeError,
                         "matepoint: an offloaded input read back from spill_dir %s (an unnamed "
                         "file of %llu bytes) does not match what was written to it: the file "
                         "was changed outside matepoint (through /proc/<pid>/fd, or by the "
                         "disk); its gradients would be wrong, so backward stops here",
                         engine->spill_dir, (unsigned long long)copy->nbytes);
            return -1;
        }
        if (status != 0) {
            errno = status;
            PyErr_Format(PyExc_OSError,
                         "matepoint: reading an offloaded input back from spill_dir %s failed "
                         "(%s)", engine->spill_dir, strerror(status));
            return -1;
        }
        finish_read(engine, copy);
        return 1;
    default:
        return 1;
    }
}

int
offload_spill_ready(mp_state *st, StorageCopy *copy)
{
    offload_engine *engine = st->engine;
    offload_spill_leave_forked(engine);
    offload_spill_leave_copy(engine, copy, NULL);     /* one no walk reaches */
    if (copy->spill_phase == SPILL_RESIDENT || copy->spill_phase == SPILL_STAYS)
        return 0;
    Py_INCREF(copy);
    int step;
    do {
        step = ready_step(engine, copy);
    } while (step == 0);
    if (step > 0)
        warn_failure_once(engine);
    Py_DECREF(copy);
    return step < 0 ? -1 : 0;
}

/* Keeps a busy slot, with the block its request uses, until it finished. */
static int
adopt_orphan(offload_engine *engine, StorageCopy *copy)
{
    if (engine->orphan_count == engine->orphan_capacity) {
        int capacity = engine->orphan_capacity ? 2 * engine->orphan_capacity : 16;
        struct spill_orphan *grown =
            PyMem_Realloc(engine->orphans, (size_t)capacity * sizeof(*grown));
        if (grown == NULL)
            return -1;
        engine->orphans = grown;
        engine->orphan_capacity = capacity;
    }
    struct spill_orphan *orphan = &engine->orphans[engine->orphan_count++];
    orphan->slot = copy->spill;
    orphan->block = copy->block;
    orphan->writing = copy->spill_phase == SPILL_WRITING;
    memset(&copy->block, 0, sizeof copy->block);
    return 0;
}

void
offload_spill_forget(offload_engine *engine, StorageCopy *copy)
{
    if (copy->spill == NULL)
        return;
    offload_spill_leave_forked(engine);
    offload_spill_leave_copy(engine, copy, NULL);     /* one no walk reaches */
    if (copy->spill == NULL)
        return;
    int busy = !spill_done(engine->spill, copy->spill);
    if (busy && adopt_orphan(engine, copy) == 0) {
        copy->spill = NULL;
        return;
    }
    /* idle, or no memory to remember it: the one wait on the disk with the GIL */
    if (copy->spill_phase == SPILL_WRITING) {
        (void)spill_wait(engine->spill, copy->spill);
        mp_counter_sub(&engine->spill_writing_bytes, copy->block.size);
    }
    spill_slot_free(engine->spill, copy->spill);
    copy->spill = NULL;
}
