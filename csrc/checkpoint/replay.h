/* What a recompute must replay of the forward's global state: the CPU and
 * accelerator RNG states, autocast settings and an active torch.device()
 * context.
 *
 * replay_capture() fills `r` at forward time from the region's input
 * tensors. replay_enter() puts that state in place for the recompute and
 * records in `undo` how to put the caller's state back; replay_exit()
 * restores it and releases `undo` (it must run after a successful
 * replay_enter(), also when the recompute failed). All need the GIL. */
#ifndef MATEPOINT_CHECKPOINT_REPLAY_H
#define MATEPOINT_CHECKPOINT_REPLAY_H

#include "base/state.h"

typedef struct {
    PyObject *cpu_rng;          /* CPU generator state, or NULL when not preserved */
    PyObject *device_module;    /* e.g. torch.cuda when its RNG states are kept */
    PyObject *device_indices;   /* tuple of device indices */
    PyObject *device_rngs;      /* tuple of their RNG states */
    PyObject *autocast;         /* tuple of (device_type, enabled, dtype) */
    PyObject *autocast_cache;   /* bool */
    PyObject *device_context;   /* torch.utils._device.DeviceContext, or NULL */
    int device_was_initialized; /* accelerator initialized before the forward */
    PyObject *uninitialized_module; /* the region's accelerator module (its inputs'
                                     * device type) when not yet initialized: the
                                     * forward must not initialize it; else NULL */
} replay_state;

typedef struct {
    PyObject *cpu_rng;
    PyObject *device_rngs;
    PyObject *contexts;         /* list of entered context managers */
} replay_undo;

int replay_capture(mp_state *st, replay_state *r, PyObject *tensors, int preserve_rng);
int replay_check_forward(mp_state *st, replay_state *r, int preserve_rng);
int replay_enter(mp_state *st, replay_state *r, PyObject *extra_context, replay_undo *undo);
int replay_exit(mp_state *st, replay_state *r, replay_undo *undo);
int replay_traverse(replay_state *r, visitproc visit, void *arg);
void replay_clear(replay_state *r);

/* Context manager helpers shared with the forward pass. */
int context_enter(mp_state *st, PyObject *cm);
/* Exits `cm`, passing the pending exception if any (it stays pending).
 * Returns 1 when the manager suppressed that exception, 0 otherwise, -1 on
 * a new error. */
int context_exit(mp_state *st, PyObject *cm);

#endif
