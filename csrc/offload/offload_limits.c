/* The limits the options put on the host pool, and the one warning when a
 * span goes through pageable memory past them.
 *
 * Owns nothing: reads the engine's options and the pool's counters, and
 * sets the engine's warned-once flags. Floor `limits`: called by the
 * device, spill, save and engine files; calls nothing of csrc/offload.
 * GIL held. */
#include "offload_internal.h"

#include <string.h>

int
offload_tier_wanted(const offload_options *options)
{
    return options->host_limit_bytes != 0 && options->spill_dir[0] != '\0';
}

uint64_t
offload_pool_limit(const offload_engine *engine)
{
    uint64_t pool = engine->options.pool_limit_bytes;
    uint64_t host = offload_tier_wanted(&engine->options) ? engine->options.host_limit_bytes : 0;
    if (pool == 0 || host == 0)
        return pool + host;
    return pool < host ? pool : host;
}

/* The pool fell back to pageable memory for a span of `nbytes`: either a
 * limit left no room for it (pool_limit_bytes, or host_limit_bytes with a
 * disk tier that could not make room: the pool's limit is the smaller)
 * or pinning itself failed. The warning names which, and what to change. */
const char *
offload_limit_reached(offload_engine *engine, uint64_t nbytes)
{
    uint64_t limit = offload_pool_limit(engine);
    if (limit == 0)
        return NULL;
    uint64_t reserved = pool_get_stats(engine->pool).bytes_reserved;
    if (reserved + pool_class_size(nbytes) <= limit)
        return NULL;
    return limit == engine->options.pool_limit_bytes ? "pool_limit_bytes" : "host_limit_bytes";
}

void
offload_warn_fallback(offload_engine *engine, uint64_t nbytes, int reading)
{
    int *warned = reading ? &engine->warned_read_fallback : &engine->warned_fallback;
    if (*warned)
        return;
    *warned = 1;
    const char *option = offload_limit_reached(engine, nbytes);
    uint64_t limit = offload_pool_limit(engine);
    int at_limit = option != NULL;
    char cause[96];
    if (at_limit)
        snprintf(cause, sizeof cause, "pinned host memory is at %s (%llu bytes)", option,
                 (unsigned long long)limit);
    else
        snprintf(cause, sizeof cause,
                 "pinning host memory failed (the system refused more page-locked memory)");
    const char *advice = !at_limit ? ""
                         : strcmp(option, "pool_limit_bytes") == 0
                             ? "raise pool_limit_bytes, or set spill_dir and "
                               "host_limit_bytes to send older inputs to disk; "
                             : "raise host_limit_bytes: the disk tier in spill_dir could not "
                               "make room (an input larger than the limit, or writes that "
                               "failed: pool_stats()['spill_failures']); ";
    if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                         "matepoint: %s; %s pageable memory: each such copy waits "
                         "for the GPU to reach it (a host synchronization) and copies more "
                         "slowly; %spool_stats()['fallbacks'] counts them", cause,
                         reading ? "reading spilled inputs back through" : "offloading into",
                         advice) < 0)
        PyErr_WriteUnraisable(NULL);
}
