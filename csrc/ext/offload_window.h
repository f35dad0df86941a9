/* The in-flight window of one device: device-to-host copies whose source
 * storage is still referenced.
 *
 * A copy joins the window when its D2H is queued on the copy-out stream
 * (after an event on the producing stream), holding its source storage.
 * Leaving it drops the source: only once the copy's completion event
 * has been seen complete. The completion event itself stays with the copy
 * for as long as the host buffer's contents are not known to be written.
 *
 * GIL held; the window is a Python list owned by the device. */
#ifndef MATEPOINT_EXT_OFFLOAD_WINDOW_H
#define MATEPOINT_EXT_OFFLOAD_WINDOW_H

#include "offload_types.h"

/* Puts a copy whose D2H was queued into the window; it takes a reference
 * to `source`. */
int offload_window_add(offload_device *device, StorageCopy *copy, PyObject *source);

/* Lets copies that have completed drop their sources. */
int offload_window_poll(offload_engine *engine, offload_device *device);
int offload_window_poll_all(offload_engine *engine);

/* Blocks until every copy of the window completed and empties it (the
 * engine is going away). */
void offload_window_drain(offload_engine *engine, offload_device *device);

#endif
