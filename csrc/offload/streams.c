#include "streams.h"

int
streams_check(const cudart *rt, int status, const char *what)
{
    if (status == CUDART_SUCCESS)
        return 0;
    (void)rt->get_last_error();
    PyErr_Format(PyExc_RuntimeError, "matepoint: %s failed: %s (CUDA error %d)", what,
                 rt->get_error_string(status), status);
    return -1;
}

int
streams_event_done(const cudart *rt, void *event)
{
    int status = rt->event_query(event);
    if (status == CUDART_ERROR_NOT_READY) {
        (void)rt->get_last_error();
        return 0;
    }
    return streams_check(rt, status, "cudaEventQuery") < 0 ? -1 : 1;
}

int
streams_memcpy(const cudart *rt, void *dst, const void *src, size_t bytes, int kind,
               void *stream, int pageable)
{
    int status;
    if (pageable) {
        Py_BEGIN_ALLOW_THREADS
        status = rt->memcpy_async(dst, src, bytes, kind, stream);
        Py_END_ALLOW_THREADS
    } else {
        status = rt->memcpy_async(dst, src, bytes, kind, stream);
    }
    return streams_check(rt, status, kind == CUDART_MEMCPY_DEVICE_TO_HOST
                                         ? "cudaMemcpyAsync (device to host)"
                                         : "cudaMemcpyAsync (host to device)");
}
