/* Small helpers over the CUDA runtime table (cudart.h) shared by the
 * allocator (csrc/alloc) and the offload engine (csrc/offload/streams.c):
 * device switching, the text of a failure, creating and recording an
 * event, asking whether one completed. Pure C, no Python: callers report
 * a failure their own way (the allocator prints it, the offload engine
 * raises a Python exception).
 *
 * Every helper returns a CUDA status (CUDART_SUCCESS: 0) or says how it
 * reports one. Thread-safe: they touch only the calling thread's current
 * device and last error, as the runtime calls they make do. */
#ifndef MATEPOINT_CUDA_CUDART_UTIL_H
#define MATEPOINT_CUDA_CUDART_UTIL_H

#include "cudart.h"

#include <stddef.h>

/* Makes `device` current and tells the device that was (*previous), so
 * cudart_leave_device() can restore it. cudaSetDevice is skipped when
 * `device` already is current. On failure *failed names the failing call
 * ("cudaGetDevice" or "cudaSetDevice"); the current device is unchanged. */
int cudart_enter_device(const cudart *rt, int device, int *previous, const char **failed);

/* Makes `previous` current again after cudart_enter_device(rt, device,
 * &previous): nothing when it is `device` or negative, or when it has no
 * primary context (rt->primary_context_active says so): setting it would
 * create one (CUDA 12), so the thread stays on `device`, as torch does. A
 * failure has nothing left to undo: it is cleared from the thread's last
 * error. */
void cudart_leave_device(const cudart *rt, int device, int previous);

/* Writes "<what> failed: <CUDA's text> (CUDA error <status>)" into `out`
 * (`size` bytes, NUL-terminated, cut short when longer) and clears the
 * calling thread's last error: the failure is handled by the caller, so
 * torch's next launch check must not see it as its own. */
void cudart_describe_failure(const cudart *rt, int status, const char *what, char *out,
                             size_t size);

/* Records `*event` on `stream`, first creating it (timing disabled) when
 * *event is NULL. On failure *failed names the call
 * ("cudaEventCreateWithFlags" or "cudaEventRecord"); an event this call
 * created is destroyed again (*event is NULL), one the caller gave stays
 * the caller's. The event belongs to the current device: callers make the
 * stream's device current first. */
int cudart_record_event(const cudart *rt, void *stream, void **event, const char **failed);

/* Has `event` completed (asked in relaxed capture mode)? 1 yes, 0 not yet (cudaErrorNotReady, which is an
 * answer, not a failure: cleared from the last error), -1 on a failure,
 * its status in *status. */
int cudart_event_done(const cudart *rt, void *event, int *status);

/* While a stream captures a CUDA graph in CUDA's default (global) mode,
 * the calls CUDA deems unsafe then (cudaMalloc, cudaFree, cudaHostAlloc,
 * cudaFreeHost, event queries, stream, event and device synchronizations)
 * fail from every thread whose own mode is global and invalidate that
 * capture (cudaErrorStreamCaptureUnsupported, 900). matepoint's own such
 * calls serve no capturing stream (callers skip those), so they run in
 * relaxed mode, as torch's allocator runs cudaMalloc:
 *     int mode = cudart_relax_capture(rt);  ...  cudart_restore_capture(rt, mode);
 * Returns the thread's previous mode to restore, or -1 (the runtime lacks
 * cudaThreadExchangeStreamCaptureMode, or it failed: cleared from the last
 * error). Per thread; nests. */
int cudart_relax_capture(const cudart *rt);
void cudart_restore_capture(const cudart *rt, int mode);

/* Is `stream` being captured into a CUDA graph? 1 yes (the legacy stream
 * counts while a blocking stream of its device captures: CUDA refuses to
 * ask it then, as it cannot be used), 0 no (also where the runtime lacks
 * cudaStreamIsCapturing), -1 another failure to ask, cleared from the
 * last error: the caller chooses what that means. */
int cudart_stream_capturing(const cudart *rt, void *stream);

#endif
