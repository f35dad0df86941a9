#define _GNU_SOURCE /* mkdtemp, rand_r, unshare */
/* Unit tests of the disk tier (csrc/spill): private directories, unnamed
 * files, data that comes back bit for bit, errors as statuses. */
#include "spill/spill.h"
#include "spill/spill_internal.h"
#include "common/host_memory.h"
#include "check.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>

static char root[] = "/tmp/matepoint-spill-test-XXXXXX";

/* Entries of `path` other than . and .. */
static int
entries(const char *path)
{
    DIR *dir = opendir(path);
    if (dir == NULL)
        return -1;
    int count = 0;
    for (struct dirent *e; (e = readdir(dir)) != NULL;)
        count += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(dir);
    return count;
}

static int
open_fds(void)
{
    return entries("/proc/self/fd");
}

static void
fill(unsigned char *buffer, uint64_t bytes, unsigned seed)
{
    for (uint64_t i = 0; i < bytes; i++)
        buffer[i] = (unsigned char)(rand_r(&seed) >> 3);
}

static void
test_directory_checks(void)
{
    char path[256], why[512];
    snprintf(path, sizeof path, "%s/made", root);
    int fd = spill_dir_open(path, why, sizeof why);
    CHECK(fd >= 0);
    struct stat info;
    CHECK(stat(path, &info) == 0 && (info.st_mode & 0777) == 0700);
    close(fd);

    CHECK(chmod(path, 0770) == 0);
    CHECK(spill_dir_open(path, why, sizeof why) < 0);
    CHECK(strstr(why, "can be written by others") != NULL && strstr(why, path) != NULL);
    CHECK(chmod(path, 0703) == 0);
    CHECK(spill_dir_open(path, why, sizeof why) < 0);
    CHECK(chmod(path, 0700) == 0);
    if (geteuid() == 0) {   /* only root can give a directory away */
        CHECK(chown(path, 4242, 4242) == 0);
        CHECK(spill_dir_open(path, why, sizeof why) < 0);
        CHECK(strstr(why, "belongs to uid 4242") != NULL);
        CHECK(chown(path, 0, 0) == 0);
    }
    char link[300];
    snprintf(link, sizeof link, "%s/link", root);
    CHECK(symlink(path, link) == 0);
    CHECK(spill_dir_open(link, why, sizeof why) < 0);
    CHECK(strstr(why, "is a symbolic link") != NULL);   /* not strerror(ELOOP)'s words */
    unlink(link);
    char file[300];
    snprintf(file, sizeof file, "%s/file", root);
    fd = open(file, O_CREAT | O_WRONLY, 0600);
    close(fd);
    CHECK(spill_dir_open(file, why, sizeof why) < 0);
    CHECK(strstr(why, "is not a directory") != NULL);
    unlink(file);
    CHECK(spill_dir_open("", why, sizeof why) < 0);
    CHECK(spill_create(path, 0, why, sizeof why) == NULL);
    CHECK(spill_create(path, SPILL_MAX_WORKERS + 1, why, sizeof why) == NULL);
    CHECK(rmdir(path) == 0);
}

/* The files of a tier: unnamed, 0600, read and written like any; where
 * the filesystem refuses O_TMPFILE (procfs) the fallback makes a named one
 * and unlinks it, and its own error is the one reported. */
static void
test_files_are_unnamed(void)
{
    int dirfd = open(root, O_RDONLY | O_DIRECTORY);
    for (int named = 0; named < 2; named++) {
        int fd = named ? spill_file_make_named(dirfd) : spill_file_make(dirfd);
        CHECK(fd >= 0 && entries(root) == 0);
        struct stat info;
        CHECK(fstat(fd, &info) == 0 && S_ISREG(info.st_mode) && (info.st_mode & 0777) == 0600);
        char back[5] = {0};
        CHECK(pwrite(fd, "span", 4, 0) == 4 && pread(fd, back, 4, 0) == 4);
        CHECK(strcmp(back, "span") == 0);
        close(fd);
    }
    close(dirfd);
    int proc = open("/proc", O_RDONLY | O_DIRECTORY);
    if (proc >= 0) {
        CHECK(spill_file_make(proc) == -ENOENT);     /* the named file's error, not O_TMPFILE's */
        close(proc);
    }
}

/* A checksum tells a buffer from the same buffer with any one byte
 * changed (in each lane, block and third of the bulk, and in the tail) or
 * cut one byte short, and gives equal buffers equal sums; both the one
 * this CPU uses and the portable one, whichever that is. */
static void
checksum_notices_changes(uint64_t (*sum)(const void *, uint64_t), const char *name)
{
    enum { BYTES = 1000 };      /* 31 blocks of 32 bytes, a tail of 8; thirds of 328 */
    unsigned char buffer[BYTES];
    fill(buffer, BYTES, 17);
    uint64_t original = sum(buffer, BYTES);
    int missed = 0;
    for (uint64_t at = 0; at < BYTES; at++) {
        buffer[at] ^= 0x40;
        missed += sum(buffer, BYTES) == original;
        buffer[at] ^= 0x40;
    }
    CHECK(missed == 0);
    CHECK(sum(buffer, BYTES) == original);
    CHECK(sum(buffer, BYTES - 1) != original);
    unsigned char zeros[64] = {0};
    CHECK(sum(zeros, 64) != sum(zeros, 63));   /* zeros cut short: the length counts */
    if (missed != 0)
        printf("spill checksum %s missed %d changed bytes\n", name, missed);
}

static void
test_checksums_notice_every_changed_byte(void)
{
    checksum_notices_changes(spill_checksum, "in use");
    checksum_notices_changes(spill_checksum_portable, "portable");
}

/* Whether the filesystem of `folder` takes an aligned O_DIRECT write,
 * asked apart from the tier: 1 or 0. */
static int
takes_direct_io(const char *folder)
{
    char path[300];
    snprintf(path, sizeof path, "%s/direct-probe", folder);
    int fd = open(path, O_CREAT | O_RDWR | O_DIRECT, 0600);
    unsigned char *block = mp_host_alloc(SPILL_ALIGN, SPILL_ALIGN);
    if (block != NULL)
        memset(block, 0, SPILL_ALIGN);   /* what is written is defined (valgrind) */
    int taken = fd >= 0 && block != NULL && pwrite(fd, block, SPILL_ALIGN, 0) == SPILL_ALIGN;
    if (fd >= 0)
        close(fd);
    unlink(path);
    mp_host_free(block);
    return taken;
}

/* Buffers of many sizes and alignments, several in flight, come back bit
 * for bit; no file is visible in the directory and none outlives its slot. */
static void
round_trip(int direct)
{
    char why[512];
    int fds_before = open_fds();
    spill_tier *tier = spill_create(root, 3, why, sizeof why);
    CHECK(tier != NULL);
    if (tier == NULL)
        return;
    spill_set_direct(tier, direct);
    enum { N = 12 };
    const uint64_t sizes[N] = {0, 1, 4095, 4096, 4097, 65536, 1 << 20, (1 << 20) + 17,
                               3 << 20, (8 << 20) + 4096, (SPILL_CHUNK_BYTES) + 12288 + 5, 512};
    unsigned char *source[N], *back[N];
    spill_slot *slots[N];
    uint64_t total = 0;
    for (int i = 0; i < N; i++) {
        /* odd slots start one byte past an aligned address */
        source[i] = mp_host_alloc(sizes[i] + 1, SPILL_ALIGN);
        back[i] = mp_host_alloc(sizes[i] + 1, SPILL_ALIGN);
        fill(source[i] + (i & 1), sizes[i], (unsigned)i + 1);
        slots[i] = spill_submit_write(tier, source[i] + (i & 1), sizes[i]);
        CHECK(slots[i] != NULL);
        total += sizes[i];
    }
    for (int i = 0; i < N; i++) {
        CHECK(spill_wait(tier, slots[i]) == 0);
        CHECK(spill_done(tier, slots[i]) && spill_status(tier, slots[i]) == 0);
        CHECK(spill_slot_bytes(slots[i]) == sizes[i]);
    }
    CHECK(entries(root) == 0);
    spill_stats stats = spill_get_stats(tier);
    CHECK(stats.writes == N && stats.bytes_written == total && stats.bytes_on_disk == total);
    CHECK(stats.slots == N && stats.write_errors == 0);
    for (int i = 0; i < N; i++) {
        memset(back[i], 0xAB, sizes[i] + 1);
        CHECK(spill_submit_read(tier, slots[i], back[i] + (i & 1)) == 0);
    }
    for (int i = 0; i < N; i++) {
        CHECK(spill_wait(tier, slots[i]) == 0);
        CHECK(memcmp(back[i] + (i & 1), source[i] + (i & 1), sizes[i]) == 0);
        spill_slot_free(tier, slots[i]);
        mp_host_free(source[i]);
        mp_host_free(back[i]);
    }
    stats = spill_get_stats(tier);
    CHECK(stats.reads == N && stats.bytes_read == total);
    CHECK(stats.bytes_on_disk == 0 && stats.slots == 0 && stats.peak_bytes_on_disk == total);
    if (!direct)
        CHECK(stats.direct_bytes == 0);
    else    /* O_DIRECT is in use exactly where the filesystem takes it */
        CHECK(stats.direct == takes_direct_io(root));
    if (direct && stats.direct)     /* and then the aligned parts used it */
        CHECK(stats.direct_bytes > 2 * (uint64_t)SPILL_CHUNK_BYTES);
    printf("spill round trip (direct %d): filesystem direct I/O %s, %llu bytes direct\n",
           direct, stats.direct ? "yes" : "no", (unsigned long long)stats.direct_bytes);
    spill_destroy(tier);
    CHECK(open_fds() == fds_before);
}

static void
test_round_trip(void)
{
    round_trip(1);
    round_trip(0);
}

/* A failed write is a status, not lost data: the slot cannot be read, the
 * tier goes on, and nothing counts as on disk. */
static void
test_injected_errors(void)
{
    char why[512];
    spill_tier *tier = spill_create(root, 1, why, sizeof why);
    unsigned char *buffer = mp_host_alloc(1 << 20, SPILL_ALIGN);
    fill(buffer, 1 << 20, 7);
    spill_inject_write_errors(tier, ENOSPC, 1);
    spill_slot *full = spill_submit_write(tier, buffer, 1 << 20);
    CHECK(spill_wait(tier, full) == ENOSPC);
    CHECK(spill_submit_read(tier, full, buffer) == -1);
    spill_inject_write_errors(tier, EIO, 1);
    spill_slot *broken = spill_submit_write(tier, buffer, 1 << 20);
    CHECK(spill_wait(tier, broken) == EIO);
    spill_slot *fine = spill_submit_write(tier, buffer, 1 << 20);
    CHECK(spill_wait(tier, fine) == 0);
    spill_stats stats = spill_get_stats(tier);
    CHECK(stats.write_errors == 2 && stats.writes == 1 && stats.bytes_on_disk == 1 << 20);
    CHECK(stats.slots == 3);
    spill_slot_free(tier, full);
    spill_slot_free(tier, broken);
    spill_slot_free(tier, fine);
    CHECK(spill_get_stats(tier).bytes_on_disk == 0);
    mp_host_free(buffer);
    spill_destroy(tier);
}

/* Destroying a tier with requests queued and slots still owned waits for
 * the requests and frees everything (ASan and valgrind see no leak). */
static void
test_destroy_with_live_slots(void)
{
    char why[512];
    int fds_before = open_fds();
    spill_tier *tier = spill_create(root, 2, why, sizeof why);
    unsigned char *buffer = mp_host_alloc(4 << 20, SPILL_ALIGN);
    fill(buffer, 4 << 20, 3);
    for (int i = 0; i < 8; i++)
        CHECK(spill_submit_write(tier, buffer, 4 << 20) != NULL);
    spill_destroy(tier);
    mp_host_free(buffer);
    CHECK(open_fds() == fds_before);
}

/* Unpauses `arg`'s tier once the main thread is waiting for it to go idle. */
static void *
unpause_later(void *arg)
{
    usleep(50 * 1000);
    spill_pause(arg, 0);
    return NULL;
}

/* While a request is queued its slot reports no status (-1) and is not
 * done; spill_wait_idle() returns only once every request ran (here: once
 * another thread let the paused workers go). */
static void
test_idle_means_every_request_ran(void)
{
    char why[512];
    spill_tier *tier = spill_create(root, 2, why, sizeof why);
    unsigned char *buffer = mp_host_alloc(1 << 20, SPILL_ALIGN);
    fill(buffer, 1 << 20, 19);
    spill_pause(tier, 1);
    spill_slot *slots[3];
    for (int i = 0; i < 3; i++)
        slots[i] = spill_submit_write(tier, buffer, 1 << 20);
    CHECK(spill_status(tier, slots[0]) == -1 && !spill_done(tier, slots[0]));
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, unpause_later, tier) == 0);
    spill_wait_idle(tier);
    for (int i = 0; i < 3; i++)
        CHECK(spill_done(tier, slots[i]) && spill_status(tier, slots[i]) == 0);
    CHECK(spill_get_stats(tier).writes == 3);
    /* a tier left to itself uses O_DIRECT where the filesystem takes it */
    CHECK(spill_get_stats(tier).direct == takes_direct_io(root));
    CHECK(pthread_join(thread, NULL) == 0);
    spill_destroy(tier);
    mp_host_free(buffer);
}

/* A slot its owner frees while another thread holds it: it leaves the
 * tier's counts and its file closes at once; its memory goes with the
 * last hold (ASan's leak check sees it otherwise), and the tier can be
 * destroyed after. */
static void
test_a_slot_freed_while_held_goes_with_its_last_hold(void)
{
    char why[512];
    int fds_before = open_fds();
    spill_tier *tier = spill_create(root, 1, why, sizeof why);
    unsigned char *buffer = mp_host_alloc(1 << 16, SPILL_ALIGN);
    fill(buffer, 1 << 16, 13);
    spill_slot *slot = spill_submit_write(tier, buffer, 1 << 16);
    spill_wait_idle(tier);
    uint64_t waits = spill_get_stats(tier).waits;
    CHECK(spill_wait(tier, slot) == 0 && spill_get_stats(tier).waits == waits);  /* finished */
    spill_slot_hold(tier, slot);
    spill_slot_hold(tier, slot);
    spill_slot_free(tier, slot);
    spill_stats stats = spill_get_stats(tier);
    CHECK(stats.slots == 0 && stats.bytes_on_disk == 0);
    CHECK(open_fds() == fds_before + 1);            /* the tier's directory alone */
    spill_slot_unhold(tier, slot);
    spill_slot_unhold(tier, slot);                  /* the last: frees the slot */
    spill_destroy(tier);
    CHECK(open_fds() == fds_before);
    mp_host_free(buffer);
}

/* A slot held on another thread (spill.h, "Holds": the engine's waiter
 * holds its slot across the GIL, and set_options(spill_dir=...) may
 * destroy the tier meanwhile): spill_destroy() returns only once the
 * hold was let go. The holder's request is paused, so it is still waiting
 * when the destroy begins; it lingers after its request ran, so a destroy
 * that did not wait has returned (and freed the tier under the holder:
 * ASan reports the use after free) before the holder lets go. */
typedef struct {
    spill_tier *tier;
    spill_slot *slot;
    atomic_int held;                /* the hold is taken */
    atomic_int destroyed;           /* spill_destroy() returned */
    int destroyed_while_held;       /* ... before the holder let go */
    uint64_t waits;                 /* the tier's count of waits that blocked */
} holder;

static void *
hold_across_destroy(void *arg)
{
    holder *h = arg;
    spill_slot_hold(h->tier, h->slot);
    atomic_store(&h->held, 1);
    CHECK(spill_wait(h->tier, h->slot) == 0);   /* ends once the destroy runs the queue */
    h->waits = spill_get_stats(h->tier).waits;
    usleep(50 * 1000);
    h->destroyed_while_held = atomic_load(&h->destroyed);
    spill_slot_unhold(h->tier, h->slot);
    return NULL;
}

static void
test_destroy_waits_for_a_hold_on_another_thread(void)
{
    char why[512];
    holder h = {.tier = spill_create(root, 1, why, sizeof why)};
    unsigned char *buffer = mp_host_alloc(1 << 20, SPILL_ALIGN);
    fill(buffer, 1 << 20, 11);
    spill_pause(h.tier, 1);
    h.slot = spill_submit_write(h.tier, buffer, 1 << 20);
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, hold_across_destroy, &h) == 0);
    while (!atomic_load(&h.held))
        sched_yield();
    CHECK(!spill_done(h.tier, h.slot));         /* the premise: held while queued */
    spill_destroy(h.tier);
    atomic_store(&h.destroyed, 1);
    CHECK(pthread_join(thread, NULL) == 0);
    CHECK(!h.destroyed_while_held);
    CHECK(h.waits == 1);                        /* the holder's wait found it unfinished */
    mp_host_free(buffer);
}

/* A forked child has none of the tier's threads: it submits nothing and
 * its spill_destroy() leaves the parent's tier alone (no join of threads
 * it does not have, no lock a parent thread may have held). */
static void
test_forked_child_leaves_the_tier_alone(void)
{
    char why[512];
    spill_tier *tier = spill_create(root, 2, why, sizeof why);
    unsigned char *buffer = mp_host_alloc(1 << 20, SPILL_ALIGN);
    fill(buffer, 1 << 20, 9);
    spill_slot *slot = spill_submit_write(tier, buffer, 1 << 20);
    CHECK(spill_wait(tier, slot) == 0);
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        int ok = spill_in_forked_child(tier) && spill_submit_write(tier, buffer, 16) == NULL &&
                 spill_submit_read(tier, slot, buffer) == -1;
        spill_destroy(tier);
        _exit(ok ? 0 : 1);
    }
    int status = -1;
    CHECK(child > 0 && waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(!spill_in_forked_child(tier));
    CHECK(spill_submit_read(tier, slot, buffer) == 0 && spill_wait(tier, slot) == 0);
    spill_destroy(tier);
    mp_host_free(buffer);
}

/* Files of the tier's directory the process holds open (unnamed files
 * read "<root>/#123 (deleted)"; the directory itself is `root`). */
static int
open_files_under(const char *dir)
{
    DIR *fds = opendir("/proc/self/fd");
    int count = 0;
    size_t length = strlen(dir);
    for (struct dirent *e; fds != NULL && (e = readdir(fds)) != NULL;) {
        char path[300], link[600];
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(path, link, sizeof link - 1);
        if (n <= 0)
            continue;
        link[n] = '\0';
        count += strncmp(link, dir, length) == 0 && (link[length] == '/' || link[length] == '\0');
    }
    if (fds != NULL)
        closedir(fds);
    return count;
}

/* Requests still queued or running at the fork: the child, which has no
 * worker, never waits for them (ECHILD), frees its slots without touching
 * the parent's files, and holds none of them open (the fork handlers
 * closed its copies); the parent's requests all finish, bit for bit. */
static void
test_forked_child_never_waits_for_the_parents_requests(void)
{
    enum { SLOTS = 32, BYTES = 1 << 20 };
    char why[512];
    spill_tier *tier = spill_create(root, 2, why, sizeof why);
    unsigned char *buffer = mp_host_alloc(BYTES, SPILL_ALIGN);
    unsigned char *back = mp_host_alloc(BYTES, SPILL_ALIGN);
    fill(buffer, BYTES, 11);
    spill_slot *slots[SLOTS];
    for (int i = 0; i < SLOTS; i++)
        slots[i] = spill_submit_write(tier, buffer, BYTES);
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        alarm(20);              /* a wait that blocks fails the test, not hangs it */
        int ok = open_files_under(root) == 0, unfinished = 0;
        for (int i = 0; i < SLOTS; i++) {
            int status = spill_wait(tier, slots[i]);
            ok &= spill_slot_forked(slots[i]) && spill_done(tier, slots[i]) == 1 &&
                  (status == 0 || status == ECHILD) && spill_status(tier, slots[i]) == status;
            unfinished += status == ECHILD;
            spill_slot_free(tier, slots[i]);
        }
        spill_destroy(tier);
        mp_host_free(buffer);
        mp_host_free(back);
        _exit(ok ? (unfinished > 0 ? 0 : 2) : 1);
    }
    int status = -1;
    CHECK(child > 0 && waitpid(child, &status, 0) == child);
    /* 2: every write had finished at the fork (a machine far faster than
     * this one): the child's answers were still right */
    CHECK(WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 2));
    for (int i = 0; i < SLOTS; i++) {
        CHECK(!spill_slot_forked(slots[i]) && spill_wait(tier, slots[i]) == 0);
        memset(back, 0, BYTES);
        CHECK(spill_submit_read(tier, slots[i], back) == 0 && spill_wait(tier, slots[i]) == 0);
        CHECK(memcmp(back, buffer, BYTES) == 0);
    }
    spill_destroy(tier);
    mp_host_free(buffer);
    mp_host_free(back);
}

/* An empty directory name is refused with its own sentence (not an
 * attempt to open or create ""). */
static void
test_an_empty_directory_name_is_refused(void)
{
    char why[512] = "";
    CHECK(spill_dir_open("", why, sizeof why) == -1);
    CHECK(strcmp(why, "the spill directory is empty: name a directory") == 0);
}

/* With stdin closed the next file is descriptor 0, and it is a good one:
 * spill_file_make() and its named fallback return it (not the stale
 * errno left by an earlier call) and the named file is unlinked. */
static void
test_a_file_may_be_descriptor_zero(void)
{
    int had_stdin = fcntl(0, F_GETFD) >= 0;
    if (!had_stdin)
        CHECK(open("/dev/null", O_RDONLY) == 0);    /* so dirfd is not 0 */
    int dirfd = open(root, O_RDONLY | O_DIRECTORY);
    int saved = dup(0);
    CHECK(dirfd > 0 && saved > 0);
    for (int named = 0; named < 2; named++) {
        close(0);
        errno = EBADF;          /* stale, as an earlier failed call leaves it */
        int fd = named ? spill_file_make_named(dirfd) : spill_file_make(dirfd);
        CHECK(fd == 0);
        CHECK(entries(root) == 0);
        CHECK(dup2(saved, 0) == 0);
    }
    close(saved);
    close(dirfd);
    if (!had_stdin)
        close(0);
}

/* A write that fails before it touches the disk moved no byte with
 * O_DIRECT: direct_bytes stays 0. */
static void
test_a_failed_write_moves_no_direct_bytes(void)
{
    char why[512];
    spill_tier *tier = spill_create(root, 1, why, sizeof why);
    unsigned char *buffer = mp_host_alloc(1 << 16, SPILL_ALIGN);
    fill(buffer, 1 << 16, 23);
    spill_set_direct(tier, 0);
    spill_inject_write_errors(tier, EIO, 1);
    spill_slot *slot = spill_submit_write(tier, buffer, 1 << 16);
    CHECK(spill_wait(tier, slot) == EIO);
    spill_stats stats = spill_get_stats(tier);
    CHECK(stats.write_errors == 1 && stats.direct_bytes == 0);
    spill_slot_free(tier, slot);
    spill_destroy(tier);
    mp_host_free(buffer);
}

/* A file cut short behind the tier's back reads as EIO (the end came
 * early), whatever errno an earlier call left. */
static void
test_a_truncated_file_reads_as_eio(void)
{
    char why[512];
    spill_tier *tier = spill_create(root, 1, why, sizeof why);
    unsigned char *buffer = mp_host_alloc(1 << 16, SPILL_ALIGN);
    fill(buffer, 1 << 16, 29);
    spill_slot *slot = spill_submit_write(tier, buffer, 1 << 16);
    CHECK(spill_wait(tier, slot) == 0);
    CHECK(ftruncate(slot->fd, 1 << 15) == 0);     /* idle: the owner may touch it */
    CHECK(spill_submit_read(tier, slot, buffer) == 0);
    CHECK(spill_wait(tier, slot) == EIO);
    CHECK(spill_get_stats(tier).read_errors == 1);
    spill_slot_free(tier, slot);
    spill_destroy(tier);
    mp_host_free(buffer);
}

/* Turning O_DIRECT on and off succeeds whatever errno an earlier call
 * left: an aligned write where the filesystem takes direct I/O is 0, all
 * of it direct. */
static void
test_direct_io_ignores_a_stale_errno(void)
{
    if (!takes_direct_io(root)) {
        printf("spill: no direct I/O under %s: stale errno around O_DIRECT not tested\n", root);
        return;
    }
    int dirfd = open(root, O_RDONLY | O_DIRECTORY);
    int fd = spill_file_make(dirfd);
    unsigned char *buffer = mp_host_alloc(SPILL_ALIGN, SPILL_ALIGN);
    fill(buffer, SPILL_ALIGN, 31);
    int direct = 1;
    uint64_t direct_bytes = 0;
    errno = ENOENT;
    CHECK(spill_io_write(fd, buffer, SPILL_ALIGN, &direct, &direct_bytes) == 0);
    CHECK(direct == 1 && direct_bytes == SPILL_ALIGN);
    mp_host_free(buffer);
    close(fd);
    close(dirfd);
}

/* A write of one byte reserves its space first too: where nothing can be
 * reserved (a character device: ENODEV) it fails before writing. */
static void
test_a_one_byte_write_reserves_first(void)
{
    int fd = open("/dev/null", O_WRONLY);
    int direct = 0;
    uint64_t direct_bytes = 0;
    CHECK(fd >= 0 && spill_io_write(fd, "x", 1, &direct, &direct_bytes) == ENODEV);
    close(fd);
}

/* A child forked without the fork handlers (a raw clone, as a library may
 * make one) still holds the parent's slot file: freeing the slot there
 * closes it. */
static void
test_forked_child_without_handlers_closes_the_slot_file(void)
{
    char why[512];
    spill_tier *tier = spill_create(root, 1, why, sizeof why);
    unsigned char *buffer = mp_host_alloc(1 << 16, SPILL_ALIGN);
    fill(buffer, 1 << 16, 37);
    spill_slot *slot = spill_submit_write(tier, buffer, 1 << 16);
    CHECK(spill_wait(tier, slot) == 0);
    spill_wait_idle(tier);                  /* no worker holds a lock at the clone */
    /* written: the buffer goes before the clone, whose child valgrind's
     * leak check would otherwise count it lost in */
    mp_host_free(buffer);
    fflush(NULL);
    long child = syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
    if (child == 0) {
        int fd = slot->fd;
        int ok = spill_slot_forked(slot) && fd > 2 && fcntl(fd, F_GETFD) >= 0;
        spill_slot_free(tier, slot);
        ok &= fcntl(fd, F_GETFD) == -1 && errno == EBADF;
        _exit(ok ? 0 : 1);
    }
    int status = -1;
    CHECK(child > 0 && waitpid((pid_t)child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    spill_slot_free(tier, slot);
    spill_destroy(tier);
}

/* A forked child that frees a parent's slot (its file closed at the fork)
 * closes nothing else: its stdin stays open. */
static void
test_forked_child_keeps_stdin_when_freeing_a_slot(void)
{
    char why[512];
    spill_tier *tier = spill_create(root, 1, why, sizeof why);
    unsigned char *buffer = mp_host_alloc(1 << 16, SPILL_ALIGN);
    fill(buffer, 1 << 16, 41);
    spill_slot *slot = spill_submit_write(tier, buffer, 1 << 16);
    CHECK(spill_wait(tier, slot) == 0);
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        if (fcntl(0, F_GETFD) < 0 && open("/dev/null", O_RDONLY) != 0)
            _exit(2);                       /* the premise: a stdin to lose */
        spill_slot_free(tier, slot);
        _exit(fcntl(0, F_GETFD) >= 0 ? 0 : 1);
    }
    int status = -1;
    CHECK(child > 0 && waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    spill_slot_free(tier, slot);
    spill_destroy(tier);
    mp_host_free(buffer);
}

/* A real full disk: a 1 MiB tmpfs in a mount namespace of its own (a
 * child process, so no mount outlives the test), where one can be made:
 * ENOSPC from the reservation, and the directory is empty afterwards. */
static void
full_tmpfs(const char *path)
{
    char why[512];
    spill_tier *tier = spill_create(path, 1, why, sizeof why);
    CHECK(tier != NULL);
    unsigned char *buffer = mp_host_alloc(4 << 20, SPILL_ALIGN);
    fill(buffer, 4 << 20, 5);
    spill_slot *small = spill_submit_write(tier, buffer, 256 << 10);
    spill_slot *large = spill_submit_write(tier, buffer, 4 << 20);
    CHECK(spill_wait(tier, small) == 0);
    CHECK(spill_wait(tier, large) == ENOSPC);
    unsigned char *back = mp_host_alloc(256 << 10, SPILL_ALIGN);
    CHECK(spill_submit_read(tier, small, back) == 0 && spill_wait(tier, small) == 0);
    CHECK(memcmp(back, buffer, 256 << 10) == 0);
    spill_slot_free(tier, large);
    spill_destroy(tier);
    CHECK(entries(path) == 0);
    mp_host_free(buffer);
    mp_host_free(back);
    CHECK(umount(path) == 0);
}

static void
test_full_tmpfs(void)
{
    char path[256];
    snprintf(path, sizeof path, "%s/tmpfs", root);
    CHECK(mkdir(path, 0700) == 0);
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        if (unshare(CLONE_NEWNS) != 0 || mount("none", "/", "none", MS_REC | MS_PRIVATE, NULL) != 0 ||
            mount("tmpfs", path, "tmpfs", 0, "size=1m,mode=0700") != 0) {
            printf("spill: no private tmpfs here (%s): real ENOSPC not tested\n",
                   strerror(errno));
            fflush(NULL);
            _exit(0);
        }
        full_tmpfs(path);
        int failed = check_report("test_spill (tmpfs child)");
        fflush(NULL);
        _exit(failed);
    }
    int status = -1;
    CHECK(child > 0 && waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(rmdir(path) == 0);
}

int
main(void)
{
    if (mkdtemp(root) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    test_directory_checks();
    test_checksums_notice_every_changed_byte();
    test_files_are_unnamed();
    test_round_trip();
    test_injected_errors();
    test_destroy_with_live_slots();
    test_idle_means_every_request_ran();
    test_a_slot_freed_while_held_goes_with_its_last_hold();
    test_destroy_waits_for_a_hold_on_another_thread();
    test_forked_child_leaves_the_tier_alone();
    test_forked_child_never_waits_for_the_parents_requests();
    test_full_tmpfs();
    test_an_empty_directory_name_is_refused();
    test_a_file_may_be_descriptor_zero();
    test_a_failed_write_moves_no_direct_bytes();
    test_a_truncated_file_reads_as_eio();
    test_direct_io_ignores_a_stale_errno();
    test_a_one_byte_write_reserves_first();
    test_forked_child_without_handlers_closes_the_slot_file();
    test_forked_child_keeps_stdin_when_freeing_a_slot();
    CHECK(entries(root) == 0);
    rmdir(root);
    return check_report("test_spill");
}
