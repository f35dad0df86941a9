/* The disk tier's settings and its stop: set_options checks spill_dir and
 * changes or stops the tier, and the engine going away stops it. A tier to
 * stop is taken off the engine with the GIL held, so no other thread
 * reaches it any more, then stopped with the GIL released (the contract:
 * offload_internal.h, the spill section).
 *
 * Owns a retired tier (offload_spill_retired) from its detach to its
 * stop. Floor `spill`, its top: called by csrc/module (set_options) and
 * the engine; calls offload_spill.c (a poll, before deciding the tier is
 * idle), offload_spill_fork.c and limits. GIL held on entry. */
#include "offload_internal.h"

#include <string.h>
#include <unistd.h>

int
offload_spill_check_dir(const char *path)
{
    char why[512];
    int fd = spill_dir_open(path, why, sizeof why);
    if (fd < 0) {
        PyErr_Format(PyExc_ValueError, "matepoint option spill_dir: %s", why);
        return -1;
    }
    close(fd);
    return 0;
}

/* Takes the tier and its orphans off the engine, GIL held: from here no
 * other thread reaches them (spill_destroy's rule, spill.h); the caller
 * stops them with offload_spill_retire(). */
static void
detach(offload_engine *engine, offload_spill_retired *retired)
{
    retired->tier = engine->spill;
    retired->orphans = engine->orphans;
    retired->orphan_count = engine->orphan_count;
    for (int i = 0; i < engine->orphan_count; i++) {
        if (engine->orphans[i].writing)
            mp_counter_sub(&engine->spill_writing_bytes, engine->orphans[i].block.size);
    }
    engine->spill = NULL;
    engine->orphans = NULL;
    engine->orphan_count = engine->orphan_capacity = 0;
    /* pool_stats()' figures of the tier are the current tier's: none now
     * (a new tier counts from 0; kept, the old tier's would read as the new
     * one's until its first poll, and counts would seem to go back) */
    engine->spilled_bytes = engine->peak_spilled_bytes = 0;
    engine->spill_writes = engine->spill_reads = 0;
}

static int
tier_busy(offload_engine *engine)
{
    offload_spill_poll(engine);
    return engine->orphan_count > 0 || spill_get_stats(engine->spill).slots > 0;
}

int
offload_spill_configure(offload_engine *engine, const offload_options *options,
                        offload_spill_retired *retired)
{
    memset(retired, 0, sizeof *retired);
    offload_spill_leave_forked(engine);
    if (engine->spill == NULL ||
        (offload_tier_wanted(options) && strcmp(options->spill_dir, engine->spill_dir) == 0))
        return 0;
    if (tier_busy(engine)) {
        PyErr_Format(PyExc_RuntimeError,
                     "matepoint: spill_dir cannot change, nor the disk tier stop, while "
                     "offloaded inputs are in %s (%llu bytes): change it between steps",
                     engine->spill_dir,
                     (unsigned long long)engine->spilled_bytes);
        return -1;
    }
    detach(engine, retired);
    return 0;
}

void
offload_spill_retire(offload_engine *engine, offload_spill_retired *retired)
{
    if (retired->tier == NULL)
        return;
    OFFLOAD_YIELD(engine, "spill.retire");
    pool *pool = engine->pool;
    /* the GIL goes: what is left of the tier is this thread's alone */
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < retired->orphan_count; i++) {
        struct spill_orphan *orphan = &retired->orphans[i];
        spill_slot_free(retired->tier, orphan->slot);     /* waits for its request */
        if (orphan->block.ptr != NULL)
            pool_release(pool, &orphan->block);
    }
    spill_destroy(retired->tier);
    Py_END_ALLOW_THREADS
    PyMem_Free(retired->orphans);
    memset(retired, 0, sizeof *retired);
}

void
offload_spill_free(offload_engine *engine)
{
    offload_spill_leave_forked(engine);
    if (engine->spill == NULL)
        return;
    offload_spill_retired retired;
    detach(engine, &retired);
    offload_spill_retire(engine, &retired);
}
