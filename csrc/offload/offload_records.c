/* The records floor: the Python objects autograd keeps for an offloaded
 * input (TensorRecord), a region's group of copies (OffloadGroup, linked
 * into its device's list in creation order), and the pack hook that hands
 * prepared records to SavedTensor (OffloadPacker); a new StorageCopy (its
 * type and end are offload_copy.c's); and the walk over every device's
 * groups.
 *
 * Owns a record's references (its copy, group, dtype, shape, the weak
 * reference to its input) and a device's group list (first, last, the
 * links). Floor `records`: called by the spill, save and restore files;
 * calls nothing of csrc/offload. GIL held. */
#include "offload_internal.h"
#include "base/compat.h"

static int
tensor_record_traverse(TensorRecord *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->copy);
    Py_VISIT(self->group);
    Py_VISIT(self->dtype);
    Py_VISIT(self->size);
    Py_VISIT(self->stride);
    Py_VISIT(self->device_obj);
    Py_VISIT(self->weak_source);
    Py_VISIT(self->version);
    Py_VISIT(self->wrapper_type);
    Py_VISIT(self->wrapper_spec);
    return 0;
}

static int
tensor_record_clear(TensorRecord *self)
{
    Py_CLEAR(self->copy);
    Py_CLEAR(self->group);
    Py_CLEAR(self->dtype);
    Py_CLEAR(self->size);
    Py_CLEAR(self->stride);
    Py_CLEAR(self->device_obj);
    Py_CLEAR(self->weak_source);
    Py_CLEAR(self->version);
    Py_CLEAR(self->wrapper_type);
    Py_CLEAR(self->wrapper_spec);
    return 0;
}

static void
tensor_record_dealloc(TensorRecord *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    tensor_record_clear(self);
    mp_type_free(tp, self);
    Py_DECREF(tp);
}

static PyType_Slot tensor_record_slots[] = {
    {Py_tp_dealloc, tensor_record_dealloc},
    {Py_tp_traverse, tensor_record_traverse},
    {Py_tp_clear, tensor_record_clear},
    {0, NULL},
};

PyType_Spec tensor_record_spec = {
    .name = "matepoint._C._TensorRecord",
    .basicsize = sizeof(TensorRecord),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = tensor_record_slots,
};

static void
group_unlink(OffloadGroup *group)
{
    if (!group->linked)
        return;
    offload_device *device = group->device;
    MP_ASSERT(group->prev == NULL ? device->first == group : group->prev->next == group);
    MP_ASSERT(group->next == NULL ? device->last == group : group->next->prev == group);
    if (group->prev != NULL)
        group->prev->next = group->next;
    else
        device->first = group->next;
    if (group->next != NULL)
        group->next->prev = group->prev;
    else
        device->last = group->prev;
    group->prev = group->next = NULL;
    group->linked = 0;
}

static void
group_link(OffloadGroup *group)
{
    offload_device *device = group->device;
    MP_ASSERT(!group->linked);
    MP_ASSERT((device->first == NULL) == (device->last == NULL));
    MP_ASSERT(device->last == NULL || device->last->next == NULL);
    group->prev = device->last;
    group->next = NULL;
    if (device->last != NULL)
        device->last->next = group;
    else
        device->first = group;
    device->last = group;
    group->linked = 1;
}

static int
offload_group_traverse(OffloadGroup *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    Py_VISIT(self->copies);
    return 0;
}

static void
offload_group_dealloc(OffloadGroup *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    group_unlink(self);
    Py_CLEAR(self->copies);
    Py_CLEAR(self->module);
    mp_type_free(tp, self);
    Py_DECREF(tp);
}

static PyType_Slot offload_group_slots[] = {
    {Py_tp_dealloc, offload_group_dealloc},
    {Py_tp_traverse, offload_group_traverse},
    {0, NULL},
};

PyType_Spec offload_group_spec = {
    .name = "matepoint._C._OffloadGroup",
    .basicsize = sizeof(OffloadGroup),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = offload_group_slots,
};

static int
packer_traverse(OffloadPacker *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->records);
    return 0;
}

static void
packer_dealloc(OffloadPacker *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->records);
    mp_type_free(tp, self);
    Py_DECREF(tp);
}

static PyObject *
packer_call(OffloadPacker *self, PyObject *args, PyObject *kwargs)
{
    (void)args;
    (void)kwargs;
    if (self->next >= PyList_GET_SIZE(self->records)) {
        PyErr_SetString(PyExc_RuntimeError, "matepoint: offload packer ran out of records");
        return NULL;
    }
    return Py_NewRef(PyList_GET_ITEM(self->records, self->next++));
}

static PyType_Slot offload_packer_slots[] = {
    {Py_tp_dealloc, packer_dealloc},
    {Py_tp_traverse, packer_traverse},
    {Py_tp_call, packer_call},
    {0, NULL},
};

PyType_Spec offload_packer_spec = {
    .name = "matepoint._C._OffloadPacker",
    .basicsize = sizeof(OffloadPacker),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = offload_packer_slots,
};

/* A weak reference to the tensor whose version tells an in-place change of
 * `tensor`: its view base when it is a view. A view shares its base's
 * version counter, and every view keeps its base alive (torch preserves the
 * base's Python object while its TensorImpl lives): the view may die while
 * its base is changed in place, and the base's version still shows it; once
 * the base is gone too, nothing can change the span. A tensor sharing the
 * counter without being a view (`detach()`) is watched only while alive. */
static PyObject *
watched_tensor(PyObject *tensor)
{
    PyObject *base = PyObject_GetAttrString(tensor, "_base");
    if (base == NULL)
        return NULL;
    PyObject *weak = PyWeakref_NewRef(base == Py_None ? tensor : base, NULL);
    Py_DECREF(base);
    return weak;
}

StorageCopy *
storage_copy_new(mp_state *st, PyObject *module, offload_device *device, PyObject *device_obj,
                 uint64_t nbytes)
{
    StorageCopy *copy = (StorageCopy *)mp_type_alloc(st->storage_copy_type);
    if (copy == NULL)
        return NULL;
    copy->module = Py_NewRef(module);
    copy->device = device;
    copy->device_obj = Py_NewRef(device_obj);
    copy->nbytes = nbytes;
    copy->thread = PyThread_get_thread_ident();     /* as its group's (group_new) */
    return copy;
}

TensorRecord *
record_new(mp_state *st, input_info *info, PyObject *copies, PyObject *group, PyObject *tensor,
           Py_ssize_t input_index)
{
    TensorRecord *record = (TensorRecord *)mp_type_alloc(st->tensor_record_type);
    if (record == NULL)
        return NULL;
    record->copy = info->copy_index >= 0
                       ? (StorageCopy *)Py_NewRef(PyList_GET_ITEM(copies, info->copy_index))
                       : NULL;
    record->group = Py_NewRef(group);
    record->dtype = Py_NewRef(info->dtype);
    record->size = Py_NewRef(info->size);
    record->stride = Py_NewRef(info->stride);
    record->device_obj = Py_NewRef(info->device_obj);
    record->wrapper_type = Py_XNewRef(info->wrapper_type);
    record->wrapper_spec = Py_XNewRef(info->wrapper_spec);
    record->offset = info->itemsize ? (int64_t)info->byte_offset / info->itemsize : 0;
    record->input_index = input_index;
    record->weak_source = watched_tensor(tensor);
    record->version = record->weak_source ? PyObject_GetAttr(tensor, st->str_version) : NULL;
    PyObject *requires_grad = record->version ? PyObject_GetAttrString(tensor, "requires_grad") : NULL;
    record->requires_grad = requires_grad == Py_True;
    Py_XDECREF(requires_grad);
    if (requires_grad == NULL) {
        Py_DECREF(record);
        return NULL;
    }
    return record;
}

PyObject *
group_new(mp_state *st, PyObject *module, PyObject *copies)
{
    OffloadGroup *group = (OffloadGroup *)mp_type_alloc(st->offload_group_type);
    if (group == NULL)
        return NULL;
    group->module = Py_NewRef(module);
    group->copies = PyList_AsTuple(copies);
    group->thread = PyThread_get_thread_ident();
    if (group->copies == NULL) {
        Py_DECREF(group);
        return NULL;
    }
    group->device = PyTuple_GET_SIZE(group->copies) > 0
                        ? ((StorageCopy *)PyTuple_GET_ITEM(group->copies, 0))->device
                        : NULL;
    if (group->device != NULL)
        group_link(group);
    return (PyObject *)group;
}

PyObject *
packer_new(mp_state *st, PyObject *records)
{
    OffloadPacker *packer = (OffloadPacker *)mp_type_alloc(st->offload_packer_type);
    if (packer == NULL)
        return NULL;
    packer->records = Py_NewRef(records);
    return (PyObject *)packer;
}

/* 1 when the record's input (or its view base) is alive with another
 * version than saved. */
int
offload_source_changed(mp_state *st, TensorRecord *record)
{
    PyObject *source = PyWeakref_GetObject(record->weak_source);
    if (source == NULL || source == Py_None)
        return source == NULL ? -1 : 0;
    PyObject *now = PyObject_GetAttr(source, st->str_version);
    if (now == NULL)
        return -1;
    int same = PyObject_RichCompareBool(now, record->version, Py_EQ);
    Py_DECREF(now);
    return same < 0 ? -1 : !same;
}

int
offload_walk_copies(offload_engine *engine,
                    int (*visit)(offload_engine *, StorageCopy *, void *), void *ctx)
{
    for (int d = 0; d < MAX_CUDA_DEVICES; d++) {
        offload_device *device = engine->cuda[d];
        for (OffloadGroup *g = device ? device->first : NULL; g != NULL; g = g->next) {
            for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g->copies); i++) {
                int stop = visit(engine, (StorageCopy *)PyTuple_GET_ITEM(g->copies, i), ctx);
                if (stop != 0)
                    return stop;
            }
        }
    }
    return 0;
}
