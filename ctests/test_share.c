/* Two engines share KV through libmaru.so against real daemons (started by
 * with_daemons.sh, which sets MARU_TEST_CONFIG_A and MARU_TEST_CONFIG_B), and every
 * status path for bad arguments. */
#include <maru.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define N 200
#define MAXLEN 60000

static size_t fill(uint8_t *buf, int i) {
    size_t len = 1000 + (size_t)(i * 271) % (MAXLEN - 1000);
    fill_pattern(buf, len, (uint32_t)i * 2654435761u + 1);
    return len;
}

int main(void) {
    const char *ca = getenv("MARU_TEST_CONFIG_A");
    const char *cb = getenv("MARU_TEST_CONFIG_B");
    CHECK(ca && cb);
    maru_handler_t *a = NULL, *b = NULL;
    CHECK(maru_handler_open(ca, &a) == MARU_OK && a);
    CHECK(maru_handler_open(cb, &b) == MARU_OK && b);

    static uint8_t buf[MAXLEN], out[MAXLEN];
    uint32_t sums[N];
    char key[64];
    for (int i = 0; i < N; i++) {
        size_t len = fill(buf, i);
        sums[i] = fnv(buf, len);
        snprintf(key, sizeof key, "c-prefix-%03d", i);
        bool stored = false;
        CHECK(maru_store(a, key, buf, len, "c-prefix-000", &stored) == MARU_OK);
        CHECK(stored);
    }
    for (int i = 0; i < N; i++) {
        snprintf(key, sizeof key, "c-prefix-%03d", i);
        bool found = false;
        CHECK(maru_exists(b, key, "c-prefix-000", &found) == MARU_OK && found);
        size_t got = 0;
        CHECK(maru_load(b, key, out, sizeof out, &got, "c-prefix-000") == MARU_OK);
        CHECK(fnv(out, got) == sums[i]);
    }
    /* Batched load of the first 8. */
    const char *keys[8];
    char kb[8][64];
    uint8_t *bufs[8];
    size_t caps[8], lens[8];
    bool found[8];
    for (int i = 0; i < 8; i++) {
        snprintf(kb[i], sizeof kb[i], "c-prefix-%03d", i);
        keys[i] = kb[i];
        bufs[i] = malloc(MAXLEN);
        caps[i] = MAXLEN;
    }
    CHECK(maru_load_batch(b, keys, bufs, caps, lens, found, 8, "c-prefix-000") == MARU_OK);
    for (int i = 0; i < 8; i++) {
        CHECK(found[i] && fnv(bufs[i], lens[i]) == sums[i]);
        free(bufs[i]);
    }

    /* Two pools: requests (each its own route key) spread over both, and each is
     * found again through the same route. */
    const char *pools = getenv("MARU_TEST_POOLS");
    if (pools && strcmp(pools, "2") == 0) {
        for (int r = 0; r < 16; r++) {
            char rk[32];
            snprintf(rk, sizeof rk, "req-%02d-chunk-0", r);
            size_t len = fill(buf, 1000 + r);
            bool stored = false;
            CHECK(maru_store(a, rk, buf, len, rk, &stored) == MARU_OK && stored);
            size_t got = 0;
            CHECK(maru_load(b, rk, out, sizeof out, &got, rk) == MARU_OK);
            CHECK(got == len && fnv(out, got) == fnv(buf, len));
        }
        char stats[8192];
        size_t need = 0;
        CHECK(maru_stats_json(a, stats, sizeof stats, &need) == MARU_OK);
        /* Per pool and total: both pools and the total stored something. */
        int nonzero = 0;
        for (const char *p = stats; (p = strstr(p, "\"stored\":")) != NULL; p++) {
            if (strtol(p + 9, NULL, 10) > 0) nonzero++;
        }
        CHECK(nonzero == 3);
    }

    /* Views in place (cxl only): the same bytes, no copy, released after use. */
    {
        maru_view_t views[8];
        bool vfound[8];
        maru_status_t st = maru_views_acquire(b, keys, 8, "c-prefix-000", views, vfound);
        if (strcmp(getenv("MARU_TEST_BACKEND"), "cxl") == 0) {
            CHECK(st == MARU_OK);
            uint64_t vids[8];
            for (int i = 0; i < 8; i++) {
                CHECK(vfound[i] && views[i].valid_ms > 0 && fnv(views[i].data, views[i].len) == sums[i]);
                vids[i] = views[i].id;
            }
            CHECK(maru_views_release(b, vids, 8) == MARU_OK);
            CHECK(maru_views_release(b, vids, 8) == MARU_OK); /* already released: ignored */
        } else {
            CHECK(st == MARU_ERR_INVALID_ARGUMENT && strstr(maru_last_error(), "cxl") != NULL);
        }
        CHECK(maru_views_acquire(b, keys, 8, NULL, NULL, vfound) == MARU_ERR_NULL_ARGUMENT);
    }

    /* Misses and bad arguments. */
    size_t got = 0;
    CHECK(maru_load(b, "never-stored", out, sizeof out, &got, NULL) == MARU_ERR_NOT_FOUND);
    CHECK(maru_load(b, "c-prefix-001", out, 10, &got, "c-prefix-000") == MARU_ERR_BUFFER_TOO_SMALL && got > 10);
    CHECK(maru_store(a, NULL, buf, 1, NULL, NULL) == MARU_ERR_NULL_ARGUMENT);
    CHECK(strstr(maru_last_error(), "key") != NULL);
    CHECK(maru_load(NULL, "k", out, 1, &got, NULL) == MARU_ERR_NULL_ARGUMENT);
    CHECK(maru_exists(a, "k", NULL, NULL) == MARU_ERR_NULL_ARGUMENT);
    uint64_t chunk = 0;
    CHECK(maru_chunk_size(a, &chunk) == MARU_OK && chunk >= MAXLEN);
    static uint8_t big[1 << 20];
    CHECK(chunk < sizeof big);
    CHECK(maru_store(a, "too-big", big, (size_t)chunk + 1, NULL, NULL) == MARU_ERR_INVALID_ARGUMENT);
    maru_handler_t *bad = NULL;
    CHECK(maru_handler_open("{not json", &bad) == MARU_ERR_CONFIG && bad == NULL);
    CHECK(maru_handler_open("{\"backend\":\"remote_cxl\",\"server_url\":\"127.0.0.1:1\",\"engine_id\":\"x\",\"typo\":1}", &bad) == MARU_ERR_CONFIG);
    CHECK(strstr(maru_last_error(), "typo") != NULL);
    CHECK(maru_handler_open(NULL, &bad) == MARU_ERR_NULL_ARGUMENT);

    size_t need = 0;
    CHECK(maru_stats_json(b, NULL, 0, &need) == MARU_ERR_BUFFER_TOO_SMALL && need > 0);
    char *stats = malloc(need + 1);
    CHECK(maru_stats_json(b, stats, need + 1, &need) == MARU_OK);
    CHECK(strstr(stats, "\"hits\"") != NULL);
    free(stats);

    CHECK(maru_handler_close(a) == MARU_OK);
    CHECK(maru_handler_close(b) == MARU_OK);
    CHECK(maru_handler_close(NULL) == MARU_OK);
    printf("test_share (%s, %s pool(s)): %d chunks shared, checksums match\n",
           getenv("MARU_TEST_BACKEND"), pools ? pools : "1", N);
    return 0;
}
