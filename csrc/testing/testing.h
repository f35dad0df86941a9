/* matepoint._C's test controls, compiled only into test builds
 * (MATEPOINT_TESTING=1 pip install .): run the offload engine over the
 * simulated GPU (testing/cudart_sim.h), drive that GPU, and look at the
 * engine's copies. A plain build ships none of this. GIL held.
 *
 *   _simulate_cuda(on)              the engine runs over the simulated GPU (or torch's again)
 *   _sim_advance(ops) -> ran        let the "GPU" run queued operations
 *   _sim_set_progress(ops)          operations it runs at every runtime call
 *   _sim_stats() -> dict            queues, live handles, contexts, calls per entry point,
 *                                   host synchronizations made with the GIL held
 *   _sim_set_device(d) / _sim_get_device()    the thread's current device (cudaSetDevice)
 *   _sim_stream_create(d) -> handle / _sim_stream_destroy(handle)
 *   _sim_set_stream(d, handle) / _sim_current_stream(d)    torch's current stream of d
 *   _sim_launch(d, handle)          a CPU kernel on that stream: it catches up first
 *   _sim_peek_last_error() -> int   the thread's CUDA last error, left in place
 *   _sim_fail(name, skip, count, status)   inject failures of a runtime call
 *   _sim_fail_fetches(skip, count)  copies back that find no device memory (OOM)
 *   OFFLOAD_SITES: {name: call}    the engine's wait and record call sites (offload_sites.h)
 *   _sim_drop_site(name)            that site's calls succeed and do nothing (None: no site);
 *                                   counts restart: each site proven needed by data
 *   _sim_site_counts() -> {name: n} calls the engine made at each site since
 *   _sim_log_waits(on) / _sim_wait_log() -> list of dict   every cudaStreamWaitEvent: the
 *                                   streams it joins (the waiter, the event's last record's)
 *   _offload_streams() -> {device: {"copy_out": h, "copy_in": h}}
 *   _sim_forget_contexts()          no device has a context (as in a new process)
 *   _sim_attach_allocator(path) -> where   matepoint's allocator library over the
 *                                   simulated GPU; `where` (a C function address)
 *                                   tells a CPU-allocator harness the device and stream
 *   _offload_copies() -> list of (device, region, nbytes, source_held, copy_out_done)
 *   _fail_pool_acquires(n)          the next n spans find no host memory at all
 * testing_lag.c:
 *   _sim_launch_for(d, handle, spans)   a CPU kernel using spans: what that memory needs lands
 *   _sim_kernel(d, handle, writes, reads)   a CPU kernel's results lag on its stream
 *   _sim_order_streams(dw, waiter, dp, producer)   waiter's later work after producer's
 *   _sim_take_last_error() -> int   the thread's CUDA last error, cleared
 *   _sim_device_of(ptr) -> int      the device whose memory holds ptr, else -1 */
#ifndef MATEPOINT_TESTING_TESTING_H
#define MATEPOINT_TESTING_TESTING_H

#include "base/state.h"
#include "offload/offload_runtime.h"

int testing_add_functions(PyObject *module);

/* A simulated device number given from Python: 0, or -1 with a
 * ValueError naming the number (or the conversion's error). */
int testing_device_arg(PyObject *arg, int *device);

/* The controls of testing_lag.c, added to `module`; 0 or -1. */
int testing_add_lag_functions(PyObject *module);
/* The disk tier's controls (testing_spill.c: the yield hook, _spill_room,
 * _spill_settle), added to `module`; 0 or -1. */
int testing_add_spill_functions(PyObject *module);

/* The call sites' controls (testing_sites.c: _sim_drop_site,
 * _sim_site_counts, _test_controls, OFFLOAD_SITES), added to `module`; 0 or -1. */
int testing_add_site_functions(PyObject *module);

/* The offload runtime over the simulated GPU (sim_runtime.c). */
extern const offload_runtime offload_runtime_sim;

/* torch's adapter over the simulated GPU (sim_runtime.c): current stream,
 * record_stream and context queries through the module state's torch.cuda
 * entry points, which a test replaces with a stand-in (testing_torch.c). */
extern const offload_runtime offload_runtime_torch_sim;

/* The test controls of torch's adapter (testing_torch.c). */
int testing_torch_add_functions(PyObject *module);

/* Links matepoint's allocator library (at `path`) to the simulated GPU:
 * its CUDA backend runs over the simulated table, and every block it hands
 * out is poisoned after its stream caught up. 0, or -1 with an error. */
int sim_runtime_attach_allocator(PyObject *path);

/* The next `skip` copies back find device memory, the `count` after them
 * raise torch.OutOfMemoryError. */
void sim_runtime_fail_fetches(uint64_t skip, uint64_t count);

/* From now on the engine's waits and records at the sites of `dropped`
 * (bit `site` of offload_sites.h set; 0: none) succeed and do nothing;
 * every site's count starts again from zero. GIL held. */
void sim_runtime_drop_sites(uint32_t dropped);
/* The sites dropped now (as above), and the copies back still to count
 * or fail (sim_runtime_fail_fetches): 0 when a test left none set. */
uint32_t sim_runtime_dropped_sites(void);
uint64_t sim_runtime_failing_fetches(void);
/* The calls the engine made at `site` since (dropped ones included). */
uint64_t sim_runtime_site_issued(offload_site site);

/* torch's device functions over the simulated GPU, per thread as torch's
 * (c10/cuda/CUDAFunctions.cpp, CUDA 12 and later), for the harness and the
 * torch.cuda stand-in:
 *   maybe_exchange_device  c10::cuda::MaybeExchangeDevice: makes `device`
 *                          current where it has a context, else only
 *                          torch's target device; returns CUDA's current
 *                          device before
 *   torch_device           what torch.cuda.current_device() answers: the
 *                          target device, else CUDA's current one
 *   torch_set_device       torch.cuda.set_device: clears the target */
int sim_runtime_maybe_exchange_device(int device);
int sim_runtime_torch_device(void);
int sim_runtime_torch_set_device(int device);

/* Where the harness allocates: the thread's current device and stream. */
void sim_runtime_where(int *device, void **stream);

#endif
