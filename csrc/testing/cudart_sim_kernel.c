/* Kernels that lag in data (cudart_sim.h, cudart_sim_queue_kernel): a CPU
 * kernel computes at launch, but until its stream reaches it the memory it
 * wrote reads as poison, and it lands only what it would have computed
 * from what it reads when it runs. Without this a copy that forgot to wait
 * for its producer still reads the right bytes, and no test sees the
 * missing wait. Contract: cudart_sim_internal.h. */
#include "cudart_sim_internal.h"
#include "common/mp_assert.h"

#include <stdlib.h>
#include <string.h>

/* A checksum of the bytes a kernel read: not cryptographic, only "did
 * anything write here since launch". 64-bit FNV-1a over 8-byte words. */
static uint64_t
span_sum(const cudart_sim_span *span)
{
    const unsigned char *bytes = span->ptr;
    uint64_t sum = 0xcbf29ce484222325ULL, word;
    size_t i = 0;
    for (; i + sizeof(word) <= span->bytes; i += sizeof(word)) {
        memcpy(&word, bytes + i, sizeof(word));
        sum = (sum ^ word) * 0x100000001b3ULL;
    }
    for (; i < span->bytes; i++)
        sum = (sum ^ bytes[i]) * 0x100000001b3ULL;
    return sum;
}

/* One allocation: the kernel, its spans, its checksums, its results.
 * Checked sizes: a span list from a test can be anything. */
static sim_kernel *
kernel_alloc(size_t n_writes, size_t n_reads, size_t result_bytes)
{
    size_t spans = n_writes + n_reads;
    if (spans > SIZE_MAX / sizeof(cudart_sim_span) / 2)
        return NULL;
    size_t head = sizeof(sim_kernel) + spans * sizeof(cudart_sim_span) +
                  n_reads * sizeof(uint64_t);
    if (result_bytes > SIZE_MAX - head)
        return NULL;
    sim_kernel *kernel = malloc(head + result_bytes);
    if (kernel == NULL)
        return NULL;
    kernel->n_writes = n_writes;
    kernel->n_reads = n_reads;
    kernel->writes = (cudart_sim_span *)(kernel + 1);
    kernel->reads = kernel->writes + n_writes;
    kernel->sums = (uint64_t *)(kernel->reads + n_reads);
    kernel->results = (unsigned char *)(kernel->sums + n_reads);
    return kernel;
}

sim_kernel *
sim_kernel_new(const cudart_sim_span *writes, size_t n_writes, const cudart_sim_span *reads,
               size_t n_reads)
{
    size_t result_bytes = 0;
    for (size_t i = 0; i < n_writes; i++) {
        if (writes[i].bytes > SIZE_MAX - result_bytes)
            return NULL;
        result_bytes += (size_t)writes[i].bytes;
    }
    sim_kernel *kernel = kernel_alloc(n_writes, n_reads, result_bytes);
    if (kernel == NULL)
        return NULL;
    memcpy(kernel->writes, writes, n_writes * sizeof(*writes));
    if (n_reads > 0)
        memcpy(kernel->reads, reads, n_reads * sizeof(*reads));
    unsigned char *result = kernel->results;
    for (size_t i = 0; i < n_writes; i++) {
        memcpy(result, writes[i].ptr, (size_t)writes[i].bytes);
        result += writes[i].bytes;
    }
    for (size_t i = 0; i < n_writes; i++)
        memset(writes[i].ptr, CUDART_SIM_POISON, (size_t)writes[i].bytes);
    /* after the poisoning: a read span overlapping a write span reads poison
     * until the kernel runs, as on a GPU */
    for (size_t i = 0; i < n_reads; i++)
        kernel->sums[i] = span_sum(&reads[i]);
    return kernel;
}

sim_kernel *
sim_kernel_new_poison(cudart_sim_span span)
{
    sim_kernel *kernel = kernel_alloc(1, 0, (size_t)span.bytes);
    if (kernel == NULL)
        return NULL;
    kernel->writes[0] = span;
    memset(kernel->results, CUDART_SIM_POISON, (size_t)span.bytes);
    return kernel;
}

void
sim_kernel_write_back(sim_kernel *kernel)
{
    const unsigned char *result = kernel->results;
    for (size_t i = 0; i < kernel->n_writes; i++) {
        memcpy(kernel->writes[i].ptr, result, (size_t)kernel->writes[i].bytes);
        result += kernel->writes[i].bytes;
    }
    free(kernel);
}

void
sim_kernel_land(sim_kernel *kernel)
{
    int read_changed = 0;
    for (size_t i = 0; i < kernel->n_reads && !read_changed; i++)
        read_changed = span_sum(&kernel->reads[i]) != kernel->sums[i];
    mp_counter_sub(&sim_gpu.stats.kernels_queued, 1);
    sim_gpu.stats.kernels_run++;
    if (!read_changed) {
        sim_kernel_write_back(kernel);
        return;
    }
    /* it read other data than at launch: what it computed is not known */
    sim_gpu.stats.kernels_poisoned++;
    for (size_t i = 0; i < kernel->n_writes; i++)
        memset(kernel->writes[i].ptr, CUDART_SIM_POISON, (size_t)kernel->writes[i].bytes);
    free(kernel);
}

static int
span_overlaps(const cudart_sim_span *span, const char *lo, const char *hi)
{
    const char *start = span->ptr;
    return start < hi && lo < start + span->bytes;
}

int
sim_kernel_touches(const sim_kernel *kernel, const char *lo, const char *hi)
{
    for (size_t i = 0; i < kernel->n_writes; i++) {
        if (span_overlaps(&kernel->writes[i], lo, hi))
            return 1;
    }
    for (size_t i = 0; i < kernel->n_reads; i++) {
        if (span_overlaps(&kernel->reads[i], lo, hi))
            return 1;
    }
    return 0;
}

/* The poison lands where the memory changes owner on the stream. */
static int
queue_poison_locked(sim_stream *stream, void *ptr, uint64_t bytes)
{
    sim_kernel *kernel = sim_kernel_new_poison((cudart_sim_span){ptr, bytes});
    if (kernel == NULL)
        return CUDART_ERROR_MEMORY_ALLOCATION;
    sim_gpu.stats.kernels_queued++;
    int status = sim_push_locked(stream, (sim_op){.kind = OP_KERNEL, .kernel = kernel});
    if (status != CUDART_SUCCESS) {
        mp_counter_sub(&sim_gpu.stats.kernels_queued, 1);
        free(kernel);
    }
    return status;
}

int
cudart_sim_handout(int device, void *stream, void *ptr, uint64_t bytes)
{
    if (device < 0 || device >= CUDART_SIM_DEVICES)
        return CUDART_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&sim_gpu.lock);
    sim_stream *s = sim_resolve_on(device, stream);
    int status;
    if (s == NULL) {
        status = CUDART_ERROR_INVALID_HANDLE;
    } else if (sim_handouts_deferred && sim_stream_touches(s, ptr, bytes)) {
        status = queue_poison_locked(s, ptr, bytes);
    } else {
        /* the new owner's work comes after what the stream's queue (its
         * waits followed) still does with the memory: that lands, no more */
        cudart_sim_span span = {ptr, bytes};
        status = sim_land_for_locked(s, &span, 1);
        if (status == CUDART_SUCCESS)
            memset(ptr, CUDART_SIM_POISON, (size_t)bytes);
    }
    pthread_mutex_unlock(&sim_gpu.lock);
    return status;
}

int
cudart_sim_queue_kernel(int device, void *stream, const cudart_sim_span *writes,
                        size_t n_writes, const cudart_sim_span *reads, size_t n_reads)
{
    if (device < 0 || device >= CUDART_SIM_DEVICES)
        return CUDART_ERROR_INVALID_DEVICE;
    if (n_writes == 0)
        return CUDART_SUCCESS;      /* nothing to land: nothing lags */
    pthread_mutex_lock(&sim_gpu.lock);
    int status = CUDART_ERROR_MEMORY_ALLOCATION;
    sim_stream *s = sim_resolve_on(device, stream);
    sim_kernel *kernel = s == NULL ? NULL : sim_kernel_new(writes, n_writes, reads, n_reads);
    if (s == NULL)
        status = CUDART_ERROR_INVALID_HANDLE;
    if (kernel != NULL) {
        sim_gpu.stats.kernels_queued++;
        status = sim_push_locked(s, (sim_op){.kind = OP_KERNEL, .kernel = kernel});
        if (status != CUDART_SUCCESS) {
            mp_counter_sub(&sim_gpu.stats.kernels_queued, 1);
            sim_kernel_write_back(kernel);
        }
    }
    pthread_mutex_unlock(&sim_gpu.lock);
    return status;
}
