/* A simulated CUDA runtime behind the same table as the real one
 * (cudart.h): the GPU timeline of the offload engine and the allocator,
 * proven in CI without a GPU. Built only into test builds.
 *
 * Model, as CUDA documents it:
 * - CUDART_SIM_DEVICES devices, each with a legacy default stream; stream
 *   handle NULL means the legacy stream of the calling thread's current
 *   device (a per-thread setting, 0 in a new thread), as does
 *   cudaStreamLegacy; cudaStreamPerThread names the calling thread's own
 *   default stream of its current device, another one on each thread
 *   (made at first use, never destroyed). Streams created are
 *   non-blocking (torch and matepoint create no other kind), and so is a
 *   per-thread stream here (on CUDA it waits for the legacy stream).
 * - Every operation queued on a stream (copies, event records, waits,
 *   kernels) runs only when the test advances the simulation, when a caller blocks on it
 *   (event or stream synchronization, a device-to-host copy into pageable
 *   host memory; one from pageable memory only stages its bytes at the
 *   call, and lands in device memory when its stream reaches it),
 *   when a CPU "kernel" launches on its stream and needs it (a launch
 *   lands what the kernel's memory depends on: cudart_sim_launch_for), or
 *   `progress_per_call` operations at every runtime call. Streams are in
 *   order; an event completes when the work queued before its last record
 *   has run; a wait captures the record it waits for. Nothing else orders
 *   work: the "GPU" lags the CPU as far as a test likes.
 * - Kernels lag in data (cudart_sim_queue_kernel): a CPU kernel computes
 *   at launch, but its result is kept aside and the memory it writes reads
 *   as poison (0xff bytes, NaN) until its stream reaches it; if what it
 *   read changed meanwhile (another stream or a copy wrote it, or it was
 *   reused), it writes poison instead. The scheduler is adversarial:
 *   the progress made at every runtime call runs copies, records and
 *   waits as early as their waits allow, and a kernel only when a queued
 *   wait needs it; otherwise a kernel runs only when something needs it (a
 *   launch or allocation on its stream, a synchronization, cudaFree, or
 *   the test's cudart_sim_advance, which runs kernels once nothing else
 *   can run), so a copy not ordered after its producer reads poison even
 *   on a GPU that keeps up.
 * - An event belongs to the device current when it was created; recording
 *   it on another device's stream fails as in CUDA.
 * - Per-thread last error: every failing call sets it (cudaErrorNotReady
 *   from a query too, as torch assumes); get_last_error returns and clears
 *   it, cudart_sim_peek_last_error only reads it.
 * - Using a device (memory, streams, events, cudaSetDevice) creates its
 *   primary context; cudaGetDevice does not.
 * - Graph capture in CUDA's default (global) mode, as torch.cuda.graph
 *   begins it (cudart_sim_begin_capture): while any stream captures, the
 *   calls CUDA forbids then from every thread (cudaMalloc, cudaFree,
 *   cudaHostAlloc, cudaFreeHost (which still frees), cudaEventQuery, cudaEventSynchronize, cudaStreamSynchronize,
 *   cudaDeviceSynchronize) fail with cudaErrorStreamCaptureUnsupported and
 *   invalidate every capture underway, unless the calling thread's mode
 *   (cudaThreadExchangeStreamCaptureMode) is relaxed (but synchronizing a
 *   device one of whose streams captures fails and invalidates its
 *   captures in every mode, as CUDA's); a thread-local mode
 *   counts as global here (stricter); cudaStreamIsCapturing answers
 *   (none for a legacy stream: the streams are non-blocking). Work queued
 *   meanwhile runs as usual (no graph is built).
 * - "Device" and pinned host memory are host memory, so tests can read it;
 *   cudaMalloc and cudaHostAlloc hand it out full of poison.
 *
 * Thread-safety: the simulation is process-wide state behind one mutex,
 * held while any of its functions runs (copies included); any thread may
 * call it. A wait that can never be satisfied returns CUDART_SIM_DEADLOCK
 * instead of blocking forever. */
#ifndef MATEPOINT_CUDART_SIM_H
#define MATEPOINT_CUDART_SIM_H

#include "cuda/cudart.h"

enum {
    CUDART_SIM_DEADLOCK = 999,
    CUDART_SIM_CAPTURE_INVALIDATED = 901,   /* cudaErrorStreamCaptureInvalidated */
    CUDART_SIM_DEVICES = 2,
};

/* The runtime entry points, for call counts and failure injection. */
typedef enum {
    SIM_GET_DEVICE_COUNT, SIM_GET_DEVICE, SIM_SET_DEVICE, SIM_HOST_ALLOC, SIM_FREE_HOST,
    SIM_STREAM_CREATE, SIM_STREAM_DESTROY, SIM_STREAM_WAIT_EVENT, SIM_STREAM_SYNCHRONIZE,
    SIM_EVENT_CREATE, SIM_EVENT_DESTROY, SIM_EVENT_RECORD, SIM_EVENT_QUERY,
    SIM_EVENT_SYNCHRONIZE, SIM_MEMCPY_ASYNC, SIM_MALLOC, SIM_FREE, SIM_MEM_GET_INFO,
    SIM_DEVICE_SYNCHRONIZE, SIM_GET_LAST_ERROR, SIM_STREAM_IS_CAPTURING,
    SIM_THREAD_EXCHANGE_STREAM_CAPTURE_MODE, SIM_ENTRY_COUNT
} cudart_sim_entry;

typedef struct {
    uint64_t ops_queued;        /* operations waiting on streams */
    uint64_t ops_run;           /* operations run so far */
    uint64_t copies_run;        /* of which copies */
    uint64_t pageable_copies;   /* copies through pageable host memory (the host waited) */
    uint64_t launch_errors;     /* launches that found a last error (torch would raise) */
    uint64_t kernels_queued;    /* kernels whose results are still kept aside */
    uint64_t kernels_run;       /* kernels whose results landed (or poison did) */
    uint64_t kernels_poisoned;  /* of which found what they read changed: wrote poison */
    uint64_t unmap_faults;      /* device memory unmapped (expandable mode) while queued
                                 * work of another stream still read or wrote it: on a
                                 * GPU an illegal address, the context lost */
    uint64_t streams_live;      /* created and not yet gone */
    uint64_t events_live;       /* created and not yet destroyed */
    uint64_t host_bytes_live;   /* pinned host memory handed out */
    uint64_t device_bytes_live[CUDART_SIM_DEVICES];
    int has_context[CUDART_SIM_DEVICES];
    uint64_t calls[SIM_ENTRY_COUNT];
} cudart_sim_stats;

/* The runtime table (process-wide, like the real one). */
const cudart *cudart_sim(void);

/* The CUDA name of an entry point ("cudaEventRecord"); NULL past the end. */
const char *cudart_sim_entry_name(int entry);

/* Runs up to `ops` queued operations, oldest runnable first, kernels once
 * nothing else can run; returns how many ran. */
uint64_t cudart_sim_advance(uint64_t ops);

/* Operations each runtime call runs before its own work, kernels only as
 * queued waits need them (0: none, the GPU is as far behind as the test
 * likes). */
void cudart_sim_set_progress(uint64_t progress_per_call);

/* On: cudaFree of device memory behaves as torch's allocator with
 * expandable_segments:True unmapping pages (on an OOM retry or
 * empty_cache()): it synchronizes only the stream current when the memory
 * was allocated (the segment's own stream), and work still queued on
 * another stream that reads or writes the memory counts in unmap_faults.
 * (The simulation then runs that work before the memory goes, to stay
 * memory safe itself.) Off (the default): the host waits for every stream,
 * as cudaFree does. */
void cudart_sim_set_expandable(int on);

/* A span of memory a kernel reads or writes: `bytes` from `ptr`. */
typedef struct {
    void *ptr;
    uint64_t bytes;
} cudart_sim_span;

/* A CPU kernel launched on `stream` of `device` (NULL: its legacy stream):
 * the CPU runs it at once, so everything queued there before must run
 * first. Like torch after its launches, it then takes the calling thread's
 * last error: one left there (a failure somebody recovered from without
 * clearing it) is counted in launch_errors, where torch would raise.
 * CUDART_SUCCESS, or CUDART_SIM_DEADLOCK. */
int cudart_sim_launch(int device, void *stream);

/* The same, for a kernel that reads or writes only `spans` (n_spans of
 * them; none: it uses no device memory), as on a GPU: of the work the
 * kernel comes after (queued before it on its stream and, through that
 * stream's waits, what each wait's event was recorded after on another
 * stream), what uses that memory runs first, with whatever comes before it
 * on its own stream (a stream runs in order). The rest stays queued: a
 * copy the stream waits for runs no earlier for the launch, so memory it
 * still reads can be reused by a stream not ordered after it. */
int cudart_sim_launch_for(int device, void *stream, const cudart_sim_span *spans,
                          size_t n_spans);

/* Memory handed out by a stream-ordered allocator for work on `stream` of
 * `device` (NULL: its legacy stream): what the new owner's work comes
 * after and still uses the memory runs first, as for a launch using it
 * (cudart_sim_launch_for), then it is filled with poison. Nothing else
 * runs: unrelated kernels keep lagging, and a copy or kernel on another
 * stream still using the memory (not ordered before its reuse) sees the
 * poison. CUDART_SUCCESS or a status. */
int cudart_sim_handout(int device, void *stream, void *ptr, uint64_t bytes);

/* While set on the calling thread, a handout that would have to run work
 * first runs nothing: the poison is queued on the stream instead, landing
 * where the memory changes owner on the GPU's timeline. For memory only
 * copies fill (the engine's copies back): work on another stream filling
 * it without waiting for the stream it was handed out on lands before the
 * poison, and is lost. Not for memory the host writes directly. */
void cudart_sim_defer_handouts(int on);

enum { CUDART_SIM_POISON = 0xff };

/* A CPU kernel that just ran on `stream` of `device` (NULL: its legacy
 * stream) after cudart_sim_launch: what it wrote (`writes`) is kept aside
 * and those spans are poisoned now; a checksum of each span it read
 * (`reads`, taken after the poisoning) is kept. The kernel is queued on the
 * stream: when it runs, its results land if every read span still has its
 * checksum, else the write spans stay poison. Spans are copied; the memory
 * must stay allocated until the kernel ran (the simulated cudaFree and
 * cudaFreeHost run everything first). CUDART_SUCCESS, or a CUDA status
 * with the results written at once. */
int cudart_sim_queue_kernel(int device, void *stream, const cudart_sim_span *writes,
                            size_t n_writes, const cudart_sim_span *reads, size_t n_reads);

/* What torch's autograd engine does between two streams (an event recorded
 * on `producer` of `producer_device`, waited for by `waiter` of
 * `waiter_device`; NULL: that device's legacy stream), without counting a
 * runtime call or an event: work queued on the waiter from now on runs
 * after the producer's work queued so far. CUDART_SUCCESS or a status. */
int cudart_sim_order_streams(int waiter_device, void *waiter, int producer_device,
                             void *producer);

/* The calling thread's current device, read and set as cudaGetDevice and
 * cudaSetDevice do, without counting a runtime call (test harness use). */
int cudart_sim_current_device(void);
int cudart_sim_set_current_device(int device);

/* The calling thread's current stream of `device` as torch would report it
 * (NULL: the legacy stream, the default), and setting it. */
void *cudart_sim_current_stream(int device);
void cudart_sim_set_current_stream(int device, void *stream);

/* The device a created stream belongs to; -1 for NULL or a stale handle. */
int cudart_sim_stream_device(void *stream);

/* The device whose memory (cudaMalloc) holds `ptr`, else -1. */
int cudart_sim_device_of(const void *ptr);

/* The calling thread's last error, left in place. */
int cudart_sim_peek_last_error(void);

/* The next `skip` calls of `entry` run normally, the `count` after them
 * fail with `status` (and set the last error) without doing anything;
 * but the calls that release (cudaStreamDestroy, cudaEventDestroy,
 * cudaFree, cudaFreeHost) release all the same, as when CUDA reports an
 * earlier asynchronous error from them. */
void cudart_sim_fail(cudart_sim_entry entry, uint64_t skip, uint64_t count, int status);

/* One cudaStreamWaitEvent: the waiting stream and the stream the event was
 * last recorded on, each as its device and handle (NULL: the legacy
 * stream). */
typedef struct {
    int waiter_device;
    void *waiter;
    int source_device;          /* -1: the event was never recorded */
    void *source;
} cudart_sim_wait;

/* Starts (clearing it) or stops a log of every cudaStreamWaitEvent call;
 * cudart_sim_wait_log copies up to `max` entries out and returns how many
 * the log holds. Tests name each wait by the streams it joins. */
void cudart_sim_log_waits(int on);
size_t cudart_sim_wait_log(cudart_sim_wait *out, size_t max);

/* Called (on the calling thread, the simulation locked: it must not call
 * back) by every call that makes the host wait for the GPU:
 * cudaEventSynchronize, cudaStreamSynchronize, cudaDeviceSynchronize,
 * cudaFree, cudaFreeHost and copies through pageable memory. NULL: none. */
typedef void (*cudart_sim_observer)(cudart_sim_entry entry);
void cudart_sim_set_sync_observer(cudart_sim_observer observer);

/* Begins a capture on created stream `stream` of `device` (CUDA refuses
 * the legacy stream and a stream capturing already), in global mode. */
int cudart_sim_begin_capture(int device, void *stream);
/* Ends it: CUDART_SUCCESS when the capture stayed valid, else
 * cudaErrorStreamCaptureInvalidated (901), as cudaStreamEndCapture. */
int cudart_sim_end_capture(int device, void *stream);

/* No device has a primary context, as in a new process. */
void cudart_sim_forget_contexts(void);

/* 1 when `event` (a handle from the table) has completed, else 0. */
int cudart_sim_event_done(void *event);

cudart_sim_stats cudart_sim_get_stats(void);

#endif
