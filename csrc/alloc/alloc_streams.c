/* Per-stream state of a device and the events of cross-stream frees
 * (torch's insert_events / process_events). Contract: alloc_internal.h. */
#include "alloc_internal.h"

#include <stdlib.h>

/* ---- streams --------------------------------------------------------------- */

stream_state *
stream_get(device_state *dev, private_pool *pool, void *stream, int device)
{
    stream_state **list = stream_list(dev, pool);
    stream_state *s = stream_find_in(list, stream, device);
    if (s == NULL && (s = calloc(1, sizeof(*s))) != NULL) {
        s->stream = stream;
        s->device = device;
        s->pool = pool;
        s->next = *list;
        *list = s;
    }
    return s;
}

static int
stream_unused(const stream_state *s)
{
    return s->segments == 0 && s->head == NULL;
}

void
stream_drop_if_unused(device_state *dev, stream_state *s)
{
    if (!stream_unused(s))
        return;
    for (stream_state **link = stream_list(dev, s->pool); *link != NULL; link = &(*link)->next) {
        if (*link == s) {
            *link = s->next;
            free(s);
            return;
        }
    }
    MP_ASSERT(0);   /* a stream state missing from its device's list */
}

#if MP_ASSERTS_ACTIVE
/* The queue of pending events is empty at both ends or at neither, and
 * its tail is its last element. */
static int
queue_consistent(const stream_state *s)
{
    return (s->head == NULL) == (s->tail == NULL) && (s->tail == NULL || s->tail->next == NULL);
}
#endif

/* Keeps a retired event and its node for the next cross-stream free
 * (torch's event pool: no create and destroy per free), up to
 * SPARE_EVENTS_MAX per device. */
static void
event_give_spare(allocator *a, device_state *dev, pending_event *e)
{
    if (dev->spare_count >= SPARE_EVENTS_MAX || e->device != dev->index) {
        a->backend.event_free(a->backend.ctx, e->event);
        free(e);
        return;
    }
    e->b = NULL;
    e->next = dev->spare_events;
    dev->spare_events = e;
    dev->spare_count++;
}

/* A node for an event of a stream of `device`: a spare with its
 * completed event (the block's device only), or a new node with none. */
static pending_event *
event_take_spare(device_state *dev, int device)
{
    pending_event *e = device == dev->index ? dev->spare_events : NULL;
    if (e == NULL) {
        e = calloc(1, sizeof(*e));
        if (e != NULL)
            e->device = device;
        return e;
    }
    dev->spare_events = e->next;
    mp_counter_sub(&dev->spare_count, 1);
    e->next = NULL;
    return e;
}

void
events_free_spares(allocator *a, device_state *dev)
{
    events_free_chain(a, dev->spare_events);
    dev->spare_events = NULL;
    dev->spare_count = 0;
}

/* Retires the events frees recorded on one stream, oldest first, up to the
 * first one not complete: later ones on the same stream cannot be complete
 * before it, so querying them would only cost (torch's process_events).
 * With `wait`, waits for each instead. A block whose last event completed
 * returns to its stream's free blocks. Lock held. */
/* Retires the oldest event of `s`, complete: its block returns to its
 * stream's free blocks once its last event did. Lock held. */
static void
retire_head(allocator *a, device_state *dev, stream_state *s)
{
    pending_event *e = s->head;
    MP_ASSERT(e->b->event_count > 0 && !e->b->allocated && !e->b->in_index);
    s->head = e->next;
    if (s->head == NULL) {
        MP_ASSERT(s->tail == e);
        s->tail = NULL;
    }
    mp_counter_sub(&dev->events_pending, 1);
    block *b = e->b;
    event_give_spare(a, dev, e);
    if (--b->event_count == 0) {
        stats_block_inactive(dev, b, NULL);
        block_insert_free(b);
    }
}

static void
retire_events(allocator *a, device_state *dev, stream_state *s, int wait)
{
    MP_ASSERT(queue_consistent(s));
    while (s->head != NULL) {
        /* a failed wait was reported (alloc_cuda.c); retiring goes on as
         * before: the pool restore, which must not free then, waits itself */
        if (wait)
            (void)a->backend.event_wait(a->backend.ctx, s->head->event);
        else if (a->backend.event_query(a->backend.ctx, s->head->event) != 1)
            return;
        retire_head(a, dev, s);
    }
}

void
events_retire_through(allocator *a, device_state *dev, stream_state *s, const pending_event *last)
{
    MP_ASSERT(queue_consistent(s));
    int done = 0;
    while (!done) {
        MP_ASSERT(s->head != NULL);     /* `last` is queued on `s` */
        done = s->head == last;
        retire_head(a, dev, s);
    }
}

/* Retires completed events of every stream (all of them if `wait`) and
 * forgets the streams left with nothing. Lock held. */
void
events_process(allocator *a, device_state *dev, int wait)
{
    /* torch's process_events records the deferred blocks' events first */
    if (dev->deferred != NULL)
        deferred_process(a, dev);
    stream_state **link = &dev->streams;
    while (*link != NULL) {
        stream_state *s = *link;
        retire_events(a, dev, s, wait);
        if (stream_unused(s)) {
            *link = s->next;
            free(s);
        } else {
            link = &s->next;
        }
    }
    MP_ASSERT(!wait || dev->events_pending == 0);
}

void
events_free_chain(allocator *a, pending_event *e)
{
    while (e != NULL) {
        pending_event *next = e->next;
        if (e->event != NULL)
            a->backend.event_free(a->backend.ctx, e->event);
        free(e);
        e = next;
    }
}

/* Records an event on each extra stream the block was used on and queues
 * it on that stream; the block returns to its free blocks once all
 * completed (torch's insert_events). Everything that can fail happens
 * before anything is queued: on -1 nothing was. */
int
events_insert(allocator *a, device_state *dev, block *b)
{
    pending_event *made = NULL;
    for (int i = 0; i < b->n_extra; i++) {
        const stream_use *use = &b->extra_streams[i];
        pending_event *e = event_take_spare(dev, use->device);
        if (e == NULL)
            goto error;
        e->b = b;
        e->next = made;
        made = e;
        /* a spare's event is recorded again; a new node gets a new one, made
         * on the stream's device (torch's insert_events enters it) */
        if (stream_get(dev, NULL, use->stream, use->device) == NULL ||
            a->backend.event_record(a->backend.ctx, use->device, use->stream,
                                    &e->event) != ALLOC_OK)
            goto error;
    }
    /* `made` holds the streams' events in reverse order */
    for (int i = b->n_extra - 1; i >= 0; i--) {
        pending_event *e = made;
        made = e->next;
        e->next = NULL;
        const stream_use *use = &b->extra_streams[i];
        stream_state *s = stream_find(dev, use->stream, use->device);
        MP_ASSERT(s != NULL && queue_consistent(s));
        if (s->tail != NULL)
            s->tail->next = e;
        else
            s->head = e;
        s->tail = e;
        b->event_count++;
        dev->events_pending++;
    }
    MP_ASSERT(made == NULL && b->event_count >= b->n_extra);
    return 0;

error:
    /* made, not queued: their events (recorded or not) go with them */
    events_free_chain(a, made);
    return -1;
}

void
block_forget_streams(block *b)
{
    if (b->extra_streams != b->extra_inline)
        free(b->extra_streams);
    b->extra_streams = NULL;
    b->n_extra = 0;
}
