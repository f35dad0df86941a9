/* The in-flight window of one device: device-to-host copies whose source
 * storage is still referenced, and the rule that bounds them.
 *
 * A copy joins the window when its D2H is queued on the copy-out stream
 * (after an event on the producing stream, the stream current when the
 * region was checkpointed), holding its source storage and tagged with the
 * region (the device's count of offloading checkpoint calls) it belongs to.
 *
 * Invariant: when region r has queued its copies, before its function
 * runs, no source of a region older than r - window + 1 is held. Such a
 * copy either completed (its event queried complete), or, before the
 * reference was dropped, (1) its producing stream was made to wait on its
 * completion event (cudaStreamWaitEvent with the copy's device current: a
 * NULL stream is the current device's), and (2) the source was marked used
 * by the producing stream (record_stream). A caching allocator hands a freed
 * block out again at once only to work queued later on the stream that
 * allocated it: when that is the producer, the work runs after the copy;
 * when the input came from another stream, (2) keeps the block until the
 * producer passed the copy. So memory is reused on the GPU's timeline,
 * never early, and device memory held by offloaded inputs allocated on the
 * producing stream stays within `window` regions however far the CPU runs
 * ahead of the GPU. The first restore of backward releases the rest the
 * same way. The completion event itself stays with the copy until it is
 * seen complete: restoring from the host buffer waits on it.
 *
 * GIL held; the window is a Python list owned by the device. */
#ifndef MATEPOINT_OFFLOAD_OFFLOAD_WINDOW_H
#define MATEPOINT_OFFLOAD_OFFLOAD_WINDOW_H

#include "offload_types.h"

/* Puts a copy whose D2H was queued after work on `producer` into the
 * window of the device's current region; takes a reference to `source`. */
int offload_window_add(offload_engine *engine, offload_device *device, StorageCopy *copy,
                       PyObject *source, void *producer);

/* Ends the device's current region and releases, in stream order, what
 * the window no longer allows. */
int offload_window_end_region(mp_state *st, offload_device *device);

/* Releases every source of the device in stream order (backward begins). */
int offload_window_release_all(mp_state *st, offload_device *device);

/* Lets copies that have completed drop their sources, on every device. */
int offload_window_poll_all(mp_state *st);

/* Blocks until every copy of the window completed and empties it (the
 * engine is going away or changes runtime). */
void offload_window_drain(offload_engine *engine, offload_device *device);

#endif
