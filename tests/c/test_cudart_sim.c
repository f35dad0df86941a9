/* Unit tests of the simulated CUDA runtime (csrc/cuda/cudart_sim.c): the
 * offload engine's CI tests are only as good as its model of streams. */
#include "cuda/cudart_sim.h"
#include "check.h"

#include <string.h>

static const cudart *rt;

static void
test_copies_wait_for_the_test_and_run_in_order(void)
{
    void *stream, *done;
    char src[2][8] = {"first", "second"}, dst[8] = "";
    CHECK(rt->stream_create(&stream, CUDART_STREAM_NON_BLOCKING) == CUDART_SUCCESS);
    CHECK(rt->event_create(&done, CUDART_EVENT_DISABLE_TIMING) == CUDART_SUCCESS);
    CHECK(rt->event_query(done) == CUDART_SUCCESS);          /* never recorded: complete */
    rt->memcpy_async(dst, src[0], sizeof(dst), CUDART_MEMCPY_DEVICE_TO_HOST, stream);
    rt->memcpy_async(dst, src[1], sizeof(dst), CUDART_MEMCPY_DEVICE_TO_HOST, stream);
    CHECK(rt->event_record(done, stream) == CUDART_SUCCESS);
    CHECK(rt->event_query(done) == CUDART_ERROR_NOT_READY);
    CHECK(dst[0] == '\0');                                   /* the "GPU" is behind */
    CHECK(cudart_sim_advance(1) == 1 && strcmp(dst, "first") == 0);
    CHECK(rt->event_query(done) == CUDART_ERROR_NOT_READY);
    CHECK(rt->event_synchronize(done) == CUDART_SUCCESS && strcmp(dst, "second") == 0);
    CHECK(cudart_sim_get_stats().ops_queued == 0);
    rt->event_destroy(done);
    rt->stream_destroy(stream);
}

static void
test_a_wait_orders_one_stream_after_another(void)
{
    void *producer, *consumer, *produced;
    char a[4] = "abc", b[4] = "", c[4] = "";
    rt->stream_create(&producer, 0);
    rt->stream_create(&consumer, 0);
    rt->event_create(&produced, 0);
    rt->memcpy_async(b, a, 4, 0, producer);
    rt->event_record(produced, producer);
    rt->stream_wait_event(consumer, produced, 0);
    rt->memcpy_async(c, b, 4, 0, consumer);                  /* reads what the first wrote */
    /* a record of the event after the wait does not concern the waiter */
    rt->event_record(produced, producer);
    CHECK(cudart_sim_get_stats().ops_queued == 5);
    CHECK(rt->device_synchronize() == CUDART_SUCCESS);
    CHECK(strcmp(c, "abc") == 0);
    CHECK(rt->event_query(produced) == CUDART_SUCCESS);
    rt->event_destroy(produced);
    rt->stream_destroy(producer);
    rt->stream_destroy(consumer);
}

static void
test_the_compute_stream_runs_at_once(void)
{
    void *side, *copied, *compute = cudart_sim_compute_stream();
    char a[4] = "xyz", b[4] = "", c[4] = "";
    rt->stream_create(&side, 0);
    rt->event_create(&copied, 0);
    rt->memcpy_async(c, a, 4, 0, compute);
    CHECK(strcmp(c, "xyz") == 0);
    rt->memcpy_async(b, a, 4, 0, side);
    rt->event_record(copied, side);
    CHECK(b[0] == '\0');
    /* the CPU stands for the compute stream: waiting there runs the copy */
    CHECK(rt->stream_wait_event(compute, copied, 0) == CUDART_SUCCESS);
    CHECK(strcmp(b, "xyz") == 0 && rt->event_query(copied) == CUDART_SUCCESS);
    rt->event_record(copied, compute);
    CHECK(rt->event_query(copied) == CUDART_SUCCESS);
    rt->event_destroy(copied);
    rt->stream_destroy(side);
}

static void
test_destroyed_handles_finish_their_work(void)
{
    void *stream, *event;
    char a[4] = "end", b[4] = "";
    cudart_sim_stats before = cudart_sim_get_stats();
    rt->stream_create(&stream, 0);
    rt->event_create(&event, 0);
    rt->memcpy_async(b, a, 4, 0, stream);
    rt->event_record(event, stream);
    rt->event_destroy(event);                                /* a queued record keeps it */
    rt->stream_destroy(stream);
    CHECK(cudart_sim_get_stats().streams_live == before.streams_live + 1);
    CHECK(cudart_sim_get_stats().events_live == before.events_live);
    CHECK(cudart_sim_advance(10) == 2 && strcmp(b, "end") == 0);
    CHECK(cudart_sim_get_stats().streams_live == before.streams_live);
}

static void
test_progress_per_call_lets_the_gpu_catch_up(void)
{
    void *stream, *event;
    char a[4] = "run", b[4] = "";
    rt->stream_create(&stream, 0);
    rt->event_create(&event, 0);
    rt->memcpy_async(b, a, 4, 0, stream);
    rt->event_record(event, stream);
    cudart_sim_set_progress(1);
    CHECK(rt->event_query(event) == CUDART_ERROR_NOT_READY);  /* ran the copy */
    CHECK(strcmp(b, "run") == 0);
    CHECK(rt->event_query(event) == CUDART_SUCCESS);          /* ran the record */
    cudart_sim_set_progress(0);
    rt->event_destroy(event);
    rt->stream_destroy(stream);
}

static void
test_host_memory_is_counted(void)
{
    void *ptr = NULL;
    uint64_t before = cudart_sim_get_stats().host_bytes_live;
    CHECK(rt->host_alloc(&ptr, 1000, CUDART_HOST_ALLOC_PORTABLE) == CUDART_SUCCESS);
    CHECK(((uintptr_t)ptr % 64) == 0);
    memset(ptr, 1, 1000);
    CHECK(cudart_sim_get_stats().host_bytes_live == before + 1000);
    rt->free_host(ptr);
    CHECK(cudart_sim_get_stats().host_bytes_live == before);
    CHECK(rt->set_device(1) != CUDART_SUCCESS);
}

int
main(void)
{
    rt = cudart_sim();
    test_copies_wait_for_the_test_and_run_in_order();
    test_a_wait_orders_one_stream_after_another();
    test_the_compute_stream_runs_at_once();
    test_destroyed_handles_finish_their_work();
    test_progress_per_call_lets_the_gpu_catch_up();
    test_host_memory_is_counted();
    CHECK(cudart_sim_get_stats().events_live == 0 && cudart_sim_get_stats().streams_live == 0);
    return check_report("test_cudart_sim");
}
