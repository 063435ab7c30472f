/* Closing a handler while other threads are inside calls on it, as a runtime does at
 * shutdown. Run under valgrind (see CMakeLists.txt), so any read or write of freed or
 * unmapped memory, in this program or inside libmaru, fails the test.
 *
 * 1. Two-step: worker threads store, load and use staging slots in a loop while one
 *    thread is blocked in maru_slots_acquire (every store slot is held);
 *    maru_handler_shutdown wakes the blocked call with MARU_ERR_CLOSED, every later
 *    call returns MARU_ERR_CLOSED, the held slots' bytes stay readable until
 *    maru_handler_free, and every thread ends.
 * 2. One step: threads blocked in maru_slots_acquire when maru_handler_close is
 *    called return MARU_ERR_CLOSED with no slot, and close returns within its bound. */
#define _POSIX_C_SOURCE 200809L
#include <maru.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "clock.h"

#define WORKERS 3
#define BLOCKED 3
#define MAX_SLOTS 64

struct shared {
    maru_handler_t *h;
    atomic_int iterations;
    atomic_int started;
};

/* Takes every store slot of `h`, so the next store acquire blocks. */
static size_t hold_all_store_slots(maru_handler_t *h, maru_slot_t *held) {
    size_t n = 0, got = 0;
    while (n < MAX_SLOTS &&
           maru_slots_acquire(h, MARU_SLOT_STORE, MAX_SLOTS - n, 200, held + n, &got) == MARU_OK)
        n += got;
    CHECK(n > 0 && n < MAX_SLOTS);
    return n;
}

/* Stores, loads and uses a load slot until a call says the handler is closed. */
static void *worker(void *arg) {
    struct shared *s = arg;
    long t = (long)atomic_fetch_add(&s->started, 1);
    uint8_t data[4096], back[4096];
    char key[64];
    for (int i = 0;; i++) {
        snprintf(key, sizeof key, "close-race-%ld-%d", t, i);
        memset(data, (int)(t * 31 + i), sizeof data);
        bool stored = false;
        maru_status_t st = maru_store(s->h, key, data, sizeof data, NULL, &stored);
        if (st == MARU_ERR_CLOSED) break;
        CHECK(st == MARU_OK);
        size_t len = 0;
        st = maru_load(s->h, key, back, sizeof back, &len, NULL);
        if (st == MARU_ERR_CLOSED) break;
        CHECK(st == MARU_OK || st == MARU_ERR_NOT_FOUND);
        if (st == MARU_OK) CHECK(len == sizeof data && memcmp(back, data, len) == 0);

        maru_slot_t slot;
        size_t got = 0;
        st = maru_slots_acquire(s->h, MARU_SLOT_LOAD, 1, 1000, &slot, &got);
        if (st == MARU_ERR_CLOSED) break;
        if (st == MARU_ERR_NO_SPACE) continue;
        CHECK(st == MARU_OK && got == 1);
        const char *keys[1] = {key};
        bool found = false;
        st = maru_load_slots(s->h, keys, &slot.id, 1, NULL, &len, &found);
        if (st == MARU_OK && found)
            CHECK(len == sizeof data && memcmp(slot.data, data, len) == 0);
        /* The slot is held until released or the handler is freed: always readable. */
        volatile uint8_t first = slot.data[0];
        (void)first;
        maru_status_t rel = maru_slots_release(s->h, &slot.id, 1);
        if (st == MARU_ERR_CLOSED || rel == MARU_ERR_CLOSED) break;
        CHECK(st == MARU_OK && rel == MARU_OK);
        atomic_fetch_add(&s->iterations, 1);
    }
    return NULL;
}

struct blocked {
    maru_handler_t *h;
    atomic_int *entered;
    maru_status_t status;
    size_t got;
    double returned_at;
};

static void *block_in_acquire(void *arg) {
    struct blocked *b = arg;
    maru_slot_t slot;
    atomic_fetch_add(b->entered, 1);
    /* Ten minutes: only a shutdown ends this wait early. */
    b->status = maru_slots_acquire(b->h, MARU_SLOT_STORE, 1, 600000, &slot, &b->got);
    b->returned_at = now_s();
    return NULL;
}

static void two_step(const char *cfg) {
    struct shared s;
    memset(&s, 0, sizeof s);
    CHECK(maru_handler_open(cfg, &s.h) == MARU_OK);
    maru_slot_t held[MAX_SLOTS];
    size_t n_held = hold_all_store_slots(s.h, held);
    for (size_t i = 0; i < n_held; i++) memset(held[i].data, 0xA5, held[i].capacity);

    atomic_int entered = 0;
    struct blocked b = {s.h, &entered, MARU_OK, 99, 0};
    pthread_t workers[WORKERS], blocked;
    for (int i = 0; i < WORKERS; i++) CHECK(pthread_create(&workers[i], NULL, worker, &s) == 0);
    CHECK(pthread_create(&blocked, NULL, block_in_acquire, &b) == 0);
    double deadline = now_s() + 60;
    while ((atomic_load(&s.iterations) < 3 * WORKERS || atomic_load(&entered) < 1) &&
           now_s() < deadline)
        sleep_ms(10);
    CHECK(atomic_load(&s.iterations) >= 3 * WORKERS);
    sleep_ms(300); /* the blocked thread is inside its acquire by now */

    double t0 = now_s();
    CHECK(maru_handler_shutdown(s.h) == MARU_OK);
    double waited = now_s() - t0;
    for (int i = 0; i < WORKERS; i++) CHECK(pthread_join(workers[i], NULL) == 0);
    CHECK(pthread_join(blocked, NULL) == 0);
    printf("two-step: %d iterations; shutdown took %.3f s; the blocked acquire returned "
           "%.3f s after shutdown began\n",
           atomic_load(&s.iterations), waited, b.returned_at - t0);
    CHECK(b.status == MARU_ERR_CLOSED && b.got == 0);
    CHECK(b.returned_at - t0 < 10.0);
    CHECK(waited < 10.0);

    /* After shutdown: calls are refused, held slots are still the caller's memory. */
    bool found = true;
    CHECK(maru_exists(s.h, "close-race-0-0", NULL, &found) == MARU_ERR_CLOSED);
    maru_slot_t more;
    size_t got = 7;
    CHECK(maru_slots_acquire(s.h, MARU_SLOT_LOAD, 1, 0, &more, &got) == MARU_ERR_CLOSED);
    CHECK(got == 0);
    CHECK(maru_handler_shutdown(s.h) == MARU_OK); /* again: nothing more to do */
    for (size_t i = 0; i < n_held; i++) CHECK(held[i].data[held[i].capacity - 1] == 0xA5);
    CHECK(maru_handler_free(s.h) == MARU_OK);
}

static void one_step(const char *cfg) {
    maru_handler_t *h = NULL;
    CHECK(maru_handler_open(cfg, &h) == MARU_OK);
    maru_slot_t held[MAX_SLOTS];
    (void)hold_all_store_slots(h, held);
    atomic_int entered = 0;
    struct blocked b[BLOCKED];
    pthread_t t[BLOCKED];
    for (int i = 0; i < BLOCKED; i++) {
        b[i] = (struct blocked){h, &entered, MARU_OK, 99, 0};
        CHECK(pthread_create(&t[i], NULL, block_in_acquire, &b[i]) == 0);
    }
    while (atomic_load(&entered) < BLOCKED) sleep_ms(5);
    sleep_ms(500); /* each is inside maru_slots_acquire by now */
    double t0 = now_s();
    CHECK(maru_handler_close(h) == MARU_OK);
    double took = now_s() - t0;
    for (int i = 0; i < BLOCKED; i++) {
        CHECK(pthread_join(t[i], NULL) == 0);
        CHECK(b[i].status == MARU_ERR_CLOSED && b[i].got == 0);
    }
    printf("one step: close took %.3f s with %d calls blocked\n", took, BLOCKED);
    CHECK(took < 10.0);
}

int main(void) {
    const char *cfg = getenv("MARU_TEST_CONFIG_A");
    CHECK(cfg != NULL);
    two_step(cfg);
    one_step(cfg);
    printf("ok\n");
    return 0;
}
