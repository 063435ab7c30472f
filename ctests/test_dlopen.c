/* Loads libmaru.so by path with dlopen, as a C++ runtime or ctypes does, and
 * checks that every function of the header is exported. */
#define _POSIX_C_SOURCE 200809L
#include "maru.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef MARU_SO_PATH
#error "MARU_SO_PATH must name libmaru.so"
#endif

static const char *const symbols[] = {
    "maru_abi_version", "maru_last_error",     "maru_last_error_copy",
    "maru_status_str",  "maru_version_string",
};

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
  if (dlclose(lib) != 0) {
    fprintf(stderr, "dlclose: %s\n", dlerror());
    failures++;
  }
  if (failures != 0) return EXIT_FAILURE;
  printf("test_dlopen: ok (ABI %u from %s)\n", got, MARU_SO_PATH);
  return EXIT_SUCCESS;
}
