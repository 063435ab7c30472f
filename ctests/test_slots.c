/* The zero-copy slot API against real daemons (with_daemons.sh sets the configs):
 * engine A fills store slots in place and stores from them (synchronously and
 * submitted), engine B loads into load slots (both ways) and every checksum matches;
 * the memory hook is called with the staging buffer before first use and on close,
 * both with the runtime's callbacks and in `auto` mode (a fake libcudart named by
 * MARU_CUDART); every bad-argument path of the slot functions. */
#define _POSIX_C_SOURCE 200809L
#include <maru.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#ifndef FAKE_CUDART_PATH
#error "FAKE_CUDART_PATH must name the fake libcudart"
#endif

#define N 64
#define BATCH 8

static size_t fill(uint8_t *buf, size_t cap, int i) {
    size_t len = 512 + (size_t)(i * 797) % (cap - 512);
    fill_pattern(buf, len, (uint32_t)i * 2654435761u + 7);
    return len;
}

/* Every buffer registered (one per handler), and how often each was unregistered. */
struct hook_calls {
    int reg;
    void *ptr[4];
    size_t len[4];
    int unreg[4];
};

static int on_register(void *ctx, void *ptr, size_t len) {
    struct hook_calls *c = ctx;
    if (c->reg >= 4) return 1;
    c->ptr[c->reg] = ptr;
    c->len[c->reg] = len;
    c->reg++;
    return 0;
}

static void on_unregister(void *ctx, void *ptr, size_t len) {
    struct hook_calls *c = ctx;
    for (int i = 0; i < c->reg; i++)
        if (ptr == c->ptr[i] && len == c->len[i]) c->unreg[i]++;
}

static int refuse_register(void *ctx, void *ptr, size_t len) {
    (void)ctx; (void)ptr; (void)len;
    return 5;
}

int main(void) {
    const char *ca = getenv("MARU_TEST_CONFIG_A");
    const char *cb = getenv("MARU_TEST_CONFIG_B");
    CHECK(ca && cb);
    /* Before any `auto` hook runs: libmaru finds libcudart once per process. */
    CHECK(setenv("MARU_CUDART", FAKE_CUDART_PATH, 1) == 0);

    struct hook_calls calls;
    memset(&calls, 0, sizeof calls);
    CHECK(maru_set_memory_hook(on_register, on_unregister, &calls) == MARU_OK);
    maru_handler_t *a = NULL, *b = NULL;
    CHECK(maru_handler_open(ca, &a) == MARU_OK);
    CHECK(calls.reg == 1 && calls.ptr[0] != NULL && calls.len[0] > 0);
    CHECK(maru_handler_open(cb, &b) == MARU_OK);
    CHECK(calls.reg == 2);

    maru_slot_t slots[BATCH];
    size_t got = 0;
    uint32_t sums[N];
    char kb[N][32];
    const char *keys[N];
    for (int i = 0; i < N; i++) {
        snprintf(kb[i], sizeof kb[i], "slot-c-%03d", i);
        keys[i] = kb[i];
    }
    for (int r = 0; r < N / BATCH; r++) {
        CHECK(maru_slots_acquire(a, MARU_SLOT_STORE, BATCH, 5000, slots, &got) == MARU_OK);
        CHECK(got == BATCH);
        uint64_t ids[BATCH];
        size_t lens[BATCH];
        for (int k = 0; k < BATCH; k++) {
            int i = r * BATCH + k;
            /* The slot lies inside the registered staging buffer. */
            CHECK(slots[k].data >= (uint8_t *)calls.ptr[0] &&
                  slots[k].data + slots[k].capacity <= (uint8_t *)calls.ptr[0] + calls.len[0]);
            lens[k] = fill(slots[k].data, slots[k].capacity, i);
            sums[i] = fnv(slots[k].data, lens[k]);
            ids[k] = slots[k].id;
        }
        bool stored[BATCH];
        size_t first_held = 0; /* ids[0] is released early when the op already finished */
        if (r % 2 == 0) {
            CHECK(maru_store_slots(a, &keys[r * BATCH], ids, lens, BATCH, keys[0], stored) == MARU_OK);
        } else {
            maru_op_t *op = NULL;
            CHECK(maru_submit_store_slots(a, &keys[r * BATCH], ids, lens, BATCH, keys[0], &op) == MARU_OK);
            /* Lent to the operation: releasing now is refused, or it already finished. */
            maru_status_t rel = maru_slots_release(a, ids, 1);
            CHECK(rel == MARU_ERR_BUSY || rel == MARU_OK);
            if (rel == MARU_OK) first_held = 1;
            CHECK(maru_op_wait(op, 30000) == MARU_OK);
            CHECK(maru_op_poll(op) == MARU_OK);
            CHECK(maru_op_results(op, stored, NULL, BATCH) == MARU_OK);
            CHECK(maru_op_results(op, stored, NULL, BATCH + 1) == MARU_ERR_INVALID_ARGUMENT);
            maru_op_free(op);
        }
        for (int k = 0; k < BATCH; k++) CHECK(stored[k]);
        CHECK(maru_slots_release(a, ids + first_held, BATCH - first_held) == MARU_OK);
    }
    bool found[N];
    CHECK(maru_exists_batch(b, keys, N, keys[0], found) == MARU_OK);
    for (int i = 0; i < N; i++) CHECK(found[i]);
    for (int r = 0; r < N / BATCH; r++) {
        CHECK(maru_slots_acquire(b, MARU_SLOT_LOAD, BATCH, 5000, slots, &got) == MARU_OK);
        CHECK(got == BATCH);
        uint64_t ids[BATCH];
        size_t lens[BATCH];
        bool hit[BATCH];
        for (int k = 0; k < BATCH; k++) ids[k] = slots[k].id;
        if (r % 2 == 0) {
            CHECK(maru_load_slots(b, &keys[r * BATCH], ids, BATCH, keys[0], lens, hit) == MARU_OK);
        } else {
            maru_op_t *op = NULL;
            CHECK(maru_submit_load_slots(b, &keys[r * BATCH], ids, BATCH, keys[0], &op) == MARU_OK);
            maru_status_t st;
            int polls = 0;
            while ((st = maru_op_poll(op)) == MARU_PENDING && polls < 3000) {
                CHECK(maru_op_wait(op, 10) == MARU_OK || maru_op_poll(op) == MARU_PENDING);
                polls++;
            }
            CHECK(st == MARU_OK);
            CHECK(maru_op_results(op, hit, NULL, BATCH) == MARU_ERR_NULL_ARGUMENT);
            CHECK(maru_op_results(op, hit, lens, BATCH) == MARU_OK);
            maru_op_free(op);
        }
        for (int k = 0; k < BATCH; k++) {
            int i = r * BATCH + k;
            CHECK(hit[k] && fnv(slots[k].data, lens[k]) == sums[i]);
        }
        CHECK(maru_slots_release(b, ids, BATCH) == MARU_OK);
        /* Already released: a caller bug, refused (nothing released). */
        CHECK(maru_slots_release(b, ids, BATCH) == MARU_ERR_INVALID_ARGUMENT);
    }

    {
        /* Only the engine that stored a key removes it; a key never stored is not found. */
        const char *two[2] = {keys[N - 1], "never-stored-remove"};
        maru_remove_result_t res[2];
        CHECK(maru_remove_batch(b, two, 1, keys[0], res) == MARU_OK && res[0] == MARU_REMOVE_NOT_OWNER);
        CHECK(maru_remove_batch(a, two, 2, keys[0], res) == MARU_OK);
        CHECK(res[0] == MARU_REMOVED && res[1] == MARU_REMOVE_NOT_FOUND);
        bool f1 = true;
        CHECK(maru_exists_batch(b, two, 1, keys[0], &f1) == MARU_OK && !f1);
        CHECK(maru_remove_batch(a, two, 1, NULL, NULL) == MARU_ERR_NULL_ARGUMENT);
        /* A pin keeps a key from removal until its engine unpins it. */
        const char *k2[2] = {keys[N - 2], "never-stored-pin"};
        bool pinned[2] = {false, true};
        CHECK(maru_pin_batch(b, k2, 2, keys[0], pinned) == MARU_OK && pinned[0] && !pinned[1]);
        CHECK(maru_remove_batch(a, k2, 1, keys[0], res) == MARU_OK && res[0] == MARU_REMOVE_PINNED);
        CHECK(maru_unpin_batch(a, k2, 1, keys[0], pinned) == MARU_OK && !pinned[0]); /* not a's pin */
        CHECK(maru_unpin_batch(b, k2, 1, keys[0], pinned) == MARU_OK && pinned[0]);
        CHECK(maru_remove_batch(a, k2, 1, keys[0], res) == MARU_OK && res[0] == MARU_REMOVED);
        CHECK(maru_pin_batch(b, k2, 1, keys[0], NULL) == MARU_ERR_NULL_ARGUMENT);
        CHECK(maru_unpin_batch(NULL, k2, 1, keys[0], pinned) == MARU_ERR_NULL_ARGUMENT);
    }

    /* Bad arguments. */
    CHECK(maru_slots_acquire(a, 7, 1, 10, slots, &got) == MARU_ERR_INVALID_ARGUMENT);
    CHECK(strstr(maru_last_error(), "MARU_SLOT_LOAD") != NULL);
    CHECK(maru_slots_acquire(a, MARU_SLOT_LOAD, 1, 10, NULL, &got) == MARU_ERR_NULL_ARGUMENT);
    CHECK(maru_slots_acquire(NULL, MARU_SLOT_LOAD, 1, 10, slots, &got) == MARU_ERR_NULL_ARGUMENT);
    CHECK(maru_slots_acquire(a, MARU_SLOT_STORE, 1, 1000, slots, &got) == MARU_OK && got == 1);
    uint64_t id = slots[0].id;
    size_t too_long = slots[0].capacity + 1;
    CHECK(maru_store_slots(a, keys, &id, &too_long, 1, NULL, NULL) == MARU_ERR_INVALID_ARGUMENT);
    uint64_t bogus = 123456789;
    size_t one = 1;
    CHECK(maru_store_slots(a, keys, &bogus, &one, 1, NULL, NULL) == MARU_ERR_INVALID_ARGUMENT);
    CHECK(strstr(maru_last_error(), "not held") != NULL);
    CHECK(maru_store_slots(a, NULL, &id, &one, 1, NULL, NULL) == MARU_ERR_NULL_ARGUMENT);
    size_t len1;
    bool hit1;
    const char *miss = "never-stored-slot";
    CHECK(maru_load_slots(a, &miss, &id, 1, NULL, &len1, &hit1) == MARU_OK && !hit1 && len1 == 0);
    CHECK(maru_load_slots(a, &miss, &id, 1, NULL, NULL, &hit1) == MARU_ERR_NULL_ARGUMENT);
    bool held1 = false;
    CHECK(maru_slots_held(a, &id, 1, &held1) == MARU_OK && held1); /* a miss keeps the slot */
    CHECK(maru_slots_release(a, &id, 1) == MARU_OK);
    CHECK(maru_slots_held(a, &id, 1, &held1) == MARU_OK && !held1);
    CHECK(maru_slots_held(a, &id, 1, NULL) == MARU_ERR_NULL_ARGUMENT);
    CHECK(maru_op_poll(NULL) == MARU_ERR_NULL_ARGUMENT);
    CHECK(maru_op_wait(NULL, 1) == MARU_ERR_NULL_ARGUMENT);
    maru_op_free(NULL);
    CHECK(maru_exists_batch(a, keys, 1, NULL, NULL) == MARU_ERR_NULL_ARGUMENT);

    {
        /* n = 0 with NULL arrays (an empty std::vector's data()) is a valid empty call. */
        CHECK(maru_store_batch(a, NULL, NULL, NULL, 0, NULL, NULL) == MARU_OK);
        CHECK(maru_load_batch(a, NULL, NULL, NULL, NULL, NULL, 0, NULL) == MARU_OK);
        CHECK(maru_exists_batch(a, NULL, 0, NULL, NULL) == MARU_OK);
        CHECK(maru_store_slots(a, NULL, NULL, NULL, 0, NULL, NULL) == MARU_OK);
        CHECK(maru_load_slots(a, NULL, NULL, 0, NULL, NULL, NULL) == MARU_OK);
        CHECK(maru_slots_release(a, NULL, 0) == MARU_OK);
        CHECK(maru_slots_held(a, NULL, 0, NULL) == MARU_OK);
        CHECK(maru_remove_batch(a, NULL, 0, NULL, NULL) == MARU_OK);
        CHECK(maru_pin_batch(a, NULL, 0, NULL, NULL) == MARU_OK);
        size_t got0 = 5;
        CHECK(maru_slots_acquire(a, MARU_SLOT_LOAD, 0, 0, NULL, &got0) == MARU_OK && got0 == 0);
        /* ... but a NULL array with entries is named. */
        CHECK(maru_exists_batch(a, NULL, 1, NULL, NULL) == MARU_ERR_NULL_ARGUMENT);
        /* Releasing an id never acquired is refused. */
        uint64_t bogus = 0xdeadbeef;
        CHECK(maru_slots_release(a, &bogus, 1) == MARU_ERR_INVALID_ARGUMENT);
        /* An unknown pool value is an error, not undefined behaviour. */
        maru_slot_t one;
        CHECK(maru_slots_acquire(a, (maru_slot_pool_t)7, 1, 0, &one, &got0) == MARU_ERR_INVALID_ARGUMENT);
    }
    CHECK(maru_handler_close(a) == MARU_OK);
    CHECK(maru_handler_close(b) == MARU_OK);
    CHECK(calls.unreg[0] == 1 && calls.unreg[1] == 1); /* each exactly once */

    /* A register callback that fails fails the open. */
    CHECK(maru_set_memory_hook(refuse_register, NULL, NULL) == MARU_OK);
    maru_handler_t *c = NULL;
    CHECK(maru_handler_open(ca, &c) == MARU_ERR_CONFIG && c == NULL);
    CHECK(strstr(maru_last_error(), "returned 5") != NULL);

    /* auto: the (fake) CUDA runtime pins the staging buffer and unpins it on close. */
    CHECK(maru_set_memory_hook_auto() == MARU_OK);
    CHECK(maru_handler_open(ca, &c) == MARU_OK);
    void *cuda = dlopen(FAKE_CUDART_PATH, RTLD_NOW);
    CHECK(cuda != NULL);
    void (*calls_of)(int *, int *, size_t *, unsigned int *);
    *(void **)(&calls_of) = dlsym(cuda, "fake_cudart_calls");
    CHECK(calls_of != NULL);
    int reg = 0, unreg = 0;
    size_t len = 0;
    unsigned int flags = 0;
    calls_of(&reg, &unreg, &len, &flags);
    CHECK(reg == 1 && unreg == 0 && len == calls.len[0] && flags == 1 /* portable */);
    CHECK(maru_handler_close(c) == MARU_OK);
    calls_of(&reg, &unreg, &len, &flags);
    CHECK(reg == 1 && unreg == 1);
    CHECK(maru_set_memory_hook(NULL, NULL, NULL) == MARU_OK);
    dlclose(cuda);
    printf("test_slots (%s): %d chunks through slots, memory hook called, auto mode pinned\n",
           getenv("MARU_TEST_BACKEND"), N);
    return 0;
}
