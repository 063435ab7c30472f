/* Time for the C tests' bounds; needs _POSIX_C_SOURCE 200809L (defined by the
 * including test before any header). Shared by test_close.c and test_header.c. */
#ifndef MARU_CTESTS_CLOCK_H
#define MARU_CTESTS_CLOCK_H
#include <time.h>

/* Monotonic seconds, for the tests' time bounds. */
static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static inline void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

#endif
