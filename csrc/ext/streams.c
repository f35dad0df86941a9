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
