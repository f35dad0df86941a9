/* The call sites where the offload engine orders work between streams.
 *
 * Every cudaStreamWaitEvent and record_stream the engine issues names its
 * site (offload_runtime.h passes it along): the real runtime ignores it;
 * the test build's simulated one counts each site's calls and drops a
 * chosen site's, so tests/test_waits_needed.py shows every site needed by
 * data, one site at a time. This table is the one list of sites: test
 * builds export it to Python (_C.OFFLOAD_SITES), so a site added here is
 * checked by that test the day it is added. Constant data only: contract
 * floor, included by every file that waits or records (through streams.h
 * and offload_runtime.h). */
#ifndef MATEPOINT_OFFLOAD_OFFLOAD_SITES_H
#define MATEPOINT_OFFLOAD_OFFLOAD_SITES_H

#define OFFLOAD_SITE_WAIT "cudaStreamWaitEvent"
#define OFFLOAD_SITE_RECORD "record_stream"

/* X(ID, name, call): one row per site.
 * - copy_out_after_producer: the copy-out stream waits for the producer's
 *   work before reading a source (offload_save.c: start_d2h)
 * - copy_in_after_compute: a prefetch's copy-in stream waits for the
 *   compute stream, whose allocator gave the destination (offload_restore.c:
 *   start_h2d)
 * - copy_in_after_copy_out: a copy back waits for the span's copy out
 *   still pending (start_h2d)
 * - copy_in_after_copy_in: a copy back on another stream than the span's
 *   previous one waits for it: the host buffer goes back once the new
 *   copy's event completes, so that event must cover both (start_h2d)
 * - reader_after_copy_in: the stream reading a restored span waits for its
 *   copy back (await_h2d)
 * - beaten_after_copy_in: a copy back another thread beat; its buffer goes
 *   back to the compute stream's allocator once that stream waited for it
 *   (drop_beaten)
 * - producer_after_copy_out: a forced retire of a source whose producer is
 *   current: the producer waits for the copy out (offload_window.c:
 *   order_producer_after_copy)
 * - source_on_producer: ... and the source is marked used by the producer,
 *   so its allocator reuses it past that wait
 * - source_on_copy_out: a forced retire with another stream current: the
 *   source is marked used by the copy-out stream, which reads it
 * - kept_on_copy_out: a source backward takes over in place while its copy
 *   out may still read it is marked used by the copy-out stream, so its
 *   memory outlives that copy whoever frees it (offload_window.c: sweep)
 * - fetched_on_copy_in: a prefetched buffer is marked used by the copy-in
 *   stream, which writes it (fetch_copy)
 * - fetched_on_reader: a prefetched buffer read on another stream than the
 *   one whose allocator gave it is marked used by the reader (await_h2d) */
#define OFFLOAD_SITES(X)                                                                  \
    X(COPY_OUT_AFTER_PRODUCER, "copy_out_after_producer", OFFLOAD_SITE_WAIT)              \
    X(COPY_IN_AFTER_COMPUTE, "copy_in_after_compute", OFFLOAD_SITE_WAIT)                  \
    X(COPY_IN_AFTER_COPY_OUT, "copy_in_after_copy_out", OFFLOAD_SITE_WAIT)                \
    X(COPY_IN_AFTER_COPY_IN, "copy_in_after_copy_in", OFFLOAD_SITE_WAIT)                  \
    X(READER_AFTER_COPY_IN, "reader_after_copy_in", OFFLOAD_SITE_WAIT)                    \
    X(BEATEN_AFTER_COPY_IN, "beaten_after_copy_in", OFFLOAD_SITE_WAIT)                    \
    X(PRODUCER_AFTER_COPY_OUT, "producer_after_copy_out", OFFLOAD_SITE_WAIT)              \
    X(SOURCE_ON_PRODUCER, "source_on_producer", OFFLOAD_SITE_RECORD)                      \
    X(SOURCE_ON_COPY_OUT, "source_on_copy_out", OFFLOAD_SITE_RECORD)                      \
    X(KEPT_ON_COPY_OUT, "kept_on_copy_out", OFFLOAD_SITE_RECORD)                          \
    X(FETCHED_ON_COPY_IN, "fetched_on_copy_in", OFFLOAD_SITE_RECORD)                      \
    X(FETCHED_ON_READER, "fetched_on_reader", OFFLOAD_SITE_RECORD)

typedef enum {
#define OFFLOAD_SITE_ENUM(id, name, call) OFFLOAD_SITE_##id,
    OFFLOAD_SITES(OFFLOAD_SITE_ENUM)
#undef OFFLOAD_SITE_ENUM
    OFFLOAD_SITE_COUNT
} offload_site;

/* The site's name and the call it makes (OFFLOAD_SITE_WAIT or
 * OFFLOAD_SITE_RECORD); NULL past the end. */
static inline const char *
offload_site_name(int site)
{
    static const char *const names[] = {
#define OFFLOAD_SITE_NAME(id, name, call) name,
        OFFLOAD_SITES(OFFLOAD_SITE_NAME)
#undef OFFLOAD_SITE_NAME
    };
    return site >= 0 && site < OFFLOAD_SITE_COUNT ? names[site] : NULL;
}

static inline const char *
offload_site_call(int site)
{
    static const char *const calls[] = {
#define OFFLOAD_SITE_CALL(id, name, call) call,
        OFFLOAD_SITES(OFFLOAD_SITE_CALL)
#undef OFFLOAD_SITE_CALL
    };
    return site >= 0 && site < OFFLOAD_SITE_COUNT ? calls[site] : NULL;
}

#endif
