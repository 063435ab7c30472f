/* What include/maru.h promises, checked point by point against real daemons (issue 36):
 *
 * - maru_load_batch loads every chunk found, also after a miss (found = 1,0,1).
 * - maru_handler_close settles a submitted store: its chunks are stored.
 * - releases of slots, views and pages succeed after maru_handler_shutdown.
 * - maru_pages_take(n) takes up to n pages (at most 4096): a large n is no error.
 * - maru_region_view of an own region also read in place returns its writable mapping.
 * - maru_handler_shutdown returns only once the calls in flight left libmaru (a call
 *   held inside the memory hook's register callback), and a call that outlived a
 *   bounded shutdown returns MARU_ERR_CLOSED, never MARU_OK.
 * - a handler keeps the memory hook it was opened with, also for CXL mappings made
 *   after the hook was removed.
 *
 * Usage (via with_daemons.sh): test_header; backend from MARU_TEST_BACKEND. */
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

#define CHUNK 4096

static const char *backend;
static char tag[32];

/* The configuration `cfg` with `"timeout_ms":ms` added (static buffer). */
static const char *with_timeout(const char *cfg, unsigned ms) {
    static char out[4096];
    size_t n = strlen(cfg);
    CHECK(n > 1 && n + 32 < sizeof out && cfg[n - 1] == '}');
    memcpy(out, cfg, n - 1);
    snprintf(out + n - 1, sizeof out - (n - 1), ",\"timeout_ms\":%u}", ms);
    return out;
}

static void key_of(char *key, size_t cap, const char *what, int i) {
    snprintf(key, cap, "hdr-%s-%s-%d", tag, what, i);
}

/* maru_load_batch of (stored, missing, stored): both stored chunks load. */
static void load_batch_loads_past_a_miss(const char *cfg) {
    maru_handler_t *h = NULL;
    CHECK(maru_handler_open(cfg, &h) == MARU_OK);
    char k[3][64];
    uint8_t data[CHUNK], bufs[3][CHUNK];
    for (int i = 0; i < 3; i++) key_of(k[i], sizeof k[i], "batch", i);
    for (int i = 0; i < 3; i += 2) {
        memset(data, 0x40 + i, sizeof data);
        bool stored = false;
        CHECK(maru_store(h, k[i], data, sizeof data, NULL, &stored) == MARU_OK && stored);
    }
    const char *keys[3] = {k[0], k[1], k[2]};
    uint8_t *bp[3] = {bufs[0], bufs[1], bufs[2]};
    size_t caps[3] = {CHUNK, CHUNK, CHUNK}, lens[3] = {9, 9, 9};
    bool found[3] = {false, true, false};
    CHECK(maru_load_batch(h, keys, bp, caps, lens, found, 3, NULL) == MARU_OK);
    CHECK(found[0] && !found[1] && found[2]);
    CHECK(lens[0] == CHUNK && lens[1] == 0 && lens[2] == CHUNK);
    CHECK(bufs[0][0] == 0x40 && bufs[2][CHUNK - 1] == 0x42);
    CHECK(maru_handler_close(h) == MARU_OK);
    printf("load_batch: found 1,0,1 as the header says\n");
}

/* A store submitted just before maru_handler_close is settled by it: every chunk is
 * stored (another engine finds them), and the op says so. */
static void close_settles_a_submitted_store(const char *cfg, const char *cfg_b) {
    enum { N = 8 };
    maru_handler_t *h = NULL;
    CHECK(maru_handler_open(cfg, &h) == MARU_OK);
    maru_slot_t slots[N];
    size_t got = 0, have = 0;
    while (have < N) {
        CHECK(maru_slots_acquire(h, MARU_SLOT_STORE, N - have, 5000, slots + have, &got) ==
              MARU_OK);
        have += got;
    }
    char k[N][64];
    const char *keys[N];
    uint64_t ids[N];
    size_t lens[N];
    for (int i = 0; i < N; i++) {
        key_of(k[i], sizeof k[i], "settle", i);
        keys[i] = k[i];
        ids[i] = slots[i].id;
        lens[i] = CHUNK;
        memset(slots[i].data, 0x60 + i, CHUNK);
    }
    maru_op_t *op = NULL;
    CHECK(maru_submit_store_slots(h, keys, ids, lens, N, NULL, &op) == MARU_OK);
    CHECK(maru_handler_close(h) == MARU_OK);
    /* The op outlives its handler and is final now. */
    CHECK(maru_op_poll(op) == MARU_OK);
    bool flags[N];
    size_t out_lens[N];
    CHECK(maru_op_results(op, flags, out_lens, N) == MARU_OK);
    int stored = 0;
    for (int i = 0; i < N; i++) stored += flags[i];
    maru_op_free(op);

    maru_handler_t *b = NULL;
    CHECK(maru_handler_open(cfg_b, &b) == MARU_OK);
    bool found[N];
    CHECK(maru_exists_batch(b, keys, N, NULL, found) == MARU_OK);
    int seen = 0;
    for (int i = 0; i < N; i++) seen += found[i];
    CHECK(maru_handler_close(b) == MARU_OK);
    printf("close settles a submitted store: %d of %d stored, %d found by another engine\n",
           stored, N, seen);
    CHECK(stored == N && seen == N);
}

/* Releases after maru_handler_shutdown succeed (the slots, views and pages are still
 * the caller's); other calls are refused. */
static void releases_after_shutdown_succeed(const char *cfg) {
    maru_handler_t *h = NULL;
    CHECK(maru_handler_open(cfg, &h) == MARU_OK);
    maru_slot_t slot;
    size_t got = 0;
    CHECK(maru_slots_acquire(h, MARU_SLOT_LOAD, 1, 5000, &slot, &got) == MARU_OK && got == 1);
    maru_view_t view;
    bool vfound = false;
    maru_page_t page;
    size_t pages = 0;
    if (strcmp(backend, "cxl") == 0) {
        char k[64];
        key_of(k, sizeof k, "view", 0);
        uint8_t data[CHUNK];
        memset(data, 0x33, sizeof data);
        bool stored = false;
        CHECK(maru_store(h, k, data, sizeof data, NULL, &stored) == MARU_OK && stored);
        const char *keys[1] = {k};
        CHECK(maru_views_acquire(h, keys, 1, NULL, &view, &vfound) == MARU_OK && vfound);
        CHECK(maru_pages_take(h, 1, NULL, &page, &pages) == MARU_OK && pages == 1);
    }
    CHECK(maru_handler_shutdown(h) == MARU_OK);
    bool found = true;
    CHECK(maru_exists(h, "any", NULL, &found) == MARU_ERR_CLOSED);
    CHECK(maru_slots_release(h, &slot.id, 1) == MARU_OK);
    if (vfound) {
        CHECK(view.data[0] == 0x33); /* still readable until released */
        CHECK(maru_views_release(h, &view.id, 1) == MARU_OK);
    }
    if (pages == 1) CHECK(maru_pages_give_back(h, &page, 1) == MARU_OK);
    CHECK(maru_handler_free(h) == MARU_OK);
    printf("releases after shutdown: MARU_OK (slots%s)\n", vfound ? ", views, pages" : "");
}

/* maru_pages_take(100000): up to n, at most 4096, never an error for a large n. */
static void pages_take_takes_up_to_n(const char *cfg) {
    enum { BIG = 100000 };
    maru_handler_t *h = NULL;
    CHECK(maru_handler_open(cfg, &h) == MARU_OK);
    maru_page_t *out = calloc(BIG, sizeof *out);
    CHECK(out != NULL);
    size_t got = 0;
    CHECK(maru_pages_take(h, BIG, NULL, out, &got) == MARU_OK);
    printf("pages_take(%d): took %zu\n", BIG, got);
    CHECK(got > 0 && got <= 4096);
    CHECK(maru_pages_give_back(h, out, got) == MARU_OK);
    free(out);
    CHECK(maru_handler_close(h) == MARU_OK);
}

/* An own region read in place is mapped twice; maru_region_view returns the writable
 * mapping, as the header says. */
static void region_view_returns_the_writable_mapping(const char *cfg) {
    maru_handler_t *h = NULL;
    CHECK(maru_handler_open(cfg, &h) == MARU_OK);
    maru_page_t page;
    size_t got = 0;
    CHECK(maru_pages_take(h, 1, NULL, &page, &got) == MARU_OK && got == 1);
    memset(page.data, 0x5A, CHUNK);
    char k[64];
    key_of(k, sizeof k, "region", 0);
    const char *keys[1] = {k};
    size_t len = CHUNK;
    bool published = false;
    CHECK(maru_pages_publish(h, keys, &page, &len, 1, &published) == MARU_OK && published);
    maru_view_t view;
    bool found = false;
    CHECK(maru_views_acquire(h, keys, 1, NULL, &view, &found) == MARU_OK && found);
    CHECK(view.data[0] == 0x5A);
    maru_region_t list[64];
    size_t count = 0;
    CHECK(maru_regions_list(h, list, 64, &count) == MARU_OK);
    int mappings = 0;
    for (size_t i = 0; i < count && i < 64; i++) mappings += list[i].region_id == page.region_id;
    maru_region_t r;
    memset(&r, 0, sizeof r);
    bool rfound = false;
    CHECK(maru_region_view(h, page.region_id, &r, &rfound) == MARU_OK && rfound);
    printf("region_view: region %llu has %d mapping(s); writable %d\n",
           (unsigned long long)page.region_id, mappings, (int)r.writable);
    CHECK(r.writable);
    CHECK(page.data >= r.data && page.data + CHUNK <= r.data + r.len);
    CHECK(maru_views_release(h, &view.id, 1) == MARU_OK);
    CHECK(maru_handler_close(h) == MARU_OK);
}

/* The memory hook: register holds the calling thread while `hold` is set and the
 * buffer is not the staging buffer (a CXL mapping made by a call). */
static struct {
    atomic_int hold;     /* 1: the next CXL mapping's register waits for release */
    atomic_int holding;  /* a register call is waiting now */
    atomic_int release;  /* 1: let it return */
    atomic_int registered;
} hk;

static int hold_register(void *ctx, void *ptr, size_t len) {
    (void)ctx;
    (void)ptr;
    (void)len;
    atomic_fetch_add(&hk.registered, 1);
    int one = 1;
    if (atomic_compare_exchange_strong(&hk.hold, &one, 0)) {
        atomic_store(&hk.holding, 1);
        double until = now_s() + 60;
        while (!atomic_load(&hk.release) && now_s() < until) sleep_ms(2);
        atomic_store(&hk.holding, 0);
    }
    return 0;
}

static void hook_unregister(void *ctx, void *ptr, size_t len) {
    (void)ctx;
    (void)ptr;
    (void)len;
}

struct held_call {
    maru_handler_t *h;
    const char *key;
    maru_status_t status;
    uint8_t buf[CHUNK];
    size_t len;
    atomic_int done;
    double returned_at;
};

/* Loads another engine's chunk: on cxl the call maps that engine's region on this
 * thread, so the register callback holds it. */
static void *load_through_hook(void *arg) {
    struct held_call *c = arg;
    c->status = maru_load(c->h, c->key, c->buf, sizeof c->buf, &c->len, NULL);
    c->returned_at = now_s();
    atomic_store(&c->done, 1);
    return NULL;
}

struct shutdown_call {
    maru_handler_t *h;
    atomic_int done;
    double returned_at;
};

static void *shutdown_thread(void *arg) {
    struct shutdown_call *s = arg;
    CHECK(maru_handler_shutdown(s->h) == MARU_OK);
    s->returned_at = now_s();
    atomic_store(&s->done, 1);
    return NULL;
}

/* Engine B stores a chunk; engine A, opened with the holding hook, starts a
 * maru_load of it, held in register while it maps B's region. */
static void start_held_call(const char *cfg, const char *cfg_b, maru_handler_t **h,
                            maru_handler_t **b, char *key, struct held_call *c, pthread_t *t) {
    memset(&hk, 0, sizeof hk);
    CHECK(maru_handler_open(cfg_b, b) == MARU_OK);
    uint8_t data[CHUNK];
    memset(data, 0x11, sizeof data);
    bool stored = false;
    CHECK(maru_store(*b, key, data, sizeof data, NULL, &stored) == MARU_OK && stored);
    CHECK(maru_set_memory_hook(hold_register, hook_unregister, NULL) == MARU_OK);
    CHECK(maru_handler_open(cfg, h) == MARU_OK); /* registers the staging buffer */
    /* Removed at once: the handler keeps the hook it was opened with, also for the
     * CXL mappings it makes later (as the header says). */
    CHECK(maru_set_memory_hook(NULL, NULL, NULL) == MARU_OK);
    atomic_store(&hk.hold, 1);
    memset(c, 0, sizeof *c);
    c->h = *h;
    c->key = key;
    CHECK(pthread_create(t, NULL, load_through_hook, c) == 0);
    double until = now_s() + 20;
    while (!atomic_load(&hk.holding) && !atomic_load(&c->done) && now_s() < until) sleep_ms(2);
    if (!atomic_load(&hk.holding))
        fprintf(stderr, "not held: %d register call(s); the call %s (%s)\n",
                atomic_load(&hk.registered), atomic_load(&c->done) ? "returned" : "runs",
                maru_status_str(c->status));
    CHECK(atomic_load(&hk.holding)); /* the call maps B's region on its own thread */
}

/* Rule 1: shutdown returns only after the call in flight left libmaru. */
static void shutdown_waits_for_calls_in_flight(const char *cfg, const char *cfg_b) {
    maru_handler_t *h = NULL, *b = NULL;
    struct held_call c;
    pthread_t t, st;
    char key[64];
    key_of(key, sizeof key, "held", 1);
    start_held_call(with_timeout(cfg, 10000), cfg_b, &h, &b, key, &c, &t);
    struct shutdown_call s = {h, 0, 0};
    CHECK(pthread_create(&st, NULL, shutdown_thread, &s) == 0);
    sleep_ms(500);
    /* The store is still inside libmaru (held in the callback): shutdown waits. */
    CHECK(!atomic_load(&s.done));
    CHECK(!atomic_load(&c.done));
    atomic_store(&hk.release, 1);
    CHECK(pthread_join(st, NULL) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    printf("shutdown waited for the held call: it returned %s %.3f s before shutdown did\n",
           maru_status_str(c.status), s.returned_at - c.returned_at);
    /* It ended before shutdown gave up: its own result stands. */
    CHECK(c.status == MARU_OK && c.len == CHUNK && c.buf[0] == 0x11);
    CHECK(maru_handler_free(h) == MARU_OK);
    CHECK(maru_handler_close(b) == MARU_OK);
}

/* Rule 2: a call that outlived a bounded shutdown returns MARU_ERR_CLOSED. */
static void a_call_outliving_shutdown_returns_closed(const char *cfg, const char *cfg_b) {
    maru_handler_t *h = NULL, *b = NULL;
    struct held_call c;
    pthread_t t;
    char key[64];
    key_of(key, sizeof key, "held", 2);
    start_held_call(with_timeout(cfg, 1500), cfg_b, &h, &b, key, &c, &t);
    double t0 = now_s();
    CHECK(maru_handler_shutdown(h) == MARU_OK);
    double took = now_s() - t0;
    CHECK(took >= 1.0 && took < 10.0); /* it waited its timeout_ms, then gave up */
    CHECK(!atomic_load(&c.done));
    atomic_store(&hk.release, 1);
    CHECK(pthread_join(t, NULL) == 0);
    printf("shutdown gave up after %.3f s; the held call then returned %s\n", took,
           maru_status_str(c.status));
    CHECK(c.status == MARU_ERR_CLOSED);
    CHECK(maru_handler_free(h) == MARU_OK);
    CHECK(maru_handler_close(b) == MARU_OK);
}

int main(void) {
    const char *cfg = getenv("MARU_TEST_CONFIG_A");
    const char *cfg_b = getenv("MARU_TEST_CONFIG_B");
    backend = getenv("MARU_TEST_BACKEND");
    CHECK(cfg != NULL && cfg_b != NULL && backend != NULL);
    snprintf(tag, sizeof tag, "%s-%ld", backend, (long)time(NULL));
    load_batch_loads_past_a_miss(cfg);
    close_settles_a_submitted_store(cfg, cfg_b);
    releases_after_shutdown_succeed(cfg);
    if (strcmp(backend, "cxl") == 0) {
        shutdown_waits_for_calls_in_flight(cfg, cfg_b);
        a_call_outliving_shutdown_returns_closed(cfg, cfg_b);
        region_view_returns_the_writable_mapping(cfg);
        /* Last: it takes every page the pool has. */
        pages_take_takes_up_to_n(cfg);
    }
    printf("ok\n");
    return 0;
}
