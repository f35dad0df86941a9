/* Pool backend over plain aligned host memory: used where CUDA is absent
 * and by the unit tests, which give it a capacity to make it fail. */
#include "pool.h"
#include "common/host_memory.h"

/* page alignment, as pinned memory has */
static void *
host_alloc(void *ctx, uint64_t bytes)
{
    pool_host_ctx *host = ctx;
    return mp_host_alloc_capped(&host->live_bytes, host->capacity_bytes, bytes, 4096);
}

static void
host_free(void *ctx, void *ptr, uint64_t bytes)
{
    pool_host_ctx *host = ctx;
    mp_host_free_capped(&host->live_bytes, ptr, bytes);
}

pool_backend
pool_host_backend(pool_host_ctx *ctx)
{
    return (pool_backend){.alloc = host_alloc, .free = host_free, .ctx = ctx, .name = "host"};
}
