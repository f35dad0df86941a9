/* Launches that land only what their kernel needs (cudart_sim_internal.h).
 *
 * On a GPU a kernel runs after everything queued before it on its stream
 * and, through that stream's waits, after what each wait's event was
 * recorded after on another stream. The CPU runs the kernel at its launch,
 * so of all that, what reads or writes the kernel's memory must have run
 * by then; the rest (a copy the stream waits for that uses other memory, a
 * kernel writing elsewhere) stays queued, as late as CUDA allows. Landing
 * everything queued on the stream instead, waits included, runs every copy
 * the stream waits for at its next kernel, and hides a reuse of that copy's
 * memory by another stream not ordered after the wait: the allocator's
 * record_stream, which orders that reuse, could then be dropped unseen.
 *
 * A stream still runs in order: landing one of its operations runs all
 * that precede it there, completing their waits in full. Only work on
 * other streams that the memory does not depend on stays behind. */
#include "cudart_sim_internal.h"

#include <stdlib.h>

/* On `stream`, what uses the memory among the operations queued up to
 * order `upto` (inclusive) must run. */
typedef struct {
    sim_stream *stream;
    uint64_t upto;
} land_item;

/* One launch's work list (a stack) and the memory its kernel uses. */
typedef struct {
    land_item *items;
    size_t count, cap;
    const cudart_sim_span *spans;
    size_t n_spans;
    uint64_t pass;              /* marks the streams this launch looked at */
} land_work;

static int
uses_span(const land_work *work, const void *ptr, size_t bytes)
{
    const char *start = ptr;
    for (size_t i = 0; i < work->n_spans; i++) {
        const char *lo = work->spans[i].ptr;
        if (start < lo + work->spans[i].bytes && lo < start + bytes)
            return 1;
    }
    return 0;
}

/* Does `op` read or write the memory? A wait or a record uses none: what
 * a wait is ordered after is followed instead. */
static int
op_uses(const sim_op *op, const land_work *work)
{
    switch (op->kind) {
    case OP_COPY:
        return uses_span(work, op->dst, op->bytes) || uses_span(work, op->src, op->bytes);
    case OP_KERNEL:
        for (size_t i = 0; i < work->n_spans; i++) {
            const char *lo = work->spans[i].ptr;
            if (sim_kernel_touches(op->kernel, lo, lo + work->spans[i].bytes))
                return 1;
        }
        return 0;
    case OP_WAIT:
    case OP_RECORD:
        return 0;
    }
    return 0;
}

static int
push(land_work *work, sim_stream *stream, uint64_t upto)
{
    if (work->count == work->cap) {
        size_t cap = work->cap ? 2 * work->cap : 16;
        land_item *grown = realloc(work->items, cap * sizeof(*grown));
        if (grown == NULL)
            return -1;
        work->items = grown;
        work->cap = cap;
    }
    work->items[work->count++] = (land_item){.stream = stream, .upto = upto};
    return 0;
}

/* A queued wait not met yet: its event's record and what precedes it on
 * the recording stream come before. (No record queued: the wait can never
 * be met; running the stream up to it says so.) */
static int
push_wait(land_work *work, const sim_op *wait)
{
    uint64_t order;
    if (sim_generation_done(wait->event, wait->generation))
        return 0;
    sim_stream *source = sim_find_record_locked(wait->event, wait->generation, &order);
    return source == NULL ? 0 : push(work, source, order);
}

/* Runs `item.stream` up to its last operation using the memory, after
 * noting the waits queued past it for what they are ordered after. Each
 * stream is looked at once per launch for each order: the parts looked
 * at before are skipped. */
static int
land_one(land_work *work, land_item item)
{
    sim_stream *s = item.stream;
    if (!sim_stream_alive(s))
        return CUDART_SUCCESS;      /* a destroyed stream whose queue ran dry */
    uint64_t from = s->land_pass == work->pass ? s->land_below : 0;
    if (from > item.upto)
        return CUDART_SUCCESS;
    s->land_pass = work->pass;
    s->land_below = item.upto == UINT64_MAX ? UINT64_MAX : item.upto + 1;
    const sim_op *last = NULL;
    for (size_t i = s->head + s->count; i > s->head && last == NULL; i--) {
        const sim_op *op = &s->ops[i - 1];
        if (op->order > item.upto)
            continue;
        if (op->order < from)
            break;
        if (op_uses(op, work))
            last = op;
        else if (op->kind == OP_WAIT && push_wait(work, op) < 0)
            return CUDART_ERROR_MEMORY_ALLOCATION;
    }
    return last == NULL ? CUDART_SUCCESS : sim_run_stream_until_locked(s, last->order, 0);
}

int
sim_land_for_locked(sim_stream *stream, const cudart_sim_span *spans, size_t n_spans)
{
    land_work work = {.spans = spans, .n_spans = n_spans, .pass = ++sim_gpu.land_passes};
    int status = push(&work, stream, UINT64_MAX) < 0 ? CUDART_ERROR_MEMORY_ALLOCATION
                                                     : CUDART_SUCCESS;
    while (status == CUDART_SUCCESS && work.count > 0) {
        work.count--;
        status = land_one(&work, work.items[work.count]);
    }
    free(work.items);
    /* out of memory: landing all the stream's work is never too little (the
     * stream is live: a launch resolved it, and landing frees no live one) */
    if (status == CUDART_ERROR_MEMORY_ALLOCATION)
        status = sim_drain_locked(stream);
    return status;
}
