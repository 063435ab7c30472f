/* A key that does not prove: maru_handler_open returns MARU_ERR_AUTH, and the last
 * error names the daemon. Run by with_daemons.sh (remote_cxl): maru-server requires the
 * key named by the configuration's server_key_file, and MARU_TEST_WRONG_KEY is another
 * key. */
#define _POSIX_C_SOURCE 200809L
#include "check.h"
#include <string.h>

/* The handler configuration of the test with the string field `field` set to `value`,
 * or left out when `value` is NULL. */
static void with_field(const char *cfg, const char *field, const char *value, char *out,
                       size_t cap) {
    char name[64];
    int k = snprintf(name, sizeof name, "\"%s\":\"", field);
    CHECK(k > 0 && (size_t)k < sizeof name);
    const char *at = strstr(cfg, name);
    CHECK(at != NULL);
    const char *end = strchr(at + strlen(name), '"');
    CHECK(end != NULL);
    int n;
    if (value != NULL) {
        n = snprintf(out, cap, "%.*s%s%s%s", (int)(at - cfg), cfg, name, value, end);
    } else {
        /* Drop the field and the comma after it (it is never the last one here). */
        const char *next = end + 1;
        CHECK(*next == ',');
        n = snprintf(out, cap, "%.*s%s", (int)(at - cfg), cfg, next + 1);
    }
    CHECK(n > 0 && (size_t)n < cap);
}

int main(void) {
    const char *cfg = getenv("MARU_TEST_CONFIG_A");
    const char *wrong = getenv("MARU_TEST_WRONG_KEY");
    CHECK(cfg != NULL && wrong != NULL);
    CHECK(unsetenv("MARU_SERVER_KEY_FILE") == 0);
    maru_handler_t *h = NULL;

    /* The right keys open. */
    CHECK(maru_handler_open(cfg, &h) == MARU_OK);
    maru_handler_close(h);
    h = NULL;

    /* A wrong agent key: refused at open (the handler proves it to the pool's agents
     * then), not at the first store. */
    char bad[4096];
    with_field(cfg, "agent_key_file", wrong, bad, sizeof bad);
    CHECK(maru_handler_open(bad, &h) == MARU_ERR_AUTH);
    CHECK(h == NULL);
    CHECK(strstr(maru_last_error(), "agent") != NULL);
    CHECK(strstr(maru_last_error(), "authentication") != NULL);

    /* A wrong maru-server key. */
    with_field(cfg, "server_key_file", wrong, bad, sizeof bad);
    CHECK(maru_handler_open(bad, &h) == MARU_ERR_AUTH);
    CHECK(h == NULL);
    CHECK(strstr(maru_last_error(), "maru-server") != NULL);

    /* No key at all, where maru-server requires one. */
    with_field(cfg, "server_key_file", NULL, bad, sizeof bad);
    CHECK(maru_handler_open(bad, &h) == MARU_ERR_AUTH);
    CHECK(h == NULL);

    /* The right keys still open. */
    CHECK(maru_handler_open(cfg, &h) == MARU_OK);
    maru_handler_close(h);
    printf("test_auth: ok\n");
    return 0;
}
