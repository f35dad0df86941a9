/* The disk tier under the host pool: host buffers written to private,
 * unnamed files and read back, on a small pool of worker threads.
 *
 * Files: each spilled buffer gets its own file in the tier's directory,
 * created unnamed (O_TMPFILE, else created under a random name and
 * unlinked at once), mode 0600, so nothing stays on disk once its file
 * descriptor is closed, whether by spill_slot_free(), spill_destroy() or
 * the death of the process. The directory must belong to this user and
 * be writable by no one else (spill_dir_open() refuses it otherwise); the
 * tier keeps it open and creates every file relative to that descriptor,
 * so replacing the directory by name afterwards changes nothing.
 *
 * Integrity: a write keeps a checksum of the buffer (spill_sum.c); a
 * read whose bytes do not match it fails with EBADMSG (the file was
 * changed since: through /proc/<pid>/fd by the same user, or by the disk),
 * so a caller never takes changed bytes for the span (the buffer then
 * holds the file's bytes: garbage to drop).
 *
 * I/O: plain pwrite/pread of the whole buffer, in pieces of at most
 * SPILL_CHUNK_BYTES. The part of a buffer aligned to SPILL_ALIGN (address
 * and length) goes through O_DIRECT where the filesystem takes it (no copy
 * through the page cache); the tail, and everything on a filesystem that
 * refuses O_DIRECT (EINVAL at open or at the first direct call), goes
 * through the page cache.
 *
 * Threads: spill_create() starts `workers` threads that run requests in
 * the order they were queued. Every function may be called from any
 * thread; one mutex in the tier guards its queue, its slots' states and
 * its statistics (the tier owns it). A caller holding a lock of its own,
 * such as the GIL, releases it around spill_wait(), spill_slot_free() of a
 * busy slot, and spill_destroy(): only they block. spill_submit_*(),
 * spill_done() and spill_get_stats() never wait on the disk.
 *
 * Fork: fork handlers (pthread_atfork, installed with the first tier)
 * take every tier's lock around fork(), so a child finds each tier in a
 * consistent state (a fork waits for a worker that made a file to make it
 * its slot's), and close the child's copies of the tiers' files, so a
 * child never keeps the parent's disk space.
 * In the child, which has none of a tier's threads, nothing touches the
 * parent's files: submissions are refused, spill_done() answers 1,
 * spill_wait() and spill_status() never block (a request unfinished at
 * the fork reports ECHILD), spill_slot_free() only frees the child's
 * memory, and spill_destroy() does nothing (the tier's memory stays for
 * the slots the child still holds). The child makes a tier of its own.
 *
 * Ownership: the caller owns a slot from spill_submit_write() until
 * spill_slot_free(); the buffer passed to a request stays the caller's and
 * must stay alive and unchanged (a write) or untouched (a read) until
 * spill_done() or spill_wait() saw the request finish. Units: bytes.
 *
 * Holds: a slot pointer is only good while its owner has not freed it. A
 * caller that reads a slot pointer under a lock of its own (the GIL) and
 * then waits on it with that lock released, while another thread that
 * owns the slot may free it meanwhile, takes a hold first (with its lock
 * held, so the slot is live): spill_slot_hold(), release the lock,
 * spill_wait(), spill_slot_unhold(). While held, the slot's memory (not
 * its file) outlives spill_slot_free(), which frees it from the tier's
 * lists at once; the last spill_slot_unhold() frees the memory. A hold
 * never blocks; spill_destroy() waits until every hold was let go, so a
 * holder must let go without waiting for anything but its own request
 * (a waiter's request always ends: the workers drain the queue). */
#ifndef MATEPOINT_SPILL_SPILL_H
#define MATEPOINT_SPILL_SPILL_H

#include <stddef.h>
#include <stdint.h>

#define SPILL_ALIGN 4096u
#define SPILL_CHUNK_BYTES (64u << 20)
#define SPILL_MAX_WORKERS 16

typedef struct spill_tier spill_tier;
typedef struct spill_slot spill_slot;

typedef struct {
    uint64_t bytes_on_disk;     /* bytes of slots written and not yet freed */
    uint64_t peak_bytes_on_disk;
    uint64_t slots;             /* live slots */
    uint64_t writes, reads;     /* requests finished without error */
    uint64_t bytes_written, bytes_read;
    uint64_t write_errors, read_errors;
    uint64_t waits;             /* spill_wait() calls that found the request unfinished */
    uint64_t direct_bytes;      /* bytes moved with O_DIRECT */
    int direct;                 /* 1 while O_DIRECT is used, 0 once the filesystem refused it */
} spill_stats;

/* Opens (creating it 0700 when missing) the directory `path` for a tier:
 * a descriptor, or -1 with a sentence saying why in `why` (it names the
 * path: missing and not creatable, not a directory, a symbolic link, owned
 * by another user, writable by group or others). */
int spill_dir_open(const char *path, char *why, size_t why_len);

/* A tier over `path` with `workers` threads (1 to SPILL_MAX_WORKERS);
 * NULL with `why` filled when the directory is refused or a thread or
 * memory could not be had. */
spill_tier *spill_create(const char *path, int workers, char *why, size_t why_len);
/* Waits for every queued request, stops the threads, waits until every
 * slot hold was let go, closes every slot's file and frees the tier; slots
 * still owned by a caller are freed too (their pointers dangle
 * afterwards). The caller must have made the tier unreachable first: no
 * call may start on it once spill_destroy() began. */
void spill_destroy(spill_tier *tier);

/* Queues writing `bytes` of `buffer` to a new file; the slot, or NULL
 * without memory or in a forked child. The file is made by the worker: failing to make it is
 * the request's error. */
spill_slot *spill_submit_write(spill_tier *tier, const void *buffer, uint64_t bytes);
/* Queues reading the slot's bytes back into `buffer` (at least as many
 * bytes as were written). 0, or -1 when the slot's write failed, a
 * request of it is still queued (the caller's bug; nothing is queued), or
 * in a forked child. */
int spill_submit_read(spill_tier *tier, spill_slot *slot, void *buffer);

/* 1 when the slot's last request finished, 0 while it is queued or runs. */
int spill_done(spill_tier *tier, spill_slot *slot);
/* Blocks until the slot's last request finished; returns its status: 0,
 * or the errno it failed with (ENOSPC, EIO, ...; EBADMSG: a read found
 * the file changed since its write). */
int spill_wait(spill_tier *tier, spill_slot *slot);
/* The status of a finished slot's last request (0 or an errno); -1 while
 * it runs. */
int spill_status(spill_tier *tier, spill_slot *slot);
uint64_t spill_slot_bytes(const spill_slot *slot);
/* A hold on a live slot, for a wait across a lock of the caller's (see
 * "Holds" above); let go with spill_slot_unhold(), any thread, no lock of
 * the caller's needed. Neither blocks. */
void spill_slot_hold(spill_tier *tier, spill_slot *slot);
void spill_slot_unhold(spill_tier *tier, spill_slot *slot);
/* Blocks until no request is queued or running (tests, teardown). */
void spill_wait_idle(spill_tier *tier);
/* Waits for the slot's request, closes its file and frees it. */
void spill_slot_free(spill_tier *tier, spill_slot *slot);

spill_stats spill_get_stats(spill_tier *tier);
/* 1 in a child forked from the process that made the tier. */
int spill_in_forked_child(const spill_tier *tier);
/* 1 when the slot's tier is a parent's (this is a forked child): its
 * bytes cannot be read back here. */
int spill_slot_forked(const spill_slot *slot);

/* Tests: the next `count` writes fail with errno `error` (ENOSPC, EIO)
 * before they touch the disk; count 0 clears it. */
void spill_inject_write_errors(spill_tier *tier, int error, int count);
/* Tests: 1 keeps the workers off the queue (requests wait, queued) until
 * 0; a stopping tier runs them all the same. */
void spill_pause(spill_tier *tier, int paused);
/* Tests and benchmarks: 0 turns O_DIRECT off for requests run from now on. */
void spill_set_direct(spill_tier *tier, int direct);

#endif
