/* Test controls of the engine's call sites (offload/offload_sites.h): the
 * test runtime (sim_runtime.c) counts each site's waits and records and
 * drops the chosen sites' (tests/test_waits_needed.py proves each site by
 * dropping it), and what a test may leave set (tests/leftovers.py). GIL
 * held.
 *
 *   _C.OFFLOAD_SITES                 {site: the call it names}
 *   _sim_drop_site(name or names)    those sites' calls succeed and do nothing
 *   _sim_site_counts() -> dict       calls per site since _sim_drop_site
 *   _test_controls() -> dict         the test controls set now */
#include "testing.h"
#include "offload/offload_internal.h"

#include <string.h>

/* The engine's call site named `name` (offload_sites.h), -1 for None;
 * -2 with a ValueError for a name no site has. */
static int
site_arg(PyObject *name)
{
    if (name == Py_None)
        return -1;
    const char *text = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    for (int site = 0; text != NULL && site < OFFLOAD_SITE_COUNT; site++) {
        if (strcmp(offload_site_name(site), text) == 0)
            return site;
    }
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "matepoint: no offload call site named %R", name);
    return -2;
}

/* Adds the site `name` names (None: none) to `dropped`; -1 with an error. */
static int
add_dropped(PyObject *name, uint32_t *dropped)
{
    int site = site_arg(name);
    if (site < -1)
        return -1;
    if (site >= 0)
        *dropped |= 1u << site;
    return 0;
}

/* `names`: None, one site's name, or a list or tuple of names. */
static PyObject *
sim_drop_site(PyObject *module, PyObject *names)
{
    (void)module;
    uint32_t dropped = 0;
    int many = PyList_Check(names) || PyTuple_Check(names);
    Py_ssize_t count = many ? PySequence_Size(names) : 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *name = many ? PySequence_GetItem(names, i) : Py_NewRef(names);
        int failed = name == NULL || add_dropped(name, &dropped) < 0;
        Py_XDECREF(name);
        if (failed)
            return NULL;
    }
    if (count < 0)
        return NULL;
    sim_runtime_drop_sites(dropped);
    Py_RETURN_NONE;
}

/* The test controls a test may leave set, for tests/leftovers.py: the
 * call sites dropped, copies back set to fail, pool acquires set to fail
 * and the yield hook. */
static PyObject *
test_controls(PyObject *module, PyObject *unused)
{
    (void)unused;
    offload_engine *engine = offload_engine_of(module);
    PyObject *dropped = PyList_New(0);
    uint32_t sites = sim_runtime_dropped_sites();
    for (int site = 0; dropped != NULL && site < OFFLOAD_SITE_COUNT; site++) {
        if (!((sites >> site) & 1u))
            continue;
        PyObject *name = PyUnicode_FromString(offload_site_name(site));
        if (name == NULL || PyList_Append(dropped, name) < 0)
            Py_CLEAR(dropped);
        Py_XDECREF(name);
    }
    if (dropped == NULL)
        return NULL;
    return Py_BuildValue("{sNsKsisO}", "dropped_sites", dropped, "failing_fetches",
                         (unsigned long long)sim_runtime_failing_fetches(),
                         "failing_pool_acquires", engine->fail_next_acquires, "yield_hook",
                         engine->yield_hook != NULL ? engine->yield_hook : Py_None);
}

static PyObject *
sim_site_counts(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    PyObject *counts = PyDict_New();
    for (int site = 0; counts != NULL && site < OFFLOAD_SITE_COUNT; site++) {
        PyObject *count = PyLong_FromUnsignedLongLong(sim_runtime_site_issued(site));
        if (count == NULL || PyDict_SetItemString(counts, offload_site_name(site), count) < 0)
            Py_CLEAR(counts);
        Py_XDECREF(count);
    }
    return counts;
}

/* _C.OFFLOAD_SITES: {name: call} of every site of offload_sites.h. */
static int
add_sites(PyObject *module)
{
    PyObject *sites = PyDict_New();
    for (int site = 0; sites != NULL && site < OFFLOAD_SITE_COUNT; site++) {
        PyObject *call = PyUnicode_FromString(offload_site_call(site));
        if (call == NULL || PyDict_SetItemString(sites, offload_site_name(site), call) < 0)
            Py_CLEAR(sites);
        Py_XDECREF(call);
    }
    if (sites == NULL)
        return -1;
    int failed = PyModule_AddObjectRef(module, "OFFLOAD_SITES", sites) < 0;
    Py_DECREF(sites);
    return failed ? -1 : 0;
}

static PyMethodDef site_methods[] = {
    {"_sim_drop_site", sim_drop_site, METH_O,
     "_sim_drop_site($module, name, /)\n--\n\n"
     "From now on the engine's waits or records at call site name (a key of OFFLOAD_SITES, "
     "or a list of them; None: no site) succeed and do nothing; every site's count starts "
     "from zero."},
    {"_test_controls", test_controls, METH_NOARGS,
     "_test_controls($module, /)\n--\n\n"
     "The test controls set now: dropped_sites, failing_fetches, failing_pool_acquires, "
     "yield_hook."},
    {"_sim_site_counts", sim_site_counts, METH_NOARGS,
     "_sim_site_counts($module, /)\n--\n\n"
     "{site: calls} the engine made at each call site since _sim_drop_site (dropped ones "
     "included)."},
    {NULL, NULL, 0, NULL},
};

int
testing_add_site_functions(PyObject *module)
{
    if (PyModule_AddFunctions(module, site_methods) < 0)
        return -1;
    return add_sites(module);
}
