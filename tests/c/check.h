/* A minimal test harness for the C unit tests: CHECK records a failure and
 * goes on; main() ends with the "N passed, N failed" line. */
#ifndef MATEPOINT_TEST_CHECK_H
#define MATEPOINT_TEST_CHECK_H

#include <stdio.h>

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

#endif
