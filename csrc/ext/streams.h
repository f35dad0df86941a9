/* CUDA stream and event helpers of the offload path, over a runtime table
 * (cuda/cudart.h: the real libcudart, or the simulated one of the tests).
 *
 * Every helper checks each runtime call's status and turns a failure into a
 * Python RuntimeError naming the call; they return 0 on success, -1 with
 * the error set. Callers hold the GIL (for the error), nothing else. */
#ifndef MATEPOINT_EXT_STREAMS_H
#define MATEPOINT_EXT_STREAMS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cuda/cudart.h"

/* 0 when status is success, else raises naming `what` and returns -1. */
int streams_check(const cudart *rt, int status, const char *what);

/* Makes `index` the current device; *previous receives the one to give
 * back to streams_leave_device. */
int streams_enter_device(const cudart *rt, int index, int *previous);
void streams_leave_device(const cudart *rt, int previous);

/* Orders `waiter` after everything queued on `producer` so far. */
int streams_wait_stream(const cudart *rt, void *waiter, void *producer);

/* Creates an event and records it on `stream`; *event stays NULL on error. */
int streams_record_new_event(const cudart *rt, void *stream, void **event);

#endif
