/* A key that does not prove: maru_handler_open returns MARU_ERR_AUTH, and the last
 * error names the daemon. Run by with_daemons.sh (remote_cxl) with
 * MARU_CTEST_SERVER_KEY=1: maru-server requires the key in MARU_SERVER_KEY_FILE, and
 * MARU_TEST_WRONG_KEY is another key. */
#define _POSIX_C_SOURCE 200809L
#include "check.h"
#include <string.h>

/* The handler configuration of the test, with its agent_key_file replaced by `key`. */
static void with_agent_key(const char *cfg, const char *key, char *out, size_t cap) {
    const char *field = "\"agent_key_file\":\"";
    const char *at = strstr(cfg, field);
    CHECK(at != NULL);
    const char *end = strchr(at + strlen(field), '"');
    CHECK(end != NULL);
    int n = snprintf(out, cap, "%.*s%s%s%s", (int)(at - cfg), cfg, field, key, end);
    CHECK(n > 0 && (size_t)n < cap);
}

int main(void) {
    const char *cfg = getenv("MARU_TEST_CONFIG_A");
    const char *server_key = getenv("MARU_SERVER_KEY_FILE");
    const char *wrong = getenv("MARU_TEST_WRONG_KEY");
    CHECK(cfg != NULL && server_key != NULL && wrong != NULL);
    char *server_key_copy = strdup(server_key);
    CHECK(server_key_copy != NULL);
    maru_handler_t *h = NULL;

    /* The right keys open. */
    CHECK(maru_handler_open(cfg, &h) == MARU_OK);
    maru_handler_close(h);
    h = NULL;

    /* A wrong agent key: refused at open (the handler proves it to the pool's agents
     * then), not at the first store. */
    char bad_agent[4096];
    with_agent_key(cfg, wrong, bad_agent, sizeof bad_agent);
    CHECK(maru_handler_open(bad_agent, &h) == MARU_ERR_AUTH);
    CHECK(h == NULL);
    CHECK(strstr(maru_last_error(), "agent") != NULL);
    CHECK(strstr(maru_last_error(), "authentication") != NULL);

    /* A wrong maru-server key. */
    CHECK(setenv("MARU_SERVER_KEY_FILE", wrong, 1) == 0);
    CHECK(maru_handler_open(cfg, &h) == MARU_ERR_AUTH);
    CHECK(h == NULL);
    CHECK(strstr(maru_last_error(), "maru-server") != NULL);

    /* No key at all, where maru-server requires one. */
    CHECK(unsetenv("MARU_SERVER_KEY_FILE") == 0);
    CHECK(maru_handler_open(cfg, &h) == MARU_ERR_AUTH);

    CHECK(setenv("MARU_SERVER_KEY_FILE", server_key_copy, 1) == 0);
    CHECK(maru_handler_open(cfg, &h) == MARU_OK);
    maru_handler_close(h);
    free(server_key_copy);
    printf("test_auth: ok\n");
    return 0;
}
