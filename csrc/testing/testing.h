/* matepoint._C's test controls (underscored, not for users): run the
 * offload engine over the simulated CUDA runtime, drive that runtime, and
 * look at the engine's copies. GIL held. */
#ifndef MATEPOINT_EXT_TESTING_H
#define MATEPOINT_EXT_TESTING_H

#include "state.h"

/* _simulate_cuda(on: bool) */
PyObject *testing_simulate_cuda(PyObject *module, PyObject *on);
/* _sim_advance(ops: int) -> int: operations run */
PyObject *testing_sim_advance(PyObject *module, PyObject *ops);
/* _sim_set_progress(ops_per_call: int) */
PyObject *testing_sim_set_progress(PyObject *module, PyObject *ops);
/* _sim_stats() -> dict */
PyObject *testing_sim_stats(PyObject *module, PyObject *unused);
/* _offload_copies() -> list of (region, nbytes, source_held, copy_out_done)
 * for every live copy of every CUDA device, oldest group first */
PyObject *testing_offload_copies(PyObject *module, PyObject *unused);

#endif
