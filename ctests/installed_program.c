/* Built against an installed libmaru with `pkg-config --cflags --libs maru` (by
 * test_install.sh): the header and the library are found, the library is loaded
 * through its SONAME, and a few calls that need no daemon work. */
#include <maru.h>
#include <stdio.h>
#include <string.h>

int main(void) {
    if (maru_abi_version() != MARU_ABI_VERSION) {
        fprintf(stderr, "ABI %u, header %u\n", maru_abi_version(), MARU_ABI_VERSION);
        return 1;
    }
    int32_t tokens[4] = {1, 2, 3, 4};
    char keys[2][MARU_CHUNK_KEY_SIZE];
    size_t n = 0;
    if (maru_chunk_keys(tokens, 4, 2, "installed", &keys[0][0], 2, &n) != MARU_OK || n != 2 ||
        strlen(keys[1]) != 64) {
        fprintf(stderr, "maru_chunk_keys: %s\n", maru_last_error());
        return 1;
    }
    printf("installed libmaru %s works\n", maru_version_string());
    return 0;
}
