#include "offload.h"
#include "compat.h"
#include "frame.h"
#include "hooks.h"
#include "cuda/cudart.h"
#include "pool/pool.h"

#include <string.h>

#define MAX_CUDA_DEVICES 64
#define SPAN_ALIGN 16   /* largest element size: keeps every view offset whole */
/* copy_index values beside a real index */
#define UNPLANNED (-1)
#define STAYS (-2)      /* the pool had no memory: saved where it is */
#define NO_DATA (-3)    /* no elements: rebuilt empty */

typedef struct OffloadGroup OffloadGroup;

/* Copy state of one device (index -1: the CPU test mode). */
typedef struct {
    int index;
    void *copy_out;             /* cudaStream_t, NULL on the CPU */
    void *copy_in;
    PyObject *in_flight;        /* list of StorageCopy whose D2H may still run */
    OffloadGroup *first, *last; /* live groups in creation order (borrowed) */
} offload_device;

struct offload_engine {
    offload_options options;
    pool *pool;                 /* created on first offload */
    pool_host_ctx host_ctx;
    const cudart *rt;           /* set once a CUDA tensor was offloaded */
    offload_device cpu;
    offload_device *cuda[MAX_CUDA_DEVICES];
    int warned_fallback;
    uint64_t prefetched;        /* spans copied back ahead of their recompute */
    uint64_t fetched_at_need;   /* spans copied back when the recompute asked */
    int fail_next_acquires;     /* tests: make the pool refuse this many spans */
};

/* One storage span staged in a host buffer. */
typedef struct {
    PyObject_HEAD
    PyObject *module;           /* keeps the engine alive */
    offload_device *device;
    PyObject *device_obj;       /* torch.device */
    uint64_t nbytes;
    pool_block block;
    PyObject *source;           /* storage kept until the D2H completed */
    void *d2h_done;             /* cudaEvent_t or NULL */
    PyObject *fetched;          /* uint8 tensor holding the span again, or NULL */
    void *h2d_done;
} StorageCopy;

/* One offloaded input: where its span is and how to view it. */
typedef struct {
    PyObject_HEAD
    StorageCopy *copy;          /* NULL for a tensor with no elements */
    PyObject *group;
    PyObject *dtype, *size, *stride, *device_obj;
    int64_t offset;             /* elements from the start of the span */
    /* in-place checks: torch skips its version check for hooked saved
     * tensors, so the record watches the input while it is alive */
    PyObject *weak_source;      /* weakref to the input */
    PyObject *version;          /* the input's version when it was saved */
    Py_ssize_t input_index;     /* position among the region's input tensors */
    int modified_in_forward;
    int requires_grad;          /* restored by hand when no SavedTensor does it */
} TensorRecord;

struct OffloadGroup {
    PyObject_HEAD
    PyObject *module;
    offload_device *device;
    PyObject *copies;           /* tuple of StorageCopy */
    OffloadGroup *prev, *next;
    int linked;
    unsigned long thread;       /* creator: backward order means nothing across threads */
};

/* Pack hook while a frame saves its inputs: hands out prepared records. */
typedef struct {
    PyObject_HEAD
    PyObject *records;
    Py_ssize_t next;
} OffloadPacker;

static mp_state *
module_state(PyObject *module)
{
    return PyModule_GetState(module);
}

/* ---- engine -------------------------------------------------------------- */

offload_engine *
offload_engine_new(void)
{
    offload_engine *engine = PyMem_Calloc(1, sizeof(*engine));
    if (engine == NULL)
        return NULL;
    engine->options = (offload_options){
        .enabled = 1, .pipeline = 1, .prefetch_depth = 1, .min_offload_bytes = 1 << 20,
    };
    engine->cpu.index = -1;
    return engine;
}

offload_options *
offload_engine_options(offload_engine *engine)
{
    return &engine->options;
}

static int
cuda_failed(const cudart *rt, int status, const char *what)
{
    if (status == CUDART_SUCCESS)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "matepoint: %s failed: %s (CUDA error %d)", what,
                 rt->get_error_string(status), status);
    return -1;
}

static void
drain_device(offload_engine *engine, offload_device *device)
{
    if (device->in_flight != NULL) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(device->in_flight); i++) {
            StorageCopy *copy = (StorageCopy *)PyList_GET_ITEM(device->in_flight, i);
            if (copy->d2h_done != NULL)
                (void)engine->rt->event_synchronize(copy->d2h_done);
        }
        Py_CLEAR(device->in_flight);
    }
}

void
offload_engine_free(offload_engine *engine)
{
    if (engine == NULL)
        return;
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] == NULL)
            continue;
        drain_device(engine, engine->cuda[i]);
        PyMem_Free(engine->cuda[i]);
    }
    Py_CLEAR(engine->cpu.in_flight);
    /* buffers still held by live copies are the process's until exit */
    if (engine->pool != NULL && pool_get_stats(engine->pool).blocks_in_use == 0)
        pool_destroy(engine->pool);
    else if (engine->pool != NULL)
        pool_empty(engine->pool);
    PyMem_Free(engine);
}

int
offload_engine_apply_limit(offload_engine *engine)
{
    if (engine->pool != NULL)
        pool_set_limit(engine->pool, engine->options.pool_limit_bytes);
    return 0;
}

static int
cuda_device_count(const cudart *rt)
{
    int count = 0;
    return rt->get_device_count(&count) == CUDART_SUCCESS ? count : 0;
}

/* Pinned memory when a CUDA runtime with a device is present, else plain. */
static int
ensure_pool(offload_engine *engine)
{
    if (engine->pool != NULL)
        return 0;
    const cudart *rt = cudart_load();
    pool_backend backend = rt != NULL && cuda_device_count(rt) > 0
                               ? pool_cuda_backend(rt)
                               : pool_host_backend(&engine->host_ctx);
    engine->pool = pool_create(backend, engine->options.pool_limit_bytes);
    if (engine->pool == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int
with_device(const cudart *rt, int index, int *previous)
{
    if (cuda_failed(rt, rt->get_device(previous), "cudaGetDevice"))
        return -1;
    if (*previous != index && cuda_failed(rt, rt->set_device(index), "cudaSetDevice"))
        return -1;
    return 0;
}

static void
restore_device(const cudart *rt, int previous)
{
    (void)rt->set_device(previous);
}

static offload_device *
cuda_device(offload_engine *engine, int index)
{
    if (index < 0 || index >= MAX_CUDA_DEVICES) {
        PyErr_Format(PyExc_ValueError, "matepoint: CUDA device index %d out of range", index);
        return NULL;
    }
    if (engine->cuda[index] != NULL)
        return engine->cuda[index];
    if (engine->rt == NULL && (engine->rt = cudart_load()) == NULL) {
        PyErr_Format(PyExc_RuntimeError, "matepoint: cannot offload CUDA tensors: %s",
                     cudart_error());
        return NULL;
    }
    const cudart *rt = engine->rt;
    offload_device *device = PyMem_Calloc(1, sizeof(*device));
    int previous;
    if (device == NULL)
        return (offload_device *)PyErr_NoMemory();
    device->index = index;
    if (with_device(rt, index, &previous) < 0) {
        PyMem_Free(device);
        return NULL;
    }
    int failed = cuda_failed(rt, rt->stream_create(&device->copy_out, CUDART_STREAM_NON_BLOCKING),
                             "cudaStreamCreate") ||
                 cuda_failed(rt, rt->stream_create(&device->copy_in, CUDART_STREAM_NON_BLOCKING),
                             "cudaStreamCreate");
    restore_device(rt, previous);
    if (failed) {
        if (device->copy_out != NULL)
            (void)rt->stream_destroy(device->copy_out);
        PyMem_Free(device);
        return NULL;
    }
    engine->cuda[index] = device;
    return device;
}

/* Drops the sources of device-to-host copies that have completed. The
 * copies still running move to a fresh list, so no slot of the old one is
 * released twice. */
static int
poll_in_flight(offload_engine *engine, offload_device *device)
{
    if (device->in_flight == NULL)
        return 0;
    PyObject *running = PyList_New(0);
    if (running == NULL)
        return -1;
    /* releasing a source may run code that polls again: hold the list */
    PyObject *list = Py_NewRef(device->in_flight);
    int result = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        StorageCopy *copy = (StorageCopy *)PyList_GET_ITEM(list, i);
        if (copy->d2h_done == NULL)
            continue;  /* finished by an earlier poll that then failed */
        int status = result < 0 ? CUDART_ERROR_NOT_READY : engine->rt->event_query(copy->d2h_done);
        if (status != CUDART_SUCCESS && status != CUDART_ERROR_NOT_READY) {
            cuda_failed(engine->rt, status, "device-to-host copy");
            result = -1;
            status = CUDART_ERROR_NOT_READY;  /* keep it: its source may still be read */
        }
        if (status == CUDART_ERROR_NOT_READY) {
            if (PyList_Append(running, (PyObject *)copy) < 0) {
                Py_DECREF(running);
                Py_DECREF(list);
                return -1;
            }
            continue;
        }
        (void)engine->rt->event_destroy(copy->d2h_done);
        copy->d2h_done = NULL;
        Py_CLEAR(copy->source);
    }
    Py_SETREF(device->in_flight, running);
    Py_DECREF(list);
    return result;
}

/* ---- Python types ---------------------------------------------------------- */

static offload_engine *
engine_of(PyObject *module)
{
    return module_state(module)->engine;
}

static void
wait_for_h2d(offload_engine *engine, StorageCopy *copy)
{
    if (copy->h2d_done == NULL)
        return;
    /* the host buffer may be read by the copy still: wait before reuse */
    Py_BEGIN_ALLOW_THREADS
    (void)engine->rt->event_synchronize(copy->h2d_done);
    Py_END_ALLOW_THREADS
    (void)engine->rt->event_destroy(copy->h2d_done);
    copy->h2d_done = NULL;
}

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
    offload_engine *engine = self->module ? engine_of(self->module) : NULL;
    if (engine != NULL) {
        /* d2h_done is clear here but when starting the copy failed half-way:
         * in_flight holds a reference until the copy completed */
        if (self->d2h_done != NULL) {
            (void)engine->rt->event_synchronize(self->d2h_done);
            (void)engine->rt->event_destroy(self->d2h_done);
        }
        wait_for_h2d(engine, self);
        if (self->block.ptr != NULL)
            pool_release(engine->pool, &self->block);
    }
    Py_CLEAR(self->fetched);
    Py_CLEAR(self->source);
    Py_CLEAR(self->device_obj);
    Py_CLEAR(self->module);
    tp->tp_free(self);
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
    return 0;
}

static void
tensor_record_dealloc(TensorRecord *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    tensor_record_clear(self);
    tp->tp_free(self);
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
    tp->tp_free(self);
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
    tp->tp_free(self);
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

/* ---- inspecting inputs ------------------------------------------------------ */

/* What the planner learns about one input tensor. */
typedef struct {
    PyObject *storage;          /* the input's untyped storage */
    PyObject *device_obj;
    PyObject *dtype, *size, *stride;
    int device_index;           /* -1: CPU */
    uintptr_t storage_ptr;
    uint64_t byte_offset, byte_extent;
    int64_t itemsize;
    Py_ssize_t copy_index;      /* into the copies list, or one of the values above */
} input_info;

static void
input_info_clear(input_info *info)
{
    Py_CLEAR(info->storage);
    Py_CLEAR(info->device_obj);
    Py_CLEAR(info->dtype);
    Py_CLEAR(info->size);
    Py_CLEAR(info->stride);
}

static int
call_int64(PyObject *obj, const char *method, int64_t *out)
{
    PyObject *value = PyObject_CallMethod(obj, method, NULL);
    if (value == NULL)
        return -1;
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int
attr_int64(PyObject *obj, const char *name, int64_t *out)
{
    PyObject *value = PyObject_GetAttrString(obj, name);
    if (value == NULL)
        return -1;
    *out = value == Py_None ? -1 : PyLong_AsLongLong(value);
    Py_DECREF(value);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* Byte span [offset, offset + extent) of the storage that `tensor` reads:
 * views, non-contiguous and stride-0 tensors read less than their storage. */
static int
tensor_span(PyObject *tensor, input_info *info)
{
    int64_t storage_offset, numel;
    if (call_int64(tensor, "storage_offset", &storage_offset) < 0 ||
        call_int64(tensor, "element_size", &info->itemsize) < 0 ||
        call_int64(tensor, "numel", &numel) < 0)
        return -1;
    info->byte_offset = (uint64_t)(storage_offset * info->itemsize);
    info->byte_extent = 0;
    if (numel == 0)
        return 0;
    int64_t last = 0;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(info->size); d++) {
        int64_t extent = PyLong_AsLongLong(PyTuple_GET_ITEM(info->size, d));
        int64_t step = PyLong_AsLongLong(PyTuple_GET_ITEM(info->stride, d));
        if (PyErr_Occurred())
            return -1;
        last += (extent - 1) * step;
    }
    info->byte_extent = (uint64_t)((last + 1) * info->itemsize);
    return 0;
}

static int
is_buffer_of(PyObject *buffers, PyObject *tensor)
{
    if (buffers == NULL)
        return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(buffers); i++) {
        if (PyList_GET_ITEM(buffers, i) == tensor)
            return 1;
    }
    return 0;
}

/* The buffers of `function` when it is a module: never offloaded. */
static PyObject *
module_buffers(mp_state *st, PyObject *function)
{
    int is_module = PyObject_IsInstance(function, st->module_type);
    if (is_module <= 0)
        return is_module < 0 ? NULL : PyList_New(0);
    PyObject *iter = PyObject_CallMethod(function, "buffers", NULL);
    PyObject *list = iter ? PySequence_List(iter) : NULL;
    Py_XDECREF(iter);
    return list;
}

/* Fills `info` for an input worth offloading: 1 if so, 0 if it stays. */
static int
inspect_input(mp_state *st, PyObject *tensor, PyObject *buffers, int cuda_enabled,
              input_info *info)
{
    offload_options *opts = &st->engine->options;
    info->copy_index = UNPLANNED;
    if (!Py_IS_TYPE(tensor, (PyTypeObject *)st->tensor_class) || is_buffer_of(buffers, tensor))
        return 0;
    int64_t nbytes;
    if (attr_int64(tensor, "nbytes", &nbytes) < 0)
        return -1;
    if (nbytes < opts->min_offload_bytes)
        return 0;
    info->device_obj = PyObject_GetAttr(tensor, st->str_device);
    PyObject *type = info->device_obj ? PyObject_GetAttr(info->device_obj, st->str_type) : NULL;
    if (type == NULL)
        return -1;
    int is_cpu = PyUnicode_Compare(type, st->str_cpu) == 0;
    int is_cuda = PyUnicode_CompareWithASCIIString(type, "cuda") == 0;
    Py_DECREF(type);
    if (!((is_cuda && cuda_enabled) || (is_cpu && opts->offload_cpu)))
        return 0;
    int64_t index = -1;
    if (is_cuda && attr_int64(info->device_obj, "index", &index) < 0)
        return -1;
    info->device_index = (int)index;
    int64_t ptr;
    info->dtype = PyObject_GetAttr(tensor, st->str_dtype);
    info->size = info->dtype ? PyObject_CallMethod(tensor, "size", NULL) : NULL;
    info->stride = info->size ? PyObject_CallMethod(tensor, "stride", NULL) : NULL;
    info->storage = info->stride ? PyObject_CallMethod(tensor, "untyped_storage", NULL) : NULL;
    if (info->storage == NULL || call_int64(info->storage, "data_ptr", &ptr) < 0 ||
        tensor_span(tensor, info) < 0)
        return -1;
    info->storage_ptr = (uintptr_t)ptr;
    return 1;
}

/* ---- copies ------------------------------------------------------------------- */

static int
current_stream(mp_state *st, int index, void **stream)
{
    if (st->current_raw_stream == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "matepoint: this torch build has no CUDA streams");
        return -1;
    }
    PyObject *raw = PyObject_CallFunction(st->current_raw_stream, "i", index);
    if (raw == NULL)
        return -1;
    *stream = PyLong_AsVoidPtr(raw);
    Py_DECREF(raw);
    return PyErr_Occurred() ? -1 : 0;
}

/* Orders `waiter` after everything queued on `producer` so far. */
static int
stream_after(const cudart *rt, void *waiter, void *producer)
{
    void *event = NULL;
    if (cuda_failed(rt, rt->event_create(&event, CUDART_EVENT_DISABLE_TIMING), "cudaEventCreate"))
        return -1;
    int failed = cuda_failed(rt, rt->event_record(event, producer), "cudaEventRecord") ||
                 cuda_failed(rt, rt->stream_wait_event(waiter, event, 0), "cudaStreamWaitEvent");
    (void)rt->event_destroy(event);
    return failed ? -1 : 0;
}

static int
record_new_event(const cudart *rt, void *stream, void **event)
{
    if (cuda_failed(rt, rt->event_create(event, CUDART_EVENT_DISABLE_TIMING), "cudaEventCreate"))
        return -1;
    if (cuda_failed(rt, rt->event_record(*event, stream), "cudaEventRecord")) {
        (void)rt->event_destroy(*event);
        *event = NULL;
        return -1;
    }
    return 0;
}

/* Device to host on the copy-out stream, after the producer's work. */
static int
start_d2h(mp_state *st, StorageCopy *copy, uintptr_t src, PyObject *storage)
{
    offload_engine *engine = st->engine;
    const cudart *rt = engine->rt;
    offload_device *device = copy->device;
    void *producer;
    int previous;
    if (device->in_flight == NULL && (device->in_flight = PyList_New(0)) == NULL)
        return -1;
    if (current_stream(st, device->index, &producer) < 0 ||
        with_device(rt, device->index, &previous) < 0)
        return -1;
    int failed = stream_after(rt, device->copy_out, producer) < 0 ||
                 cuda_failed(rt, rt->memcpy_async(copy->block.ptr, (const void *)src,
                                                  (size_t)copy->nbytes,
                                                  CUDART_MEMCPY_DEVICE_TO_HOST, device->copy_out),
                             "cudaMemcpyAsync (device to host)") ||
                 record_new_event(rt, device->copy_out, &copy->d2h_done) < 0;
    restore_device(rt, previous);
    if (failed)
        return -1;
    copy->source = Py_NewRef(storage);
    return PyList_Append(device->in_flight, (PyObject *)copy);
}

static void
warn_fallback_once(offload_engine *engine)
{
    if (engine->warned_fallback)
        return;
    engine->warned_fallback = 1;
    if (PyErr_WarnEx(PyExc_RuntimeWarning,
                     "matepoint: the pinned host pool is at pool_limit_bytes or pinning failed; "
                     "offloading into pageable memory, which copies more slowly",
                     1) < 0)
        PyErr_WriteUnraisable(NULL);
}

static StorageCopy *
storage_copy_new(mp_state *st, PyObject *module, offload_device *device, PyObject *device_obj,
                 uint64_t nbytes)
{
    StorageCopy *copy = PyObject_GC_New(StorageCopy, st->storage_copy_type);
    if (copy == NULL)
        return NULL;
    Py_INCREF(st->storage_copy_type);
    copy->module = Py_NewRef(module);
    copy->device = device;
    copy->device_obj = Py_NewRef(device_obj);
    copy->nbytes = nbytes;
    copy->block = (pool_block){0};
    copy->source = copy->fetched = NULL;
    copy->d2h_done = copy->h2d_done = NULL;
    PyObject_GC_Track(copy);
    return copy;
}

/* Copies one storage span out. Returns the copy, Py_None when the pool has
 * no memory at all (the inputs then stay on their device), NULL on error. */
static PyObject *
offload_span(mp_state *st, PyObject *module, input_info *first, uint64_t lo, uint64_t hi)
{
    offload_engine *engine = st->engine;
    offload_device *device = first->device_index < 0 ? &engine->cpu
                                                     : cuda_device(engine, first->device_index);
    if (device == NULL || ensure_pool(engine) < 0)
        return NULL;
    if (device->index >= 0 && poll_in_flight(engine, device) < 0)
        return NULL;
    StorageCopy *copy = storage_copy_new(st, module, device, first->device_obj, hi - lo);
    if (copy == NULL)
        return NULL;
    uint64_t fallbacks = pool_get_stats(engine->pool).fallbacks;
    int refused = engine->fail_next_acquires > 0;
    engine->fail_next_acquires -= refused;
    if (refused || pool_acquire(engine->pool, hi - lo, &copy->block) < 0) {
        Py_DECREF(copy);
        return Py_NewRef(Py_None);
    }
    if (pool_get_stats(engine->pool).fallbacks != fallbacks)
        warn_fallback_once(engine);
    uintptr_t src = first->storage_ptr + (uintptr_t)lo;
    if (device->index < 0) {
        memcpy(copy->block.ptr, (const void *)src, (size_t)(hi - lo));
    } else if (start_d2h(st, copy, src, first->storage) < 0) {
        Py_DECREF(copy);
        return NULL;
    }
    return (PyObject *)copy;
}

static int
same_storage(const input_info *a, const input_info *b)
{
    return a->device_index == b->device_index && a->storage_ptr == b->storage_ptr;
}

/* Plans one copy per distinct storage among `infos` and starts them. */
static PyObject *
offload_storages(mp_state *st, PyObject *module, input_info *infos, Py_ssize_t n)
{
    PyObject *copies = PyList_New(0);
    if (copies == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!infos[i].storage || infos[i].copy_index != UNPLANNED)
            continue;
        if (infos[i].byte_extent == 0) {
            infos[i].copy_index = NO_DATA;
            continue;
        }
        uint64_t lo = infos[i].byte_offset, hi = lo + infos[i].byte_extent;
        for (Py_ssize_t j = i + 1; j < n; j++) {
            if (infos[j].storage && same_storage(&infos[i], &infos[j]) && infos[j].byte_extent) {
                lo = infos[j].byte_offset < lo ? infos[j].byte_offset : lo;
                uint64_t end = infos[j].byte_offset + infos[j].byte_extent;
                hi = end > hi ? end : hi;
            }
        }
        lo -= lo % SPAN_ALIGN;
        PyObject *copy = offload_span(st, module, &infos[i], lo, hi);
        if (copy == NULL || PyList_Append(copies, copy) < 0) {
            Py_XDECREF(copy);
            Py_DECREF(copies);
            return NULL;
        }
        Py_ssize_t index = copy == Py_None ? STAYS : PyList_GET_SIZE(copies) - 1;
        Py_DECREF(copy);
        for (Py_ssize_t j = i; j < n; j++) {
            if (infos[j].storage && infos[j].byte_extent && same_storage(&infos[i], &infos[j])) {
                infos[j].copy_index = index;
                infos[j].byte_offset -= lo;
            }
        }
    }
    return copies;
}

/* ---- saving ------------------------------------------------------------------ */

static TensorRecord *
record_new(mp_state *st, input_info *info, PyObject *copies, PyObject *group, PyObject *tensor,
           Py_ssize_t input_index)
{
    TensorRecord *record = PyObject_GC_New(TensorRecord, st->tensor_record_type);
    if (record == NULL)
        return NULL;
    Py_INCREF(st->tensor_record_type);
    record->copy = info->copy_index >= 0
                       ? (StorageCopy *)Py_NewRef(PyList_GET_ITEM(copies, info->copy_index))
                       : NULL;
    record->group = Py_NewRef(group);
    record->dtype = Py_NewRef(info->dtype);
    record->size = Py_NewRef(info->size);
    record->stride = Py_NewRef(info->stride);
    record->device_obj = Py_NewRef(info->device_obj);
    record->offset = info->itemsize ? (int64_t)info->byte_offset / info->itemsize : 0;
    record->weak_source = record->version = NULL;
    record->input_index = input_index;
    record->modified_in_forward = 0;
    PyObject_GC_Track(record);
    record->weak_source = PyWeakref_NewRef(tensor, NULL);
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

static PyObject *
group_new(mp_state *st, PyObject *module, PyObject *copies)
{
    OffloadGroup *group = PyObject_GC_New(OffloadGroup, st->offload_group_type);
    if (group == NULL)
        return NULL;
    Py_INCREF(st->offload_group_type);
    group->module = Py_NewRef(module);
    group->copies = PyList_AsTuple(copies);
    group->prev = group->next = NULL;
    group->linked = 0;
    group->thread = PyThread_get_thread_ident();
    group->device = PyTuple_GET_SIZE(group->copies) > 0
                        ? ((StorageCopy *)PyTuple_GET_ITEM(group->copies, 0))->device
                        : NULL;
    PyObject_GC_Track(group);
    if (group->copies == NULL) {
        Py_DECREF(group);
        return NULL;
    }
    if (group->device != NULL)
        group_link(group);
    return (PyObject *)group;
}

/* Saves the records through torch's SavedTensor, so that torch keeps each
 * input's version counter; our packer hands it the prepared records. */
static int
save_records_as_saved_tensors(mp_state *st, PyObject *records, PyObject *tensors,
                              input_info *infos, PyObject *saved)
{
    OffloadPacker *packer = PyObject_GC_New(OffloadPacker, st->offload_packer_type);
    if (packer == NULL)
        return -1;
    Py_INCREF(st->offload_packer_type);
    packer->records = Py_NewRef(records);
    packer->next = 0;
    PyObject_GC_Track(packer);
    int result = hooks_push(st, (PyObject *)packer, st->offload_unpack);
    Py_DECREF(packer);
    if (result < 0)
        return -1;
    for (Py_ssize_t i = 0; result == 0 && i < PyList_GET_SIZE(tensors); i++) {
        if (infos[i].copy_index == UNPLANNED || infos[i].copy_index == STAYS)
            continue;
        PyObject *saved_tensor = hooks_save_tensor(st, PyList_GET_ITEM(tensors, i));
        if (saved_tensor == NULL || PyList_SetItem(saved, i, saved_tensor) < 0)
            result = -1;
    }
    return hooks_pop(st) < 0 ? -1 : result;
}

static PyObject *
make_records(mp_state *st, PyObject *tensors, input_info *infos, PyObject *copies,
             PyObject *group, PyObject *saved)
{
    PyObject *records = PyList_New(0);
    if (records == NULL)
        return NULL;
    int direct = st->make_saved_tensor == NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors); i++) {
        if (infos[i].copy_index == UNPLANNED || infos[i].copy_index == STAYS)
            continue;
        TensorRecord *record = record_new(st, &infos[i], copies, group,
                                          PyList_GET_ITEM(tensors, i), i);
        int failed = record == NULL || PyList_Append(records, (PyObject *)record) < 0 ||
                     (direct && PyList_SetItem(saved, i, Py_NewRef(record)) < 0);
        Py_XDECREF(record);
        if (failed) {
            Py_DECREF(records);
            return NULL;
        }
    }
    if (!direct && save_records_as_saved_tensors(st, records, tensors, infos, saved) < 0)
        Py_CLEAR(records);
    return records;
}

/* Offloading is torch's nesting rule in reverse: inside another
 * checkpoint's forward (or any saved-tensor hooks) inputs belong to the outer
 * hooks, so they are left alone. */
static int
hooks_active(mp_state *st)
{
    PyObject *top = PyObject_CallOneArg(st->top_hooks, Py_False);
    if (top == NULL)
        return -1;
    int active = top != Py_None;
    Py_DECREF(top);
    return active;
}

int
offload_save_inputs(mp_state *st, PyObject *module, PyObject *function, PyObject *tensors,
                    int offload_override, PyObject *saved, PyObject **group_out,
                    PyObject **records_out)
{
    offload_options *opts = &st->engine->options;
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    int cuda_enabled = offload_override < 0 ? opts->enabled : offload_override;
    *group_out = *records_out = NULL;
    if (n == 0 || offload_override == 0 || !(cuda_enabled || opts->offload_cpu))
        return 0;
    int active = hooks_active(st);
    if (active != 0)
        return active < 0 ? -1 : 0;
    input_info *infos = PyMem_Calloc((size_t)n, sizeof(input_info));
    PyObject *buffers = NULL, *copies = NULL;
    int result = -1, candidates = 0;
    if (infos == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    buffers = module_buffers(st, function);
    if (buffers == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int eligible = inspect_input(st, PyList_GET_ITEM(tensors, i), buffers, cuda_enabled,
                                     &infos[i]);
        if (eligible < 0)
            goto done;
        if (!eligible)
            input_info_clear(&infos[i]);
        candidates += eligible;
    }
    result = 0;
    if (candidates == 0)
        goto done;
    result = -1;
    copies = offload_storages(st, module, infos, n);
    if (copies == NULL)
        goto done;
    /* entries of Py_None stand for spans the pool could not take */
    PyObject *live = PyList_New(0);
    for (Py_ssize_t i = 0; live != NULL && i < PyList_GET_SIZE(copies); i++) {
        if (PyList_GET_ITEM(copies, i) != Py_None && PyList_Append(live, PyList_GET_ITEM(copies, i)) < 0)
            Py_CLEAR(live);
    }
    if (live == NULL)
        goto done;
    *group_out = group_new(st, module, live);
    Py_DECREF(live);
    if (*group_out != NULL)
        *records_out = make_records(st, tensors, infos, copies, *group_out, saved);
    if (*records_out == NULL) {
        Py_CLEAR(*group_out);
        goto done;
    }
    if (PyList_GET_SIZE(*records_out) == 0) {   /* everything stayed where it was */
        Py_CLEAR(*records_out);
        Py_CLEAR(*group_out);
    }
    result = 0;
done:
    for (Py_ssize_t i = 0; i < n; i++)
        input_info_clear(&infos[i]);
    PyMem_Free(infos);
    Py_XDECREF(buffers);
    Py_XDECREF(copies);
    return result;
}

/* ---- restoring ------------------------------------------------------------------ */

static PyObject *
empty_bytes(mp_state *st, uint64_t nbytes, PyObject *device_obj)
{
    PyObject *kwargs = Py_BuildValue("{sOsO}", "dtype", st->uint8_dtype, "device", device_obj);
    PyObject *args = kwargs ? Py_BuildValue("((K))", (unsigned long long)nbytes) : NULL;
    PyObject *tensor = args ? PyObject_Call(st->torch_empty, args, kwargs) : NULL;
    Py_XDECREF(kwargs);
    Py_XDECREF(args);
    return tensor;
}

static int
tensor_ptr(PyObject *tensor, void **ptr)
{
    int64_t value;
    if (call_int64(tensor, "data_ptr", &value) < 0)
        return -1;
    *ptr = (void *)(uintptr_t)value;
    return 0;
}

/* Host to device, on the copy-in stream (prefetch) or the current one. */
static int
start_h2d(mp_state *st, StorageCopy *copy, void *dst, int on_copy_stream)
{
    const cudart *rt = st->engine->rt;
    offload_device *device = copy->device;
    void *compute, *stream;
    int previous;
    if (current_stream(st, device->index, &compute) < 0 ||
        with_device(rt, device->index, &previous) < 0)
        return -1;
    stream = on_copy_stream ? device->copy_in : compute;
    /* the destination came from the compute stream's allocator: copy after
     * its queued work, and after the offload's own D2H if still pending */
    int failed = (on_copy_stream && stream_after(rt, stream, compute) < 0) ||
                 (copy->d2h_done != NULL &&
                  cuda_failed(rt, rt->stream_wait_event(stream, copy->d2h_done, 0),
                              "cudaStreamWaitEvent"));
    if (!failed && copy->h2d_done != NULL) {
        (void)rt->event_destroy(copy->h2d_done);
        copy->h2d_done = NULL;
    }
    failed = failed ||
             cuda_failed(rt, rt->memcpy_async(dst, copy->block.ptr, (size_t)copy->nbytes,
                                              CUDART_MEMCPY_HOST_TO_DEVICE, stream),
                         "cudaMemcpyAsync (host to device)") ||
             record_new_event(rt, stream, &copy->h2d_done) < 0;
    restore_device(rt, previous);
    return failed ? -1 : 0;
}

/* Allocating the destination lets other threads run: the copy is held
 * meanwhile, and one fetched by them in that window is taken as is. */
static int
fetch_copy(mp_state *st, StorageCopy *copy, int on_copy_stream)
{
    if (copy->fetched != NULL)
        return 0;
    Py_INCREF(copy);
    PyObject *fetched = empty_bytes(st, copy->nbytes, copy->device_obj);
    void *dst;
    int failed = fetched == NULL || tensor_ptr(fetched, &dst) < 0;
    if (!failed && copy->fetched == NULL) {
        failed = copy->device->index < 0
                     ? (memcpy(dst, copy->block.ptr, (size_t)copy->nbytes), 0)
                     : start_h2d(st, copy, dst, on_copy_stream);
        if (!failed) {
            copy->fetched = Py_NewRef(fetched);
            if (on_copy_stream)
                st->engine->prefetched++;
            else
                st->engine->fetched_at_need++;
        }
    }
    Py_XDECREF(fetched);
    Py_DECREF(copy);
    return failed ? -1 : 0;
}

static int
fetch_group(mp_state *st, OffloadGroup *group, int on_copy_stream)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(group->copies); i++) {
        if (fetch_copy(st, (StorageCopy *)PyTuple_GET_ITEM(group->copies, i), on_copy_stream) < 0)
            return -1;
    }
    return 0;
}

int
offload_group_begin_restore(mp_state *st, PyObject *group_obj, int prefetch_ahead)
{
    OffloadGroup *group = (OffloadGroup *)group_obj;
    offload_options *opts = &st->engine->options;
    if (group == NULL || group->device == NULL)
        return 0;
    if (group->device->index >= 0 && poll_in_flight(st->engine, group->device) < 0)
        return -1;
    if (fetch_group(st, group, 0) < 0)
        return -1;
    if (!opts->pipeline || !prefetch_ahead)
        return 0;
    /* backward runs this thread's frames in reverse creation order: fetch
     * those ahead. Fetching lets other threads run and free groups, so the
     * walk holds the group it stands on. */
    int fetched = 0, failed = 0;
    OffloadGroup *ahead = group->linked ? group->prev : NULL;
    Py_XINCREF(ahead);
    while (ahead != NULL && fetched < opts->prefetch_depth && !failed) {
        if (ahead->thread == group->thread) {
            failed = fetch_group(st, ahead, 1) < 0;
            fetched++;
        }
        OffloadGroup *next = ahead->linked ? ahead->prev : NULL;
        Py_XINCREF(next);
        Py_SETREF(ahead, next);
    }
    Py_XDECREF(ahead);
    return failed ? -1 : 0;
}

void
offload_group_end_restore(PyObject *group_obj)
{
    OffloadGroup *group = (OffloadGroup *)group_obj;
    if (group == NULL)
        return;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(group->copies); i++)
        Py_CLEAR(((StorageCopy *)PyTuple_GET_ITEM(group->copies, i))->fetched);
}

int
offload_is_record(mp_state *st, PyObject *obj)
{
    return Py_IS_TYPE(obj, st->tensor_record_type);
}

/* 1 when the record's input is alive with another version than saved. */
static int
source_changed(mp_state *st, TensorRecord *record)
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
offload_check_forward(mp_state *st, PyObject *records)
{
    if (records == NULL)
        return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(records); i++) {
        TensorRecord *record = (TensorRecord *)PyList_GET_ITEM(records, i);
        /* the copy out may have raced the change: the data is unusable */
        int changed = source_changed(st, record);
        if (changed < 0)
            return -1;
        record->modified_in_forward = changed;
    }
    return 0;
}

static PyObject *
view_of_copy(mp_state *st, TensorRecord *record)
{
    StorageCopy *copy = record->copy;
    PyObject *kwargs = Py_BuildValue("{sOsO}", "dtype", record->dtype, "device",
                                     record->device_obj);
    if (kwargs == NULL)
        return NULL;
    PyObject *result = NULL;
    if (copy == NULL) {
        PyObject *args = PyTuple_Pack(2, record->size, record->stride);
        result = args ? PyObject_Call(st->torch_empty_strided, args, kwargs) : NULL;
        Py_XDECREF(args);
        Py_DECREF(kwargs);
        return result;
    }
    PyObject *args = Py_BuildValue("((i))", 0);
    PyObject *empty = args ? PyObject_Call(st->torch_empty, args, kwargs) : NULL;
    PyObject *storage = empty ? PyObject_CallMethod(copy->fetched, "untyped_storage", NULL) : NULL;
    if (storage != NULL)
        result = PyObject_CallMethod(empty, "set_", "OLOO", storage, (long long)record->offset,
                                     record->size, record->stride);
    Py_XDECREF(args);
    Py_XDECREF(empty);
    Py_XDECREF(storage);
    Py_DECREF(kwargs);
    return result;
}

/* A restored input must require grad as it did in the forward pass, or the
 * recompute would save other tensors. SavedTensor does this itself. */
static PyObject *
with_requires_grad(PyObject *tensor, int requires_grad)
{
    if (tensor == NULL || !requires_grad)
        return tensor;
    PyObject *done = PyObject_CallMethod(tensor, "requires_grad_", "O", Py_True);
    Py_DECREF(tensor);
    return done;
}

PyObject *
offload_restore(mp_state *st, PyObject *record_obj)
{
    TensorRecord *record = (TensorRecord *)record_obj;
    StorageCopy *copy = record->copy;
    int changed = record->modified_in_forward ? 1 : source_changed(st, record);
    if (changed != 0) {
        if (changed > 0)
            checkpoint_raise_modified_input(record->input_index);
        return NULL;
    }
    if (copy != NULL) {
        /* fetched already by the group, unless unpacked on its own */
        if (copy->fetched == NULL && fetch_copy(st, copy, 0) < 0)
            return NULL;
        if (copy->device->index >= 0 && copy->h2d_done != NULL) {
            const cudart *rt = st->engine->rt;
            void *compute;
            if (current_stream(st, copy->device->index, &compute) < 0 ||
                cuda_failed(rt, rt->stream_wait_event(compute, copy->h2d_done, 0),
                            "cudaStreamWaitEvent"))
                return NULL;
        }
    }
    PyObject *view = view_of_copy(st, record);
    return st->make_saved_tensor == NULL ? with_requires_grad(view, record->requires_grad) : view;
}

PyObject *
offload_unpack_hook(PyObject *module, PyObject *record)
{
    mp_state *st = module_state(module);
    if (!offload_is_record(st, record)) {
        PyErr_SetString(PyExc_TypeError, "matepoint: offload unpack hook got a foreign object");
        return NULL;
    }
    return offload_restore(st, record);
}

/* ---- pool API ------------------------------------------------------------------- */

/* Lets copies that have completed give their buffers back. */
static int
poll_all_devices(offload_engine *engine)
{
    for (int i = 0; i < MAX_CUDA_DEVICES; i++) {
        if (engine->cuda[i] != NULL && poll_in_flight(engine, engine->cuda[i]) < 0)
            return -1;
    }
    return 0;
}

PyObject *
offload_pool_stats(mp_state *st)
{
    offload_engine *engine = st->engine;
    pool_stats stats = {0};
    if (poll_all_devices(engine) < 0)
        return NULL;
    if (engine->pool != NULL)
        stats = pool_get_stats(engine->pool);
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKss}", "prefetched", (unsigned long long)engine->prefetched,
        "fetched_at_need", (unsigned long long)engine->fetched_at_need, "bytes_in_use", stats.bytes_in_use, "bytes_requested",
        stats.bytes_requested, "bytes_reserved", stats.bytes_reserved, "peak_bytes_in_use",
        stats.peak_bytes_in_use, "host_allocations", stats.host_allocations, "hits", stats.hits,
        "misses", stats.misses, "fallbacks", stats.fallbacks, "failures", stats.failures,
        "blocks_in_use", stats.blocks_in_use, "backend",
        engine->pool == NULL ? "none" : pool_backend_name(engine->pool));
}

void
offload_fail_next_acquires(mp_state *st, int count)
{
    st->engine->fail_next_acquires = count;
}

int
offload_empty_pool(mp_state *st)
{
    if (poll_all_devices(st->engine) < 0)
        return -1;
    if (st->engine->pool != NULL)
        pool_empty(st->engine->pool);
    return 0;
}
