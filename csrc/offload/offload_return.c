/* Returning host buffers to the pool in stream order (torch's
 * CachingHostAllocator: record at free, query at reuse).
 *
 * A StorageCopy that dies while a copy still reads or writes its host
 * buffer does not make the host wait for that copy: it hands the buffer to
 * its device with the event of the last such copy. The pool counts it
 * free at once (pool_release_pending) and caches it again once the event
 * is seen complete: when a span finds the pool's cache empty
 * (offload_return_poll), when the pool's counters are read or its cache
 * emptied, and, waiting for it, when the device goes away or the runtime
 * changes.
 *
 * Owns each device's `returning` list (buffers with their last event).
 * Floor `return`: called by the window, spill, copy, save and engine
 * files; calls only device and streams. It never polls on its own: its
 * callers above do, at the moments just named. GIL held. */
#include "offload_internal.h"
#include "streams.h"

void
offload_return_after(offload_engine *engine, offload_device *device, pool_block *block,
                     void *event, void *stream)
{
    MP_ASSERT(block->ptr != NULL && event != NULL);
    if (device->returning_count == device->returning_capacity) {
        int capacity = device->returning_capacity ? 2 * device->returning_capacity : 16;
        returning_block *grown =
            PyMem_Realloc(device->returning, (size_t)capacity * sizeof(*grown));
        if (grown == NULL) {
            /* no memory to remember it: the one host wait left */
            streams_wait_event_quietly(engine->rt, event);
            pool_release(engine->pool, block);
            offload_device_give_event(engine, device, event);
            return;
        }
        device->returning = grown;
        device->returning_capacity = capacity;
    }
    pool_release_pending(engine->pool, block);
    device->returning[device->returning_count++] = (returning_block){*block, event, stream};
    *block = (pool_block){0};
}

/* Events on one stream complete in the order they were recorded: on each
 * stream the first one not complete ends the walk for that stream (as
 * torch's host allocator stops at its first event not ready), so a lagging
 * GPU costs one query per stream. Buffers whose stream is not known count
 * as one stream: their events complete roughly in the order the copies
 * died. A failing query is cleared and blocks its stream too: the buffer
 * stays until the device goes. Past BLOCKED_MAX streams blocked, the rest
 * waits for the next poll. */
#define BLOCKED_MAX 8

static int
is_blocked(void *const *blocked, int count, void *stream)
{
    for (int i = 0; i < count; i++) {
        if (blocked[i] == stream)
            return 1;
    }
    return count == BLOCKED_MAX;
}

int
offload_return_poll(offload_engine *engine, offload_device *device)
{
    void *blocked[BLOCKED_MAX];
    int blocked_count = 0, returned = 0, kept = 0;
    for (int i = 0; i < device->returning_count; i++) {
        returning_block entry = device->returning[i];
        int status, done = 0;
        if (!is_blocked(blocked, blocked_count, entry.stream)) {
            done = cudart_event_done(engine->rt, entry.event, &status);
            if (done < 0)
                (void)engine->rt->get_last_error();
        }
        if (done > 0) {
            pool_recycle(engine->pool, &entry.block);
            offload_device_give_event(engine, device, entry.event);
            returned++;
            continue;
        }
        if (!is_blocked(blocked, blocked_count, entry.stream))
            blocked[blocked_count++] = entry.stream;
        device->returning[kept++] = entry;     /* order kept */
    }
    MP_ASSERT(kept + returned == device->returning_count);
    device->returning_count = kept;
    return returned;
}

void
offload_return_poll_all(offload_engine *engine)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL)
            (void)offload_return_poll(engine, engine->cuda[i]);
    }
}

int
offload_return_wait_stream(offload_engine *engine)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        offload_device *device = engine->cuda[i];
        /* a stream, unlike an event, lives as long as its device: another
         * thread may poll and recycle the entry's event while this one waits */
        void *stream = NULL;
        for (int k = 0; device != NULL && stream == NULL && k < device->returning_count; k++)
            stream = device->returning[k].stream;
        if (stream == NULL)
            continue;
        streams_wait_stream_quietly(engine->rt, stream);
        return offload_return_poll(engine, device) > 0;
    }
    return 0;
}

void
offload_return_drain(offload_engine *engine, offload_device *device)
{
    /* each wait lets other threads run, which poll the list (recycling
     * entries not waited on here) or add to it: it is taken off the device
     * first; what was added meanwhile is drained next turn */
    while (device->returning_count > 0) {
        returning_block *entries = device->returning;
        int count = device->returning_count;
        device->returning = NULL;
        device->returning_count = device->returning_capacity = 0;
        for (int i = 0; i < count; i++) {
            OFFLOAD_YIELD(engine, "return.drain");
            streams_wait_event_quietly(engine->rt, entries[i].event);
            pool_recycle(engine->pool, &entries[i].block);
            offload_device_give_event(engine, device, entries[i].event);
        }
        PyMem_Free(entries);
    }
    PyMem_Free(device->returning);
    device->returning = NULL;
    device->returning_capacity = 0;
}
