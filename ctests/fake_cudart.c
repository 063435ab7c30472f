/* A stand-in for libcudart with the two entry points the `auto` memory hook uses;
 * it records the calls so test_slots can check them (through fake_cudart_calls). */
#include <stddef.h>

static int registered, unregistered;
static void *last_ptr;
static size_t last_len;
static unsigned int last_flags;

int cudaHostRegister(void *ptr, size_t size, unsigned int flags) {
    registered++;
    last_ptr = ptr;
    last_len = size;
    last_flags = flags;
    return 0;
}

int cudaHostUnregister(void *ptr) {
    if (ptr == last_ptr) unregistered++;
    return 0;
}

void fake_cudart_calls(int *reg, int *unreg, size_t *len, unsigned int *flags) {
    *reg = registered;
    *unreg = unregistered;
    *len = last_len;
    *flags = last_flags;
}
