// wake_gap: what waking a thread that slept costs on this machine, against how long it
// slept. A 64-byte ping-pong over loopback TCP (TCP_NODELAY): the server thread blocks
// in epoll_wait between pings; the client spins for a gap (busy, no memory traffic),
// sends, and polls recv without blocking for the reply. Prints the round trip's p50
// and p90 per gap, two rounds. No argument; Linux only.
//
//   cc -O2 -pthread -o /tmp/wake_gap scripts/wake_gap.c && /tmp/wake_gap
//
// See docs/benchmarks.md, "the publish after a copy pays a long sleep's wake-up".
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>

static int listener;

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void *echo(void *unused) {
    (void)unused;
    int c = accept(listener, 0, 0);
    if (c < 0) die("accept");
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = c};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev) != 0) die("epoll");
    char b[64];
    for (;;) {
        struct epoll_event e;
        if (epoll_wait(ep, &e, 1, -1) < 1) continue;
        ssize_t n = recv(c, b, sizeof b, 0);
        if (n <= 0) return 0;
        if (send(c, b, (size_t)n, 0) != n) die("send (server)");
    }
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(void) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    listener = socket(AF_INET, SOCK_STREAM, 0);
    if (listener < 0 || bind(listener, (void *)&a, sizeof a) != 0 || listen(listener, 1) != 0 ||
        getsockname(listener, (void *)&a, &len) != 0)
        die("listen");
    pthread_t server;
    if (pthread_create(&server, 0, echo, 0) != 0) die("pthread_create");
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, (void *)&a, sizeof a) != 0) die("connect");
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    const int gaps[] = {0, 30, 100, 250, 500, 1000, 2000};
    char b[64] = {0};
    for (int round = 1; round <= 2; round++) {
        for (size_t g = 0; g < sizeof gaps / sizeof *gaps; g++) {
            int n = gaps[g] >= 1000 ? 800 : 2000;
            double *rtt = malloc(n * sizeof *rtt);
            if (!rtt) die("malloc");
            for (int i = 0; i < n; i++) {
                double s = now_us();
                while (now_us() - s < gaps[g]) {
                }
                double t0 = now_us();
                if (send(c, b, sizeof b, 0) != (ssize_t)sizeof b) die("send");
                size_t got = 0;
                while (got < sizeof b) {
                    ssize_t r = recv(c, b, sizeof b - got, MSG_DONTWAIT);
                    if (r > 0) got += (size_t)r;
                    else if (r == 0) die("the server closed");
                    else if (errno != EAGAIN && errno != EWOULDBLOCK) die("recv");
                }
                rtt[i] = now_us() - t0;
            }
            qsort(rtt, n, sizeof *rtt, by_value);
            printf("round %d, gap %5d us: round trip p50 %6.1f us, p90 %6.1f us\n", round, gaps[g],
                   rtt[n / 2], rtt[n * 9 / 10]);
            free(rtt);
        }
    }
    return 0;
}
