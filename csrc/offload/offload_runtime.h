/* Where the offload engine meets the GPU: the CUDA runtime table plus the
 * few facts only torch knows (which device a tensor lives on, the current
 * stream, record_stream, whether a device has a context yet).
 *
 * Two implementations: torch's, over the real libcudart
 * (offload_runtime_torch.c), and in test builds the simulated GPU
 * (csrc/testing/sim_runtime.c). The engine never learns which one it runs
 * on. Every function is called with the GIL held and returns 0 on success,
 * -1 with a Python error set. Contract floor: any file of csrc/offload may
 * call through the table; the engine's own runtime is engine->runtime
 * (chosen by offload_engine.c). */
#ifndef MATEPOINT_OFFLOAD_OFFLOAD_RUNTIME_H
#define MATEPOINT_OFFLOAD_OFFLOAD_RUNTIME_H

#include "base/state.h"
#include "cuda/cudart.h"
#include "offload_sites.h"

typedef struct offload_runtime {
    const char *name;
    const char *device_type;    /* torch's device type of the tensors it moves */
    /* The runtime table, loaded on first use; NULL with an error set. */
    const cudart *(*load)(void);
    /* 0 when no tensor can live where this runtime copies from (a CPU
     * build of torch has no CUDA tensors): the engine then skips the
     * inspection of a region's inputs altogether. Cannot fail. */
    int (*may_hold_tensors)(mp_state *st);
    /* The device whose memory `tensor` (of torch device `device_obj`)
     * lives in: 1 with *index set when this runtime copies it, 0 when it
     * stays where it is. */
    int (*tensor_device)(mp_state *st, PyObject *tensor, PyObject *device_obj, int *index);
    /* torch's current stream of `device` on this thread (NULL is the
     * legacy stream of the *current* device: enter `device` to use it). */
    int (*current_stream)(mp_state *st, int device, void **stream);
    /* The memory of `storage` (on `device`) is used by the work queued on
     * `stream` so far: whichever stream allocated it reuses it only after
     * that work (torch's record_stream; nothing when `stream` allocated it).
     * `site` names the engine's call (offload_sites.h). */
    int (*record_stream)(mp_state *st, offload_site site, PyObject *storage, int device,
                         void *stream);
    /* `stream` waits for `event` (cudaStreamWaitEvent through `rt`, the
     * table load() gave), the wait the engine makes at `site`: a CUDA
     * status, nothing raised. */
    int (*stream_wait_event)(const cudart *rt, offload_site site, void *stream, void *event);
    /* 1 when `device` has its primary context already, 0 when using it
     * would create one. */
    int (*has_context)(mp_state *st, int device);
    /* The engine entered a device and, leaving, stays there because
     * `previous`, the device it left, has no context (setting it would
     * create one). torch keeps its own idea of the thread's current device
     * for that case (c10::cuda::MaybeExchangeDevice: a thread-local target
     * device index, what torch.cuda.current_device() then answers and what
     * torch's next device guard makes current): it is set to `previous`
     * here, as torch's own guards leave it, so torch never takes the
     * device the engine used for the thread's. */
    int (*keep_target_device)(mp_state *st, int previous);
    /* A new uint8 tensor of `nbytes` on `device` (torch device
     * `device_obj`), allocated on its current stream. */
    PyObject *(*empty_bytes)(mp_state *st, int device, PyObject *device_obj, uint64_t nbytes);
} offload_runtime;

extern const offload_runtime offload_runtime_torch;

/* torch's answers of offload_runtime_torch, for the test build's runtime
 * that runs them over the simulated GPU. They reach torch only through
 * the entry points the module state looked up once (base/state.h:
 * current_raw_stream, has_primary_context, maybe_exchange_device,
 * cuda_default_stream, cuda_external_stream, tensor_record_stream), so a
 * test can put a
 * torch.cuda stand-in written in Python in their place; being Python, it
 * may hand the GIL to another thread inside any of them, as torch may. */
int offload_torch_may_hold_tensors(mp_state *st);
int offload_torch_current_stream(mp_state *st, int device, void **stream);
int offload_torch_record_stream(mp_state *st, offload_site site, PyObject *storage, int device,
                                void *stream);
int offload_torch_stream_wait_event(const cudart *rt, offload_site site, void *stream,
                                    void *event);
int offload_torch_has_context(mp_state *st, int device);
int offload_torch_keep_target_device(mp_state *st, int previous);

#endif
