/* The floor for a serial TCP get on this machine, with no kvpool in the way:
 * a request of 16 bytes, a reply of SIZE bytes, over K loopback connections
 * at once (the reply cut in K equal parts, one per connection, each served
 * by its own server thread), one request at a time; p50 and p99 of the
 * whole exchange. No lookup, no checksum. The source is the same SIZE bytes
 * every time (warm in cache), or with ROTATE=BYTES in the server's
 * environment the next SIZE bytes of a BYTES-long pool each time (cold, as
 * a get of another object reads).
 *
 *   cc -O2 -pthread -o tcp_rr benches/reference/tcp_rr.c
 *   ./tcp_rr s SIZE 0 K & ./tcp_rr c SIZE CALLS K
 *
 * docs/benchmarks/transfer-engine.md ("What a plain TCP exchange reaches here") quotes it. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define PORT 7998
#define MAXK 16

static size_t size;
static int k;
static char *src;
static size_t pool = 0; /* ROTATE: bytes the source rotates over */

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static struct sockaddr_in loopback(void) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(PORT)};
  a.sin_addr.s_addr = htonl(0x7f000001);
  return a;
}

static void *serve(void *p) {
  int c = (int)(long)p;
  char req[16];
  size_t part = size / k, at = 0;
  for (;;) {
    size_t got = 0;
    while (got < sizeof req) {
      ssize_t r = read(c, req + got, sizeof req - got);
      if (r <= 0) return NULL;
      got += r;
    }
    const char *from = src + at;
    if (pool) at = (at + size) % (pool - pool % size);
    for (size_t off = 0; off < part;) {
      ssize_t w = write(c, from + off, part - off);
      if (w <= 0) return NULL;
      off += w;
    }
  }
}

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s s|c SIZE CALLS K\n", argv[0]);
    return 2;
  }
  size = strtoull(argv[2], NULL, 10);
  int calls = atoi(argv[3]);
  k = atoi(argv[4]);
  if (k < 1 || k > MAXK || size % k) {
    fprintf(stderr, "K in 1..%d dividing SIZE\n", MAXK);
    return 2;
  }
  int one = 1;
  struct sockaddr_in a = loopback();
  if (argv[1][0] == 's') {
    const char *rotate = getenv("ROTATE");
    pool = rotate ? strtoull(rotate, NULL, 10) : 0;
    if (pool && pool < size) pool = 0;
    src = malloc(pool ? pool : size);
    memset(src, 7, pool ? pool : size);
    int l = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, (void *)&a, sizeof a) || listen(l, MAXK)) {
      perror("listen");
      return 1;
    }
    pthread_t t[MAXK];
    for (int i = 0; i < k; i++) {
      int c = accept(l, NULL, NULL);
      setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      pthread_create(&t[i], NULL, serve, (void *)(long)c);
    }
    for (int i = 0; i < k; i++) pthread_join(t[i], NULL);
    return 0;
  }
  char *dst = malloc(size);
  memset(dst, 1, size);
  int cs[MAXK];
  for (int i = 0; i < k; i++) {
    cs[i] = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(cs[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(cs[i], (void *)&a, sizeof a)) {
      perror("connect");
      return 1;
    }
    fcntl(cs[i], F_SETFL, O_NONBLOCK);
  }
  double *lat = malloc(calls * sizeof *lat);
  char req[16] = {0};
  size_t part = size / k;
  for (int n = 0; n < calls; n++) {
    double t = now_us();
    size_t got[MAXK] = {0};
    int left = k;
    for (int j = 0; j < k; j++)
      if (write(cs[j], req, sizeof req) != sizeof req) return 1;
    while (left) {
      struct pollfd p[MAXK];
      for (int j = 0; j < k; j++) {
        p[j].fd = got[j] < part ? cs[j] : -1;
        p[j].events = POLLIN;
      }
      if (poll(p, k, 5000) <= 0) return 1;
      for (int j = 0; j < k; j++) {
        if (got[j] == part) continue;
        ssize_t r = read(cs[j], dst + j * part + got[j], part - got[j]);
        if (r == 0) return 1;
        if (r > 0 && (got[j] += r) == part) left--;
      }
    }
    lat[n] = now_us() - t;
  }
  qsort(lat, calls, sizeof *lat, cmp);
  printf("size %zu connections %d: p50 %.1f us p99 %.1f us -> %.2f GB/s at p50\n",
         size, k, lat[calls / 2], lat[calls * 99 / 100], size / lat[calls / 2] / 1e3);
  return 0;
}
