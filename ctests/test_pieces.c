/* maru_load_pieces: chunks loaded and copied in pieces into the caller's memory in one
 * call (leases taken, pieces copied while held; the leases given back after it). Engine A stores
 * chunks of odd lengths; engine B loads them in pieces at odd offsets, in any order,
 * past a missing key, with a chunk shorter than its pieces need, then the bad
 * arguments (a piece naming no key, a NULL destination, NULL outputs) are refused
 * before anything is copied. Run by with_daemons.sh on both backends. */
#define _POSIX_C_SOURCE 200809L
#include "check.h"
#include <stdint.h>
#include <string.h>

#define N 3

int main(void) {
    const char *ca = getenv("MARU_TEST_CONFIG_A");
    const char *cb = getenv("MARU_TEST_CONFIG_B");
    CHECK(ca && cb);
    maru_handler_t *a = NULL, *b = NULL;
    CHECK(maru_handler_open(ca, &a) == MARU_OK);
    CHECK(maru_handler_open(cb, &b) == MARU_OK);

    static uint8_t chunk[N][9000];
    const size_t lens[N] = {8191, 3, 4097};
    const char *keys[N] = {"pieces/c0", "pieces/c1", "pieces/c2"};
    const uint8_t *datas[N];
    for (int i = 0; i < N; i++) {
        for (size_t k = 0; k < lens[i]; k++) chunk[i][k] = (uint8_t)(k * 13 + (size_t)i * 7 + 1);
        datas[i] = chunk[i];
    }
    bool stored[N];
    CHECK(maru_store_batch(a, keys, datas, lens, N, "pieces", stored) == MARU_OK);
    for (int i = 0; i < N; i++) CHECK(stored[i]);

    /* B: c0 in two pieces (its tail first) at an odd address, a missing key, c1 asked
     * for 4 of its 3 bytes, c2 whole. */
    const char *ask[4] = {"pieces/c0", "pieces/none", "pieces/c1", "pieces/c2"};
    static uint8_t dst[20000];
    memset(dst, 0, sizeof dst);
    maru_piece_t pieces[4] = {
        {.chunk = 0, .offset = 1001, .dst = dst + 1 + 1001, .len = 8191 - 1001},
        {.chunk = 0, .offset = 0, .dst = dst + 1, .len = 1001},
        {.chunk = 2, .offset = 0, .dst = dst + 9000, .len = 4},
        {.chunk = 3, .offset = 0, .dst = dst + 10001, .len = 4097},
    };
    size_t got[4];
    bool found[4];
    CHECK(maru_load_pieces(b, ask, 4, "pieces", pieces, 4, got, found) == MARU_OK);
    CHECK(found[0] && got[0] == 8191 && memcmp(dst + 1, chunk[0], 8191) == 0);
    CHECK(!found[1] && got[1] == 0);
    CHECK(!found[2] && got[2] == 3);
    for (int k = 0; k < 4; k++) CHECK(dst[9000 + k] == 0); /* nothing of the short chunk */
    CHECK(found[3] && got[3] == 4097 && memcmp(dst + 10001, chunk[2], 4097) == 0);
    CHECK(dst[0] == 0 && dst[8192] == 0 && dst[14098] == 0);

    /* Bad arguments: refused, naming the piece, before anything is loaded. */
    memset(dst, 0, sizeof dst);
    maru_piece_t bad[2] = {{.chunk = 0, .offset = 0, .dst = dst, .len = 16},
                           {.chunk = 4, .offset = 0, .dst = dst + 100, .len = 1}};
    CHECK(maru_load_pieces(b, ask, 4, "pieces", bad, 2, got, found) == MARU_ERR_INVALID_ARGUMENT);
    CHECK(strstr(maru_last_error(), "pieces[1]") != NULL);
    bad[1].chunk = 1;
    bad[1].dst = NULL;
    CHECK(maru_load_pieces(b, ask, 4, "pieces", bad, 2, got, found) == MARU_ERR_NULL_ARGUMENT);
    CHECK(strstr(maru_last_error(), "pieces[1]") != NULL);
    bad[1].offset = SIZE_MAX;
    bad[1].dst = dst + 100;
    CHECK(maru_load_pieces(b, ask, 4, "pieces", bad, 2, got, found) == MARU_ERR_INVALID_ARGUMENT);
    for (int k = 0; k < 16; k++) CHECK(dst[k] == 0);
    CHECK(maru_load_pieces(b, ask, 4, "pieces", NULL, 1, got, found) == MARU_ERR_NULL_ARGUMENT);
    CHECK(maru_load_pieces(b, ask, 4, "pieces", pieces, 4, NULL, found) == MARU_ERR_NULL_ARGUMENT);
    CHECK(maru_load_pieces(NULL, ask, 4, "pieces", pieces, 4, got, found) == MARU_ERR_NULL_ARGUMENT);
    /* No keys, no pieces: nothing to do. */
    CHECK(maru_load_pieces(b, NULL, 0, NULL, NULL, 0, NULL, NULL) == MARU_OK);

    /* The leases go back after each call (libmaru's release thread), at the latest
     * when the handler closes: then nothing is left held and the owner removes. */
    CHECK(maru_handler_close(b) == MARU_OK);
    maru_remove_result_t rr[N];
    CHECK(maru_remove_batch(a, keys, N, "pieces", rr) == MARU_OK);
    for (int i = 0; i < N; i++) CHECK(rr[i] == MARU_REMOVED);

    CHECK(maru_handler_close(a) == MARU_OK);
    puts("pieces ok");
    return 0;
}
