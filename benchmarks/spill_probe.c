/* The disk tier's throughput against the raw disk (issue 37): sequential
 * O_DIRECT pwrite/pread of `count` buffers of `mib` MiB in one file of
 * `dir` (a dd-like probe), then the same buffers through the tier
 * (csrc/spill: one unnamed file each, its worker threads). Same sizes,
 * same directory, same run. `make spill-probe DIR=... MIB=... COUNT=...`.
 * Prints MB/s (10^6 bytes per second) of each. */
#define _GNU_SOURCE
#include "spill/spill.h"
#include "common/host_memory.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double
now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* One pass of raw sequential I/O over `count` buffers: seconds, or -1. */
static double
raw_pass(const char *dir, unsigned char **buffers, int count, uint64_t bytes, int writing,
         int *fd)
{
    if (*fd < 0) {
        *fd = open(dir, O_TMPFILE | O_RDWR | O_DIRECT, 0600);
        if (*fd < 0) {
            fprintf(stderr, "raw probe: O_DIRECT O_TMPFILE in %s: %s\n", dir, strerror(errno));
            return -1;
        }
    }
    double start = now();
    for (int i = 0; i < count; i++) {
        uint64_t done = 0;
        while (done < bytes) {
            size_t piece = bytes - done < SPILL_CHUNK_BYTES ? bytes - done : SPILL_CHUNK_BYTES;
            off_t at = (off_t)((uint64_t)i * bytes + done);
            ssize_t n = writing ? pwrite(*fd, buffers[i] + done, piece, at)
                                : pread(*fd, buffers[i] + done, piece, at);
            if (n <= 0) {
                fprintf(stderr, "raw probe: %s\n", n < 0 ? strerror(errno) : "short transfer");
                return -1;
            }
            done += (uint64_t)n;
        }
    }
    return now() - start;
}

static double
tier_pass(spill_tier *tier, spill_slot **slots, unsigned char **buffers, int count,
          uint64_t bytes, int writing)
{
    double start = now();
    for (int i = 0; i < count; i++) {
        if (writing)
            slots[i] = spill_submit_write(tier, buffers[i], bytes);
        else if (spill_submit_read(tier, slots[i], buffers[i]) != 0)
            return -1;
    }
    for (int i = 0; i < count; i++) {
        if (spill_wait(tier, slots[i]) != 0)
            return -1;
    }
    return now() - start;
}

int
main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: spill_probe DIR MIB COUNT WORKERS\n");
        return 2;
    }
    const char *dir = argv[1];
    uint64_t bytes = strtoull(argv[2], NULL, 10) << 20;
    int count = atoi(argv[3]), workers = atoi(argv[4]);
    unsigned char **buffers = calloc((size_t)count, sizeof *buffers);
    spill_slot **slots = calloc((size_t)count, sizeof *slots);
    for (int i = 0; i < count; i++) {
        buffers[i] = mp_host_alloc(bytes, SPILL_ALIGN);
        memset(buffers[i], i + 1, bytes);
    }
    char why[512];
    spill_tier *tier = spill_create(dir, workers, why, sizeof why);
    if (tier == NULL) {
        fprintf(stderr, "%s\n", why);
        return 1;
    }
    int fd = -1;
    double total = (double)bytes * count / 1e6;
    double raw_w = raw_pass(dir, buffers, count, bytes, 1, &fd);
    double tier_w = tier_pass(tier, slots, buffers, count, bytes, 1);
    double raw_r = raw_pass(dir, buffers, count, bytes, 0, &fd);
    double tier_r = tier_pass(tier, slots, buffers, count, bytes, 0);
    spill_stats stats = spill_get_stats(tier);
    if (raw_w < 0 || tier_w < 0 || raw_r < 0 || tier_r < 0)
        return 1;
    printf("%d x %llu MiB, %d workers, direct %s: write raw %.0f MB/s tier %.0f MB/s (%.2f); "
           "read raw %.0f MB/s tier %.0f MB/s (%.2f)\n", count,
           (unsigned long long)(bytes >> 20), workers, stats.direct ? "yes" : "no",
           total / raw_w, total / tier_w, raw_w / tier_w, total / raw_r, total / tier_r,
           raw_r / tier_r);
    close(fd);
    spill_destroy(tier);
    for (int i = 0; i < count; i++)
        mp_host_free(buffers[i]);
    free(buffers);
    free(slots);
    return 0;
}
