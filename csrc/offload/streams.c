/* The offload engine's checked CUDA stream and event calls (the contract:
 * streams.h). Owns nothing. Floor `gpu`: called by every floor above;
 * calls the runtime table and the site table only. */
#include "streams.h"

int
streams_check(const cudart *rt, int status, const char *what)
{
    if (status == CUDART_SUCCESS)
        return 0;
    char text[256];
    cudart_describe_failure(rt, status, what, text, sizeof(text));
    PyErr_Format(PyExc_RuntimeError, "matepoint: %s", text);
    return -1;
}

int
streams_wait_event(const offload_runtime *runtime, const cudart *rt, offload_site site,
                   void *stream, void *event)
{
    int status = runtime->stream_wait_event(rt, site, stream, event);
    if (status == CUDART_SUCCESS)
        return 0;
    char what[96];
    snprintf(what, sizeof(what), "cudaStreamWaitEvent (at %s)", offload_site_name(site));
    return streams_check(rt, status, what);
}

int
streams_event_done(const cudart *rt, void *event)
{
    int status;
    int done = cudart_event_done(rt, event, &status);
    if (done >= 0)
        return done;
    return streams_check(rt, status, "cudaEventQuery");
}

void
streams_wait_event_quietly(const cudart *rt, void *event)
{
    int status, mode = cudart_relax_capture(rt);
    Py_BEGIN_ALLOW_THREADS
    status = rt->event_synchronize(event);
    Py_END_ALLOW_THREADS
    cudart_restore_capture(rt, mode);
    if (status != CUDART_SUCCESS)
        (void)rt->get_last_error();
}

void
streams_wait_stream_quietly(const cudart *rt, void *stream)
{
    int status, mode = cudart_relax_capture(rt);
    Py_BEGIN_ALLOW_THREADS
    status = rt->stream_synchronize(stream);
    Py_END_ALLOW_THREADS
    cudart_restore_capture(rt, mode);
    if (status != CUDART_SUCCESS)
        (void)rt->get_last_error();
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

int
streams_enter_device(const cudart *rt, int device, int *previous)
{
    const char *failed = NULL;
    int status = cudart_enter_device(rt, device, previous, &failed);
    return status == CUDART_SUCCESS ? 0 : streams_check(rt, status, failed);
}

int
streams_record_event(const cudart *rt, void *stream, void **event)
{
    const char *failed = NULL;
    int status = cudart_record_event(rt, stream, event, &failed);
    return status == CUDART_SUCCESS ? 0 : streams_check(rt, status, failed);
}
