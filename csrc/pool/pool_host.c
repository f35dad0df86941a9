/* Pool backend over plain aligned host memory: used where CUDA is absent
 * and by the unit tests, which give it a capacity to make it fail. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* posix_memalign under -std=c11 */
#endif
#include "pool.h"

#include <stdint.h>
#include <stdlib.h>

static void *
host_alloc(void *ctx, uint64_t bytes)
{
    pool_host_ctx *host = ctx;
    uint64_t live = atomic_load(&host->live_bytes);
    do {
        /* live + bytes > capacity, without wrapping */
        if (host->capacity_bytes != 0 &&
            (bytes > host->capacity_bytes || live > host->capacity_bytes - bytes))
            return NULL;
    } while (!atomic_compare_exchange_weak(&host->live_bytes, &live, live + bytes));
    void *ptr = NULL;
    /* page alignment, as pinned memory has */
    if (bytes > PTRDIFF_MAX || posix_memalign(&ptr, 4096, (size_t)bytes) != 0) {
        atomic_fetch_sub(&host->live_bytes, bytes);
        return NULL;
    }
    return ptr;
}

static void
host_free(void *ctx, void *ptr, uint64_t bytes)
{
    pool_host_ctx *host = ctx;
    atomic_fetch_sub(&host->live_bytes, bytes);
    free(ptr);
}

pool_backend
pool_host_backend(pool_host_ctx *ctx)
{
    return (pool_backend){.alloc = host_alloc, .free = host_free, .ctx = ctx, .name = "host"};
}
