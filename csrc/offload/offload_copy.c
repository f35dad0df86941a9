/* The copy floor: the type of a StorageCopy, one storage span staged in a
 * pool buffer (made by offload_records.c's storage_copy_new), and its end:
 * the disk tier lets go of its file, and its host buffer goes back to the
 * pool after the last copy that reads or writes it.
 *
 * Owns what a copy owns (offload_types.h: its block, its events, the
 * source while a window holds it, the restored copy) once it dies. Floor
 * `copy`: reached through the type's slots only (torch's and Python's
 * references going); calls spill, return and device. GIL held. */
#include "offload_internal.h"
#include "base/compat.h"

static int
storage_copy_traverse(StorageCopy *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    Py_VISIT(self->device_obj);
    Py_VISIT(self->source);
    Py_VISIT(self->fetched);
    return 0;
}

static void
storage_copy_dealloc(StorageCopy *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    offload_engine *engine = self->module ? offload_engine_of(self->module) : NULL;
    if (engine != NULL) {
        /* the host buffer may still be read by a copy back or written by
         * the copy out (a source released in stream order keeps its
         * event): it goes back with the event of the last one, and the
         * pool reuses it once that completed, without a host wait. A copy
         * back was queued after the copy out, so its event covers both. */
        /* a span the disk tier still writes or reads keeps its block there */
        offload_spill_forget(engine, self);
        void *last = self->h2d_done != NULL ? self->h2d_done : self->d2h_done;
        int had_block = self->block.ptr != NULL;
        if (self->h2d_done != NULL && self->d2h_done != NULL)
            offload_device_give_event(engine, self->device, self->d2h_done);
        self->h2d_done = self->d2h_done = NULL;
        if (self->block.ptr != NULL && last != NULL)
            offload_return_after(engine, self->device, &self->block, last, NULL);
        else if (last != NULL)
            offload_device_give_event(engine, self->device, last);
        if (self->block.ptr != NULL)
            pool_release(engine->pool, &self->block);   /* nothing copies it */
        if (had_block)
            copy_advance(self, COPY_RETURNED);
    }
    /* a window holds a reference to every copy whose source it holds */
    MP_ASSERT(self->source == NULL);
    Py_CLEAR(self->fetched);
    Py_CLEAR(self->source);
    Py_CLEAR(self->device_obj);
    Py_CLEAR(self->module);
    mp_type_free(tp, self);
    Py_DECREF(tp);
}

static PyType_Slot storage_copy_slots[] = {
    {Py_tp_dealloc, storage_copy_dealloc},
    {Py_tp_traverse, storage_copy_traverse},
    {0, NULL},
};

PyType_Spec storage_copy_spec = {
    .name = "matepoint._C._StorageCopy",
    .basicsize = sizeof(StorageCopy),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = storage_copy_slots,
};
