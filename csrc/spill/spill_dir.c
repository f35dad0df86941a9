/* The tier's directory and its files: a private directory checked as the
 * OOM unit's cache folder is (matepoint/_oom.py), and unnamed files in it. */
#define _GNU_SOURCE
#include "spill_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define DIR_FLAGS (O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)

/* Opens `path`, creating it 0700 when missing: -1 with why filled. */
static int
open_or_create(const char *path, char *why, size_t why_len)
{
    int fd = open(path, DIR_FLAGS);
    if (fd >= 0 || errno != ENOENT)
        goto opened;
    if (mkdir(path, 0700) != 0 && errno != EEXIST) {
        snprintf(why, why_len, "the spill directory %s cannot be created: %s", path,
                 strerror(errno));
        return -1;
    }
    fd = open(path, DIR_FLAGS);
opened:
    if (fd < 0) {
        /* O_NOFOLLOW|O_DIRECTORY refuses a link with ELOOP or ENOTDIR */
        const char *what = strerror(errno);
        struct stat info;
        if ((errno == ELOOP || errno == ENOTDIR) && lstat(path, &info) == 0)
            what = S_ISLNK(info.st_mode) ? "is a symbolic link" : "is not a directory";
        snprintf(why, why_len, "the spill directory %s cannot be used: %s", path, what);
    }
    return fd;
}

int
spill_dir_open(const char *path, char *why, size_t why_len)
{
    if (path == NULL || path[0] == '\0') {
        snprintf(why, why_len, "the spill directory is empty: name a directory");
        return -1;
    }
    int fd = open_or_create(path, why, why_len);
    if (fd < 0)
        return -1;
    struct stat info;
    if (fstat(fd, &info) != 0) {
        snprintf(why, why_len, "the spill directory %s cannot be read: %s", path,
                 strerror(errno));
        goto refused;
    }
    /* checked on the open descriptor, which every file is made through,
     * so the directory cannot be swapped between check and use */
    if (info.st_uid != geteuid()) {
        snprintf(why, why_len,
                 "the spill directory %s belongs to uid %lu, not this user (%lu): "
                 "use a directory of your own", path, (unsigned long)info.st_uid,
                 (unsigned long)geteuid());
        goto refused;
    }
    if (info.st_mode & (S_IWGRP | S_IWOTH)) {
        snprintf(why, why_len,
                 "the spill directory %s can be written by others (mode %o): "
                 "chmod 700 it or use another", path, (unsigned)(info.st_mode & 07777));
        goto refused;
    }
    return fd;
refused:
    close(fd);
    return -1;
}

int
spill_file_make_named(int dirfd)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    for (int attempt = 0; attempt < 16; attempt++) {
        char name[64];
        snprintf(name, sizeof name, ".matepoint-spill-%ld-%lx-%d", (long)getpid(),
                 (unsigned long)(now.tv_nsec ^ ((unsigned long)now.tv_sec << 20)), attempt);
        int fd = openat(dirfd, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0 && errno == EEXIST)
            continue;
        if (fd < 0)
            return -errno;
        if (unlinkat(dirfd, name, 0) != 0) {
            int error = errno;
            close(fd);
            return -error;
        }
        return fd;
    }
    return -EEXIST;
}

int
spill_file_make(int dirfd)
{
    int fd = openat(dirfd, ".", O_TMPFILE | O_RDWR | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0)
        return fd;
    /* filesystems without O_TMPFILE say EOPNOTSUPP or EISDIR */
    if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL)
        return -errno;
    return spill_file_make_named(dirfd);
}
