/* A minimal test harness for the C unit tests: CHECK records a failure and
 * goes on; main() ends with the "N passed, N failed" line. */
#ifndef MATEPOINT_TEST_CHECK_H
#define MATEPOINT_TEST_CHECK_H

#include <signal.h>
#include <stdio.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static int checks_passed, checks_failed;

#define CHECK(cond)                                                                   \
    do {                                                                              \
        if (cond) {                                                                   \
            checks_passed++;                                                          \
        } else {                                                                      \
            checks_failed++;                                                          \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                             \
    } while (0)

static inline int
check_report(const char *suite)
{
    printf("%s: %d passed, %d failed\n", suite, checks_passed, checks_failed);
    return checks_failed != 0;
}

/* Runs `broken` in a child process: 1 when MP_ASSERT stopped it (abort,
 * SIGABRT), 0 when it ran to its end or died otherwise. */
static inline int
aborts_on_invariant(void (*broken)(void))
{
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        broken();
        _exit(0);
    }
    int status = 0;
    if (child < 0 || waitpid(child, &status, 0) != child)
        return 0;
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

#endif
