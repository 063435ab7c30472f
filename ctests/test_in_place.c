/* Writes in place (backend cxl) through the C API, and the memory hook in `auto` mode
 * (a fake libcudart) over every CXL mapping: engine A takes pages, writes chunks into
 * the mapping, publishes them; engine B reads them in place (mapping A's region
 * read-only). Every mapping and staging buffer is registered once and unregistered
 * once, while still mapped. Run by with_daemons.sh with backend cxl. */
#define _POSIX_C_SOURCE 200809L
#include "check.h"
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#ifndef FAKE_CUDART_PATH
#error "FAKE_CUDART_PATH must name the fake libcudart"
#endif

#define N 6

int main(void) {
    const char *ca = getenv("MARU_TEST_CONFIG_A");
    const char *cb = getenv("MARU_TEST_CONFIG_B");
    CHECK(ca && cb);
    CHECK(setenv("MARU_CUDART", FAKE_CUDART_PATH, 1) == 0);
    CHECK(maru_set_memory_hook_auto() == MARU_OK);

    maru_handler_t *a = NULL, *b = NULL;
    CHECK(maru_handler_open(ca, &a) == MARU_OK);
    CHECK(maru_handler_open(cb, &b) == MARU_OK);

    /* A: take pages, write in place, publish. */
    maru_page_t pages[N];
    size_t got = 0;
    CHECK(maru_pages_take(a, N, "req", pages, &got) == MARU_OK && got == N);
    const char *keys[N];
    char names[N][32];
    size_t lens[N];
    uint32_t sums[N];
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "req/c%d", i);
        keys[i] = names[i];
        lens[i] = 1000 + (size_t)i * 4096;
        CHECK(lens[i] <= pages[i].capacity);
        for (size_t k = 0; k < lens[i]; k++) pages[i].data[k] = (uint8_t)(k * 7 + (size_t)i);
        sums[i] = fnv(pages[i].data, lens[i]);
    }
    bool found[N];
    CHECK(maru_exists_batch(b, keys, N, "req", found) == MARU_OK && !found[0]);
    /* Another handler cannot publish A's pages. */
    CHECK(maru_pages_publish(b, keys, pages, lens, N, NULL) == MARU_ERR_INVALID_ARGUMENT);
    /* A length over the page: refused, nothing published, the pages stay A's. */
    size_t too_long = pages[0].capacity + 1;
    CHECK(maru_pages_publish(a, keys, pages, &too_long, 1, NULL) == MARU_ERR_INVALID_ARGUMENT);
    /* Give one back, publish the rest. */
    CHECK(maru_pages_give_back(a, &pages[N - 1], 1) == MARU_OK);
    bool published[N];
    CHECK(maru_pages_publish(a, keys, pages, lens, N - 1, published) == MARU_OK);
    for (int i = 0; i < N - 1; i++) CHECK(published[i]);
    CHECK(maru_pages_publish(a, keys, pages, lens, 1, NULL) == MARU_ERR_INVALID_ARGUMENT);

    /* A's own region is listed, writable. */
    maru_region_t regions[8];
    size_t count = 0;
    CHECK(maru_regions_list(a, regions, 8, &count) == MARU_OK && count >= 1);
    CHECK(regions[0].writable && regions[0].page_size == pages[0].capacity);
    bool has = false;
    maru_region_t r;
    CHECK(maru_region_view(a, pages[0].region_id, &r, &has) == MARU_OK && has);
    CHECK(r.data + pages[0].offset == pages[0].data);

    /* B reads in place: A's region mapped read-only in B. */
    maru_view_t views[N];
    CHECK(maru_views_acquire(b, keys, N - 1, "req", views, found) == MARU_OK);
    uint64_t ids[N];
    for (int i = 0; i < N - 1; i++) {
        CHECK(found[i] && views[i].len == lens[i] && fnv(views[i].data, views[i].len) == sums[i]);
        ids[i] = views[i].id;
    }
    CHECK(maru_regions_list(b, regions, 8, &count) == MARU_OK && count >= 1 && !regions[0].writable);
    CHECK(maru_views_release(b, ids, N - 1) == MARU_OK);

    /* A NULL out-count is named, as for every call. */
    CHECK(maru_pages_take(a, 1, NULL, NULL, NULL) == MARU_ERR_NULL_ARGUMENT);

    CHECK(maru_handler_close(a) == MARU_OK);
    CHECK(maru_handler_close(b) == MARU_OK);

    void *cuda = dlopen(FAKE_CUDART_PATH, RTLD_NOW);
    CHECK(cuda != NULL);
    int (*entry)(int, size_t *, int *, int *, int *);
    *(void **)(&entry) = dlsym(cuda, "fake_cudart_entry");
    CHECK(entry != NULL);
    size_t len = 0;
    int reg = 0, unreg = 0, mapped = 0;
    int n = entry(-1, &len, &reg, &unreg, &mapped);
    /* Two staging buffers, A's own region, B's read-only mapping of it. */
    CHECK(n >= 4);
    for (int i = 0; i < n; i++) {
        entry(i, &len, &reg, &unreg, &mapped);
        if (reg != 1 || unreg != 1 || mapped != 1)
            fprintf(stderr, "mapping %d (%zu bytes): registered %d, unregistered %d, mapped at unregister %d\n",
                    i, len, reg, unreg, mapped);
        CHECK(reg == 1 && unreg == 1 && mapped == 1);
    }
    CHECK(maru_set_memory_hook(NULL, NULL, NULL) == MARU_OK);
    dlclose(cuda);
    printf("test_in_place: %d chunks written in place and read in place; %d buffers registered and unregistered once each\n",
           N - 1, n);
    return 0;
}
