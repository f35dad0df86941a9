/* Unit tests of the helpers shared across layers: aligned host memory
 * against a capacity (csrc/common/host_memory.c) and the CUDA helpers of
 * the allocator and the offload engine (csrc/cuda/cudart_util.c), over the
 * simulated runtime. */
#include "common/host_memory.h"
#include "testing/cudart_sim.h"
#include "cuda/cudart_util.h"
#include "check.h"

#include <stdint.h>
#include <string.h>

static const cudart *rt;

static void
test_host_memory_is_aligned_and_capped(void)
{
    _Atomic uint64_t live = 0;
    void *a = mp_host_alloc_capped(&live, 8192, 4096, 4096);
    CHECK(a != NULL && (uintptr_t)a % 4096 == 0 && live == 4096);
    memset(a, 7, 4096);
    void *b = mp_host_alloc_capped(&live, 8192, 4097, 512);
    CHECK(b == NULL && live == 4096);                   /* would pass the capacity */
    b = mp_host_alloc_capped(&live, 8192, 4096, 512);
    CHECK(b != NULL && (uintptr_t)b % 512 == 0 && live == 8192);
    CHECK(mp_host_alloc_capped(&live, 8192, UINT64_MAX, 512) == NULL && live == 8192);
    mp_host_free_capped(&live, a, 4096);
    mp_host_free_capped(&live, b, 4096);
    CHECK(live == 0);
    /* no capacity: only PTRDIFF_MAX refuses, and *live is left as it was */
    CHECK(mp_host_alloc_capped(&live, 0, (uint64_t)PTRDIFF_MAX + 1, 64) == NULL && live == 0);
    void *zero = mp_host_alloc(0, 64), *other = mp_host_alloc(0, 64);
    CHECK(zero != NULL && other != NULL && zero != other);
    mp_host_free(zero);
    mp_host_free(other);
}

static void
test_entering_a_device_and_leaving_it(void)
{
    int previous = -2;
    const char *failed = NULL;
    cudart_sim_set_current_device(0);
    uint64_t sets = cudart_sim_get_stats().calls[SIM_SET_DEVICE];
    CHECK(cudart_enter_device(rt, 0, &previous, &failed) == CUDART_SUCCESS && previous == 0);
    CHECK(cudart_sim_get_stats().calls[SIM_SET_DEVICE] == sets);    /* already current */
    CHECK(cudart_enter_device(rt, 1, &previous, &failed) == CUDART_SUCCESS && previous == 0);
    CHECK(cudart_sim_current_device() == 1);
    cudart_leave_device(rt, 1, previous);
    CHECK(cudart_sim_current_device() == 0);
    /* a failing switch names its call and leaves the device as it was */
    cudart_sim_fail(SIM_SET_DEVICE, 0, 1, CUDART_ERROR_INVALID_DEVICE);
    CHECK(cudart_enter_device(rt, 1, &previous, &failed) == CUDART_ERROR_INVALID_DEVICE);
    CHECK(failed != NULL && strcmp(failed, "cudaSetDevice") == 0);
    CHECK(cudart_sim_current_device() == 0);
    cudart_sim_fail(SIM_GET_DEVICE, 0, 1, CUDART_ERROR_INVALID_VALUE);
    CHECK(cudart_enter_device(rt, 1, &previous, &failed) == CUDART_ERROR_INVALID_VALUE);
    CHECK(strcmp(failed, "cudaGetDevice") == 0 && previous == -1);
    cudart_leave_device(rt, 1, previous);                           /* nothing to restore */
    CHECK(cudart_sim_current_device() == 0);
    (void)rt->get_last_error();
}

static void
test_a_failure_is_described_and_cleared(void)
{
    char text[128];
    cudart_sim_fail(SIM_MALLOC, 0, 1, CUDART_ERROR_MEMORY_ALLOCATION);
    void *ptr;
    int status = rt->malloc(&ptr, 16);
    CHECK(cudart_sim_peek_last_error() == CUDART_ERROR_MEMORY_ALLOCATION);
    cudart_describe_failure(rt, status, "cudaMalloc", text, sizeof(text));
    CHECK(strcmp(text, "cudaMalloc failed: out of memory (simulated) (CUDA error 2)") == 0);
    CHECK(cudart_sim_peek_last_error() == CUDART_SUCCESS);
    cudart_describe_failure(rt, status, "cudaMalloc", text, 8);     /* cut short, terminated */
    CHECK(strlen(text) == 7);
}

static void
test_recording_events_creates_reuses_and_cleans_up(void)
{
    void *stream, *event = NULL;
    const char *failed = NULL;
    int status;
    uint64_t events = cudart_sim_get_stats().events_live;
    rt->stream_create(&stream, CUDART_STREAM_NON_BLOCKING);
    CHECK(cudart_record_event(rt, stream, &event, &failed) == CUDART_SUCCESS && event != NULL);
    CHECK(cudart_sim_get_stats().events_live == events + 1);
    CHECK(cudart_event_done(rt, event, &status) == 0 && status == CUDART_ERROR_NOT_READY);
    CHECK(cudart_sim_peek_last_error() == CUDART_SUCCESS);          /* an answer, not a failure */
    cudart_sim_advance(UINT64_MAX);
    CHECK(cudart_event_done(rt, event, &status) == 1);
    /* a given event is recorded again, not replaced */
    void *given = event;
    CHECK(cudart_record_event(rt, stream, &event, &failed) == CUDART_SUCCESS && event == given);
    CHECK(cudart_sim_get_stats().events_live == events + 1);
    /* a failing record: the given event stays the caller's ... */
    cudart_sim_fail(SIM_EVENT_RECORD, 0, 1, CUDART_ERROR_INVALID_HANDLE);
    CHECK(cudart_record_event(rt, stream, &event, &failed) == CUDART_ERROR_INVALID_HANDLE);
    CHECK(event == given && strcmp(failed, "cudaEventRecord") == 0);
    rt->event_destroy(event);
    /* ... one it created is destroyed again */
    event = NULL;
    cudart_sim_fail(SIM_EVENT_RECORD, 0, 1, CUDART_ERROR_INVALID_HANDLE);
    CHECK(cudart_record_event(rt, stream, &event, &failed) == CUDART_ERROR_INVALID_HANDLE);
    CHECK(event == NULL && cudart_sim_get_stats().events_live == events);
    cudart_sim_fail(SIM_EVENT_CREATE, 0, 1, CUDART_ERROR_MEMORY_ALLOCATION);
    CHECK(cudart_record_event(rt, stream, &event, &failed) == CUDART_ERROR_MEMORY_ALLOCATION);
    CHECK(event == NULL && strcmp(failed, "cudaEventCreateWithFlags") == 0);
    cudart_sim_fail(SIM_EVENT_QUERY, 0, 1, CUDART_ERROR_INVALID_HANDLE);
    CHECK(cudart_event_done(rt, given, &status) == -1 && status == CUDART_ERROR_INVALID_HANDLE);
    (void)rt->get_last_error();
    rt->stream_destroy(stream);
    CHECK(cudart_sim_get_stats().events_live == events);
}

static int
sim_primary_context_active(int device, int *active)
{
    if (device < 0 || device >= CUDART_SIM_DEVICES)
        return CUDART_ERROR_INVALID_DEVICE;
    *active = cudart_sim_get_stats().has_context[device];
    return CUDART_SUCCESS;
}

/* Leaving a device restores the previous one only where that creates no
 * context: a thread on device 0, never used, that touched device 1 stays
 * there (torch's MaybeSetDevice); a device with a context is restored. */
static void
test_leaving_creates_no_context(void)
{
    cudart with_driver = *rt;
    with_driver.primary_context_active = sim_primary_context_active;
    int previous = -2;
    const char *failed = NULL;
    cudart_sim_set_current_device(0);
    cudart_sim_forget_contexts();          /* a new thread: on device 0, never used */
    CHECK(cudart_enter_device(&with_driver, 1, &previous, &failed) == CUDART_SUCCESS);
    CHECK(previous == 0 && cudart_sim_get_stats().has_context[1]);
    cudart_leave_device(&with_driver, 1, previous);
    CHECK(!cudart_sim_get_stats().has_context[0]);
    CHECK(cudart_sim_current_device() == 1);
    /* device 0 with a context: back to it */
    cudart_sim_set_current_device(0);
    void *stream = NULL;
    CHECK(rt->stream_create(&stream, CUDART_STREAM_NON_BLOCKING) == CUDART_SUCCESS);
    CHECK(cudart_sim_get_stats().has_context[0]);
    CHECK(cudart_enter_device(&with_driver, 1, &previous, &failed) == CUDART_SUCCESS);
    cudart_leave_device(&with_driver, 1, previous);
    CHECK(cudart_sim_current_device() == 0);
    rt->stream_destroy(stream);
    /* an unanswered question restores, as before */
    cudart_sim_set_current_device(0);
    cudart_sim_forget_contexts();
    CHECK(cudart_enter_device(rt, 1, &previous, &failed) == CUDART_SUCCESS);
    cudart_leave_device(rt, 1, previous);
    CHECK(cudart_sim_current_device() == 0);
    CHECK(rt->get_last_error() == CUDART_SUCCESS);
}

int
main(void)
{
    rt = cudart_sim();
    test_host_memory_is_aligned_and_capped();
    test_entering_a_device_and_leaving_it();
    test_leaving_creates_no_context();
    test_a_failure_is_described_and_cleared();
    test_recording_events_creates_reuses_and_cleans_up();
    return check_report("test_helpers");
}
