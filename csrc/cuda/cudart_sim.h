/* A simulated CUDA runtime behind the same table as the real one
 * (cudart.h), so the offload engine's stream, event and in-flight logic
 * runs in CI without a GPU, with copies that complete late on purpose.
 *
 * Model: one device (index 0); "device memory" is host memory. Work queued
 * on a created stream (copies, event records, waits) runs only when the
 * test advances the simulation, when a caller blocks on it
 * (cudaEventSynchronize, cudaDeviceSynchronize), or `progress_per_call`
 * operations at every runtime call. The compute stream stands for torch's
 * current stream, whose kernels the CPU runs at once in the tests: work
 * queued there runs at once, so a wait queued on it first runs the other
 * streams until the awaited event completed. Everything else behaves as
 * CUDA documents it: in-order streams, an event completes when the work
 * queued before its last record has run, a wait captures that record.
 *
 * Thread-safety: the simulation is process-wide state behind one mutex,
 * held while any of its functions runs (copies included); any thread may
 * call it. A wait that can never be satisfied returns CUDART_SIM_DEADLOCK
 * instead of blocking forever. */
#ifndef MATEPOINT_CUDART_SIM_H
#define MATEPOINT_CUDART_SIM_H

#include "cudart.h"

enum { CUDART_SIM_DEADLOCK = 999 };

typedef struct {
    uint64_t ops_queued;        /* operations waiting on created streams */
    uint64_t ops_run;           /* operations run since the last reset */
    uint64_t copies_run;        /* of which copies */
    uint64_t streams_live;
    uint64_t events_live;       /* created and not yet destroyed */
    uint64_t host_bytes_live;   /* pinned host memory handed out */
} cudart_sim_stats;

/* The runtime table (process-wide, like the real one). */
const cudart *cudart_sim(void);

/* The handle standing for torch's current stream. */
void *cudart_sim_compute_stream(void);

/* Runs up to `ops` queued operations, oldest runnable first; returns how
 * many ran. */
uint64_t cudart_sim_advance(uint64_t ops);

/* Operations each runtime call runs before its own work (0: none, the GPU
 * is as far behind as the test likes). */
void cudart_sim_set_progress(uint64_t progress_per_call);

/* 1 when `event` (a handle from the table) has completed, else 0. */
int cudart_sim_event_done(void *event);

cudart_sim_stats cudart_sim_get_stats(void);

#endif
