/* The disk tier in a forked child (fork without exec: os.fork, a
 * fork-started worker): the child has none of the tier's threads, so it
 * leaves the parent's tier and files alone (spill.h, "Fork"), keeps the
 * spans its own memory holds, and starts a tier of its own at its first
 * spill (the contract: offload_internal.h, the spill section).
 *
 * Owns nothing of its own: it lets go of the parent's tier (the engine's
 * `spill` and orphans) and of each copy's slot of it. Floor `spill`, its
 * bottom: called by offload_spill.c and offload_spill_retire.c; calls
 * records (the walk over the groups). GIL held. */
#include "offload_internal.h"

/* A copy whose slot is a parent tier's: the span is in its block still
 * when the tier was writing it or had read it back (resident again), else
 * only in the parent's file (SPILL_FORKED; a read under way goes with its
 * block). The slot is freed without touching the parent's file. Runs no
 * Python code. */
int
offload_spill_leave_copy(offload_engine *engine, StorageCopy *copy, void *ctx)
{
    (void)ctx;
    if (copy->spill == NULL || !spill_slot_forked(copy->spill))
        return 0;
    int phase = copy->spill_phase;
    MP_ASSERT(phase == SPILL_WRITING || phase == SPILL_ON_DISK || phase == SPILL_READING);
    if (phase == SPILL_WRITING)
        mp_counter_sub(&engine->spill_writing_bytes, copy->block.size);
    int in_block = phase == SPILL_WRITING ||
                   (phase == SPILL_READING && spill_status(engine->spill, copy->spill) == 0);
    if (!in_block && copy->block.ptr != NULL)
        pool_release(engine->pool, &copy->block);
    copy->spill_phase = in_block ? SPILL_RESIDENT : SPILL_FORKED;
    spill_slot_free(engine->spill, copy->spill);
    copy->spill = NULL;
    return 0;
}

void
offload_spill_leave_forked(offload_engine *engine)
{
    if (engine->spill == NULL || !spill_in_forked_child(engine->spill))
        return;
    offload_walk_copies(engine, offload_spill_leave_copy, NULL);
    for (int i = 0; i < engine->orphan_count; i++) {
        struct spill_orphan *orphan = &engine->orphans[i];
        if (orphan->writing)
            mp_counter_sub(&engine->spill_writing_bytes, orphan->block.size);
        if (orphan->block.ptr != NULL)
            pool_release(engine->pool, &orphan->block);
        spill_slot_free(engine->spill, orphan->slot);
    }
    engine->orphan_count = 0;
    engine->spill = NULL;       /* its memory stays, for slots copies still hold */
    engine->spilled_bytes = 0;
}
