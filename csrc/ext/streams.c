#include "streams.h"

int
streams_check(const cudart *rt, int status, const char *what)
{
    if (status == CUDART_SUCCESS)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "matepoint: %s failed: %s (CUDA error %d)", what,
                 rt->get_error_string(status), status);
    return -1;
}

int
streams_enter_device(const cudart *rt, int index, int *previous)
{
    if (streams_check(rt, rt->get_device(previous), "cudaGetDevice"))
        return -1;
    if (*previous != index && streams_check(rt, rt->set_device(index), "cudaSetDevice"))
        return -1;
    return 0;
}

void
streams_leave_device(const cudart *rt, int previous)
{
    (void)rt->set_device(previous);
}

int
streams_wait_stream(const cudart *rt, void *waiter, void *producer)
{
    void *event = NULL;
    if (streams_record_new_event(rt, producer, &event) < 0)
        return -1;
    int failed = streams_check(rt, rt->stream_wait_event(waiter, event, 0), "cudaStreamWaitEvent");
    (void)rt->event_destroy(event);
    return failed ? -1 : 0;
}

int
streams_record_new_event(const cudart *rt, void *stream, void **event)
{
    *event = NULL;
    if (streams_check(rt, rt->event_create(event, CUDART_EVENT_DISABLE_TIMING),
                      "cudaEventCreate"))
        return -1;
    if (streams_check(rt, rt->event_record(*event, stream), "cudaEventRecord")) {
        (void)rt->event_destroy(*event);
        *event = NULL;
        return -1;
    }
    return 0;
}
