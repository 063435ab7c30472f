/* A stand-in for libcudart with the two entry points the `auto` memory hook uses;
 * it records the calls so test_slots and test_in_place can check them (through
 * fake_cudart_calls and fake_cudart_entry). */
#define _DEFAULT_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

static int registered, unregistered;
static void *last_ptr;
static size_t last_len;
static unsigned int last_flags;

/* Every buffer ever registered: how often it was registered and unregistered, and
 * whether it was still mapped when it was unregistered. */
#define MAX_ENTRIES 64
static struct {
    void *ptr;
    size_t len;
    int reg, unreg, mapped_at_unreg;
} entries[MAX_ENTRIES];
static int n_entries;

static int still_mapped(void *ptr, size_t len) {
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)ptr & ~(uintptr_t)(page - 1);
    /* msync fails with ENOMEM on any range that is not mapped. */
    return msync((void *)start, len + ((uintptr_t)ptr - start), MS_ASYNC) == 0;
}

int cudaHostRegister(void *ptr, size_t size, unsigned int flags) {
    registered++;
    last_ptr = ptr;
    last_len = size;
    last_flags = flags;
    for (int i = n_entries - 1; i >= 0; i--) {
        if (entries[i].ptr == ptr && entries[i].reg > entries[i].unreg) {
            entries[i].reg++; /* registered again while registered: counted as such */
            return 0;
        }
    }
    if (n_entries < MAX_ENTRIES) {
        entries[n_entries].ptr = ptr;
        entries[n_entries].len = size;
        entries[n_entries].reg = 1;
        n_entries++;
    }
    return 0;
}

int cudaHostUnregister(void *ptr) {
    if (ptr == last_ptr) unregistered++;
    for (int i = n_entries - 1; i >= 0; i--) {
        if (entries[i].ptr == ptr) {
            entries[i].unreg++;
            if (still_mapped(ptr, entries[i].len)) entries[i].mapped_at_unreg++;
            break;
        }
    }
    return 0;
}

void fake_cudart_calls(int *reg, int *unreg, size_t *len, unsigned int *flags) {
    *reg = registered;
    *unreg = unregistered;
    *len = last_len;
    *flags = last_flags;
}

/* Entry i of the table (0 <= i < the returned count): its length, registrations,
 * unregistrations, and how many of those found it still mapped. */
int fake_cudart_entry(int i, size_t *len, int *reg, int *unreg, int *mapped_at_unreg) {
    if (i >= 0 && i < n_entries) {
        *len = entries[i].len;
        *reg = entries[i].reg;
        *unreg = entries[i].unreg;
        *mapped_at_unreg = entries[i].mapped_at_unreg;
    }
    return n_entries;
}
