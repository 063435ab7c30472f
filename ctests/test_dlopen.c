/* Loads libmaru.so by path with dlopen, as a C++ runtime or ctypes does, and
 * checks that every function of the header is exported. Run by with_daemons.sh
 * (MARU_TEST_CONFIG_A/B set), two engines also share KV through the loaded library. */
#define _POSIX_C_SOURCE 200809L
#include "maru.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MARU_SO_PATH
#error "MARU_SO_PATH must name libmaru.so"
#endif

static const char *const symbols[] = {
    "maru_abi_version",     "maru_last_error",        "maru_last_error_copy",
    "maru_status_str",      "maru_version_string",    "maru_handler_open",
    "maru_handler_close",   "maru_store",             "maru_load",
    "maru_exists",          "maru_exists_batch",      "maru_store_batch",
    "maru_load_batch",      "maru_stats_json",        "maru_chunk_size",
    "maru_slots_acquire",   "maru_slots_release",     "maru_store_slots",
    "maru_load_slots",      "maru_submit_store_slots", "maru_submit_load_slots",
    "maru_op_poll",         "maru_op_wait",           "maru_op_results",
    "maru_op_free",         "maru_set_memory_hook",   "maru_set_memory_hook_auto",
    "maru_views_acquire",   "maru_views_release",     "maru_slots_held",
    "maru_remove_batch",    "maru_pin_batch",         "maru_unpin_batch",
    "maru_handler_shutdown", "maru_handler_free",     "maru_set_log_callback",
    "maru_chunk_keys",
};

#define SYM(lib, name, type, var)                                                   \
  type var;                                                                        \
  *(void **)(&var) = dlsym(lib, name);                                             \
  if (var == NULL) {                                                               \
    fprintf(stderr, "dlsym %s: %s\n", name, dlerror());                            \
    return 1;                                                                      \
  }

/* Two engines share chunks through the dlopened library; 0 when every checksum
 * matches. */
static int share(void *lib, const char *ca, const char *cb) {
  typedef maru_status_t (*open_fn)(const char *, maru_handler_t **);
  typedef maru_status_t (*close_fn)(maru_handler_t *);
  typedef maru_status_t (*store_fn)(const maru_handler_t *, const char *, const uint8_t *,
                                    size_t, const char *, bool *);
  typedef maru_status_t (*load_fn)(const maru_handler_t *, const char *, uint8_t *, size_t,
                                   size_t *, const char *);
  typedef const char *(*last_error_fn)(void);
  SYM(lib, "maru_handler_open", open_fn, open_h);
  SYM(lib, "maru_handler_close", close_fn, close_h);
  SYM(lib, "maru_store", store_fn, store);
  SYM(lib, "maru_load", load_fn, load);
  SYM(lib, "maru_last_error", last_error_fn, last_error);
  maru_handler_t *a = NULL, *b = NULL;
  if (open_h(ca, &a) != MARU_OK || open_h(cb, &b) != MARU_OK) {
    fprintf(stderr, "open: %s\n", last_error());
    return 1;
  }
  static uint8_t data[50000], out[50000];
  for (int i = 0; i < 32; i++) {
    char key[32];
    snprintf(key, sizeof key, "dl-%02d", i);
    size_t len = 1000 + (size_t)i * 1500;
    for (size_t k = 0; k < len; k++) data[k] = (uint8_t)(k * 31 + (size_t)i);
    bool stored = false;
    if (store(a, key, data, len, "dl-00", &stored) != MARU_OK || !stored) {
      fprintf(stderr, "store %s: %s\n", key, last_error());
      return 1;
    }
    size_t got = 0;
    if (load(b, key, out, sizeof out, &got, "dl-00") != MARU_OK || got != len ||
        memcmp(out, data, len) != 0) {
      fprintf(stderr, "load %s: %s (got %zu of %zu)\n", key, last_error(), got, len);
      return 1;
    }
  }
  if (close_h(a) != MARU_OK || close_h(b) != MARU_OK) {
    fprintf(stderr, "close: %s\n", last_error());
    return 1;
  }
  printf("test_dlopen: 32 chunks shared through the dlopened library\n");
  return 0;
}

int main(void) {
  void *lib = dlopen(MARU_SO_PATH, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "dlopen %s: %s\n", MARU_SO_PATH, dlerror());
    return EXIT_FAILURE;
  }
  int failures = 0;
  for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
    if (dlsym(lib, symbols[i]) == NULL) {
      fprintf(stderr, "dlsym %s: %s\n", symbols[i], dlerror());
      failures++;
    }
  }

  uint32_t (*abi_version)(void);
  /* POSIX-sanctioned conversion from the object pointer dlsym returns. */
  *(void **)(&abi_version) = dlsym(lib, "maru_abi_version");
  if (abi_version == NULL) {
    fprintf(stderr, "dlsym maru_abi_version: %s\n", dlerror());
    return EXIT_FAILURE;
  }
  uint32_t got = abi_version();
  if (got != MARU_ABI_VERSION) {
    fprintf(stderr, "maru_abi_version() = %u, header says %u\n", got, MARU_ABI_VERSION);
    failures++;
  }
  const char *ca = getenv("MARU_TEST_CONFIG_A"), *cb = getenv("MARU_TEST_CONFIG_B");
  if (ca && cb && failures == 0) failures += share(lib, ca, cb);
  if (dlclose(lib) != 0) {
    fprintf(stderr, "dlclose: %s\n", dlerror());
    failures++;
  }
  if (failures != 0) return EXIT_FAILURE;
  printf("test_dlopen: ok (ABI %u from %s)\n", got, MARU_SO_PATH);
  return EXIT_SUCCESS;
}
