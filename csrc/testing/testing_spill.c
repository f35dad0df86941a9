/* Test controls of the disk tier under several threads: a hook called at
 * the engine's yield points (OFFLOAD_YIELD, offload_internal.h), so a test
 * runs another thread's work exactly where the engine lets the GIL go,
 * and the entry points such work goes through. GIL held.
 *
 *   _set_yield_hook(hook)      hook(name) at every yield point; None: no hook
 *   _spill_room(nbytes)        what a forward saving a span of nbytes does first:
 *                              spills the oldest spans and waits for room
 *   _spill_settle()            waits (GIL released) until the tier runs no
 *                              request, then finishes what it did (a poll)
 *   _spill_pause(on)           the tier's workers leave queued requests alone (True)
 *   _spill_fail_writes(n)      the tier's next n writes fail with ENOSPC
 *   _spill_hold() -> (tier, slot)  a hold on the slot of a span on disk, as a
 *                              waiter takes one across the GIL (spill.h, "Holds")
 *   _spill_unhold(tier, slot)  lets that hold go (GIL released) */
#include "testing.h"
#include "offload/offload_internal.h"

#include <errno.h>

static PyObject *
set_yield_hook(PyObject *module, PyObject *hook)
{
    offload_engine *engine = mp_state_of(module)->engine;
    if (hook != Py_None && !PyCallable_Check(hook)) {
        PyObject *type_name = mp_type_name(hook);
        PyErr_Format(PyExc_TypeError, "matepoint: the yield hook must be callable or None, "
                     "not %.100V", type_name, "?");
        Py_XDECREF(type_name);
        return NULL;
    }
    Py_XSETREF(engine->yield_hook, hook == Py_None ? NULL : Py_NewRef(hook));
    Py_RETURN_NONE;
}

static PyObject *
spill_room(PyObject *module, PyObject *arg)
{
    unsigned long long nbytes = PyLong_AsUnsignedLongLong(arg);
    if (nbytes == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    mp_state *st = mp_state_of(module);
    if (offload_engine_ensure_pool(st->engine) < 0 || offload_spill_room(st, nbytes) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
spill_settle(PyObject *module, PyObject *unused)
{
    (void)unused;
    offload_engine *engine = mp_state_of(module)->engine;
    spill_tier *tier = engine->spill;
    if (tier == NULL)
        Py_RETURN_NONE;
    /* read with the GIL, used without it: tests call this only where no
     * set_options runs meanwhile (a retired tier would go under it) */
    Py_BEGIN_ALLOW_THREADS
    spill_wait_idle(tier);
    Py_END_ALLOW_THREADS
    offload_spill_poll(engine);
    Py_RETURN_NONE;
}

/* The engine's tier, or NULL with a RuntimeError: it starts at the
 * first spill. */
static spill_tier *
started_tier(PyObject *module)
{
    spill_tier *tier = mp_state_of(module)->engine->spill;
    if (tier == NULL)
        PyErr_SetString(PyExc_RuntimeError, "matepoint: no disk tier has started");
    return tier;
}

static PyObject *
spill_pause_tier(PyObject *module, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    spill_tier *tier = on < 0 ? NULL : started_tier(module);
    if (tier == NULL)
        return NULL;
    spill_pause(tier, on);
    Py_RETURN_NONE;
}

static PyObject *
spill_fail_writes(PyObject *module, PyObject *arg)
{
    long count = PyLong_AsLong(arg);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    spill_tier *tier = started_tier(module);
    if (tier == NULL)
        return NULL;
    spill_inject_write_errors(tier, ENOSPC, count > INT32_MAX ? INT32_MAX : (int)count);
    Py_RETURN_NONE;
}

/* The newest span on disk (or being written): its slot, into ctx. */
static int
find_spilled(offload_engine *engine, StorageCopy *copy, void *ctx)
{
    (void)engine;
    if (copy->spill != NULL)
        *(spill_slot **)ctx = copy->spill;
    return 0;
}

/* The hold is the test's to let go: a test holds a slot on its thread
 * while another retires the tier, as the engine's waiter does while it
 * waits with the GIL released (offload_spill.c, wait_request). */
static PyObject *
spill_hold_slot(PyObject *module, PyObject *unused)
{
    (void)unused;
    offload_engine *engine = mp_state_of(module)->engine;
    spill_tier *tier = started_tier(module);
    spill_slot *slot = NULL;
    if (tier == NULL)
        return NULL;
    offload_walk_copies(engine, find_spilled, &slot);
    if (slot == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "matepoint: no span is on disk to hold the slot of");
        return NULL;
    }
    spill_slot_hold(tier, slot);
    return Py_BuildValue("(NN)", PyLong_FromVoidPtr(tier), PyLong_FromVoidPtr(slot));
}

static PyObject *
spill_unhold_slot(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *tier_arg, *slot_arg;
    if (!PyArg_ParseTuple(args, "OO:_spill_unhold", &tier_arg, &slot_arg))
        return NULL;
    spill_tier *tier = PyLong_AsVoidPtr(tier_arg);
    spill_slot *slot = PyErr_Occurred() ? NULL : PyLong_AsVoidPtr(slot_arg);
    if (PyErr_Occurred())
        return NULL;
    /* a retiring tier waits for this with the GIL released: so must this */
    Py_BEGIN_ALLOW_THREADS
    spill_slot_unhold(tier, slot);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef spill_methods[] = {
    {"_spill_pause", spill_pause_tier, METH_O,
     "_spill_pause($module, on, /)\n--\n\n"
     "True: the disk tier's workers leave queued requests alone; False: they run them."},
    {"_spill_fail_writes", spill_fail_writes, METH_O,
     "_spill_fail_writes($module, count, /)\n--\n\n"
     "The disk tier's next count writes fail with ENOSPC (0 clears it)."},
    {"_set_yield_hook", set_yield_hook, METH_O,
     "_set_yield_hook($module, hook, /)\n--\n\n"
     "Calls hook(name) at each of the engine's yield points; None for no hook."},
    {"_spill_room", spill_room, METH_O,
     "_spill_room($module, nbytes, /)\n--\n\n"
     "Makes room under host_limit_bytes for a span of nbytes, as a forward does."},
    {"_spill_settle", spill_settle, METH_NOARGS,
     "_spill_settle($module, /)\n--\n\n"
     "Waits until the disk tier runs no request, then polls it."},
    {"_spill_hold", spill_hold_slot, METH_NOARGS,
     "_spill_hold($module, /)\n--\n\n"
     "Holds the slot of a span on disk, as a waiter does across the GIL; (tier, slot)."},
    {"_spill_unhold", spill_unhold_slot, METH_VARARGS,
     "_spill_unhold($module, tier, slot, /)\n--\n\n"
     "Lets go of a hold _spill_hold took."},
    {NULL, NULL, 0, NULL},
};

int
testing_add_spill_functions(PyObject *module)
{
    return PyModule_AddFunctions(module, spill_methods);
}
