/* Unit tests of the simulated CUDA runtime (csrc/testing/cudart_sim.c): the
 * offload engine's CI tests are only as good as its model of streams. */
#include "testing/cudart_sim.h"
#include "check.h"

#include <pthread.h>
#include <string.h>

static const cudart *rt;

static void
test_copies_wait_for_the_test_and_run_in_order(void)
{
    void *stream, *done, *pinned = NULL;
    char src[2][8] = {"first", "second"};
    CHECK(rt->host_alloc(&pinned, 8, CUDART_HOST_ALLOC_PORTABLE) == CUDART_SUCCESS);
    char *dst = pinned;       /* pinned: pageable memory would copy at once */
    dst[0] = '\0';
    CHECK(rt->stream_create(&stream, CUDART_STREAM_NON_BLOCKING) == CUDART_SUCCESS);
    CHECK(rt->event_create(&done, CUDART_EVENT_DISABLE_TIMING) == CUDART_SUCCESS);
    CHECK(rt->event_query(done) == CUDART_SUCCESS);          /* never recorded: complete */
    rt->memcpy_async(dst, src[0], 8, CUDART_MEMCPY_DEVICE_TO_HOST, stream);
    rt->memcpy_async(dst, src[1], 8, CUDART_MEMCPY_DEVICE_TO_HOST, stream);
    CHECK(rt->event_record(done, stream) == CUDART_SUCCESS);
    CHECK(rt->event_query(done) == CUDART_ERROR_NOT_READY);
    CHECK(dst[0] == '\0');                                   /* the "GPU" is behind */
    CHECK(cudart_sim_advance(1) == 1 && strcmp(dst, "first") == 0);
    CHECK(rt->event_query(done) == CUDART_ERROR_NOT_READY);
    CHECK(rt->event_synchronize(done) == CUDART_SUCCESS && strcmp(dst, "second") == 0);
    CHECK(cudart_sim_get_stats().ops_queued == 0);
    rt->event_destroy(done);
    rt->stream_destroy(stream);
    rt->free_host(pinned);
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
test_the_legacy_stream_lags_and_a_launch_runs_only_what_it_needs(void)
{
    void *side, *other, *copied;
    char a[4] = "xyz", b[4] = "", c[4] = "", d[4] = "";
    rt->stream_create(&side, 0);
    rt->stream_create(&other, 0);
    rt->event_create(&copied, 0);
    rt->memcpy_async(d, a, 4, 0, other);                     /* unrelated, older */
    rt->memcpy_async(b, a, 4, 0, side);
    rt->event_record(copied, side);
    CHECK(rt->stream_wait_event(NULL, copied, 0) == CUDART_SUCCESS);   /* queued, not run */
    rt->memcpy_async(c, b, 4, 0, NULL);
    CHECK(b[0] == '\0' && c[0] == '\0');
    /* a CPU kernel on the legacy stream: it and what it waits for run, nothing else */
    CHECK(cudart_sim_launch(0, NULL) == CUDART_SUCCESS);
    CHECK(strcmp(c, "xyz") == 0 && d[0] == '\0');
    CHECK(rt->stream_synchronize(other) == CUDART_SUCCESS && strcmp(d, "xyz") == 0);
    rt->event_destroy(copied);
    rt->stream_destroy(side);
    rt->stream_destroy(other);
}

static void
test_devices_streams_events_and_the_last_error(void)
{
    void *on_zero, *on_one, *stream_one;
    int device = -1;
    CHECK(rt->get_device(&device) == CUDART_SUCCESS && device == 0);
    rt->event_create(&on_zero, 0);
    CHECK(rt->set_device(1) == CUDART_SUCCESS);
    rt->event_create(&on_one, 0);
    rt->stream_create(&stream_one, 0);
    CHECK(cudart_sim_stream_device(stream_one) == 1);
    /* NULL is the current device's legacy stream: now device 1's */
    CHECK(rt->event_record(on_one, NULL) == CUDART_SUCCESS);
    CHECK(rt->event_record(on_zero, NULL) != CUDART_SUCCESS);
    CHECK(rt->event_record(on_zero, stream_one) != CUDART_SUCCESS);
    CHECK(cudart_sim_peek_last_error() != CUDART_SUCCESS);
    CHECK(rt->get_last_error() != CUDART_SUCCESS && rt->get_last_error() == CUDART_SUCCESS);
    CHECK(rt->set_device(CUDART_SIM_DEVICES) != CUDART_SUCCESS);
    (void)rt->get_last_error();
    CHECK(rt->set_device(0) == CUDART_SUCCESS);
    CHECK(rt->event_record(on_zero, NULL) == CUDART_SUCCESS);
    CHECK(cudart_sim_launch(1, NULL) == CUDART_SUCCESS && cudart_sim_event_done(on_one));
    CHECK(!cudart_sim_event_done(on_zero));
    CHECK(rt->event_query(on_zero) == CUDART_ERROR_NOT_READY);
    CHECK(rt->get_last_error() == CUDART_ERROR_NOT_READY);  /* as torch assumes */
    CHECK(rt->event_synchronize(on_zero) == CUDART_SUCCESS);
    rt->event_destroy(on_zero);
    rt->event_destroy(on_one);
    rt->stream_destroy(stream_one);
}

static void
test_contexts_and_memory_ranges(void)
{
    void *device_memory = NULL, *pinned = NULL;
    int device;
    cudart_sim_forget_contexts();
    CHECK(rt->get_device(&device) == CUDART_SUCCESS);
    CHECK(!cudart_sim_get_stats().has_context[0]);          /* asking creates none */
    CHECK(rt->set_device(1) == CUDART_SUCCESS && rt->malloc(&device_memory, 256) == 0);
    CHECK(cudart_sim_get_stats().has_context[1] && !cudart_sim_get_stats().has_context[0]);
    CHECK(cudart_sim_device_of((char *)device_memory + 255) == 1);
    CHECK(rt->host_alloc(&pinned, 64, CUDART_HOST_ALLOC_PORTABLE) == 0);
    CHECK(cudart_sim_device_of(pinned) == -1 && cudart_sim_device_of(&device) == -1);
    CHECK(!cudart_sim_get_stats().has_context[0]);
    /* the wrong free is refused and leaves the memory as it was */
    CHECK(rt->free(pinned) != CUDART_SUCCESS && rt->free_host(device_memory) != CUDART_SUCCESS);
    (void)rt->get_last_error();
    CHECK(rt->free(device_memory) == 0 && rt->free_host(pinned) == 0);
    CHECK(rt->free(device_memory) != CUDART_SUCCESS);       /* freed already */
    (void)rt->get_last_error();
    CHECK(rt->set_device(0) == CUDART_SUCCESS);
}

static void
test_pageable_copies_synchronize_and_pinned_ones_do_not(void)
{
    void *stream, *pinned = NULL;
    char pageable[8] = "", src[8] = "pinned";
    rt->stream_create(&stream, 0);
    rt->host_alloc(&pinned, 8, 0);
    memset(pinned, 0, 8);
    uint64_t before = cudart_sim_get_stats().pageable_copies;
    rt->memcpy_async(pinned, src, 8, CUDART_MEMCPY_DEVICE_TO_HOST, stream);
    CHECK(((char *)pinned)[0] == '\0');
    rt->memcpy_async(pageable, src, 8, CUDART_MEMCPY_DEVICE_TO_HOST, stream);
    CHECK(strcmp(pageable, "pinned") == 0 && strcmp(pinned, "pinned") == 0);
    CHECK(cudart_sim_get_stats().pageable_copies == before + 1);
    rt->free_host(pinned);
    rt->stream_destroy(stream);
}

static void
test_injected_failures(void)
{
    void *events[3] = {NULL, NULL, NULL};
    cudart_sim_fail(SIM_EVENT_CREATE, 1, 1, CUDART_ERROR_MEMORY_ALLOCATION);
    CHECK(rt->event_create(&events[0], 0) == CUDART_SUCCESS);
    CHECK(rt->event_create(&events[1], 0) == CUDART_ERROR_MEMORY_ALLOCATION);
    CHECK(events[1] == NULL);
    CHECK(rt->event_create(&events[2], 0) == CUDART_SUCCESS);
    CHECK(rt->get_last_error() == CUDART_ERROR_MEMORY_ALLOCATION);
    CHECK(cudart_sim_get_stats().calls[SIM_EVENT_CREATE] >= 3);
    CHECK(strcmp(cudart_sim_entry_name(SIM_EVENT_CREATE), "cudaEventCreateWithFlags") == 0);
    rt->event_destroy(events[0]);
    rt->event_destroy(events[2]);
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
}

static int
all_poison(const unsigned char *bytes, size_t count)
{
    for (size_t i = 0; i < count; i++)
        if (bytes[i] != CUDART_SIM_POISON)
            return 0;
    return 1;
}

/* New device and pinned memory holds poison, not what the last owner of
 * that memory left there (malloc hands freed memory back): a copy that
 * reads a new buffer too early reads poison wherever the buffer lies. */
static void
test_new_memory_is_poison(void)
{
    for (int pinned = 0; pinned < 2; pinned++) {
        for (int round = 0; round < 2; round++) {
            void *ptr = NULL;
            int status = pinned ? rt->host_alloc(&ptr, 4096, CUDART_HOST_ALLOC_PORTABLE)
                                : rt->malloc(&ptr, 4096);
            CHECK(status == CUDART_SUCCESS && all_poison(ptr, 4096));
            memset(ptr, 0x11, 4096);                /* what a run left there */
            CHECK((pinned ? rt->free_host(ptr) : rt->free(ptr)) == CUDART_SUCCESS);
        }
    }
}

/* A wait waits for the record it captured, as in CUDA: the same event
 * recorded again on another stream, and that record run first, does not
 * release it (an event re-recorded on several streams completes its
 * records out of order). */
static void
test_a_wait_keeps_the_record_it_captured(void)
{
    void *slow, *fast, *waiter, *event, *pinned = NULL;
    char a[4] = "abc", c[4] = "";
    CHECK(rt->host_alloc(&pinned, 4, CUDART_HOST_ALLOC_PORTABLE) == CUDART_SUCCESS);
    char *b = pinned;
    b[0] = '\0';
    rt->stream_create(&slow, 0);
    rt->stream_create(&fast, 0);
    rt->stream_create(&waiter, 0);
    rt->event_create(&event, 0);
    rt->memcpy_async(b, a, 4, 0, slow);
    rt->event_record(event, slow);
    CHECK(rt->stream_wait_event(waiter, event, 0) == CUDART_SUCCESS);
    rt->event_record(event, fast);                  /* a later record, nothing before it */
    rt->memcpy_async(c, b, 4, 0, waiter);
    CHECK(rt->stream_synchronize(fast) == CUDART_SUCCESS);     /* the later record ran */
    CHECK(b[0] == '\0');                            /* the captured one has not */
    CHECK(rt->stream_synchronize(waiter) == CUDART_SUCCESS);
    CHECK(strcmp(c, "abc") == 0);                   /* read after the copy it waited for */
    rt->event_destroy(event);
    rt->stream_destroy(slow);
    rt->stream_destroy(fast);
    rt->stream_destroy(waiter);
    rt->free_host(pinned);
}

/* Without a wait nothing orders the streams: the consumer's copy runs
 * before the producer's, as it would on a GPU whose engine forgot the wait
 * (what the test build's runtime does for a dropped call site:
 * csrc/testing/sim_runtime.c). */
static void
test_a_missing_wait_orders_nothing(void)
{
    void *producer, *consumer, *produced, *pinned = NULL;
    char a[4] = "abc", c[4] = "";
    CHECK(rt->host_alloc(&pinned, 4, CUDART_HOST_ALLOC_PORTABLE) == CUDART_SUCCESS);
    char *b = pinned;
    b[0] = '\0';
    rt->stream_create(&producer, 0);
    rt->stream_create(&consumer, 0);
    rt->event_create(&produced, 0);
    rt->memcpy_async(b, a, 4, 0, producer);          /* kind 0: no pageable side */
    rt->event_record(produced, producer);
    rt->memcpy_async(c, b, 4, 0, consumer);
    CHECK(rt->stream_synchronize(consumer) == CUDART_SUCCESS);
    CHECK(c[0] == '\0');                            /* read before it was written */
    CHECK(rt->event_query(produced) == CUDART_ERROR_NOT_READY);
    (void)rt->get_last_error();
    /* with the wait */
    rt->stream_wait_event(consumer, produced, 0);
    rt->memcpy_async(c, b, 4, 0, consumer);
    CHECK(rt->stream_synchronize(consumer) == CUDART_SUCCESS && strcmp(c, "abc") == 0);
    rt->event_destroy(produced);
    rt->stream_destroy(producer);
    rt->stream_destroy(consumer);
    rt->free_host(pinned);
}

/* A release that reports an injected failure (an earlier asynchronous
 * error) still releases: nothing stays live, the error is the last one. */
static void
test_failed_releases_release(void)
{
    void *stream, *event, *pinned = NULL, *device = NULL;
    cudart_sim_stats before = cudart_sim_get_stats();
    rt->stream_create(&stream, 0);
    rt->event_create(&event, 0);
    rt->host_alloc(&pinned, 64, CUDART_HOST_ALLOC_PORTABLE);
    rt->malloc(&device, 64);
    cudart_sim_fail(SIM_STREAM_DESTROY, 0, 1, 700);
    cudart_sim_fail(SIM_EVENT_DESTROY, 0, 1, 700);
    cudart_sim_fail(SIM_FREE_HOST, 0, 1, 700);
    cudart_sim_fail(SIM_FREE, 0, 1, 700);
    CHECK(rt->stream_destroy(stream) == 700 && rt->get_last_error() == 700);
    CHECK(rt->event_destroy(event) == 700 && rt->get_last_error() == 700);
    CHECK(rt->free_host(pinned) == 700 && rt->get_last_error() == 700);
    CHECK(rt->free(device) == 700 && rt->get_last_error() == 700);
    cudart_sim_stats after = cudart_sim_get_stats();
    CHECK(after.streams_live == before.streams_live && after.events_live == before.events_live);
    CHECK(after.host_bytes_live == before.host_bytes_live);
    CHECK(after.device_bytes_live[0] == before.device_bytes_live[0]);
}

/* A kernel's output reads as poison until its stream reaches it; a copy on
 * another stream not ordered after it copies poison, even when the GPU
 * runs on its own (copies first, kernels last). */
static void
test_a_kernel_lags_in_data(void)
{
    void *compute, *copy_out, *produced;
    float in[4] = {1, 2, 3, 4}, out[4], copied[4];
    uint32_t poison;
    memset(&poison, CUDART_SIM_POISON, sizeof(poison));
    rt->stream_create(&compute, 0);
    rt->stream_create(&copy_out, 0);
    rt->event_create(&produced, 0);
    cudart_sim_stats before = cudart_sim_get_stats();
    CHECK(cudart_sim_launch(0, compute) == CUDART_SUCCESS);
    for (int i = 0; i < 4; i++)
        out[i] = in[i] * 2;                                  /* the CPU "kernel" */
    cudart_sim_span write = {out, sizeof(out)}, read = {in, sizeof(in)};
    CHECK(cudart_sim_queue_kernel(0, compute, &write, 1, &read, 1) == CUDART_SUCCESS);
    CHECK(memcmp(&out[3], &poison, sizeof(poison)) == 0);   /* not landed yet */
    /* unordered: the copy runs first though queued after the kernel */
    rt->memcpy_async(copied, out, sizeof(out), 0, copy_out);
    CHECK(cudart_sim_advance(1) == 1 && memcmp(&copied[0], &poison, sizeof(poison)) == 0);
    CHECK(cudart_sim_get_stats().kernels_queued == before.kernels_queued + 1);
    CHECK(cudart_sim_advance(1) == 1 && out[3] == 8.0f);    /* then the kernel */
    /* ordered: the wait makes the kernel land before the copy */
    CHECK(cudart_sim_queue_kernel(0, compute, &write, 1, &read, 1) == CUDART_SUCCESS);
    rt->event_record(produced, compute);
    rt->stream_wait_event(copy_out, produced, 0);
    rt->memcpy_async(copied, out, sizeof(out), 0, copy_out);
    CHECK(rt->stream_synchronize(copy_out) == CUDART_SUCCESS && copied[3] == 8.0f);
    cudart_sim_stats after = cudart_sim_get_stats();
    CHECK(after.kernels_run == before.kernels_run + 2 && after.kernels_queued == 0);
    CHECK(after.kernels_poisoned == before.kernels_poisoned);
    rt->event_destroy(produced);
    rt->stream_destroy(compute);
    rt->stream_destroy(copy_out);
}

/* A kernel still queued reads what is there when it runs: memory written
 * meanwhile (reused, or a copy into it) leaves its outputs poison. */
static void
test_a_kernel_whose_input_changed_writes_poison(void)
{
    void *compute, *other;
    double in[2] = {1, 2}, out[2] = {0, 0}, other_data[2] = {5, 6};
    uint64_t poison;
    memset(&poison, CUDART_SIM_POISON, sizeof(poison));
    rt->stream_create(&compute, 0);
    rt->stream_create(&other, 0);
    uint64_t poisoned = cudart_sim_get_stats().kernels_poisoned;
    out[0] = in[0] + in[1];
    out[1] = in[0] - in[1];
    cudart_sim_span write = {out, sizeof(out)}, read = {in, sizeof(in)};
    CHECK(cudart_sim_queue_kernel(0, compute, &write, 1, &read, 1) == CUDART_SUCCESS);
    rt->memcpy_async(in, other_data, sizeof(in), 0, other);
    CHECK(cudart_sim_launch(0, other) == CUDART_SUCCESS && in[0] == 5.0);
    CHECK(cudart_sim_launch(0, compute) == CUDART_SUCCESS);       /* lands now */
    CHECK(memcmp(&out[0], &poison, sizeof(poison)) == 0 && memcmp(&out[1], &poison, 8) == 0);
    CHECK(cudart_sim_get_stats().kernels_poisoned == poisoned + 1);
    /* nothing written meanwhile: the results land */
    cudart_sim_span again = {out, sizeof(out)}, read_again = {in, sizeof(in)};
    out[0] = 11.0;
    out[1] = -1.0;
    CHECK(cudart_sim_queue_kernel(0, NULL, &again, 1, &read_again, 1) == CUDART_SUCCESS);
    CHECK(cudart_sim_launch(0, NULL) == CUDART_SUCCESS && out[0] == 11.0 && out[1] == -1.0);
    CHECK(cudart_sim_get_stats().kernels_poisoned == poisoned + 1);
    /* bad arguments: refused, nothing queued */
    CHECK(cudart_sim_queue_kernel(CUDART_SIM_DEVICES, NULL, &again, 1, NULL, 0) ==
          CUDART_ERROR_INVALID_DEVICE);
    CHECK(cudart_sim_queue_kernel(0, &poison, &again, 1, NULL, 0) ==
          CUDART_ERROR_INVALID_HANDLE);
    CHECK(cudart_sim_queue_kernel(0, NULL, NULL, 0, NULL, 0) == CUDART_SUCCESS);
    CHECK(cudart_sim_get_stats().ops_queued == 0 && out[0] == 11.0);
    rt->stream_destroy(compute);
    rt->stream_destroy(other);
}

/* Kernels land only when something forces them (a launch on their
 * stream, a cudaFree, a queued wait), never on their own by the progress
 * of each runtime call, which runs the copies. */
static void
test_kernels_land_as_late_as_possible(void)
{
    void *compute, *copies, *mem = NULL;
    int out = 0, src = 7, dst = 0;
    rt->stream_create(&compute, 0);
    rt->stream_create(&copies, 0);
    out = 42;
    cudart_sim_span write = {&out, sizeof(out)};
    CHECK(cudart_sim_queue_kernel(0, compute, &write, 1, NULL, 0) == CUDART_SUCCESS);
    rt->memcpy_async(&dst, &src, sizeof(src), 0, copies);
    cudart_sim_set_progress(1);
    int device;
    CHECK(rt->get_device(&device) == CUDART_SUCCESS && dst == 7);  /* ran the copy */
    CHECK(out == -1);
    /* progress alone never lands a kernel; a launch on its stream does */
    CHECK(rt->malloc(&mem, 16) == CUDART_SUCCESS && out == -1);
    CHECK(cudart_sim_launch(0, compute) == CUDART_SUCCESS && out == 42);
    cudart_sim_set_progress(0);
    /* a queued wait needs the kernel: progress lands it, then the copy runs */
    void *produced;
    rt->event_create(&produced, 0);
    out = 44;
    CHECK(cudart_sim_queue_kernel(0, compute, &write, 1, NULL, 0) == CUDART_SUCCESS);
    rt->event_record(produced, compute);
    rt->stream_wait_event(copies, produced, 0);
    rt->memcpy_async(&dst, &out, sizeof(out), 0, copies);
    cudart_sim_set_progress(100);
    CHECK(rt->get_device(&device) == CUDART_SUCCESS && out == 44 && dst == 44);
    cudart_sim_set_progress(0);
    rt->event_destroy(produced);
    out = 43;
    CHECK(cudart_sim_queue_kernel(0, compute, &write, 1, NULL, 0) == CUDART_SUCCESS);
    CHECK(out == -1 && rt->free(mem) == CUDART_SUCCESS && out == 43);   /* cudaFree runs all */
    rt->stream_destroy(compute);
    rt->stream_destroy(copies);
}

/* The harness's own ordering (torch's engine between streams): counted as
 * no runtime call and no event, gone once it ran. */
static void
test_ordering_streams_as_the_autograd_engine_does(void)
{
    void *producer, *waiter;
    int out = 0, copied = 0;
    rt->stream_create(&producer, 0);
    rt->stream_create(&waiter, 0);
    cudart_sim_stats before = cudart_sim_get_stats();
    CHECK(cudart_sim_order_streams(0, waiter, 0, producer) == CUDART_SUCCESS);
    CHECK(cudart_sim_get_stats().ops_queued == 0);               /* nothing to wait for */
    out = 5;
    cudart_sim_span write = {&out, sizeof(out)};
    CHECK(cudart_sim_queue_kernel(0, producer, &write, 1, NULL, 0) == CUDART_SUCCESS);
    CHECK(cudart_sim_order_streams(0, waiter, 0, producer) == CUDART_SUCCESS);
    CHECK(cudart_sim_order_streams(0, producer, 0, producer) == CUDART_SUCCESS);  /* itself */
    rt->memcpy_async(&copied, &out, sizeof(out), 0, waiter);
    CHECK(rt->stream_synchronize(waiter) == CUDART_SUCCESS && copied == 5);
    cudart_sim_stats after = cudart_sim_get_stats();
    CHECK(after.events_live == before.events_live && after.ops_queued == 0);
    CHECK(after.calls[SIM_EVENT_RECORD] == before.calls[SIM_EVENT_RECORD]);
    CHECK(after.calls[SIM_STREAM_WAIT_EVENT] == before.calls[SIM_STREAM_WAIT_EVENT]);
    CHECK(cudart_sim_order_streams(0, waiter, CUDART_SIM_DEVICES, NULL) ==
          CUDART_ERROR_INVALID_HANDLE);
    /* the legacy streams of two devices */
    out = 6;
    CHECK(cudart_sim_queue_kernel(1, NULL, &write, 1, NULL, 0) == CUDART_SUCCESS);
    CHECK(cudart_sim_order_streams(0, NULL, 1, NULL) == CUDART_SUCCESS);
    CHECK(cudart_sim_launch(0, NULL) == CUDART_SUCCESS && out == 6);
    rt->stream_destroy(producer);
    rt->stream_destroy(waiter);
}

/* A stream-ordered allocator hands memory out: the work before on that
 * stream still touching it runs first, nothing else does. */
static void
test_a_handout_runs_only_the_work_touching_the_memory(void)
{
    void *compute;
    int32_t a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
    rt->stream_create(&compute, 0);
    cudart_sim_span on_a = {a, sizeof(a)}, on_b = {b, sizeof(b)};
    CHECK(cudart_sim_queue_kernel(0, compute, &on_a, 1, NULL, 0) == CUDART_SUCCESS);
    CHECK(cudart_sim_queue_kernel(0, compute, &on_b, 1, NULL, 0) == CUDART_SUCCESS);
    /* `b`'s kernel comes last: handing `a` out runs `a`'s only */
    CHECK(cudart_sim_handout(0, compute, a, sizeof(a)) == CUDART_SUCCESS);
    CHECK(a[0] == -1 && a[3] == -1 && b[0] == -1);           /* poisoned; b still lags */
    CHECK(cudart_sim_get_stats().ops_queued == 1);
    CHECK(cudart_sim_handout(0, compute, &b[2], 8) == CUDART_SUCCESS);
    CHECK(b[0] == 5 && b[1] == 6 && b[2] == -1 && cudart_sim_get_stats().ops_queued == 0);
    CHECK(cudart_sim_handout(0, &on_a, a, 4) == CUDART_ERROR_INVALID_HANDLE);
    rt->stream_destroy(compute);
}

/* Memory only a copy fills changes owner in stream order: a fill on
 * another stream not ordered after the handout stream is lost. */
static void
test_a_deferred_handout_poisons_in_stream_order(void)
{
    void *compute, *copy_in, *ordered;
    int32_t block[4] = {1, 2, 3, 4}, fill[4] = {9, 9, 9, 9}, out = 0;
    rt->stream_create(&compute, 0);
    rt->stream_create(&copy_in, 0);
    rt->event_create(&ordered, 0);
    cudart_sim_span old_read = {block, sizeof(block)}, old_write = {&out, sizeof(out)};
    out = 10;                                                   /* the old owner */
    CHECK(cudart_sim_queue_kernel(0, compute, &old_write, 1, &old_read, 1) == CUDART_SUCCESS);
    cudart_sim_defer_handouts(1);
    CHECK(cudart_sim_handout(0, compute, block, sizeof(block)) == CUDART_SUCCESS);
    cudart_sim_defer_handouts(0);
    CHECK(block[0] == 1 && cudart_sim_get_stats().ops_queued == 2);  /* nothing ran */
    rt->memcpy_async(block, fill, sizeof(fill), CUDART_MEMCPY_HOST_TO_DEVICE, copy_in);
    CHECK(rt->stream_synchronize(copy_in) == CUDART_SUCCESS && block[0] == 9);
    CHECK(cudart_sim_launch(0, compute) == CUDART_SUCCESS);
    CHECK(block[0] == -1 && out == -1);        /* the fill lost; the old owner read it */
    /* ordered after the handout stream, the fill lands after the poison */
    out = 11;
    CHECK(cudart_sim_queue_kernel(0, compute, &old_write, 1, &old_read, 1) == CUDART_SUCCESS);
    cudart_sim_defer_handouts(1);
    CHECK(cudart_sim_handout(0, compute, block, sizeof(block)) == CUDART_SUCCESS);
    cudart_sim_defer_handouts(0);
    rt->event_record(ordered, compute);
    rt->stream_wait_event(copy_in, ordered, 0);
    rt->memcpy_async(block, fill, sizeof(fill), CUDART_MEMCPY_HOST_TO_DEVICE, copy_in);
    CHECK(rt->stream_synchronize(copy_in) == CUDART_SUCCESS && block[3] == 9 && out == 11);
    /* nothing queued touches it: poisoned at once, as without deferring */
    cudart_sim_defer_handouts(1);
    CHECK(cudart_sim_handout(0, compute, block, sizeof(block)) == CUDART_SUCCESS);
    cudart_sim_defer_handouts(0);
    CHECK(block[0] == -1 && cudart_sim_get_stats().ops_queued == 0);
    rt->event_destroy(ordered);
    rt->stream_destroy(compute);
    rt->stream_destroy(copy_in);
}

/* A launch (or a handout) lands what its memory depends on: on its stream
 * in order, and through the stream's waits on other streams; the rest
 * stays queued, a copy the stream waits for included, so memory only that
 * copy reads can be reused meanwhile by a stream not ordered after it. */
static void
test_a_launch_lands_only_what_its_memory_needs(void)
{
    void *compute, *copy_out, *copied, *pinned = NULL;
    int32_t source[4] = {1, 2, 3, 4}, x[4] = {7, 7, 7, 7}, y[4] = {8, 8, 8, 8}, other[4] = {0};
    CHECK(rt->host_alloc(&pinned, sizeof(source), 0) == CUDART_SUCCESS);
    int32_t *host = pinned;
    memset(host, 0, sizeof(source));
    rt->stream_create(&compute, 0);
    rt->stream_create(&copy_out, 0);
    rt->event_create(&copied, 0);
    cudart_sim_span on_x = {x, sizeof(x)}, on_y = {y, sizeof(y)}, on_other = {other, 16};
    cudart_sim_span on_source = {source, sizeof(source)};
    uint64_t queued = cudart_sim_get_stats().ops_queued;
    /* compute waits for a copy out of `source`, then writes x */
    rt->memcpy_async(host, source, sizeof(source), CUDART_MEMCPY_DEVICE_TO_HOST, copy_out);
    rt->event_record(copied, copy_out);
    rt->stream_wait_event(compute, copied, 0);
    CHECK(cudart_sim_queue_kernel(0, compute, &on_x, 1, NULL, 0) == CUDART_SUCCESS);
    CHECK(cudart_sim_launch_for(0, compute, &on_other, 1) == CUDART_SUCCESS);
    CHECK(cudart_sim_launch_for(0, compute, NULL, 0) == CUDART_SUCCESS);
    CHECK(host[0] == 0 && x[0] == -1 && cudart_sim_get_stats().ops_queued == queued + 4);
    CHECK(cudart_sim_handout(0, compute, other, sizeof(other)) == CUDART_SUCCESS);
    CHECK(host[0] == 0 && cudart_sim_get_stats().ops_queued == queued + 4);
    /* x's kernel comes after the wait: landing it runs the copy first */
    CHECK(cudart_sim_launch_for(0, compute, &on_x, 1) == CUDART_SUCCESS);
    CHECK(host[3] == 4 && x[0] == 7 && cudart_sim_get_stats().ops_queued == queued);
    /* the memory a waited-for copy reads: the copy runs, the kernel after stays */
    source[0] = 5;
    rt->memcpy_async(host, source, sizeof(source), CUDART_MEMCPY_DEVICE_TO_HOST, copy_out);
    rt->event_record(copied, copy_out);
    rt->stream_wait_event(compute, copied, 0);
    CHECK(cudart_sim_queue_kernel(0, compute, &on_y, 1, NULL, 0) == CUDART_SUCCESS);
    CHECK(cudart_sim_launch_for(0, compute, &on_source, 1) == CUDART_SUCCESS);
    CHECK(host[0] == 5 && y[0] == -1 && cudart_sim_get_stats().ops_queued == queued + 3);
    /* a stream runs in order: landing y's kernel lands x's before it */
    CHECK(cudart_sim_queue_kernel(0, compute, &on_x, 1, NULL, 0) == CUDART_SUCCESS);
    CHECK(cudart_sim_queue_kernel(0, compute, &on_other, 1, NULL, 0) == CUDART_SUCCESS);
    CHECK(cudart_sim_launch_for(0, compute, &on_x, 1) == CUDART_SUCCESS);
    CHECK(y[0] == 8 && x[0] == 7 && cudart_sim_get_stats().ops_queued == queued + 1);
    /* a handout of the copy's memory runs the copy before the poison */
    source[0] = 6;
    rt->memcpy_async(host, source, sizeof(source), CUDART_MEMCPY_DEVICE_TO_HOST, copy_out);
    rt->event_record(copied, copy_out);
    rt->stream_wait_event(compute, copied, 0);
    CHECK(cudart_sim_handout(0, compute, source, sizeof(source)) == CUDART_SUCCESS);
    CHECK(host[0] == 6 && source[0] == -1);
    CHECK(cudart_sim_launch_for(0, NULL, &on_x, 1) == CUDART_SUCCESS);     /* another stream */
    CHECK(cudart_sim_launch_for(0, &on_x, &on_x, 1) == CUDART_ERROR_INVALID_HANDLE);
    CHECK(cudart_sim_launch_for(CUDART_SIM_DEVICES, NULL, &on_x, 1) == CUDART_ERROR_INVALID_DEVICE);
    CHECK(cudart_sim_get_stats().ops_queued == queued + 3);
    CHECK(cudart_sim_launch(0, compute) == CUDART_SUCCESS);
    CHECK(cudart_sim_get_stats().ops_queued == queued);
    rt->event_destroy(copied);
    rt->stream_destroy(compute);
    rt->stream_destroy(copy_out);
    rt->free_host(pinned);
}

/* Expandable mode: cudaFree syncs the memory's own stream only; work of
 * another stream still on it is a fault. Off: every stream is waited for. */
static void
test_expandable_free_syncs_only_the_own_stream(void)
{
    void *side, *seg, *pinned, *other;
    char host[8] = "bytes";
    CHECK(rt->stream_create(&side, 0) == CUDART_SUCCESS);
    CHECK(rt->host_alloc(&pinned, 8, CUDART_HOST_ALLOC_PORTABLE) == CUDART_SUCCESS);
    for (int expandable = 0; expandable <= 1; expandable++) {
        uint64_t faults = cudart_sim_get_stats().unmap_faults;
        CHECK(rt->malloc(&seg, 64) == CUDART_SUCCESS);                /* the legacy stream's */
        CHECK(rt->malloc(&other, 64) == CUDART_SUCCESS);
        rt->memcpy_async(seg, host, 8, CUDART_MEMCPY_HOST_TO_DEVICE, NULL);   /* own stream */
        rt->memcpy_async(pinned, seg, 8, CUDART_MEMCPY_DEVICE_TO_HOST, side); /* a reader */
        rt->memcpy_async(other, pinned, 8, CUDART_MEMCPY_HOST_TO_DEVICE, side);
        cudart_sim_set_expandable(expandable);
        CHECK(rt->free(seg) == CUDART_SUCCESS);
        cudart_sim_set_expandable(0);
        CHECK(cudart_sim_get_stats().unmap_faults - faults == (uint64_t)expandable);
        CHECK(cudart_sim_get_stats().ops_queued == 0);     /* the sim stays memory safe */
        CHECK(memcmp(pinned, "bytes", 6) == 0);
        /* memory no queued work touches unmaps without a fault */
        cudart_sim_set_expandable(1);
        CHECK(rt->free(other) == CUDART_SUCCESS);
        cudart_sim_set_expandable(0);
        CHECK(cudart_sim_get_stats().unmap_faults - faults == (uint64_t)expandable);
    }
    rt->free_host(pinned);
    rt->stream_destroy(side);
}

/* Synchronizes the calling thread's cudaStreamPerThread stream. */
static void *
synchronize_own_default_stream(void *status)
{
    *(int *)status = rt->stream_synchronize(CUDART_STREAM_PER_THREAD);
    return NULL;
}

static void
test_the_per_thread_handle_names_each_threads_own_stream(void)
{
    void *pinned;
    char host[8] = "mine";
    int status = -1;
    pthread_t other;
    CHECK(rt->host_alloc(&pinned, 8, CUDART_HOST_ALLOC_PORTABLE) == CUDART_SUCCESS);
    memset(pinned, 0, 8);
    CHECK(rt->memcpy_async(pinned, host, 8, CUDART_MEMCPY_HOST_TO_DEVICE,
                           CUDART_STREAM_PER_THREAD) == CUDART_SUCCESS);
    /* another thread's stream of that handle holds none of this work */
    CHECK(pthread_create(&other, NULL, synchronize_own_default_stream, &status) == 0);
    CHECK(pthread_join(other, NULL) == 0);
    CHECK(status == CUDART_SUCCESS && ((char *)pinned)[0] == '\0');
    CHECK(rt->stream_synchronize(CUDART_STREAM_PER_THREAD) == CUDART_SUCCESS);
    CHECK(strcmp(pinned, "mine") == 0);
    /* cudaStreamLegacy is the legacy stream, as NULL */
    memset(pinned, 0, 8);
    rt->memcpy_async(pinned, host, 8, CUDART_MEMCPY_HOST_TO_DEVICE, NULL);
    CHECK(rt->stream_synchronize(CUDART_STREAM_LEGACY) == CUDART_SUCCESS);
    CHECK(strcmp(pinned, "mine") == 0);
    /* default streams are never destroyed */
    CHECK(rt->stream_destroy(CUDART_STREAM_PER_THREAD) == CUDART_ERROR_INVALID_HANDLE);
    CHECK(rt->stream_destroy(CUDART_STREAM_LEGACY) == CUDART_ERROR_INVALID_HANDLE);
    (void)rt->get_last_error();
    CHECK(cudart_sim_get_stats().ops_queued == 0);
    rt->free_host(pinned);
}

int
main(void)
{
    rt = cudart_sim();
    test_copies_wait_for_the_test_and_run_in_order();
    test_a_wait_orders_one_stream_after_another();
    test_the_legacy_stream_lags_and_a_launch_runs_only_what_it_needs();
    test_devices_streams_events_and_the_last_error();
    test_contexts_and_memory_ranges();
    test_pageable_copies_synchronize_and_pinned_ones_do_not();
    test_injected_failures();
    test_destroyed_handles_finish_their_work();
    test_progress_per_call_lets_the_gpu_catch_up();
    test_host_memory_is_counted();
    test_new_memory_is_poison();
    test_a_missing_wait_orders_nothing();
    test_a_wait_keeps_the_record_it_captured();
    test_failed_releases_release();
    test_a_kernel_lags_in_data();
    test_a_kernel_whose_input_changed_writes_poison();
    test_kernels_land_as_late_as_possible();
    test_ordering_streams_as_the_autograd_engine_does();
    test_a_handout_runs_only_the_work_touching_the_memory();
    test_a_deferred_handout_poisons_in_stream_order();
    test_a_launch_lands_only_what_its_memory_needs();
    test_expandable_free_syncs_only_the_own_stream();
    test_the_per_thread_handle_names_each_threads_own_stream();
    CHECK(cudart_sim_get_stats().events_live == 0 && cudart_sim_get_stats().streams_live == 0);
    return check_report("test_cudart_sim");
}
