/* Test controls that run torch's offload adapter (offload/offload_runtime_torch.c)
 * without a GPU: the engine over the simulated GPU with torch's answers for
 * the current stream, record_stream and context queries, taken from a
 * torch.cuda stand-in (tests/fake_torch_cuda.py) put in place of the module
 * state's entry points. Test builds only; GIL held.
 *
 *   _simulate_torch_adapter(on)      the engine runs torch's adapter over the
 *                                    simulated GPU (or torch's CUDA runtime again)
 *   _torch_cuda_entries(entries) -> previous    replace torch's CUDA entry points
 *                                    the adapter calls, by torch's name
 *   _torch_tensor_device(tensor, device) -> int or None    the adapter's answer
 *   _sim_stream_device(handle) -> int    the simulated device of a stream (-1: none)
 *   _sim_maybe_exchange_device(device) -> int    torch's MaybeExchangeDevice over
 *                                    the simulated GPU (the stand-in's)
 *   _sim_torch_device() -> int       the device torch.cuda.current_device() answers */
#include "testing.h"
#include "testing/cudart_sim.h"
#include "offload/offload_internal.h"

#include <stddef.h>

/* The entry points of torch's CUDA API the adapter calls, by torch's
 * name, and where the module state keeps each. */
static const struct {
    const char *name;
    size_t offset;
} entries[] = {
    {"_cuda_getCurrentRawStream", offsetof(mp_state, current_raw_stream)},
    {"_cuda_hasPrimaryContext", offsetof(mp_state, has_primary_context)},
    {"_cuda_maybeExchangeDevice", offsetof(mp_state, maybe_exchange_device)},
    {"default_stream", offsetof(mp_state, cuda_default_stream)},
    {"ExternalStream", offsetof(mp_state, cuda_external_stream)},
    {"record_stream", offsetof(mp_state, tensor_record_stream)},
};
#define ENTRY_COUNT (sizeof(entries) / sizeof(entries[0]))

static PyObject **
entry_field(mp_state *st, size_t i)
{
    return (PyObject **)((char *)st + entries[i].offset);
}

static PyObject *
simulate_torch_adapter(PyObject *module, PyObject *on)
{
    int enable = PyObject_IsTrue(on);
    const offload_runtime *runtime = enable ? &offload_runtime_torch_sim : &offload_runtime_torch;
    if (enable < 0 || offload_engine_use_runtime(offload_engine_of(module), runtime) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Every key of `given` names an entry and maps to a callable or None. */
static int
check_entries(PyObject *given)
{
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(given, &pos, &key, &value)) {
        size_t i = 0;
        while (i < ENTRY_COUNT && (!PyUnicode_Check(key) ||
                                   PyUnicode_CompareWithASCIIString(key, entries[i].name) != 0))
            i++;
        if (i == ENTRY_COUNT) {
            PyErr_Format(PyExc_ValueError, "matepoint: no torch CUDA entry point named %R", key);
            return -1;
        }
        if (value != Py_None && !PyCallable_Check(value)) {
            PyErr_Format(PyExc_TypeError, "matepoint: the stand-in for %s must be callable or "
                         "None, got %R", entries[i].name, value);
            return -1;
        }
    }
    return 0;
}

/* The entry points as a dict (None where torch has none). */
static PyObject *
current_entries(mp_state *st)
{
    PyObject *dict = PyDict_New();
    for (size_t i = 0; dict != NULL && i < ENTRY_COUNT; i++) {
        PyObject *value = *entry_field(st, i);
        if (PyDict_SetItemString(dict, entries[i].name, value ? value : Py_None) < 0)
            Py_CLEAR(dict);
    }
    return dict;
}

/* Puts the callables of `given` in place (checked first: all or none
 * change) and returns what was there before, every entry, for putting back. */
static PyObject *
torch_cuda_entries(PyObject *module, PyObject *given)
{
    mp_state *st = mp_state_of(module);
    if (!PyDict_Check(given)) {
        PyErr_Format(PyExc_TypeError, "matepoint: entries must be a dict, got %R", given);
        return NULL;
    }
    PyObject *previous = check_entries(given) < 0 ? NULL : current_entries(st);
    for (size_t i = 0; previous != NULL && i < ENTRY_COUNT; i++) {
        PyObject *value = PyDict_GetItemString(given, entries[i].name);
        if (value != NULL)
            Py_XSETREF(*entry_field(st, i), value == Py_None ? NULL : Py_NewRef(value));
    }
    return previous;
}

static PyObject *
torch_tensor_device(PyObject *module, PyObject *args)
{
    PyObject *tensor, *device_obj;
    int index = -1;
    if (!PyArg_ParseTuple(args, "OO:_torch_tensor_device", &tensor, &device_obj))
        return NULL;
    int moves = offload_runtime_torch.tensor_device(mp_state_of(module), tensor, device_obj,
                                                    &index);
    if (moves < 0)
        return NULL;
    return moves ? PyLong_FromLong(index) : Py_NewRef(Py_None);
}

static PyObject *
sim_stream_device(PyObject *module, PyObject *handle)
{
    (void)module;
    void *stream = PyLong_AsVoidPtr(handle);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(cudart_sim_stream_device(stream));
}

static PyObject *
sim_maybe_exchange_device(PyObject *module, PyObject *arg)
{
    (void)module;
    int device;
    if (testing_device_arg(arg, &device) < 0)
        return NULL;
    return PyLong_FromLong(sim_runtime_maybe_exchange_device(device));
}

static PyObject *
sim_torch_device(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromLong(sim_runtime_torch_device());
}

static PyMethodDef testing_torch_methods[] = {
    {"_simulate_torch_adapter", simulate_torch_adapter, METH_O,
     "_simulate_torch_adapter($module, on, /)\n--\n\n"
     "Run the offload engine over the simulated GPU with torch's adapter asking torch.cuda "
     "(on=True), or over torch's CUDA again."},
    {"_torch_cuda_entries", torch_cuda_entries, METH_O,
     "_torch_cuda_entries($module, entries, /)\n--\n\n"
     "Replace torch's CUDA entry points the adapter calls (a dict by torch's name: "
     "_cuda_getCurrentRawStream, _cuda_hasPrimaryContext, _cuda_maybeExchangeDevice, "
     "default_stream, ExternalStream, record_stream; None: absent); returns all of them as they were."},
    {"_torch_tensor_device", torch_tensor_device, METH_VARARGS,
     "_torch_tensor_device($module, tensor, device, /)\n--\n\n"
     "The CUDA device index torch's adapter copies tensor (on device) from, or None."},
    {"_sim_stream_device", sim_stream_device, METH_O,
     "_sim_stream_device($module, handle, /)\n--\n\n"
     "The simulated device a stream handle belongs to; -1 for 0 or a stale handle."},
    {"_sim_maybe_exchange_device", sim_maybe_exchange_device, METH_O,
     "_sim_maybe_exchange_device($module, device, /)\n--\n\n"
     "torch's MaybeExchangeDevice on the simulated GPU: device becomes current where it has a "
     "context, else only torch's target device; returns the device CUDA had current."},
    {"_sim_torch_device", sim_torch_device, METH_NOARGS,
     "_sim_torch_device($module, /)\n--\n\n"
     "The calling thread's current device as torch reports it (its target device, else "
     "CUDA's)."},
    {NULL, NULL, 0, NULL},
};

int
testing_torch_add_functions(PyObject *module)
{
    return PyModule_AddFunctions(module, testing_torch_methods);
}
