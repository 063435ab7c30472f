/* The C ABI basics of libmaru.so, linked through include/maru.h. */
#define _POSIX_C_SOURCE 200809L
#include "maru.h"
#include "maru.h" /* the include guard holds */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(maru_status_t) == 4, "maru_status_t is a 32-bit code");
_Static_assert(MARU_OK == 0, "status values are stable");
_Static_assert(MARU_ERR_NULL_ARGUMENT == 1, "status values are stable");
_Static_assert(MARU_ERR_BUFFER_TOO_SMALL == 14, "status values are stable");
_Static_assert(MARU_ERR_PANIC == 99, "status values are stable");

static int failures = 0;

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      failures++;                                                            \
    }                                                                        \
  } while (0)

static void test_versions(void) {
  CHECK(maru_abi_version() == MARU_ABI_VERSION);
  const char *version = maru_version_string();
  CHECK(version != NULL);
  CHECK(version != NULL && strlen(version) > 0);
}

static void test_status_str(void) {
  const uint32_t codes[] = {MARU_OK, MARU_ERR_NULL_ARGUMENT, MARU_ERR_INVALID_ARGUMENT,
                            MARU_ERR_CONFIG, MARU_ERR_NOT_FOUND, MARU_ERR_BUFFER_TOO_SMALL,
                            MARU_ERR_PANIC};
  const size_t n = sizeof codes / sizeof codes[0];
  for (size_t i = 0; i < n; i++) {
    const char *a = maru_status_str(codes[i]);
    CHECK(a != NULL);
    if (a == NULL) continue;
    CHECK(strlen(a) > 0);
    for (size_t j = 0; j < i; j++) {
      const char *b = maru_status_str(codes[j]);
      CHECK(b != NULL && strcmp(a, b) != 0);
    }
  }
  const char *unknown = maru_status_str(12345u);
  CHECK(unknown != NULL && strcmp(unknown, "unknown status") == 0);
  CHECK(strcmp(maru_status_str(MARU_OK), "ok") == 0);
}

static void test_last_error(void) {
  const char *err = maru_last_error();
  CHECK(err != NULL);
  CHECK(err != NULL && err[0] == '\0');

  /* A zero-length buffer cannot hold even the NUL: too small, length 0. */
  size_t out_len = 12345;
  CHECK(maru_last_error_copy(NULL, 0, &out_len) == MARU_ERR_BUFFER_TOO_SMALL);
  CHECK(out_len == 0);

  char buf[8];
  memset(buf, 'x', sizeof buf);
  out_len = 12345;
  CHECK(maru_last_error_copy(buf, sizeof buf, &out_len) == MARU_OK);
  CHECK(out_len == 0);
  CHECK(buf[0] == '\0');

  CHECK(maru_last_error_copy(buf, sizeof buf, NULL) == MARU_ERR_NULL_ARGUMENT);
  CHECK(maru_last_error_copy(NULL, sizeof buf, &out_len) == MARU_ERR_NULL_ARGUMENT);
}

/* Messages the log callback received. */
struct captured {
  int count;
  int warnings;
  char last[512];
};

static void on_log(void *ctx, maru_log_level_t level, const char *target, const char *message) {
  struct captured *c = ctx;
  c->count++;
  if (level == MARU_LOG_WARN) c->warnings++;
  snprintf(c->last, sizeof c->last, "%s: %s", target, message);
}

/* With a callback, libmaru's warnings reach it (here: the pool of an open that cannot
 * reach its server); an unknown level is refused; NULL goes back to stderr. */
static void test_log_callback(void) {
  struct captured c;
  memset(&c, 0, sizeof c);
  CHECK(maru_set_log_callback((maru_log_level_t)77, on_log, &c) == MARU_ERR_INVALID_ARGUMENT);
  CHECK(maru_set_log_callback(MARU_LOG_WARN, on_log, &c) == MARU_OK);
  maru_handler_t *h = NULL;
  /* Port 1 on loopback: nothing listens there. */
  CHECK(maru_handler_open("{\"backend\":\"cxl\",\"server_url\":\"127.0.0.1:1\",\"engine_id\":\"e\","
                          "\"timeout_ms\":500}", &h) == MARU_ERR_UNAVAILABLE);
  CHECK(h == NULL);
  CHECK(c.warnings >= 1);
  CHECK(strstr(c.last, "127.0.0.1:1") != NULL);
  CHECK(maru_set_log_callback(MARU_LOG_OFF, NULL, NULL) == MARU_OK);
  int before = c.count;
  CHECK(maru_handler_open("{\"backend\":\"cxl\",\"server_url\":\"127.0.0.1:1\",\"engine_id\":\"e\","
                          "\"timeout_ms\":500}", &h) == MARU_ERR_UNAVAILABLE);
  CHECK(c.count == before);
  /* A malformed address is a configuration error, not an unreachable pool. */
  CHECK(maru_handler_open("{\"backend\":\"cxl\",\"server_url\":\"no-port\",\"engine_id\":\"e\"}", &h) ==
        MARU_ERR_CONFIG);
}

/* A relative MARU_CUDART is refused at once, with a message that says why. */
static void test_hook_auto_refuses_relative_cudart(void) {
  CHECK(setenv("MARU_CUDART", "libcudart.so", 1) == 0);
  CHECK(maru_set_memory_hook_auto() == MARU_ERR_CONFIG);
  CHECK(strstr(maru_last_error(), "relative") != NULL);
  CHECK(unsetenv("MARU_CUDART") == 0);
  CHECK(maru_set_memory_hook(NULL, NULL, NULL) == MARU_OK);
}

/* Chunk keys: one key per full chunk, 64 hex digits, equal prefixes give equal keys. */
static void test_chunk_keys(void) {
  int32_t a[5] = {1, 2, 3, 4, 5}, b[5] = {1, 2, 3, 9, 5};
  char ka[2][MARU_CHUNK_KEY_SIZE], kb[2][MARU_CHUNK_KEY_SIZE];
  size_t n = 0;
  CHECK(maru_chunk_keys(a, 5, 2, "model/layout", &ka[0][0], 2, &n) == MARU_OK && n == 2);
  CHECK(strlen(ka[0]) == 64 && strlen(ka[1]) == 64);
  CHECK(maru_chunk_keys(b, 5, 2, "model/layout", &kb[0][0], 2, &n) == MARU_OK && n == 2);
  CHECK(strcmp(ka[0], kb[0]) == 0 && strcmp(ka[1], kb[1]) != 0);
  CHECK(maru_chunk_keys(a, 5, 2, "model/layout", &ka[0][0], 1, &n) == MARU_ERR_BUFFER_TOO_SMALL);
  CHECK(n == 2);
  CHECK(maru_chunk_keys(NULL, 0, 2, "m", NULL, 0, &n) == MARU_OK && n == 0);
}

int main(void) {
  test_versions();
  test_status_str();
  test_last_error();
  test_log_callback();
  test_hook_auto_refuses_relative_cudart();
  test_chunk_keys();
  if (failures != 0) {
    fprintf(stderr, "test_abi: %d check(s) failed\n", failures);
    return EXIT_FAILURE;
  }
  printf("test_abi: ok (libmaru %s, ABI %u)\n", maru_version_string(), maru_abi_version());
  return EXIT_SUCCESS;
}
