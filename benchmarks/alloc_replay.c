/* Replays an allocation trace through the caching allocator on its host
 * backend and prints the time per malloc+free pair (benchmarks/alloc_bench.py
 * compiles it against csrc/alloc and runs it; no GPU involved).
 *
 * Trace (text, one operation a line):
 *   a ID BYTES STREAM   malloc on stream STREAM (0..7), kept as ID
 *   f ID                free of ID (one unit of work queued on its stream)
 *   r ID STREAM         record_stream of ID on STREAM
 *   c                   every stream's queued work completes
 * Usage: alloc_replay TRACE REPEATS. Prints one JSON object. */
#define _GNU_SOURCE
#include "alloc/alloc.h"
#include "alloc/alloc_host.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define STREAMS 8

typedef struct {
    char kind;
    uint32_t id, stream;
    uint64_t bytes;
} op;

static op *
read_trace(const char *path, size_t *count, uint32_t *ids)
{
    FILE *file = fopen(path, "r");
    size_t cap = 1 << 16, n = 0;
    op *ops = malloc(cap * sizeof(op));
    char line[128];
    if (file == NULL || ops == NULL)
        return NULL;
    *ids = 0;
    while (fgets(line, sizeof(line), file) != NULL) {
        op o = {.kind = line[0]};
        unsigned long long bytes = 0;
        if ((o.kind == 'a' && sscanf(line + 1, "%u %llu %u", &o.id, &bytes, &o.stream) != 3) ||
            (o.kind == 'f' && sscanf(line + 1, "%u", &o.id) != 1) ||
            (o.kind == 'r' && sscanf(line + 1, "%u %u", &o.id, &o.stream) != 2) ||
            o.stream >= STREAMS)
            return NULL;
        o.bytes = bytes;
        if (o.id + 1 > *ids)
            *ids = o.id + 1;
        if (n == cap && (ops = realloc(ops, (cap *= 2) * sizeof(op))) == NULL)
            return NULL;
        ops[n++] = o;
    }
    fclose(file);
    *count = n;
    return ops;
}

static double
now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

int
main(int argc, char **argv)
{
    size_t count = 0;
    uint32_t ids = 0;
    op *ops = argc == 3 ? read_trace(argv[1], &count, &ids) : NULL;
    int repeats = argc == 3 ? atoi(argv[2]) : 0;
    if (ops == NULL || repeats <= 0) {
        fprintf(stderr, "usage: alloc_replay TRACE REPEATS (a readable, well-formed trace)\n");
        return 2;
    }
    alloc_host_ctx ctx;
    alloc_host_init(&ctx, 0);
    allocator *a = alloc_create(alloc_host_backend(&ctx), 1);
    static alloc_host_stream streams[STREAMS];
    void **live = calloc(ids, sizeof(void *));
    uint32_t *stream_of = calloc(ids, sizeof(uint32_t));
    double best = 0, total = 0;
    uint64_t mallocs = 0;
    for (int r = 0; r < repeats + 1; r++) {     /* the first pass fills the cache */
        double start = now_ns();
        mallocs = 0;
        for (size_t i = 0; i < count; i++) {
            const op *o = &ops[i];
            switch (o->kind) {
            case 'a':
                live[o->id] = alloc_malloc(a, o->bytes, 0, &streams[o->stream], 0);
                stream_of[o->id] = o->stream;
                mallocs++;
                if (live[o->id] == NULL)
                    return fprintf(stderr, "alloc_replay: out of memory\n"), 1;
                break;
            case 'f':
                alloc_host_submit(&streams[stream_of[o->id]]);
                alloc_free(a, live[o->id], 0);
                break;
            case 'r':
                alloc_record_stream(a, live[o->id], &streams[o->stream]);
                break;
            default:
                for (int s = 0; s < STREAMS; s++)
                    alloc_host_complete(&streams[s]);
            }
        }
        double elapsed = now_ns() - start;
        if (r > 0) {
            best = r == 1 || elapsed < best ? elapsed : best;
            total += elapsed;
        }
    }
    alloc_stats stats = alloc_get_stats(a, 0);
    printf("{\"pairs\": %llu, \"best_pair_ns\": %.1f, \"mean_pair_ns\": %.1f, "
           "\"segments\": %llu, \"peak_reserved_bytes\": %llu, \"peak_allocated_bytes\": %llu}\n",
           (unsigned long long)mallocs, best / (double)mallocs,
           total / repeats / (double)mallocs, (unsigned long long)stats.device_allocs,
           (unsigned long long)stats.peak_reserved_bytes,
           (unsigned long long)stats.peak_allocated_bytes);
    free(live);
    free(stream_of);
    free(ops);
    alloc_destroy(a);
    return 0;
}
