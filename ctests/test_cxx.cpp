// include/maru.h compiles as C++ and links from C++.
#include "maru.h"

#include <cstdio>
#include <cstring>
#include <type_traits>

static_assert(std::is_same<std::underlying_type<maru_status_t>::type, uint32_t>::value,
              "maru_status_t is a 32-bit code in C++ too");
static_assert(MARU_ERR_PANIC == 99, "status values are stable");

int main() {
  if (maru_abi_version() != MARU_ABI_VERSION) return 1;
  const char *err = maru_last_error();
  if (err == nullptr || err[0] != '\0') return 1;
  size_t out_len = 1;
  maru_status_t st = maru_last_error_copy(nullptr, 0, &out_len);
  if (st != MARU_ERR_BUFFER_TOO_SMALL || out_len != 0) return 1;
  if (std::strcmp(maru_status_str(MARU_OK), "ok") != 0) return 1;
  std::printf("test_cxx: ok (libmaru %s)\n", maru_version_string());
  return 0;
}
