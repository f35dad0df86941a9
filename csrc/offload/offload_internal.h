/* The offload engine: per-device copy state, the host pool and counters.
 *
 * One engine per module state (mp_state.engine), created at module exec and
 * freed with the module. It runs over an offload runtime (offload_runtime.h:
 * torch's, or the simulated GPU of test builds), whose CUDA table is loaded
 * at the first offload. Each device gets, on its first offload, a copy-out
 * and a copy-in stream and an in-flight window (offload_window.h). The pool
 * is created on first use: pinned memory when the runtime has a device,
 * else plain host memory.
 *
 * Devices: CUDA resolves stream handle NULL (torch's default stream) to the
 * legacy stream of the calling thread's *current* device, so every wait and
 * record on a stream of device d runs with d current
 * (offload_engine_enter_device), and the previous device is given back only
 * where that creates no context.
 *
 * Thread-safety: every field is guarded by the GIL; the pool has its own
 * lock. `runtime` and `rt` change only while no copy exists. */
#ifndef MATEPOINT_OFFLOAD_OFFLOAD_ENGINE_H
#define MATEPOINT_OFFLOAD_OFFLOAD_ENGINE_H

#include "offload.h"
#include "offload_runtime.h"
#include "pool/pool.h"

#define MAX_CUDA_DEVICES 64

struct OffloadGroup;

/* Copy state of one device. */
typedef struct {
    int index;
    void *copy_out;             /* cudaStream_t */
    void *copy_in;
    PyObject *in_flight;        /* list of StorageCopy whose source is held (offload_window.h) */
    uint64_t regions;           /* checkpoint calls that offloaded here so far */
    struct OffloadGroup *first, *last; /* live groups in creation order (borrowed) */
    /* Events are made once and reused, not created and destroyed per copy:
     * `ordering` is recorded on one stream and waited on by another right
     * away (a wait captures the record it was given, so it is free again at
     * once); `spare` holds completion events no copy needs any more. */
    void *ordering;
    void **spare;
    int spare_count, spare_capacity;
} offload_device;

struct offload_engine {
    offload_options options;
    pool *pool;                 /* created on first use */
    pool_host_ctx host_ctx;
    const offload_runtime *runtime;
    const cudart *rt;           /* runtime->load(), at the first device */
    uint64_t devices_with_context;          /* bit d: device d has a context (cache) */
    uint64_t device_bytes_in_flight;        /* sources held by the windows */
    uint64_t peak_device_bytes_in_flight;
    offload_device *cuda[MAX_CUDA_DEVICES];
    int warned_fallback;
    uint64_t prefetched;        /* spans copied back ahead of their recompute */
    uint64_t fetched_at_need;   /* spans copied back when the recompute asked */
    int fail_next_acquires;     /* tests: make the pool refuse this many spans */
};

/* The engine of the module that owns an offload object. */
offload_engine *offload_engine_of(PyObject *module);

/* Creates the pool on first use. */
int offload_engine_ensure_pool(offload_engine *engine);

/* The copy state of device `index`, made (streams included) on first use;
 * NULL with an error set when no runtime or device is there. */
offload_device *offload_engine_device(mp_state *st, int index);

/* Orders `waiter` after the work queued on `producer` so far; the
 * device is current. */
int offload_device_order(offload_engine *engine, offload_device *device, void *waiter,
                         void *producer);
/* Records a completion event of the device on `stream` (the device is
 * current): a spare one, or a new one. *event stays NULL on error. */
int offload_device_record(offload_engine *engine, offload_device *device, void *stream,
                          void **event);
/* Gives back a completion event no copy needs any more (any thread with
 * the GIL, any current device). */
void offload_device_give_event(offload_engine *engine, offload_device *device, void *event);

/* torch's current stream on device `index`. */
int offload_engine_current_stream(mp_state *st, int index, void **stream);

/* Makes `index` the calling thread's current device; *previous receives
 * what offload_engine_leave_device gives back. */
int offload_engine_enter_device(mp_state *st, int index, int *previous);
void offload_engine_leave_device(mp_state *st, int index, int previous);

/* The device pinned host memory is best allocated with: the current one
 * when it has a context, else the first that has one, else -1 (none yet:
 * pinning then creates the current device's). */
int offload_engine_pinning_device(mp_state *st);

/* Runs the engine over `runtime` from now on. Refused (RuntimeError) while
 * offloaded inputs are alive. */
int offload_engine_use_runtime(offload_engine *engine, const offload_runtime *runtime);

#endif
