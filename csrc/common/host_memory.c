#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* posix_memalign under -std=c11 */
#endif
#include "host_memory.h"
#include "mp_assert.h"

#include <stdlib.h>

void *
mp_host_alloc(uint64_t bytes, size_t align)
{
    void *ptr = NULL;
    if (bytes > PTRDIFF_MAX)
        return NULL;
    if (posix_memalign(&ptr, align, bytes != 0 ? (size_t)bytes : 1) != 0)
        return NULL;
    return ptr;
}

void
mp_host_free(void *ptr)
{
    free(ptr);
}

/* Adds `bytes` to *live unless the sum would pass `capacity`; 0 or -1. A
 * compare-and-swap loop, so concurrent callers never overshoot together. */
static int
claim(_Atomic uint64_t *live, uint64_t capacity, uint64_t bytes)
{
    uint64_t now = atomic_load(live);
    do {
        /* now + bytes > capacity, without wrapping */
        if (capacity != 0 && (bytes > capacity || now > capacity - bytes))
            return -1;
        if (now > UINT64_MAX - bytes)
            return -1;
    } while (!atomic_compare_exchange_weak(live, &now, now + bytes));
    return 0;
}

static void
unclaim(_Atomic uint64_t *live, uint64_t bytes)
{
    uint64_t before = atomic_fetch_sub(live, bytes);
    MP_ASSERT(before >= bytes);
    (void)before;
}

void *
mp_host_alloc_capped(_Atomic uint64_t *live, uint64_t capacity, uint64_t bytes, size_t align)
{
    if (claim(live, capacity, bytes) < 0)
        return NULL;
    void *ptr = mp_host_alloc(bytes, align);
    if (ptr == NULL)
        unclaim(live, bytes);
    return ptr;
}

void
mp_host_free_capped(_Atomic uint64_t *live, void *ptr, uint64_t bytes)
{
    unclaim(live, bytes);
    mp_host_free(ptr);
}
