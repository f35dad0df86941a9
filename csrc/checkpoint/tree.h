/* Nested argument structures: find the tensors inside tuples, lists, dicts
 * and namedtuples, and rebuild the structure around other tensors later.
 *
 * tree_flatten() returns a template (new reference) and appends every tensor
 * it meets to `tensors`. Objects holding no tensor are kept as they are, so
 * their identity survives; containers holding tensors become internal nodes
 * and tensors become numbered slots. tree_unflatten() turns a template and a
 * sequence of replacement tensors back into the structure (new reference).
 * Both need the GIL. */
#ifndef MATEPOINT_CHECKPOINT_TREE_H
#define MATEPOINT_CHECKPOINT_TREE_H

#include "base/state.h"

PyObject *tree_flatten(mp_state *st, PyObject *obj, PyObject *tensors);
PyObject *tree_unflatten(mp_state *st, PyObject *templ, PyObject *tensors);

extern PyType_Spec tree_slot_spec;
extern PyType_Spec tree_node_spec;

#endif
