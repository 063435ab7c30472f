/* CHECK(cond): on failure, print the condition, where it failed and libmaru's last
 * error, then exit(1). Shared by the C tests that run against daemons. */
#ifndef MARU_CTESTS_CHECK_H
#define MARU_CTESTS_CHECK_H
#include <maru.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(cond)                                                                      \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__,       \
                    __LINE__, #cond, maru_last_error());                                 \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

/* FNV-1a of n bytes: the checksum the tests compare. */
static inline uint32_t fnv(const uint8_t *p, size_t n) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

/* Fills len bytes of buf with the xorshift32 stream from seed x (not 0): the bytes a
 * test stores and expects back. */
static inline void fill_pattern(uint8_t *buf, size_t len, uint32_t x) {
    for (size_t k = 0; k < len; k++) {
        x ^= x << 13; x ^= x >> 17; x ^= x << 5;
        buf[k] = (uint8_t)x;
    }
}

#endif
