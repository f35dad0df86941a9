#include "cudart_util.h"

#include <stdio.h>

int
cudart_enter_device(const cudart *rt, int device, int *previous, const char **failed)
{
    *previous = -1;
    int status = rt->get_device(previous);
    if (status != CUDART_SUCCESS) {
        *previous = -1;
        *failed = "cudaGetDevice";
        return status;
    }
    if (*previous != device && (status = rt->set_device(device)) != CUDART_SUCCESS) {
        *failed = "cudaSetDevice";
        return status;
    }
    return CUDART_SUCCESS;
}

void
cudart_leave_device(const cudart *rt, int device, int previous)
{
    if (previous < 0 || previous == device)
        return;
    /* cudaSetDevice creates the device's primary context: a thread that
     * was on a device it never used (0, in a new thread) stays on
     * `device`, as torch's MaybeSetDevice does. Unknown: restored. */
    int active = 1;
    if (rt->primary_context_active != NULL && rt->primary_context_active(previous, &active) != 0)
        active = 1;
    if (active && rt->set_device(previous) != CUDART_SUCCESS)
        (void)rt->get_last_error();
}

void
cudart_describe_failure(const cudart *rt, int status, const char *what, char *out, size_t size)
{
    (void)rt->get_last_error();
    snprintf(out, size, "%s failed: %s (CUDA error %d)", what, rt->get_error_string(status),
             status);
}

int
cudart_record_event(const cudart *rt, void *stream, void **event, const char **failed)
{
    int created = *event == NULL;
    int status;
    if (created && (status = rt->event_create(event, CUDART_EVENT_DISABLE_TIMING)) !=
                       CUDART_SUCCESS) {
        *event = NULL;
        *failed = "cudaEventCreateWithFlags";
        return status;
    }
    status = rt->event_record(*event, stream);
    if (status == CUDART_SUCCESS)
        return CUDART_SUCCESS;
    *failed = "cudaEventRecord";
    if (created) {
        /* the record's failure is the one to report: keep it as the last error */
        (void)rt->event_destroy(*event);
        *event = NULL;
    }
    return status;
}

int
cudart_relax_capture(const cudart *rt)
{
    int mode = CUDART_STREAM_CAPTURE_MODE_RELAXED;
    if (rt->thread_exchange_stream_capture_mode == NULL)
        return -1;
    if (rt->thread_exchange_stream_capture_mode(&mode) != CUDART_SUCCESS) {
        (void)rt->get_last_error();
        return -1;
    }
    return mode;
}

void
cudart_restore_capture(const cudart *rt, int mode)
{
    if (mode >= 0 && rt->thread_exchange_stream_capture_mode(&mode) != CUDART_SUCCESS)
        (void)rt->get_last_error();
}

int
cudart_event_done(const cudart *rt, void *event, int *status)
{
    int mode = cudart_relax_capture(rt);
    *status = rt->event_query(event);
    cudart_restore_capture(rt, mode);
    if (*status == CUDART_SUCCESS)
        return 1;
    if (*status == CUDART_ERROR_NOT_READY) {
        (void)rt->get_last_error();
        return 0;
    }
    return -1;
}

int
cudart_stream_capturing(const cudart *rt, void *stream)
{
    if (rt->stream_is_capturing == NULL)
        return 0;
    int capture = CUDART_STREAM_CAPTURE_STATUS_NONE;
    int status = rt->stream_is_capturing(stream, &capture);
    if (status == CUDART_SUCCESS)
        return capture != CUDART_STREAM_CAPTURE_STATUS_NONE;
    (void)rt->get_last_error();
    return status == CUDART_ERROR_STREAM_CAPTURE_IMPLICIT ? 1 : -1;
}
