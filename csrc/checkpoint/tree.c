#include "tree.h"

/* A numbered tensor position inside a template. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t index;
} TreeSlot;

/* A container that held tensors: its kind, its type (for namedtuples), its
 * keys (dicts) and the templates of its items. */
enum tree_kind { TREE_TUPLE, TREE_LIST, TREE_DICT, TREE_NAMEDTUPLE };

typedef struct {
    PyObject_HEAD
    int kind;
    PyObject *type;   /* namedtuple class, else NULL */
    PyObject *keys;   /* tuple of dict keys, else NULL */
    PyObject *items;  /* tuple of item templates */
} TreeNode;

static void
slot_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    mp_type_free(tp, self);
    Py_DECREF(tp);
}

static PyType_Slot tree_slot_slots[] = {
    {Py_tp_dealloc, slot_dealloc},
    {0, NULL},
};

PyType_Spec tree_slot_spec = {
    .name = "matepoint._C._TreeSlot",
    .basicsize = sizeof(TreeSlot),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = tree_slot_slots,
};

static int
node_traverse(TreeNode *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->type);
    Py_VISIT(self->keys);
    Py_VISIT(self->items);
    return 0;
}

static int
node_clear(TreeNode *self)
{
    Py_CLEAR(self->type);
    Py_CLEAR(self->keys);
    Py_CLEAR(self->items);
    return 0;
}

static void
node_dealloc(TreeNode *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    node_clear(self);
    mp_type_free(tp, self);
    Py_DECREF(tp);
}

static PyType_Slot tree_node_slots[] = {
    {Py_tp_dealloc, node_dealloc},
    {Py_tp_traverse, node_traverse},
    {Py_tp_clear, node_clear},
    {0, NULL},
};

PyType_Spec tree_node_spec = {
    .name = "matepoint._C._TreeNode",
    .basicsize = sizeof(TreeNode),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = tree_node_slots,
};

static PyObject *
slot_new(mp_state *st, Py_ssize_t index)
{
    /* tp_alloc takes the reference to the type that slot_dealloc gives back */
    TreeSlot *slot = (TreeSlot *)mp_type_alloc(st->slot_type);
    if (slot == NULL)
        return NULL;
    slot->index = index;
    return (PyObject *)slot;
}

/* Steals `items`, `keys`; borrows `type`. */
static PyObject *
node_new(mp_state *st, int kind, PyObject *type, PyObject *keys, PyObject *items)
{
    /* tp_alloc tracks the node and takes the type reference node_dealloc
     * gives back */
    TreeNode *node = (TreeNode *)mp_type_alloc(st->node_type);
    if (node == NULL) {
        Py_XDECREF(keys);
        Py_DECREF(items);
        return NULL;
    }
    node->kind = kind;
    node->type = Py_XNewRef(type);
    node->keys = keys;
    node->items = items;
    return (PyObject *)node;
}

static int
is_namedtuple(mp_state *st, PyObject *obj)
{
    if (!PyTuple_Check(obj) || PyTuple_CheckExact(obj))
        return 0;
    return PyObject_HasAttr((PyObject *)Py_TYPE(obj), st->str_fields);
}

/* Flattens each element of `seq` (a tuple or list). Returns a new tuple of
 * templates and sets *changed when any element held a tensor. */
static PyObject *
flatten_items(mp_state *st, PyObject *seq, PyObject *tensors, int *changed)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyTuple_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *templ = tree_flatten(st, item, tensors);
        if (templ == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        if (templ != item)
            *changed = 1;
        PyTuple_SET_ITEM(out, i, templ);
    }
    return out;
}

static PyObject *
flatten_dict(mp_state *st, PyObject *dict, PyObject *tensors)
{
    PyObject *keys = PyDict_Keys(dict);
    PyObject *values = keys ? PyDict_Values(dict) : NULL;
    PyObject *key_tuple = NULL, *items = NULL;
    int changed = 0;
    if (values == NULL)
        goto error;
    items = flatten_items(st, values, tensors, &changed);
    if (items == NULL)
        goto error;
    if (!changed) {
        Py_DECREF(items);
        Py_DECREF(keys);
        Py_DECREF(values);
        return Py_NewRef(dict);
    }
    key_tuple = PyList_AsTuple(keys);
    if (key_tuple == NULL)
        goto error;
    Py_DECREF(keys);
    Py_DECREF(values);
    return node_new(st, TREE_DICT, NULL, key_tuple, items);
error:
    Py_XDECREF(keys);
    Py_XDECREF(values);
    Py_XDECREF(items);
    return NULL;
}

PyObject *
tree_flatten(mp_state *st, PyObject *obj, PyObject *tensors)
{
    if (PyObject_TypeCheck(obj, (PyTypeObject *)st->tensor_type)) {
        if (PyList_Append(tensors, obj) < 0)
            return NULL;
        return slot_new(st, PyList_GET_SIZE(tensors) - 1);
    }
    int kind;
    if (PyTuple_CheckExact(obj))
        kind = TREE_TUPLE;
    else if (PyList_CheckExact(obj))
        kind = TREE_LIST;
    else if (PyDict_CheckExact(obj))
        kind = TREE_DICT;
    else if (is_namedtuple(st, obj))
        kind = TREE_NAMEDTUPLE;
    else
        return Py_NewRef(obj);

    if (Py_EnterRecursiveCall(" while looking for tensors in checkpoint arguments"))
        return NULL;
    PyObject *result;
    if (kind == TREE_DICT) {
        result = flatten_dict(st, obj, tensors);
    } else {
        int changed = 0;
        PyObject *items = flatten_items(st, obj, tensors, &changed);
        if (items == NULL || !changed) {
            Py_XDECREF(items);
            result = items ? Py_NewRef(obj) : NULL;
        } else {
            PyObject *type = kind == TREE_NAMEDTUPLE ? (PyObject *)Py_TYPE(obj) : NULL;
            result = node_new(st, kind, type, NULL, items);
        }
    }
    Py_LeaveRecursiveCall();
    return result;
}

static PyObject *
unflatten_node(mp_state *st, TreeNode *node, PyObject *tensors)
{
    Py_ssize_t n = PyTuple_GET_SIZE(node->items);
    PyObject *items = PyTuple_New(n);
    PyObject *result = NULL;
    if (items == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = tree_unflatten(st, PyTuple_GET_ITEM(node->items, i), tensors);
        if (item == NULL)
            goto done;
        PyTuple_SET_ITEM(items, i, item);
    }
    switch (node->kind) {
    case TREE_TUPLE:
        result = Py_NewRef(items);
        break;
    case TREE_LIST:
        result = PySequence_List(items);
        break;
    case TREE_NAMEDTUPLE:
        result = PyObject_Call(node->type, items, NULL);
        break;
    case TREE_DICT:
        result = PyDict_New();
        for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
            if (PyDict_SetItem(result, PyTuple_GET_ITEM(node->keys, i),
                               PyTuple_GET_ITEM(items, i)) < 0)
                Py_CLEAR(result);
        }
        break;
    }
done:
    Py_DECREF(items);
    return result;
}

PyObject *
tree_unflatten(mp_state *st, PyObject *templ, PyObject *tensors)
{
    if (Py_IS_TYPE(templ, st->slot_type)) {
        PyObject *tensor = PySequence_GetItem(tensors, ((TreeSlot *)templ)->index);
        return tensor;
    }
    if (!Py_IS_TYPE(templ, st->node_type))
        return Py_NewRef(templ);
    if (Py_EnterRecursiveCall(" while rebuilding checkpoint arguments"))
        return NULL;
    PyObject *result = unflatten_node(st, (TreeNode *)templ, tensors);
    Py_LeaveRecursiveCall();
    return result;
}
