/* The simulated GPU's scheduler: per-stream queues run oldest first
 * (kernels last), or only as far as a blocking call needs; the memory ranges handed out; the
 * entry and exit of every runtime call. Contract: cudart_sim_internal.h. */
#include "cudart_sim_internal.h"
#include "common/host_memory.h"
#include "common/mp_assert.h"

#include <stdlib.h>
#include <string.h>

/* ---- queues ------------------------------------------------------------------ */

int
sim_event_done(const sim_event *event)
{
    return event->completed >= event->recorded;
}

void
sim_event_release(sim_event *event)
{
    MP_ASSERT(event->refs > 0);
    if (--event->refs == 0)
        free(event);
}

int
sim_generation_done(const sim_event *event, uint64_t generation)
{
    if (event->completed == generation || generation == 0)
        return 1;
    uint64_t order;
    return event->completed > generation &&
           sim_find_record_locked(event, generation, &order) == NULL;
}

static int
op_runnable(const sim_op *op)
{
    return op->kind != OP_WAIT || sim_generation_done(op->event, op->generation);
}

static void
op_run(sim_op *op)
{
    sim_gpu.stats.ops_run++;
    switch (op->kind) {
    case OP_COPY:
        memcpy(op->dst, op->src, op->bytes);
        free(op->staged);
        sim_gpu.stats.copies_run++;
        return;
    case OP_RECORD:
        if (op->generation > op->event->completed)
            op->event->completed = op->generation;
        sim_event_release(op->event);
        return;
    case OP_WAIT:
        sim_event_release(op->event);
        return;
    case OP_KERNEL:
        sim_kernel_land(op->kernel);
        return;
    }
}

void
sim_stream_unlink_and_free(sim_stream *stream)
{
    for (sim_stream **link = &sim_gpu.streams; *link != NULL; link = &(*link)->next) {
        if (*link == stream) {
            *link = stream->next;
            break;
        }
    }
    mp_counter_sub(&sim_gpu.stats.streams_live, 1);
    if (stream->capture != 0)
        mp_counter_sub(&sim_gpu.captures, 1);
    free(stream->ops);
    free(stream);
}

int
sim_stream_alive(const sim_stream *stream)
{
    for (int d = 0; d < CUDART_SIM_DEVICES; d++) {
        if (stream == &sim_gpu.legacy[d])
            return 1;
    }
    for (const sim_stream *s = sim_gpu.streams; s != NULL; s = s->next) {
        if (s == stream)
            return 1;
    }
    return 0;
}

static sim_stream *
first_stream(void)
{
    return &sim_gpu.legacy[0];
}

/* Streams are walked as legacy[0..n) followed by the created list. */
static sim_stream *
next_stream(sim_stream *s)
{
    if (s >= sim_gpu.legacy && s < sim_gpu.legacy + CUDART_SIM_DEVICES - 1)
        return s + 1;
    if (s == &sim_gpu.legacy[CUDART_SIM_DEVICES - 1])
        return sim_gpu.streams;
    return s->next;
}

/* Runs the head operation of `stream`, which must be runnable. */
static void
pop_and_run_locked(sim_stream *stream)
{
    sim_op op = stream->ops[stream->head];
    stream->head++;
    stream->count--;
    mp_counter_sub(&sim_gpu.stats.ops_queued, 1);
    if (stream->count == 0 && stream->destroyed)
        sim_stream_unlink_and_free(stream);
    op_run(&op);
}

/* The stream whose head runs next on its own: the oldest runnable head but
 * a kernel, else (`kernels_too` set) the oldest kernel. Adversarial on
 * purpose: copies go as early as their waits allow and kernels' results
 * land as late as possible, so a copy not ordered after its producer reads
 * poison even on a GPU that keeps up. NULL when nothing can run. */
static sim_stream *
next_to_run_locked(int kernels_too)
{
    sim_stream *oldest = NULL;
    for (int kernels = 0; kernels <= kernels_too && oldest == NULL; kernels++) {
        for (sim_stream *s = first_stream(); s != NULL; s = next_stream(s)) {
            if (s->count == 0 || (s->ops[s->head].kind == OP_KERNEL) != kernels ||
                !op_runnable(&s->ops[s->head]))
                continue;
            if (oldest == NULL || s->ops[s->head].order < oldest->ops[oldest->head].order)
                oldest = s;
        }
    }
    return oldest;
}

static int complete_locked(sim_event *event, uint64_t generation, int depth);

/* A GPU that keeps up runs what a queued wait needs, kernels included: the
 * oldest blocked wait gets its event completed. 1 if that ran anything. */
static int
unblock_oldest_wait_locked(void)
{
    sim_op *oldest = NULL;
    for (sim_stream *s = first_stream(); s != NULL; s = next_stream(s)) {
        sim_op *head = s->count > 0 ? &s->ops[s->head] : NULL;
        if (head != NULL && !op_runnable(head) && (oldest == NULL || head->order < oldest->order))
            oldest = head;
    }
    if (oldest == NULL)
        return 0;
    uint64_t before = sim_gpu.stats.ops_run;
    (void)complete_locked(oldest->event, oldest->generation, 0);
    return sim_gpu.stats.ops_run != before;
}

/* Runs the head operation next_to_run_locked picks, or (kernels left out)
 * what the oldest blocked wait needs; 0 if nothing ran. */
static int
run_one_locked(int kernels_too)
{
    sim_stream *next = next_to_run_locked(kernels_too);
    if (next == NULL)
        return kernels_too ? 0 : unblock_oldest_wait_locked();
    pop_and_run_locked(next);
    return 1;
}

uint64_t
sim_advance_locked(uint64_t ops, int kernels_too)
{
    uint64_t ran = 0;
    while (ran < ops && run_one_locked(kernels_too))
        ran++;
    return ran;
}

/* The queued record that completes `generation` of `event`, and its stream. */
sim_stream *
sim_find_record_locked(const sim_event *event, uint64_t generation, uint64_t *order)
{
    for (sim_stream *s = first_stream(); s != NULL; s = next_stream(s)) {
        for (size_t i = s->head; i < s->head + s->count; i++) {
            if (s->ops[i].kind == OP_RECORD && s->ops[i].event == event &&
                s->ops[i].generation == generation) {
                *order = s->ops[i].order;
                return s;
            }
        }
    }
    return NULL;
}


/* Runs only what `generation` of `event` needs: its record's stream up to
 * the record, and recursively what that waits for. The least a GPU must do,
 * so everything else stays as late as CUDA allows. */
static int
complete_locked(sim_event *event, uint64_t generation, int depth)
{
    if (sim_generation_done(event, generation))
        return CUDART_SUCCESS;
    uint64_t order;
    sim_stream *stream = sim_find_record_locked(event, generation, &order);
    if (stream == NULL || depth > 64)
        return CUDART_SIM_DEADLOCK;
    return sim_run_stream_until_locked(stream, order, depth + 1);
}

int
sim_run_stream_until_locked(sim_stream *stream, uint64_t order, int depth)
{
    while (stream->count > 0 && stream->ops[stream->head].order <= order) {
        sim_op *head = &stream->ops[stream->head];
        if (!op_runnable(head)) {
            int status = complete_locked(head->event, head->generation, depth);
            if (status != CUDART_SUCCESS)
                return status;
            continue;
        }
        int last = stream->count == 1;
        pop_and_run_locked(stream);   /* may free a destroyed stream */
        if (last)
            break;
    }
    return CUDART_SUCCESS;
}

/* Runs what `event` reaching `generation` needs. */
int
sim_run_until_locked(sim_event *event, uint64_t generation)
{
    return complete_locked(event, generation, 0);
}

/* Runs what `stream`'s queued work needs, and that work. */
int
sim_drain_locked(sim_stream *stream)
{
    return sim_run_stream_until_locked(stream, UINT64_MAX, 0);
}

static int
op_touches(const sim_op *op, const char *lo, const char *hi)
{
    switch (op->kind) {
    case OP_COPY:
        return ((const char *)op->dst < hi && lo < (const char *)op->dst + op->bytes) ||
               ((const char *)op->src < hi && lo < (const char *)op->src + op->bytes);
    case OP_KERNEL:
        return sim_kernel_touches(op->kernel, lo, hi);
    case OP_WAIT:
        /* what it waits for may use the memory (a copy still reading it):
         * the new owner's work comes after it on the stream */
        return 1;
    case OP_RECORD:
        return 0;
    }
    return 0;
}

/* The last queued operation of `stream` touching the span, or -1. */
static ptrdiff_t
last_touching(const sim_stream *stream, const void *ptr, uint64_t bytes)
{
    const char *lo = ptr, *hi = lo + bytes;
    for (size_t i = stream->head + stream->count; i > stream->head; i--) {
        if (op_touches(&stream->ops[i - 1], lo, hi))
            return (ptrdiff_t)(i - 1);
    }
    return -1;
}

int
sim_stream_touches(const sim_stream *stream, const void *ptr, uint64_t bytes)
{
    return last_touching(stream, ptr, bytes) >= 0;
}

int
sim_push_locked(sim_stream *stream, sim_op op)
{
    if (stream->head + stream->count == stream->cap) {
        if (stream->head > 0) {
            memmove(stream->ops, stream->ops + stream->head, stream->count * sizeof(sim_op));
            stream->head = 0;
        } else {
            size_t cap = stream->cap ? stream->cap * 2 : 16;
            sim_op *grown = realloc(stream->ops, cap * sizeof(sim_op));
            if (grown == NULL)
                return CUDART_ERROR_MEMORY_ALLOCATION;
            stream->ops = grown;
            stream->cap = cap;
        }
    }
    op.order = sim_gpu.next_order++;
    stream->ops[stream->head + stream->count++] = op;
    sim_gpu.stats.ops_queued++;
    return CUDART_SUCCESS;
}

/* ---- devices, handles, memory ranges ---------------------------------------------- */

void
sim_use_device(int device)
{
    sim_gpu.stats.has_context[device] = 1;
}

/* The calling thread's cudaStreamPerThread stream of `device`, made at
 * its first use; NULL when out of memory. */
static sim_stream *
per_thread_stream(int device)
{
    sim_stream *s = sim_per_thread_streams[device];
    if (s == NULL && (s = calloc(1, sizeof(*s))) != NULL) {
        s->device = device;
        s->per_thread = 1;
        s->next = sim_gpu.streams;
        sim_gpu.streams = s;
        sim_per_thread_streams[device] = s;
    }
    return s;
}

/* NULL and cudaStreamLegacy are the legacy stream of `device`,
 * cudaStreamPerThread the calling thread's own stream there; any other
 * handle must be a live created stream (of whichever device). */
sim_stream *
sim_resolve_on(int device, void *handle)
{
    if (device < 0 || device >= CUDART_SIM_DEVICES)
        return NULL;
    if (handle == NULL || handle == CUDART_STREAM_LEGACY)
        return &sim_gpu.legacy[device];
    if (handle == CUDART_STREAM_PER_THREAD)
        return per_thread_stream(device);
    for (sim_stream *s = sim_gpu.streams; s != NULL; s = s->next) {
        if (s == handle && s->created && !s->destroyed)
            return s;
    }
    return NULL;
}

void *
sim_handle_of(const sim_stream *stream)
{
    if (stream->created)
        return (void *)stream;
    return stream->per_thread ? CUDART_STREAM_PER_THREAD : NULL;
}

/* A handle as the runtime's calls take it: of the current device. */
sim_stream *
sim_resolve(void *handle)
{
    return sim_resolve_on(sim_current_device, handle);
}

int
sim_add_range(void *base, size_t bytes, int device)
{
    sim_range *range = malloc(sizeof(*range));
    if (range == NULL)
        return -1;
    *range = (sim_range){.base = base, .bytes = bytes, .device = device, .next = sim_gpu.ranges};
    sim_gpu.ranges = range;
    return 0;
}

sim_range *
sim_find_range(const void *ptr)
{
    for (sim_range *r = sim_gpu.ranges; r != NULL; r = r->next) {
        if ((const char *)ptr >= r->base && (const char *)ptr < r->base + r->bytes)
            return r;
    }
    return NULL;
}

/* The host now waits for the GPU. */
void
sim_note_sync_locked(cudart_sim_entry entry)
{
    if (sim_gpu.sync_observer != NULL)
        sim_gpu.sync_observer(entry);
}

/* torch's expandable segments unmap after synchronizing the segment's own
 * stream only: work another stream still has queued on the range faults. */
static void
unmap_after_own_stream_locked(const sim_range *range)
{
    sim_stream *owner = sim_resolve_on(range->device, range->owner);
    if (owner != NULL)
        (void)sim_drain_locked(owner);
    for (sim_stream *s = first_stream(); s != NULL; s = next_stream(s)) {
        if (s->count > 0 && sim_stream_touches(s, range->base, range->bytes)) {
            sim_gpu.stats.unmap_faults++;
            return;
        }
    }
}

/* Frees what sim_host_alloc (pinned) or sim_malloc (device memory) handed
 * out at `ptr`; anything else is refused and left alone. The host waits
 * for the GPU, as cudaFreeHost and cudaFree do. */
int
sim_free_range_locked(void *ptr, int pinned, cudart_sim_entry entry)
{
    sim_range **link = &sim_gpu.ranges;
    while (*link != NULL && (*link)->base != ptr)
        link = &(*link)->next;
    sim_range *range = *link;
    if (range == NULL || (range->device == -1) != pinned)
        return CUDART_ERROR_INVALID_VALUE;
    sim_note_sync_locked(entry);
    if (!pinned && sim_gpu.expandable)
        unmap_after_own_stream_locked(range);
    sim_advance_locked(UINT64_MAX, 1);
    if (pinned)
        mp_counter_sub(&sim_gpu.stats.host_bytes_live, range->bytes);
    else
        mp_counter_sub(&sim_gpu.stats.device_bytes_live[range->device], range->bytes);
    *link = range->next;
    free(range);
    mp_host_free(ptr);
    return CUDART_SUCCESS;
}

/* ---- entry and exit of every runtime call ------------------------------------------ */

/* Takes the lock, counts the call, lets the "GPU" make its progress and
 * says whether an injected failure applies (its status, else success). */
int
sim_enter(cudart_sim_entry entry)
{
    pthread_mutex_lock(&sim_gpu.lock);
    sim_gpu.stats.calls[entry]++;
    /* the GPU on its own: a kernel lands only when something needs it. A
     * call that only reads or sets the calling thread's own state (its
     * capture mode) is no clock: the GPU lags as far behind the engine's
     * work whether or not the engine guards each call against a capture */
    if (entry != SIM_THREAD_EXCHANGE_STREAM_CAPTURE_MODE)
        sim_advance_locked(sim_gpu.progress_per_call, 0);
    sim_failure *failure = &sim_gpu.failures[entry];
    if (failure->skip > 0) {
        failure->skip--;
        return CUDART_SUCCESS;
    }
    if (failure->count == 0)
        return CUDART_SUCCESS;
    failure->count--;
    return failure->status;
}

void
sim_log_wait_locked(const sim_stream *waiter, const sim_event *event)
{
    if (!sim_gpu.wait_log_on)
        return;
    if (sim_gpu.wait_log_count == sim_gpu.wait_log_capacity) {
        size_t capacity = sim_gpu.wait_log_capacity ? 2 * sim_gpu.wait_log_capacity : 64;
        cudart_sim_wait *grown = realloc(sim_gpu.wait_log, capacity * sizeof(*grown));
        if (grown == NULL)
            return;
        sim_gpu.wait_log = grown;
        sim_gpu.wait_log_capacity = capacity;
    }
    const sim_stream *source = event->recorded_on;
    /* a legacy source is known only by the device its event belongs to */
    sim_gpu.wait_log[sim_gpu.wait_log_count++] = (cudart_sim_wait){
        .waiter_device = waiter->device,
        .waiter = sim_handle_of(waiter),
        .source_device = event->recorded == 0 ? -1 : event->device,
        .source = (void *)source,
    };
}

int
sim_leave(int status)
{
    pthread_mutex_unlock(&sim_gpu.lock);
    if (status != CUDART_SUCCESS)
        sim_last_error = status;
    return status;
}
