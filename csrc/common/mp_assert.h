/* MP_ASSERT(cond): an invariant of matepoint's own bookkeeping (a counter
 * that must not go negative, a list link, a copy's state transition).
 *
 * Active in debug, sanitizer and test builds (MATEPOINT_DEBUG or
 * MATEPOINT_TESTING defined, as `make test` builds everything): a broken
 * invariant prints where and aborts, so the sanitizer run stops at the
 * first corruption instead of at its consequence. In a release build the
 * condition is not evaluated: it must have no side effects. Thread-safe,
 * needs no lock and no GIL. */
#ifndef MATEPOINT_COMMON_MP_ASSERT_H
#define MATEPOINT_COMMON_MP_ASSERT_H

#if defined(MATEPOINT_DEBUG) || defined(MATEPOINT_TESTING)
#include <stdio.h>
#include <stdlib.h>

#define MP_ASSERT(cond)                                                              \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "matepoint: invariant broken at %s:%d: %s\n", __FILE__,  \
                    __LINE__, #cond);                                                \
            abort();                                                                 \
        }                                                                            \
    } while (0)
#define MP_ASSERTS_ACTIVE 1
#else
#define MP_ASSERT(cond) ((void)0)
#define MP_ASSERTS_ACTIVE 0
#endif

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* mp_counter_sub(&counter, amount): counter -= amount for a counter that
 * must not go below zero, checked where it changes (as c10 asserts every
 * statistic); a broken one is reported at the caller's line. */
#define mp_counter_sub(counter, amount) mp_counter_sub_at((counter), (amount), __FILE__, __LINE__)

static inline void
mp_counter_sub_at(uint64_t *counter, uint64_t amount, const char *file, int line)
{
#if MP_ASSERTS_ACTIVE
    if (*counter < amount) {
        fprintf(stderr, "matepoint: invariant broken at %s:%d: a counter would go below zero "
                        "(%llu - %llu)\n", file, line, (unsigned long long)*counter,
                (unsigned long long)amount);
        abort();
    }
#else
    (void)file;
    (void)line;
#endif
    *counter -= amount;
}

#endif
