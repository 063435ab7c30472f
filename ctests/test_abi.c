/* The C ABI basics of libmaru.so, linked through include/maru.h. */
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

int main(void) {
  test_versions();
  test_status_str();
  test_last_error();
  if (failures != 0) {
    fprintf(stderr, "test_abi: %d check(s) failed\n", failures);
    return EXIT_FAILURE;
  }
  printf("test_abi: ok (libmaru %s, ABI %u)\n", maru_version_string(), maru_abi_version());
  return EXIT_SUCCESS;
}
