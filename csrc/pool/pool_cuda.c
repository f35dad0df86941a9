/* Pool backend over pinned (page-locked) memory from the CUDA runtime.
 * Portable pinning, so one pool serves copies to and from every device. */
#include "pool.h"
#include "cuda/cudart.h"
#include "cuda/cudart_util.h"

static void *
pinned_alloc(void *ctx, uint64_t bytes)
{
    const cudart *rt = ctx;
    void *ptr = NULL;
    if (bytes > SIZE_MAX)
        return NULL;
    /* pinning is forbidden beside a capture in global mode (cudart_util.h) */
    int mode = cudart_relax_capture(rt);
    int status = rt->host_alloc(&ptr, (size_t)bytes, CUDART_HOST_ALLOC_PORTABLE);
    cudart_restore_capture(rt, mode);
    if (status != CUDART_SUCCESS) {
        /* the pool falls back to pageable memory: torch's next launch check
         * must not see this failure as its own */
        (void)rt->get_last_error();
        return NULL;
    }
    return ptr;
}

static void
pinned_free(void *ctx, void *ptr, uint64_t bytes)
{
    const cudart *rt = ctx;
    (void)bytes;
    /* a failure here leaves nothing to undo; the pool forgets the buffer */
    int mode = cudart_relax_capture(rt);
    int status = rt->free_host(ptr);
    cudart_restore_capture(rt, mode);
    if (status != CUDART_SUCCESS)
        (void)rt->get_last_error();
}

pool_backend
pool_cuda_backend(const cudart *rt)
{
    return (pool_backend){.alloc = pinned_alloc, .free = pinned_free, .ctx = (void *)rt,
                          .name = "cuda-pinned"};
}
