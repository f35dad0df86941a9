/* Aligned host memory, optionally counted against a capacity: the one
 * place the pool's backends, the allocator's host backend and the
 * simulated GPU get plain host memory from.
 *
 * Sizes are uint64_t: a request past PTRDIFF_MAX (no object can be that
 * large) fails without asking the C library. `align` is a power of two and
 * a multiple of sizeof(void *). Memory is freed with mp_host_free() (or
 * mp_host_free_capped() for counted memory). Thread-safe; the capacity
 * count is atomic and never passes the capacity, even transiently. */
#ifndef MATEPOINT_COMMON_HOST_MEMORY_H
#define MATEPOINT_COMMON_HOST_MEMORY_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* `bytes` of memory at an `align` boundary (0 bytes gives a distinct
 * 1-byte block); NULL without memory or past PTRDIFF_MAX. */
void *mp_host_alloc(uint64_t bytes, size_t align);
void mp_host_free(void *ptr);

/* As mp_host_alloc(), first adding `bytes` to *live; NULL, with *live as
 * it was, when that would pass `capacity` (0: no capacity) or the memory
 * cannot be had. */
void *mp_host_alloc_capped(_Atomic uint64_t *live, uint64_t capacity, uint64_t bytes,
                           size_t align);
/* Frees memory of mp_host_alloc_capped() and takes `bytes` off *live. */
void mp_host_free_capped(_Atomic uint64_t *live, void *ptr, uint64_t bytes);

#endif
