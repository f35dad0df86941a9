/* torch's saved-tensor machinery as the extension uses it: pushing and
 * popping default pack/unpack hooks, and saving a tensor through them.
 * hooks_pop() keeps an exception already in flight (the pop error, if any,
 * is chained to it). All need the GIL. */
#ifndef MATEPOINT_BASE_HOOKS_H
#define MATEPOINT_BASE_HOOKS_H

#include "state.h"

int hooks_push(mp_state *st, PyObject *pack, PyObject *unpack);
int hooks_pop(mp_state *st);
/* torch._C._autograd._make_saved_tensor(tensor, is_output=False): the
 * tensor packed by the hooks on top of the stack (new reference). */
PyObject *hooks_save_tensor(mp_state *st, PyObject *tensor);
/* `_checkpoint_internal` and `_user_hooks` of the pack-hook types, the
 * attributes torch 2.14 reads to tell a checkpoint's hooks from the user's. */
extern PyGetSetDef hooks_internal_getset[];

#endif
