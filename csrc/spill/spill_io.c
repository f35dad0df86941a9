/* The tier's file I/O: whole buffers with pwrite/pread, O_DIRECT for the
 * aligned part where the filesystem takes it. Called by the workers with
 * no lock held. */
#define _GNU_SOURCE
#include "spill_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

/* Turns O_DIRECT on or off for `fd`: 0, or the errno (EINVAL where the
 * filesystem has no direct I/O). */
static int
set_direct(int fd, int on)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0)
        return errno;
    int wanted = on ? (flags | O_DIRECT) : (flags & ~O_DIRECT);
    if (wanted != flags && fcntl(fd, F_SETFL, wanted) != 0)
        return errno;
    return 0;
}

/* Moves [offset, offset + bytes) in pieces of SPILL_CHUNK_BYTES, resuming
 * after short transfers; a read that finds the end of the file early is
 * EIO (the file lost bytes: never hand back wrong data). */
static int
transfer(int fd, char *buffer, uint64_t offset, uint64_t bytes, int writing)
{
    while (bytes > 0) {
        size_t piece = bytes < SPILL_CHUNK_BYTES ? (size_t)bytes : SPILL_CHUNK_BYTES;
        ssize_t done = writing ? pwrite(fd, buffer, piece, (off_t)offset)
                               : pread(fd, buffer, piece, (off_t)offset);
        if (done < 0 && errno == EINTR)
            continue;
        if (done < 0)
            return errno;
        if (done == 0)
            return writing ? ENOSPC : EIO;
        buffer += done;
        offset += (uint64_t)done;
        bytes -= (uint64_t)done;
    }
    return 0;
}

/* The bytes of the buffer O_DIRECT may move: from its start (aligned),
 * a multiple of SPILL_ALIGN; 0 for an unaligned buffer. */
static uint64_t
direct_part(const void *buffer, uint64_t bytes)
{
    if ((uintptr_t)buffer % SPILL_ALIGN != 0)
        return 0;
    return bytes - bytes % SPILL_ALIGN;
}

/* The aligned part through O_DIRECT, then the rest through the page cache;
 * a filesystem that refuses direct I/O (EINVAL) gets all of it buffered,
 * and *direct goes to 0 for the callers to come. */
static int
move(int fd, char *buffer, uint64_t bytes, int *direct, uint64_t *direct_bytes, int writing)
{
    uint64_t head = *direct ? direct_part(buffer, bytes) : 0;
    *direct_bytes = 0;
    if (head > 0) {
        int error = set_direct(fd, 1);
        if (error == 0)
            error = transfer(fd, buffer, 0, head, writing);
        if (error == EINVAL) {
            *direct = 0;
            head = 0;
        } else if (error != 0) {
            set_direct(fd, 0);
            return error;
        } else {
            *direct_bytes = head;
        }
        int cleared = set_direct(fd, 0);
        if (cleared != 0)
            return cleared;
    }
    return transfer(fd, buffer + head, head, bytes - head, writing);
}

int
spill_io_write(int fd, const void *buffer, uint64_t bytes, int *direct, uint64_t *direct_bytes)
{
    /* reserve the blocks first: a full disk is then ENOSPC here, never a
     * failed write-back of the page-cached tail later */
    if (bytes > 0) {
        int error = posix_fallocate(fd, 0, (off_t)bytes);
        if (error != 0 && error != EOPNOTSUPP && error != EINVAL)
            return error;
    }
    return move(fd, (char *)buffer, bytes, direct, direct_bytes, 1);
}

int
spill_io_read(int fd, void *buffer, uint64_t bytes, int *direct, uint64_t *direct_bytes)
{
    return move(fd, buffer, bytes, direct, direct_bytes, 0);
}
