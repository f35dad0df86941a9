/* The offload engine: per-device copy state, the host pool and counters.
 *
 * One engine per module state (mp_state.engine), created at module exec and
 * freed with the module. Each CUDA device gets, on its first offload, a
 * copy-out and a copy-in stream and an in-flight window (offload_window.h);
 * the CPU test mode (offload_cpu) uses `cpu`, index -1, copying with memcpy.
 * The pool is created on the first offload: pinned memory when a CUDA
 * runtime with a device is present, else plain host memory.
 *
 * Thread-safety: every field is guarded by the GIL; the pool has its own
 * lock. `rt` is set once and never changes while copies exist. */
#ifndef MATEPOINT_EXT_OFFLOAD_ENGINE_H
#define MATEPOINT_EXT_OFFLOAD_ENGINE_H

#include "offload.h"
#include "cuda/cudart.h"
#include "pool/pool.h"

#define MAX_CUDA_DEVICES 64

struct OffloadGroup;

/* Copy state of one device (index -1: the CPU test mode). */
typedef struct {
    int index;
    void *copy_out;             /* cudaStream_t, NULL on the CPU */
    void *copy_in;
    PyObject *in_flight;        /* list of StorageCopy whose source is held (offload_window.h) */
    uint64_t regions;           /* checkpoint calls that offloaded here so far */
    struct OffloadGroup *first, *last; /* live groups in creation order (borrowed) */
} offload_device;

struct offload_engine {
    offload_options options;
    pool *pool;                 /* created on first offload */
    pool_host_ctx host_ctx;
    const cudart *rt;           /* set once a CUDA tensor was offloaded */
    int simulated;              /* tests: rt is the simulated runtime and CPU
                                 * tensors stand for device 0's (cudart_sim.h) */
    uint64_t device_bytes_in_flight;        /* sources held by the windows */
    uint64_t peak_device_bytes_in_flight;
    offload_device cpu;
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

/* The copy state of CUDA device `index`, made (streams included) on first
 * use; NULL with an error set when no runtime or device is there. */
offload_device *offload_engine_cuda_device(offload_engine *engine, int index);

/* torch's current stream on CUDA device `index`. */
int offload_engine_current_stream(mp_state *st, int index, void **stream);

/* Tests: run the CUDA path over the simulated runtime (on != 0) or the real
 * one again. Refused (RuntimeError) while offloaded inputs are alive. */
int offload_engine_simulate(offload_engine *engine, int on);

#endif
