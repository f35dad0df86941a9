/* Stopping the disk tier (set_options changing spill_dir, the engine
 * going away): the tier is taken off the engine with the GIL held, so no
 * other thread reaches it any more, then stopped with the GIL released
 * (the contract: offload_internal.h, "The disk tier"). */
#include "offload_internal.h"

#include <string.h>

void
offload_spill_detach(offload_engine *engine, offload_spill_retired *retired)
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
    offload_spill_detach(engine, &retired);
    offload_spill_retire(engine, &retired);
}
