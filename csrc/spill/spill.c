/* The disk tier: slots, their request queue and the worker threads. */
#include "spill_internal.h"
#include "common/mp_assert.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Owner: the tier owns its mutex, its threads and every slot on its live
 * list. `lock` guards every field below but `dirfd`, `workers` and
 * `threads`, which are set before the threads start and read-only after
 * (but in a forked child, which has none of the threads: it closes dirfd). */
struct spill_tier {
    pthread_mutex_t lock;
    pthread_cond_t work;        /* signalled when a request is queued or the tier stops */
    pthread_cond_t finished;    /* broadcast when any request finished */
    /* Workers between making a file and making it their slot's: a fork
     * waits for none, so a child never holds a file it does not know of
     * (and so cannot close). `published` is broadcast as each one ends. */
    int making_files;
    pthread_cond_t published;
    /* Slot holds (spill.h, "Holds"): spill_destroy() waits until none is
     * left, broadcast on `released`, so no waiter finds a destroyed mutex. */
    int holds;
    pthread_cond_t released;
    int dirfd;
    int workers;
    pid_t pid;                  /* the process whose threads these are */
    pthread_t threads[SPILL_MAX_WORKERS];
    int stopping;
    int direct;
    spill_slot *queue_head, *queue_tail;
    spill_slot *live;           /* every slot, newest first */
    spill_stats stats;
    int inject_error, inject_count;
    int paused;                 /* tests: workers leave the queue alone */
    spill_tier *next_registered;    /* the registry's list (registry_lock) */
};

/* Every tier this process made and has not destroyed, for the fork
 * handlers. Owner: this file; `registry` and each tier's next_registered
 * are guarded by registry_lock, which is taken before any tier's lock and
 * never while one is held. */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static spill_tier *registry;
static pthread_once_t fork_handlers_once = PTHREAD_ONCE_INIT;
static int fork_handlers_error;     /* pthread_atfork's, written once under fork_handlers_once */

/* Around fork(): every tier's lock is taken first, so the child gets each
 * tier's queue and slots in a consistent state (a worker may have held a
 * lock mid-update otherwise), once no worker holds a file its slot does
 * not (making_files). */
static void
before_fork(void)
{
    pthread_mutex_lock(&registry_lock);
    for (spill_tier *tier = registry; tier != NULL; tier = tier->next_registered) {
        pthread_mutex_lock(&tier->lock);
        while (tier->making_files > 0)
            pthread_cond_wait(&tier->published, &tier->lock);
    }
}

static void
after_fork_in_parent(void)
{
    for (spill_tier *tier = registry; tier != NULL; tier = tier->next_registered)
        pthread_mutex_unlock(&tier->lock);
    pthread_mutex_unlock(&registry_lock);
}

/* The child has no worker: its copies of the tiers' files are closed, so
 * the parent's files go when the parent frees them (a child holding one
 * open would keep its disk space until it exits). The tiers stay, on the
 * registry too, for spill_slot_forked() and spill_slot_free(); nothing
 * else uses them here (a later fork finds their files closed already). */
static void
after_fork_in_child(void)
{
    for (spill_tier *tier = registry; tier != NULL; tier = tier->next_registered) {
        for (spill_slot *slot = tier->live; slot != NULL; slot = slot->next_live) {
            if (slot->fd >= 0)
                close(slot->fd);
            slot->fd = -1;
        }
        if (tier->dirfd >= 0)
            close(tier->dirfd);     /* spill_destroy() closes nothing here */
        tier->dirfd = -1;
        pthread_mutex_unlock(&tier->lock);
    }
    pthread_mutex_unlock(&registry_lock);
}

static void
install_fork_handlers(void)
{
    fork_handlers_error = pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
}

/* 0, or the error that kept the fork handlers out (then no tier starts:
 * a child could find a tier's lock held forever). */
static int
register_tier(spill_tier *tier)
{
    pthread_once(&fork_handlers_once, install_fork_handlers);
    if (fork_handlers_error != 0)
        return fork_handlers_error;
    pthread_mutex_lock(&registry_lock);
    tier->next_registered = registry;
    registry = tier;
    pthread_mutex_unlock(&registry_lock);
    return 0;
}

static void
unregister_tier(spill_tier *tier)
{
    pthread_mutex_lock(&registry_lock);
    for (spill_tier **at = &registry; *at != NULL; at = &(*at)->next_registered) {
        if (*at == tier) {
            *at = tier->next_registered;
            break;
        }
    }
    pthread_mutex_unlock(&registry_lock);
}

/* Takes the oldest queued slot; lock held. NULL when none. */
static spill_slot *
dequeue(spill_tier *tier)
{
    spill_slot *slot = tier->queue_head;
    if (slot == NULL)
        return NULL;
    tier->queue_head = slot->next_queued;
    if (tier->queue_head == NULL)
        tier->queue_tail = NULL;
    slot->next_queued = NULL;
    MP_ASSERT(slot->phase == SLOT_QUEUED);
    slot->phase = SLOT_RUNNING;
    return slot;
}

/* Runs one request with the lock released; `injected` is an error a test
 * asked for (0 for none). */
static int
run_request(spill_tier *tier, spill_slot *slot, int injected, int *direct, uint64_t *direct_bytes)
{
    *direct_bytes = 0;
    if (slot->op == SPILL_READ) {
        int status = spill_io_read(slot->fd, slot->buffer, slot->bytes, direct, direct_bytes);
        if (status == 0 && spill_checksum(slot->buffer, slot->bytes) != slot->sum)
            return EBADMSG;     /* the file changed since it was written */
        return status;
    }
    if (injected != 0)
        return injected;
    slot->sum = spill_checksum(slot->buffer, slot->bytes);
    if (slot->fd < 0) {
        pthread_mutex_lock(&tier->lock);
        tier->making_files++;
        pthread_mutex_unlock(&tier->lock);
        int fd = spill_file_make(tier->dirfd);
        /* under the lock: a fork sees it, and the child closes it */
        pthread_mutex_lock(&tier->lock);
        if (fd >= 0)
            slot->fd = fd;
        tier->making_files--;
        pthread_cond_broadcast(&tier->published);
        pthread_mutex_unlock(&tier->lock);
        if (fd < 0)
            return -fd;
    }
    return spill_io_write(slot->fd, slot->buffer, slot->bytes, direct, direct_bytes);
}

/* Counts a finished request; lock held. */
static void
account(spill_tier *tier, spill_slot *slot, int status, uint64_t direct_bytes)
{
    spill_stats *s = &tier->stats;
    s->direct_bytes += direct_bytes;
    if (slot->op == SPILL_WRITE && status == 0) {
        slot->written = 1;
        s->writes++;
        s->bytes_written += slot->bytes;
        s->bytes_on_disk += slot->bytes;
        if (s->bytes_on_disk > s->peak_bytes_on_disk)
            s->peak_bytes_on_disk = s->bytes_on_disk;
    } else if (slot->op == SPILL_WRITE) {
        s->write_errors++;
    } else if (status == 0) {
        s->reads++;
        s->bytes_read += slot->bytes;
    } else {
        s->read_errors++;
    }
}

static void *
worker_main(void *arg)
{
    spill_tier *tier = arg;
    pthread_mutex_lock(&tier->lock);
    for (;;) {
        spill_slot *slot = tier->paused && !tier->stopping ? NULL : dequeue(tier);
        if (slot == NULL) {
            if (tier->stopping)
                break;
            pthread_cond_wait(&tier->work, &tier->lock);
            continue;
        }
        int injected = 0;
        if (slot->op == SPILL_WRITE && tier->inject_count > 0) {
            tier->inject_count--;
            injected = tier->inject_error;
        }
        int direct = tier->direct;
        uint64_t direct_bytes = 0;
        pthread_mutex_unlock(&tier->lock);
        int status = run_request(tier, slot, injected, &direct, &direct_bytes);
        pthread_mutex_lock(&tier->lock);
        if (!direct)
            tier->direct = 0;
        account(tier, slot, status, direct_bytes);
        slot->status = status;
        slot->buffer = NULL;
        MP_ASSERT(slot->phase == SLOT_RUNNING);
        slot->phase = SLOT_IDLE;
        pthread_cond_broadcast(&tier->finished);
    }
    pthread_mutex_unlock(&tier->lock);
    return NULL;
}

/* Stops and joins the first `started` threads. */
static void
stop_workers(spill_tier *tier, int started)
{
    pthread_mutex_lock(&tier->lock);
    tier->stopping = 1;
    pthread_cond_broadcast(&tier->work);
    pthread_mutex_unlock(&tier->lock);
    for (int i = 0; i < started; i++)
        pthread_join(tier->threads[i], NULL);
}

spill_tier *
spill_create(const char *path, int workers, char *why, size_t why_len)
{
    if (workers < 1 || workers > SPILL_MAX_WORKERS) {
        snprintf(why, why_len, "the spill tier takes 1 to %d worker threads, not %d",
                 SPILL_MAX_WORKERS, workers);
        return NULL;
    }
    int dirfd = spill_dir_open(path, why, why_len);
    if (dirfd < 0)
        return NULL;
    spill_tier *tier = calloc(1, sizeof *tier);
    if (tier == NULL)
        goto error;
    pthread_mutex_init(&tier->lock, NULL);
    pthread_cond_init(&tier->work, NULL);
    pthread_cond_init(&tier->finished, NULL);
    pthread_cond_init(&tier->published, NULL);
    pthread_cond_init(&tier->released, NULL);
    tier->dirfd = dirfd;
    tier->pid = getpid();
    tier->direct = 1;
    tier->stats.direct = 1;
    int error = register_tier(tier);
    if (error != 0) {
        snprintf(why, why_len, "the spill tier could not install its fork handlers: %s",
                 strerror(error));
        goto error;
    }
    for (int i = 0; i < workers; i++) {
        error = pthread_create(&tier->threads[i], NULL, worker_main, tier);
        if (error != 0) {
            snprintf(why, why_len, "the spill tier could not start a thread: %s",
                     strerror(error));
            stop_workers(tier, i);
            unregister_tier(tier);
            goto error;
        }
        tier->workers = i + 1;
    }
    return tier;
error:
    if (tier == NULL)
        snprintf(why, why_len, "out of memory for the spill tier");
    else {
        pthread_cond_destroy(&tier->released);
        pthread_cond_destroy(&tier->published);
        pthread_cond_destroy(&tier->finished);
        pthread_cond_destroy(&tier->work);
        pthread_mutex_destroy(&tier->lock);
        free(tier);
    }
    close(dirfd);
    return NULL;
}

/* Takes a slot off the tier's live list; lock held. */
static void
live_unlink(spill_tier *tier, spill_slot *slot)
{
    if (slot->prev_live != NULL)
        slot->prev_live->next_live = slot->next_live;
    else
        tier->live = slot->next_live;
    if (slot->next_live != NULL)
        slot->next_live->prev_live = slot->prev_live;
}

/* Takes a slot off the live list, closes its file and frees it, or
 * leaves its memory to the last of its holds; lock held, slot idle. */
static void
slot_drop(spill_tier *tier, spill_slot *slot)
{
    MP_ASSERT(slot->tier == tier && slot->phase == SLOT_IDLE && !slot->dropped);
    live_unlink(tier, slot);
    if (slot->written)
        mp_counter_sub(&tier->stats.bytes_on_disk, slot->bytes);
    mp_counter_sub(&tier->stats.slots, 1);
    if (slot->fd >= 0)
        close(slot->fd);
    slot->fd = -1;
    slot->dropped = 1;
    if (slot->holds > 0)
        return;     /* the last spill_slot_unhold() frees it */
#ifdef MATEPOINT_TESTING
    memset(slot, 0xdb, sizeof *slot);   /* a pointer kept past here fails its asserts */
#endif
    free(slot);
}

/* A forked child has none of the tier's threads, and the lock may have
 * been held by one of them at the fork: it must not touch either. */
static int
in_forked_child(const spill_tier *tier)
{
    return getpid() != tier->pid;
}

int
spill_in_forked_child(const spill_tier *tier)
{
    return in_forked_child(tier);
}

int
spill_slot_forked(const spill_slot *slot)
{
    return in_forked_child(slot->tier);
}

/* The status a forked child sees of a parent's slot: its last request's
 * if it had finished at the fork, else ECHILD (it never will here). No
 * lock: nothing in the child changes the slot but its owner. */
static int
forked_status(const spill_slot *slot)
{
    return slot->phase == SLOT_IDLE ? slot->status : ECHILD;
}

void
spill_destroy(spill_tier *tier)
{
    if (tier == NULL || in_forked_child(tier))
        return;
    unregister_tier(tier);
    /* the workers drain the queue before they see `stopping` */
    stop_workers(tier, tier->workers);
    pthread_mutex_lock(&tier->lock);
    /* every request ran: each hold goes as soon as its waiter wakes */
    while (tier->holds > 0)
        pthread_cond_wait(&tier->released, &tier->lock);
    while (tier->live != NULL)
        slot_drop(tier, tier->live);
    pthread_mutex_unlock(&tier->lock);
    close(tier->dirfd);
    pthread_cond_destroy(&tier->released);
    pthread_cond_destroy(&tier->published);
    pthread_cond_destroy(&tier->finished);
    pthread_cond_destroy(&tier->work);
    pthread_mutex_destroy(&tier->lock);
    free(tier);
}

/* Puts an idle slot's request at the end of the queue; lock held. */
static void
enqueue(spill_tier *tier, spill_slot *slot, spill_op op, void *buffer)
{
    MP_ASSERT(slot->phase == SLOT_IDLE);
    slot->op = op;
    slot->buffer = buffer;
    slot->status = -1;
    slot->phase = SLOT_QUEUED;
    if (tier->queue_tail != NULL)
        tier->queue_tail->next_queued = slot;
    else
        tier->queue_head = slot;
    tier->queue_tail = slot;
    pthread_cond_signal(&tier->work);
}

spill_slot *
spill_submit_write(spill_tier *tier, const void *buffer, uint64_t bytes)
{
    if (in_forked_child(tier))
        return NULL;
    spill_slot *slot = calloc(1, sizeof *slot);
    if (slot == NULL)
        return NULL;
    slot->tier = tier;
    slot->fd = -1;
    slot->bytes = bytes;
    slot->phase = SLOT_IDLE;
    pthread_mutex_lock(&tier->lock);
    slot->next_live = tier->live;
    if (tier->live != NULL)
        tier->live->prev_live = slot;
    tier->live = slot;
    tier->stats.slots++;
    /* the buffer is only read: the cast lets one field serve both ops */
    enqueue(tier, slot, SPILL_WRITE, (void *)(uintptr_t)buffer);
    pthread_mutex_unlock(&tier->lock);
    return slot;
}

int
spill_submit_read(spill_tier *tier, spill_slot *slot, void *buffer)
{
    if (in_forked_child(tier))
        return -1;
    pthread_mutex_lock(&tier->lock);
    int ok = slot->phase == SLOT_IDLE && slot->written;
    if (ok)
        enqueue(tier, slot, SPILL_READ, buffer);
    pthread_mutex_unlock(&tier->lock);
    return ok ? 0 : -1;
}

int
spill_done(spill_tier *tier, spill_slot *slot)
{
    if (spill_slot_forked(slot))
        return 1;
    pthread_mutex_lock(&tier->lock);
    int done = slot->phase == SLOT_IDLE;
    pthread_mutex_unlock(&tier->lock);
    return done;
}

int
spill_status(spill_tier *tier, spill_slot *slot)
{
    if (spill_slot_forked(slot))
        return forked_status(slot);
    pthread_mutex_lock(&tier->lock);
    int status = slot->phase == SLOT_IDLE ? slot->status : -1;
    pthread_mutex_unlock(&tier->lock);
    return status;
}

int
spill_wait(spill_tier *tier, spill_slot *slot)
{
    if (spill_slot_forked(slot))
        return forked_status(slot);
    pthread_mutex_lock(&tier->lock);
    MP_ASSERT(slot->tier == tier);
    if (slot->phase != SLOT_IDLE)
        tier->stats.waits++;
    while (slot->phase != SLOT_IDLE)
        pthread_cond_wait(&tier->finished, &tier->lock);
    int status = slot->status;
    pthread_mutex_unlock(&tier->lock);
    return status;
}

void
spill_slot_hold(spill_tier *tier, spill_slot *slot)
{
    if (spill_slot_forked(slot))
        return;     /* a child's waits never block: nothing to outlive */
    pthread_mutex_lock(&tier->lock);
    MP_ASSERT(slot->tier == tier && !slot->dropped);
    slot->holds++;
    tier->holds++;
    pthread_mutex_unlock(&tier->lock);
}

void
spill_slot_unhold(spill_tier *tier, spill_slot *slot)
{
    if (spill_slot_forked(slot))
        return;
    pthread_mutex_lock(&tier->lock);
    MP_ASSERT(slot->holds > 0 && tier->holds > 0);
    slot->holds--;
    if (slot->dropped && slot->holds == 0)
        free(slot);
    if (--tier->holds == 0)
        pthread_cond_broadcast(&tier->released);
    pthread_mutex_unlock(&tier->lock);
}

void
spill_wait_idle(spill_tier *tier)
{
    if (in_forked_child(tier))
        return;
    pthread_mutex_lock(&tier->lock);
    for (int busy = 1; busy;) {
        busy = tier->queue_head != NULL;
        for (spill_slot *slot = tier->live; slot != NULL && !busy; slot = slot->next_live)
            busy = slot->phase != SLOT_IDLE;
        if (busy)
            pthread_cond_wait(&tier->finished, &tier->lock);
    }
    pthread_mutex_unlock(&tier->lock);
}

uint64_t
spill_slot_bytes(const spill_slot *slot)
{
    return slot->bytes;
}

/* A parent's slot in a forked child: off its tier's live list and freed,
 * without waiting for a request no thread here runs (its file was closed
 * at the fork; a queued one stays in the dead queue, never read). */
static void
forget_forked(spill_slot *slot)
{
    spill_tier *tier = slot->tier;
    /* usable here: the fork handlers held it across the fork */
    pthread_mutex_lock(&tier->lock);
    live_unlink(tier, slot);
    pthread_mutex_unlock(&tier->lock);
    if (slot->fd >= 0)
        close(slot->fd);
    free(slot);
}

void
spill_slot_free(spill_tier *tier, spill_slot *slot)
{
    if (slot == NULL)
        return;
    if (spill_slot_forked(slot)) {
        forget_forked(slot);
        return;
    }
    pthread_mutex_lock(&tier->lock);
    while (slot->phase != SLOT_IDLE)
        pthread_cond_wait(&tier->finished, &tier->lock);
    slot_drop(tier, slot);
    pthread_mutex_unlock(&tier->lock);
}

spill_stats
spill_get_stats(spill_tier *tier)
{
    pthread_mutex_lock(&tier->lock);
    spill_stats stats = tier->stats;
    stats.direct = tier->direct;
    pthread_mutex_unlock(&tier->lock);
    return stats;
}

void
spill_inject_write_errors(spill_tier *tier, int error, int count)
{
    pthread_mutex_lock(&tier->lock);
    tier->inject_error = error;
    tier->inject_count = count > 0 ? count : 0;
    pthread_mutex_unlock(&tier->lock);
}

void
spill_pause(spill_tier *tier, int paused)
{
    pthread_mutex_lock(&tier->lock);
    tier->paused = paused != 0;
    pthread_cond_broadcast(&tier->work);
    pthread_mutex_unlock(&tier->lock);
}

void
spill_set_direct(spill_tier *tier, int direct)
{
    pthread_mutex_lock(&tier->lock);
    tier->direct = direct != 0;
    pthread_mutex_unlock(&tier->lock);
}
