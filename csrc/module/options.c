#include "options.h"
#include "base/compat.h"
#include "offload/offload.h"

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef enum { KIND_BOOL, KIND_INT, KIND_INT_OR_NONE, KIND_PATH_OR_NONE } option_kind;
typedef enum { FIELD_INT, FIELD_INT64, FIELD_UINT64, FIELD_PATH } field_kind;

typedef struct {
    const char *name;
    option_kind kind;
    int64_t default_value;   /* KIND_INT_OR_NONE: 0 is None */
    int64_t low, high;
    const char *high_words;  /* `high` as errors name it */
    const char *accepted;    /* the range in words, as errors name it */
    size_t offset;           /* its field in offload_options */
    field_kind field;
} option_spec;

#define FIELD(name, kind) offsetof(offload_options, name), kind

/* The C core keeps counts of checkpoints in an int and byte sizes in 64
 * bits with room for sums: hence the upper bounds. */
static const option_spec option_specs[] = {
    {"offload", KIND_BOOL, 1, 0, 1, NULL, NULL, FIELD(enabled, FIELD_INT)},
    {"pipeline", KIND_BOOL, 1, 0, 1, NULL, NULL, FIELD(pipeline, FIELD_INT)},
    {"prefetch_depth", KIND_INT, 1, 0, INT_MAX, "2**31 - 1", "an int from 0 to 2**31 - 1",
     FIELD(prefetch_depth, FIELD_INT)},
    {"offload_window", KIND_INT, 2, 1, INT_MAX, "2**31 - 1", "an int from 1 to 2**31 - 1",
     FIELD(window, FIELD_INT)},
    {"min_offload_bytes", KIND_INT, 1 << 20, 0, INT64_MAX, "2**63 - 1",
     "an int from 0 to 2**63 - 1",
     FIELD(min_offload_bytes, FIELD_INT64)},
    {"pool_limit_bytes", KIND_INT_OR_NONE, 0, 1, INT64_MAX, "2**63 - 1",
     "an int from 1 to 2**63 - 1, or None", FIELD(pool_limit_bytes, FIELD_UINT64)},
    {"host_limit_bytes", KIND_INT_OR_NONE, 0, 1, INT64_MAX, "2**63 - 1",
     "an int from 1 to 2**63 - 1, or None", FIELD(host_limit_bytes, FIELD_UINT64)},
    {"spill_dir", KIND_PATH_OR_NONE, 0, 0, 0, NULL, "a directory path (str or os.PathLike), or None",
     FIELD(spill_dir, FIELD_PATH)},
};
#define OPTION_COUNT (sizeof(option_specs) / sizeof(option_specs[0]))

static void
store(offload_options *opts, const option_spec *spec, int64_t value)
{
    char *field = (char *)opts + spec->offset;
    if (spec->field == FIELD_PATH)
        field[0] = '\0';   /* a path is stored by check_path; 0 is None */
    else if (spec->field == FIELD_INT)
        *(int *)field = (int)value;
    else if (spec->field == FIELD_INT64)
        *(int64_t *)field = value;
    else
        *(uint64_t *)field = (uint64_t)value;
}

void
options_set_defaults(mp_state *st)
{
    offload_options *opts = offload_engine_options(st->engine);
    for (size_t i = 0; i < OPTION_COUNT; i++)
        store(opts, &option_specs[i], option_specs[i].default_value);
}

static const option_spec *
find_spec(PyObject *name)
{
    for (size_t i = 0; PyUnicode_Check(name) && i < OPTION_COUNT; i++) {
        if (PyUnicode_CompareWithASCIIString(name, option_specs[i].name) == 0)
            return &option_specs[i];
    }
    return NULL;
}

/* `value` for a message: a huge int by its size (str() refuses past 4300
 * digits). */
static PyObject *
show_int(PyObject *value)
{
    PyObject *bits = PyObject_CallMethod(value, "bit_length", NULL);
    Py_ssize_t count = bits != NULL ? PyLong_AsSsize_t(bits) : -1;
    Py_XDECREF(bits);
    if (count < 0)
        return NULL;
    return count <= 256 ? PyObject_Str(value)
                        : PyUnicode_FromFormat("an int of %zd bits", count);
}

/* The bound `value` broke, in words: a value too large names the limit
 * (2**62 is not "negative", it is past 2**31 - 1). */
static int
out_of_range(const option_spec *spec, PyObject *value, int too_large)
{
    PyObject *shown = show_int(value);
    if (shown == NULL)
        return -1;
    if (too_large)
        PyErr_Format(PyExc_ValueError, "matepoint option %s must be at most %s (%s), got %U",
                     spec->name, spec->high_words,
                     spec->accepted, shown);
    else
        PyErr_Format(PyExc_ValueError, "matepoint option %s must be %s (%s), got %U",
                     spec->name, spec->low > 0 ? "positive" : "positive or zero",
                     spec->accepted, shown);
    Py_DECREF(shown);
    return -1;
}

/* A path option: a str, bytes or os.PathLike naming something, short
 * enough for the engine's buffer; copied into `into` when given. 0, or -1
 * with a TypeError or ValueError naming the option. */
static int
check_path(const option_spec *spec, PyObject *value, char *into)
{
    PyObject *encoded = NULL;
    if (!PyUnicode_Check(value) && !PyBytes_Check(value) &&
        !PyObject_HasAttrString(value, "__fspath__")) {
        PyErr_Format(PyExc_TypeError, "matepoint option %s must be %s, got %R", spec->name,
                     spec->accepted, value);
        return -1;
    }
    if (!PyUnicode_FSConverter(value, &encoded)) {
        /* a NUL in the path, or an __fspath__ that failed: say which option */
        PyObject *cause = mp_take_exception();
        PyObject *kind = PyErr_GivenExceptionMatches(cause, PyExc_ValueError)
                             ? PyExc_ValueError
                             : PyExc_TypeError;
        PyErr_Format(kind, "matepoint option %s must be %s, got %R: %S", spec->name,
                     spec->accepted, value, cause);
        PyObject *raised = mp_take_exception();
        PyException_SetCause(raised, Py_NewRef(cause));
        PyException_SetContext(raised, cause);
        mp_restore_exception(raised);
        return -1;
    }
    Py_ssize_t length = PyBytes_GET_SIZE(encoded);
    int status = 0;
    if (length == 0 || length >= OFFLOAD_PATH_MAX) {
        PyErr_Format(PyExc_ValueError, "matepoint option %s must name a directory (1 to %d "
                     "bytes), got %R", spec->name, OFFLOAD_PATH_MAX - 1, value);
        status = -1;
    } else if (into != NULL) {
        memcpy(into, PyBytes_AS_STRING(encoded), (size_t)length + 1);
    }
    Py_DECREF(encoded);
    return status;
}

/* The one check of an option's value: 0 with *out set, or -1 with a
 * TypeError or ValueError naming the option and what it accepts. */
static int
check_value(const option_spec *spec, PyObject *value, int64_t *out)
{
    if (spec->kind == KIND_PATH_OR_NONE) {
        *out = 0;
        return value == Py_None ? 0 : check_path(spec, value, NULL);
    }
    if (spec->kind == KIND_BOOL) {
        if (!PyBool_Check(value)) {
            PyErr_Format(PyExc_TypeError, "matepoint option %s must be a bool, got %R",
                         spec->name, value);
            return -1;
        }
        *out = value == Py_True;
        return 0;
    }
    if (value == Py_None && spec->kind == KIND_INT_OR_NONE) {
        *out = 0;
        return 0;
    }
    if (PyBool_Check(value) || !PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "matepoint option %s must be %s, got %R", spec->name,
                     spec->accepted, value);
        return -1;
    }
    int overflow;
    long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (number == -1 && PyErr_Occurred())
        return -1;
    if (overflow != 0 || number < spec->low || number > spec->high)
        return out_of_range(spec, value, overflow > 0 || number > spec->high);
    *out = number;
    return 0;
}

int
options_add_table(PyObject *module)
{
    PyObject *table = PyDict_New();
    for (size_t i = 0; table != NULL && i < OPTION_COUNT; i++) {
        const option_spec *spec = &option_specs[i];
        PyObject *entry =
            spec->kind == KIND_BOOL ? Py_BuildValue("(Os)", spec->default_value ? Py_True
                                                                                : Py_False,
                                                    NULL)
            : (spec->kind == KIND_INT_OR_NONE || spec->kind == KIND_PATH_OR_NONE) &&
                      spec->default_value == 0
                ? Py_BuildValue("(Os)", Py_None, spec->accepted)
                : Py_BuildValue("(Ls)", (long long)spec->default_value, spec->accepted);
        if (entry == NULL || PyDict_SetItemString(table, spec->name, entry) < 0)
            Py_CLEAR(table);
        Py_XDECREF(entry);
    }
    int status = table != NULL ? PyModule_AddObjectRef(module, "OPTIONS", table) : -1;
    Py_XDECREF(table);
    return status;
}

/* _check_option(name, value) -> value, or the error set_options raises. */
PyObject *
options_check_py(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "_check_option takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    const option_spec *spec = find_spec(args[0]);
    int64_t value;
    if (spec == NULL) {
        PyErr_Format(PyExc_TypeError, "unknown matepoint option %R", args[0]);
        return NULL;
    }
    if (check_value(spec, args[1], &value) < 0)
        return NULL;
    return Py_NewRef(args[1]);
}

/* The disk tier's options together: a host limit needs a directory to
 * spill to, and the directory must be private (offload_spill_check_dir). */
static int
check_spill(const offload_options *staged)
{
    if (staged->host_limit_bytes != 0 && staged->spill_dir[0] == '\0') {
        PyErr_SetString(PyExc_ValueError,
                        "matepoint option host_limit_bytes needs spill_dir (or MATEPOINT_SPILL_DIR): "
                        "the directory offloaded inputs past the limit are written to");
        return -1;
    }
    return staged->spill_dir[0] != '\0' ? offload_spill_check_dir(staged->spill_dir) : 0;
}

/* _configure(**options): checks every value first, then applies them all
 * (an option not given keeps its value). */
PyObject *
options_configure_py(PyObject *module, PyObject *args, PyObject *kwargs)
{
    mp_state *st = mp_state_of(module);
    offload_options *current = offload_engine_options(st->engine);
    offload_options staged = *current;
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "matepoint._C._configure takes keywords only");
        return NULL;
    }
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    while (kwargs != NULL && PyDict_Next(kwargs, &pos, &name, &value)) {
        const option_spec *spec = find_spec(name);
        int64_t number;
        if (spec == NULL) {
            PyErr_Format(PyExc_TypeError, "unknown matepoint option %R", name);
            return NULL;
        }
        if (check_value(spec, value, &number) < 0)
            return NULL;
        store(&staged, spec, number);
        if (spec->kind == KIND_PATH_OR_NONE && value != Py_None &&
            check_path(spec, value, (char *)&staged + spec->offset) < 0)
            return NULL;
    }
    offload_spill_retired retired;
    if (check_spill(&staged) < 0 || offload_spill_configure(st->engine, &staged, &retired) < 0)
        return NULL;
    *current = staged;
    /* the old tier stops with the GIL released: the new options first */
    offload_spill_retire(st->engine, &retired);
    offload_engine_apply_limit(st->engine);
    Py_RETURN_NONE;
}
