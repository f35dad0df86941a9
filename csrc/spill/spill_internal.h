/* The disk tier's private parts, shared by the files of csrc/spill: the
 * slot struct (guarded by its tier's mutex, spill.c) and the plain file
 * calls the workers make without any lock (spill_io.c, spill_dir.c). */
#ifndef MATEPOINT_SPILL_SPILL_INTERNAL_H
#define MATEPOINT_SPILL_SPILL_INTERNAL_H

#include "spill.h"

/* Where a slot's last request is: it moves IDLE -> QUEUED -> RUNNING ->
 * IDLE, and only a worker moves it out of QUEUED. */
typedef enum {
    SLOT_IDLE,
    SLOT_QUEUED,
    SLOT_RUNNING,
} slot_phase;

typedef enum {
    SPILL_WRITE,
    SPILL_READ,
} spill_op;

/* Every field is guarded by the tier's mutex, but `fd` and `sum`, which
 * only the worker running the slot's request uses (phase RUNNING), or the
 * owner once the slot is IDLE. */
struct spill_slot {
    spill_tier *tier;           /* the tier that made it: set once, read-only */
    int fd;                     /* -1 until a write made the file (or a fork closed it) */
    uint64_t bytes;
    slot_phase phase;
    spill_op op;
    int status;                 /* of the last finished request: 0 or an errno */
    int written;                /* a write succeeded: the file holds the bytes */
    uint64_t sum;               /* spill_checksum() of the bytes written */
    int holds;                  /* spill_slot_hold()s not yet let go */
    int dropped;                /* freed by its owner while held: the last hold frees it */
    void *buffer;               /* the request's buffer (const for a write) */
    spill_slot *next_queued;    /* the tier's queue, oldest first */
    spill_slot *prev_live, *next_live;  /* every slot of the tier */
};

/* The checksum of a buffer written, checked when it is read back
 * (spill_sum.c). No lock: pure. */
uint64_t spill_checksum(const void *buffer, uint64_t bytes);
/* The plain C checksum spill_checksum() falls back to where the CPU has no
 * CRC32C instruction; the unit tests call it on CPUs that have one. */
uint64_t spill_checksum_portable(const void *buffer, uint64_t bytes);

/* A new unnamed file in `dirfd`, mode 0600: its descriptor, or -errno. */
int spill_file_make(int dirfd);
/* Its fallback where the filesystem refuses O_TMPFILE: a file made under
 * a random name and unlinked at once; the unit tests call it directly. */
int spill_file_make_named(int dirfd);

/* Writes/reads `bytes` at offset 0 of `fd` from/into `buffer`, the part
 * aligned to SPILL_ALIGN through O_DIRECT when *direct (set to 0 when the
 * filesystem refuses it). 0, or the errno of the failed call. No lock
 * held: they block on the disk. *direct_bytes gets the bytes moved so. */
int spill_io_write(int fd, const void *buffer, uint64_t bytes, int *direct,
                   uint64_t *direct_bytes);
int spill_io_read(int fd, void *buffer, uint64_t bytes, int *direct, uint64_t *direct_bytes);

#endif
