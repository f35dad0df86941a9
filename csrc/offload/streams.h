/* CUDA stream and event helpers of the offload path, over a runtime table
 * (cuda/cudart.h: the real libcudart, or the simulated one of the tests).
 *
 * Every helper checks each runtime call's status and turns a failure into a
 * Python RuntimeError naming the call, clearing the runtime's per-thread
 * last error (torch checks it after its kernel launches: a failure handled
 * here must not surface there as a second, unrelated error). They return 0
 * on success, -1 with the error set. Callers hold the GIL (for the error)
 * and have made the streams' device current. Floor `gpu` (streams.c):
 * included by every floor above; owns nothing. */
#ifndef MATEPOINT_OFFLOAD_STREAMS_H
#define MATEPOINT_OFFLOAD_STREAMS_H

#include "base/compat.h"

#include "cuda/cudart.h"
#include "cuda/cudart_util.h"
#include "offload_runtime.h"

/* Do two stream handles the engine kept as keys name one stream where
 * they are compared? The engine compares keys with their device current,
 * so equal handles do (NULL names that device's legacy stream for every
 * thread), all but cudaStreamPerThread: it names the calling thread's own
 * stream, so one taken on a thread names another stream on the next (a
 * forward's and its backward worker's), and it matches nothing, itself
 * included. Unequal handles count as two streams (cudaStreamLegacy and
 * NULL are one): a wait too many, never one too few. */
static inline int
streams_same(const void *a, const void *b)
{
    return a == b && a != CUDART_STREAM_PER_THREAD;
}

/* 0 when status is success, else raises naming `what` and returns -1. */
int streams_check(const cudart *rt, int status, const char *what);

/* cudaMemcpyAsync. Through pageable host memory CUDA returns only once the
 * copy ran (after the stream's earlier work): a host synchronization, so
 * the GIL is released around it. */
int streams_memcpy(const cudart *rt, void *dst, const void *src, size_t bytes, int kind,
                   void *stream, int pageable);

/* `stream` waits for `event` through `runtime` (which may count or, in
 * a test, drop the waits of `site`): 0, or -1 with an error naming
 * cudaStreamWaitEvent and the site. */
int streams_wait_event(const offload_runtime *runtime, const cudart *rt, offload_site site,
                       void *stream, void *event);

/* Has `event` completed? 1, 0, or -1 with an error. cudaErrorNotReady is
 * an answer, not a failure: the last error it leaves is cleared. */
int streams_event_done(const cudart *rt, void *event);

/* Makes `device` current (cudart_enter_device); *previous is the device
 * that was, for cudart_leave_device() or the engine's own leave. 0, or -1
 * with an error naming cudaGetDevice or cudaSetDevice. */
int streams_enter_device(const cudart *rt, int device, int *previous);

/* Records `*event` on `stream`, creating it first when *event is NULL
 * (cudart_record_event). 0, or -1 with an error; an event this call
 * created is then destroyed (*event NULL), a given one stays the
 * caller's. */
int streams_record_event(const cudart *rt, void *stream, void **event);

/* The host waits for `event`, or for all of `stream`, with the GIL released,
 * where a failure leaves nothing to undo (a device going away, a buffer
 * that goes back either way): unlike the helpers above they raise nothing,
 * and only clear the failure from the thread's last error, where torch
 * would find it. */
void streams_wait_event_quietly(const cudart *rt, void *event);
void streams_wait_stream_quietly(const cudart *rt, void *stream);

#endif
