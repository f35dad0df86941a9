/* Whether a lock is free right now, seen from another thread: runs `fn`
 * (which takes the lock) on a helper thread and waits up to 2 s for it.
 * The helper is joined by probe_join(), once the caller let the lock go, so
 * a lock held by the caller shows as a timeout, not a deadlock. Needs
 * _GNU_SOURCE (or POSIX) defined before the first include. */
#ifndef MATEPOINT_TEST_LOCK_PROBE_H
#define MATEPOINT_TEST_LOCK_PROBE_H

#include <errno.h>
#include <pthread.h>
#include <time.h>

typedef struct {
    void (*fn)(void *);
    void *arg;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t finished;
    int done;
} lock_probe;

static inline void *
probe_main(void *arg)
{
    lock_probe *probe = arg;
    probe->fn(probe->arg);
    pthread_mutex_lock(&probe->lock);
    probe->done = 1;
    pthread_cond_signal(&probe->finished);
    pthread_mutex_unlock(&probe->lock);
    return NULL;
}

/* 1 when `fn` ran to its end within 2 s; call probe_join() either way. */
static inline int
probe_lock_free(lock_probe *probe)
{
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 2;
    pthread_mutex_init(&probe->lock, NULL);
    pthread_cond_init(&probe->finished, NULL);
    probe->done = 0;
    pthread_create(&probe->thread, NULL, probe_main, probe);
    pthread_mutex_lock(&probe->lock);
    int status = 0;
    while (!probe->done && status != ETIMEDOUT)
        status = pthread_cond_timedwait(&probe->finished, &probe->lock, &deadline);
    int done = probe->done;
    pthread_mutex_unlock(&probe->lock);
    return done;
}

static inline void
probe_join(lock_probe *probe)
{
    pthread_join(probe->thread, NULL);
    pthread_cond_destroy(&probe->finished);
    pthread_mutex_destroy(&probe->lock);
}

#endif
