/* Private to the simulated runtime (test builds only): its state and the
 * scheduler the runtime entry points share. Not part of cudart_sim.h's
 * contract.
 *
 * The files:
 * - cudart_sim_queue.c  the "GPU": per-stream queues of copies, event
 *                       records, waits and kernels, run oldest first or as little
 *                       as a blocking call needs; memory ranges handed
 *                       out; the entry and exit of every runtime call
 * - cudart_sim_calls.c  the runtime table: one function per CUDA entry point
 * - cudart_sim_kernel.c kernels that lag in data: results kept aside,
 *                       landed (or poison) when their stream reaches them
 * - cudart_sim_land.c   a launch runs only the queued work its kernel's
 *                       memory depends on
 * - cudart_sim.c        the state itself and the test controls
 *
 * Every function here but sim_enter() runs with `sim_gpu.lock` held
 * (sim_enter takes it, sim_leave releases it). */
#ifndef MATEPOINT_CUDART_SIM_INTERNAL_H
#define MATEPOINT_CUDART_SIM_INTERNAL_H

#include "cudart_sim.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t recorded;          /* generation of the last record queued */
    uint64_t completed;         /* the highest generation whose record ran (sim_generation_done) */
    int device;                 /* current when the event was created */
    int refs;                   /* the caller's handle plus queued operations */
    void *recorded_on;          /* handle of the stream of the last record (NULL: legacy) */
} sim_event;

typedef enum { OP_COPY, OP_RECORD, OP_WAIT, OP_KERNEL } op_kind;

/* A kernel's results kept aside (cudart_sim_kernel.c): its write spans and
 * their bytes, its read spans and their checksums at launch. One block. */
typedef struct {
    size_t n_writes, n_reads;
    cudart_sim_span *writes;
    cudart_sim_span *reads;
    uint64_t *sums;
    unsigned char *results;     /* the write spans' bytes, one after another */
} sim_kernel;

typedef struct {
    op_kind kind;
    uint64_t order;             /* global queueing order: oldest runs first */
    sim_event *event;
    uint64_t generation;        /* record: the one it completes; wait: the one it needs */
    void *dst;
    const void *src;
    size_t bytes;
    sim_kernel *kernel;         /* OP_KERNEL: owned by the op until it runs */
    void *staged;               /* OP_COPY from pageable memory: `src`, the bytes
                                 * staged at the call, owned until it runs */
} sim_op;

typedef struct sim_stream {
    sim_op *ops;
    size_t head, count, cap;    /* queued operations are ops[head .. head + count) */
    int device;
    int created;                /* 0 for the legacy streams, which live forever */
    int per_thread;             /* a thread's cudaStreamPerThread stream (not created:
                                 * lives forever, as the thread's own) */
    int destroyed;              /* freed once its queue ran dry */
    int capture;                /* CUDA's capture status: 0 none, 1 active, 2 invalidated */
    uint64_t land_pass;         /* the launch (sim_gpu.land_passes) that last looked here */
    uint64_t land_below;        /* ... and the orders below which it looked */
    struct sim_stream *next;
} sim_stream;

/* Memory handed out: device memory (device >= 0) or pinned host memory. */
typedef struct sim_range {
    char *base;
    size_t bytes;
    int device;
    void *owner;                /* device memory: the stream current at cudaMalloc */
    struct sim_range *next;
} sim_range;

typedef struct {
    uint64_t skip, count;
    int status;
} sim_failure;

/* The whole simulation. Process-wide because the runtime table it stands
 * for is; every access holds `lock`. Defined in cudart_sim.c. */
typedef struct {
    pthread_mutex_t lock;
    sim_stream legacy[CUDART_SIM_DEVICES];
    sim_stream *streams;        /* every stream with queued work or a live handle */
    sim_range *ranges;
    uint64_t next_order;
    uint64_t land_passes;       /* launches that landed what they need (cudart_sim_land.c) */
    uint64_t progress_per_call;
    sim_failure failures[SIM_ENTRY_COUNT];
    cudart_sim_wait *wait_log;  /* cudart_sim_log_waits: every wait while on */
    size_t wait_log_count, wait_log_capacity;
    int wait_log_on;
    cudart_sim_observer sync_observer;
    uint64_t captures;          /* streams capturing (valid or not): global mode */
    int expandable;             /* cudart_sim_set_expandable */
    cudart_sim_stats stats;
} sim_world;

extern sim_world sim_gpu;

/* What CUDA keeps per host thread. */
extern _Thread_local int sim_current_device;
extern _Thread_local int sim_last_error;
extern _Thread_local void *sim_current_streams[CUDART_SIM_DEVICES];
extern _Thread_local int sim_handouts_deferred;
extern _Thread_local int sim_capture_mode;     /* cudaStreamCaptureMode, 0: global */
/* The thread's cudaStreamPerThread stream of each device, made at first
 * use and kept on sim_gpu.streams after the thread ended (its queued work
 * still runs). */
extern _Thread_local sim_stream *sim_per_thread_streams[CUDART_SIM_DEVICES];

/* The runtime table (cudart_sim_calls.c). */
extern const cudart sim_table;

/* ---- cudart_sim_kernel.c ------------------------------------------------- */

/* Keeps the write spans' bytes aside and poisons them; NULL when out of
 * memory (nothing changed then). */
sim_kernel *sim_kernel_new(const cudart_sim_span *writes, size_t n_writes,
                           const cudart_sim_span *reads, size_t n_reads);
/* A kernel that writes poison over `span` and reads nothing, leaving the
 * memory as it is until it runs; NULL when out of memory. */
sim_kernel *sim_kernel_new_poison(cudart_sim_span span);
/* Lands the results (or poison, when a read span changed) and frees. */
void sim_kernel_land(sim_kernel *kernel);
/* Writes the results back at once and frees (a kernel that cannot be
 * queued runs as a CPU kernel always did). */
void sim_kernel_write_back(sim_kernel *kernel);

/* ---- cudart_sim_land.c --------------------------------------------------- */

/* Runs what a kernel launched on `stream` that reads or writes `spans`
 * needs before it: on its stream, the operations up to the last one using
 * the memory (and what their waits need: a stream runs in order); on
 * other streams, what the stream's queued waits are ordered after and
 * uses the memory, recursively. The rest stays queued. A CUDA status. */
int sim_land_for_locked(sim_stream *stream, const cudart_sim_span *spans, size_t n_spans);

/* ---- cudart_sim_queue.c -------------------------------------------------- */

/* Has the event's last record run? */
int sim_event_done(const sim_event *event);
/* Drops one reference (the handle or a queued operation); frees at 0. */
void sim_event_release(sim_event *event);
/* A destroyed stream whose queue ran dry goes. */
void sim_stream_unlink_and_free(sim_stream *stream);
/* Runs up to `ops` runnable operations, oldest first but kernels last
 * (none unless `kernels_too`); how many ran. */
uint64_t sim_advance_locked(uint64_t ops, int kernels_too);
/* Runs what `event` reaching `generation` needs; CUDART_SIM_DEADLOCK when
 * it can never run. */
int sim_run_until_locked(sim_event *event, uint64_t generation);
/* Runs what `stream`'s queued work needs, and that work. */
int sim_drain_locked(sim_stream *stream);
/* Runs `stream`'s operations queued up to `order` (all of them:
 * UINT64_MAX) and what their waits need; `depth` bounds the recursion
 * (0 from outside). May free a destroyed stream whose queue runs dry. */
int sim_run_stream_until_locked(sim_stream *stream, uint64_t order, int depth);
/* The stream holding the queued record that completes `generation` of
 * `event`, and the record's order; NULL when none is queued. */
sim_stream *sim_find_record_locked(const sim_event *event, uint64_t generation,
                                   uint64_t *order);
/* Is `stream` a legacy stream or one still linked (not freed)? */
int sim_stream_alive(const sim_stream *stream);
/* Does `stream` have queued work touching `bytes` at `ptr`, or a queued
 * wait (what it waits for may)? */
int sim_stream_touches(const sim_stream *stream, const void *ptr, uint64_t bytes);
/* Does a queued kernel touch the span? (cudart_sim_kernel.c) */
int sim_kernel_touches(const sim_kernel *kernel, const char *lo, const char *hi);
/* Queues `op` on `stream`; a CUDA status. */
int sim_push_locked(sim_stream *stream, sim_op op);
/* The device now has its primary context. */
void sim_use_device(int device);
/* The stream a handle names on the calling thread: NULL and
 * cudaStreamLegacy the legacy stream of the current device (of `device`),
 * cudaStreamPerThread the thread's own stream there, else a live created
 * stream; NULL when the handle is none (or out of memory). */
sim_stream *sim_resolve(void *handle);
/* The same, NULL naming `device`'s legacy stream; NULL when none. */
sim_stream *sim_resolve_on(int device, void *handle);
/* The handle a stream is known by in logs and event records: the
 * created stream itself, cudaStreamPerThread, or NULL (legacy). */
void *sim_handle_of(const sim_stream *stream);
/* Memory handed out at `base` on `device` (-1: pinned host); 0 or -1. */
int sim_add_range(void *base, size_t bytes, int device);
sim_range *sim_find_range(const void *ptr);
/* The host now waits for the GPU: tells the sync observer. */
void sim_note_sync_locked(cudart_sim_entry entry);
/* Frees a range sim_add_range recorded; a CUDA status. */
int sim_free_range_locked(void *ptr, int pinned, cudart_sim_entry entry);
/* Takes the lock, counts the call, runs the configured progress; returns
 * an injected failure's status, else success. */
int sim_enter(cudart_sim_entry entry);
/* Has the record of `generation` of `event` run? A wait waits for the
 * record it captured, as in CUDA: records of one event on several streams
 * may run out of order, and a later one that ran says nothing of an
 * earlier one still queued (the engine re-records one ordering event on
 * whichever stream produced). */
int sim_generation_done(const sim_event *event, uint64_t generation);
/* Appends a wait to the log while logging is on (a full log drops it). */
void sim_log_wait_locked(const sim_stream *waiter, const sim_event *event);
/* A call CUDA forbids while a capture is underway in global mode: with
 * one underway, every capture is invalidated and the call fails
 * (cudaErrorStreamCaptureUnsupported); else CUDART_SUCCESS. */
int sim_capture_forbids_locked(void);
/* cudaDeviceSynchronize while a stream of `device` captures: invalid in
 * every capture mode, relaxed too (the captured work never runs; CUDA's
 * programming guide, "Prohibited and Unhandled Operations"), and the
 * device's captures are invalidated; else CUDART_SUCCESS. */
int sim_device_sync_forbidden_locked(int device);
/* Releases the lock; a failing status becomes the thread's last error. */
int sim_leave(int status);

#endif
