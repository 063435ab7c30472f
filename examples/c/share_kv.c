/* Two engines share KV through libmaru.so, loaded with dlopen as an inference runtime
 * would load it. Engine A writes each chunk into a staging slot in place (where a
 * runtime's GPU→host copy would land) and stores from the slots asynchronously;
 * engine B checks which chunks exist, loads them into its own slots and verifies them.
 *
 * Build:  cc -std=c11 -I include examples/c/share_kv.c -ldl -o /tmp/share_kv
 * Run:    examples/c/run.sh   (starts the daemons on loopback, builds and runs this)
 * Usage:  share_kv LIBMARU.so CONFIG_A_JSON CONFIG_B_JSON [CHUNKS]
 */
#define _POSIX_C_SOURCE 200809L
#include "maru.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The functions this example uses, resolved from the library. */
static struct {
    maru_status_t (*open)(const char *, maru_handler_t **);
    maru_status_t (*close)(maru_handler_t *);
    maru_status_t (*acquire)(const maru_handler_t *, uint32_t, size_t, uint32_t, maru_slot_t *, size_t *);
    maru_status_t (*release)(const maru_handler_t *, const uint64_t *, size_t);
    maru_status_t (*submit_store)(const maru_handler_t *, const char *const *, const uint64_t *,
                                  const size_t *, size_t, const char *, maru_op_t **);
    maru_status_t (*load_slots)(const maru_handler_t *, const char *const *, const uint64_t *, size_t,
                                const char *, size_t *, bool *);
    maru_status_t (*exists_batch)(const maru_handler_t *, const char *const *, size_t, const char *, bool *);
    maru_status_t (*op_wait)(const maru_op_t *, uint32_t);
    maru_status_t (*op_results)(const maru_op_t *, bool *, size_t *, size_t);
    void (*op_free)(maru_op_t *);
    maru_status_t (*hook_auto)(void);
    const char *(*last_error)(void);
    uint32_t (*abi_version)(void);
} m;

static int resolve(void *lib) {
    struct { const char *name; void **slot; } syms[] = {
        {"maru_handler_open", (void **)&m.open},
        {"maru_handler_close", (void **)&m.close},
        {"maru_slots_acquire", (void **)&m.acquire},
        {"maru_slots_release", (void **)&m.release},
        {"maru_submit_store_slots", (void **)&m.submit_store},
        {"maru_load_slots", (void **)&m.load_slots},
        {"maru_exists_batch", (void **)&m.exists_batch},
        {"maru_op_wait", (void **)&m.op_wait},
        {"maru_op_results", (void **)&m.op_results},
        {"maru_op_free", (void **)&m.op_free},
        {"maru_set_memory_hook_auto", (void **)&m.hook_auto},
        {"maru_last_error", (void **)&m.last_error},
        {"maru_abi_version", (void **)&m.abi_version},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].slot = dlsym(lib, syms[i].name);
        if (*syms[i].slot == NULL) {
            fprintf(stderr, "%s is not in the library: %s\n", syms[i].name, dlerror());
            return -1;
        }
    }
    return 0;
}

#define TRY(call)                                                                        \
    do {                                                                                 \
        maru_status_t st_ = (call);                                                      \
        if (st_ != MARU_OK) {                                                            \
            fprintf(stderr, "%s failed (%u): %s\n", #call, (unsigned)st_, m.last_error()); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

#define BATCH 8

/* A chunk's bytes: a pattern from its index, so the reader can check it. */
static uint8_t pattern(int chunk, size_t k) { return (uint8_t)(chunk * 131 + k * 7); }

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s LIBMARU.so CONFIG_A_JSON CONFIG_B_JSON [CHUNKS]\n", argv[0]);
        return 2;
    }
    int chunks = argc > 4 ? atoi(argv[4]) : 64;
    if (chunks <= 0 || chunks % BATCH != 0) {
        fprintf(stderr, "CHUNKS must be a positive multiple of %d\n", BATCH);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
        return 1;
    }
    if (resolve(lib) != 0) return 1;
    if (m.abi_version() != MARU_ABI_VERSION) {
        fprintf(stderr, "libmaru ABI %u, this program was built for %u\n", m.abi_version(), MARU_ABI_VERSION);
        return 1;
    }
    /* Pin staging buffers with CUDA when it is there (logged either way). */
    TRY(m.hook_auto());
    maru_handler_t *a, *b;
    TRY(m.open(argv[2], &a));
    TRY(m.open(argv[3], &b));

    char names[BATCH][48];
    const char *keys[BATCH];
    const char *route = "example-request-0/chunk-0";
    size_t stored = 0, loaded = 0, bad = 0, bytes = 0;
    for (int base = 0; base < chunks; base += BATCH) {
        for (int i = 0; i < BATCH; i++) {
            snprintf(names[i], sizeof names[i], "example-request-0/chunk-%d", base + i);
            keys[i] = names[i];
        }
        /* Engine A: fill store slots in place, store them without waiting. */
        maru_slot_t s[BATCH];
        size_t got = 0;
        TRY(m.acquire(a, MARU_SLOT_STORE, BATCH, 1000, s, &got));
        uint64_t ids[BATCH];
        size_t lens[BATCH];
        for (size_t i = 0; i < got; i++) {
            lens[i] = s[i].capacity / 2 + i;
            for (size_t k = 0; k < lens[i]; k++) s[i].data[k] = pattern(base + (int)i, k);
            ids[i] = s[i].id;
        }
        maru_op_t *op;
        TRY(m.submit_store(a, keys, ids, lens, got, route, &op));
        /* ... a runtime would compute the next layer here ... */
        TRY(m.op_wait(op, 10000));
        bool ok[BATCH];
        TRY(m.op_results(op, ok, NULL, got));
        for (size_t i = 0; i < got; i++) stored += ok[i];
        m.op_free(op);
        TRY(m.release(a, ids, got));

        /* Engine B: which of them exist, then load into its own slots and check. */
        bool found[BATCH];
        TRY(m.exists_batch(b, keys, got, route, found));
        maru_slot_t r[BATCH];
        size_t rgot = 0;
        TRY(m.acquire(b, MARU_SLOT_LOAD, got, 1000, r, &rgot));
        uint64_t rids[BATCH];
        for (size_t i = 0; i < rgot; i++) rids[i] = r[i].id;
        size_t rlens[BATCH];
        bool hit[BATCH];
        TRY(m.load_slots(b, keys, rids, rgot, route, rlens, hit));
        for (size_t i = 0; i < rgot; i++) {
            if (!hit[i]) continue;
            loaded++;
            bytes += rlens[i];
            for (size_t k = 0; k < rlens[i]; k++)
                if (r[i].data[k] != pattern(base + (int)i, k)) { bad++; break; }
        }
        TRY(m.release(b, rids, rgot));
    }
    TRY(m.close(a));
    TRY(m.close(b));
    printf("engine A stored %zu chunks, engine B loaded %zu (%.1f MiB), %zu mismatched\n",
           stored, loaded, (double)bytes / (1 << 20), bad);
    dlclose(lib);
    return (stored == (size_t)chunks && loaded == stored && bad == 0) ? 0 : 1;
}
