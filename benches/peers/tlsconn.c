/*
 * tlsconn: new TLS connections per second, one HTTP/1.1 request each, with
 * session resumption on or off, for benches/peers (run.sh compiles it:
 * gcc -O2 -pthread tlsconn.c -lssl -lcrypto).
 *
 *   tlsconn --ip 203.0.113.10 --host origin.test --path /1k --conns 4 --duration 4 [--resume]
 *           [--cafile bundle.pem] [--port 443]
 *
 * Each of --conns threads loops until the deadline: TCP connect, TLS
 * handshake (SNI and ALPN http/1.1, the certificate verified against --cafile
 * when given), "GET path" with "Connection: close", read the whole response
 * (Content-Length), then read on until the server closes (which the request
 * asked for), close.
 *
 * Resumption off (default): the SSL_CTX has no session cache
 * (SSL_SESS_CACHE_OFF) and SSL_OP_NO_TICKET, and no session is ever handed to
 * a new connection (SSL_set_session is never called), so the client offers
 * neither a session id, nor a ticket, nor a TLS 1.3 PSK: every connection is
 * a full handshake.  Resumption on (--resume): each thread keeps the newest
 * session the server gave it (TLS 1.3 NewSessionTicket or TLS 1.2
 * ticket/session id, through the new-session callback) and offers it on its
 * next connection.  Either way every connection is checked with
 * SSL_session_reused() and the count of resumed handshakes is reported, so
 * the figure says what really happened.
 *
 * Prints one JSON object: ok, errors, resumed, elapsed_s, rate (ok / elapsed),
 * p50_ms/p99_ms (connect → response read), first_error.  Bounded: the loop by
 * --duration, each socket operation by a 5 s timeout, errors by 10,000.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static const char *opt_ip = "203.0.113.10", *opt_host = "origin.test", *opt_path = "/1k", *opt_cafile = NULL;
static int opt_port = 443, opt_conns = 4, opt_resume = 0;
static double opt_duration = 4.0;
static SSL_CTX *ctx;
static double deadline;
static struct sockaddr_in dst;
static char request[1024];
static int request_len;

#define MAX_SAMPLES 1000000
#define MAX_ERRORS 10000

struct worker {
    pthread_t thread;
    long ok, errors, resumed;
    SSL_SESSION *session;
    double *lat;
    long nlat;
    double finished;
    char first_error[160];
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int keep_session(SSL *ssl, SSL_SESSION *sess) {
    struct worker *w = SSL_get_app_data(ssl);
    if (!w || !opt_resume)
        return 0; /* not kept: OpenSSL frees it */
    if (w->session)
        SSL_SESSION_free(w->session);
    w->session = sess;
    return 1; /* the reference is ours now */
}

static void fail(struct worker *w, const char *what) {
    w->errors++;
    if (!w->first_error[0]) {
        unsigned long e = ERR_peek_last_error();
        char buf[120] = "";
        if (e)
            ERR_error_string_n(e, buf, sizeof buf);
        snprintf(w->first_error, sizeof w->first_error, "%s %s%s", what, buf, e ? "" : strerror(errno));
    }
    ERR_clear_error();
}

/* Reads the response: the head, then Content-Length bytes of body.  Returns 0 on a complete 200. */
static int read_response(SSL *ssl) {
    static __thread char buf[65536];
    size_t have = 0;
    long body = -1, need = -1;
    for (;;) {
        int n = SSL_read(ssl, buf + have, (int)(sizeof buf - have));
        if (n <= 0)
            return -1;
        if (need < 0) {
            have += (size_t)n;
            char *end = memmem(buf, have, "\r\n\r\n", 4);
            if (!end) {
                if (have == sizeof buf)
                    return -1;
                continue;
            }
            if (have < 12 || memcmp(buf + 9, "200", 3) != 0)
                return -1;
            *end = 0;
            char *cl = strcasestr(buf, "\r\ncontent-length:");
            if (!cl)
                return -1;
            need = strtol(cl + 17, NULL, 10);
            body = (long)(have - (size_t)(end + 4 - buf));
            have = 0;
        } else {
            body += n;
        }
        if (body >= need)
            return 0;
    }
}

static int one(struct worker *w) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        fail(w, "socket");
        return -1;
    }
    int one_ = 1;
    struct timeval tv = {5, 0};
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one_, sizeof one_);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    double t0 = now();
    SSL *ssl = NULL;
    int rc = -1;
    if (connect(fd, (struct sockaddr *)&dst, sizeof dst) != 0) {
        fail(w, "connect");
        goto out;
    }
    ssl = SSL_new(ctx);
    SSL_set_app_data(ssl, w);
    SSL_set_fd(ssl, fd);
    SSL_set_tlsext_host_name(ssl, opt_host);
    if (opt_cafile)
        SSL_set1_host(ssl, opt_host);
    if (opt_resume && w->session)
        SSL_set_session(ssl, w->session);
    if (SSL_connect(ssl) != 1) {
        fail(w, "handshake");
        goto out;
    }
    if (SSL_session_reused(ssl))
        w->resumed++;
    if (SSL_write(ssl, request, request_len) != request_len) {
        fail(w, "write");
        goto out;
    }
    if (read_response(ssl) != 0) {
        fail(w, "response");
        goto out;
    }
    w->ok++;
    if (w->nlat < MAX_SAMPLES)
        w->lat[w->nlat++] = (now() - t0) * 1000.0;
    /* Read on to the close the request asked for: records after the response
     * (a TLS 1.3 server may send its session tickets there) are processed. */
    {
        char sink[4096];
        while (SSL_read(ssl, sink, sizeof sink) > 0)
            ;
    }
    /* A clean end: OpenSSL marks the session of a connection freed without
     * one as not resumable. */
    SSL_set_shutdown(ssl, SSL_SENT_SHUTDOWN | SSL_RECEIVED_SHUTDOWN);
    rc = 0;
out:
    if (ssl)
        SSL_free(ssl);
    close(fd);
    return rc;
}

static void *run(void *arg) {
    struct worker *w = arg;
    while (now() < deadline && w->errors < MAX_ERRORS) {
        if (one(w) != 0)
            usleep(1000); /* a refused or broken column must not spin */
    }
    w->finished = now();
    return NULL;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--resume")) { opt_resume = 1; continue; }
        if (!v) { fprintf(stderr, "tlsconn: %s needs a value\n", a); return 2; }
        if (!strcmp(a, "--ip")) opt_ip = v;
        else if (!strcmp(a, "--host")) opt_host = v;
        else if (!strcmp(a, "--path")) opt_path = v;
        else if (!strcmp(a, "--cafile")) opt_cafile = v;
        else if (!strcmp(a, "--port")) opt_port = atoi(v);
        else if (!strcmp(a, "--conns")) opt_conns = atoi(v);
        else if (!strcmp(a, "--duration")) opt_duration = atof(v);
        else { fprintf(stderr, "tlsconn: unknown option %s\n", a); return 2; }
        i++;
    }
    if (opt_conns < 1 || opt_conns > 256 || opt_duration <= 0 || opt_duration > 600) {
        fprintf(stderr, "tlsconn: --conns 1..256, --duration 0..600\n");
        return 2;
    }
    memset(&dst, 0, sizeof dst);
    dst.sin_family = AF_INET;
    dst.sin_port = htons((unsigned short)opt_port);
    if (inet_pton(AF_INET, opt_ip, &dst.sin_addr) != 1) {
        fprintf(stderr, "tlsconn: --ip must be an IPv4 address\n");
        return 2;
    }
    request_len = snprintf(request, sizeof request,
                           "GET %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: eb-tlsconn\r\nConnection: close\r\n\r\n",
                           opt_path, opt_host);

    ctx = SSL_CTX_new(TLS_client_method());
    SSL_CTX_set_options(ctx, SSL_OP_IGNORE_UNEXPECTED_EOF);
    SSL_CTX_set_mode(ctx, SSL_MODE_AUTO_RETRY);
    static const unsigned char alpn[] = "\x08http/1.1";
    SSL_CTX_set_alpn_protos(ctx, alpn, sizeof alpn - 1);
    if (opt_resume) {
        /* Client-side caching through the callback only: each thread keeps its own newest session. */
        SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
        SSL_CTX_sess_set_new_cb(ctx, keep_session);
    } else {
        SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
        SSL_CTX_set_options(ctx, SSL_OP_NO_TICKET);
    }
    if (opt_cafile) {
        if (SSL_CTX_load_verify_locations(ctx, opt_cafile, NULL) != 1) {
            fprintf(stderr, "tlsconn: cannot load %s\n", opt_cafile);
            return 2;
        }
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    } else {
        SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, NULL);
    }

    struct worker *w = calloc((size_t)opt_conns, sizeof *w);
    double start = now();
    deadline = start + opt_duration;
    for (int i = 0; i < opt_conns; i++) {
        w[i].lat = malloc(sizeof(double) * MAX_SAMPLES);
        pthread_create(&w[i].thread, NULL, run, &w[i]);
    }
    long ok = 0, errors = 0, resumed = 0, nlat = 0;
    double end = start;
    const char *first_error = "";
    for (int i = 0; i < opt_conns; i++) {
        pthread_join(w[i].thread, NULL);
        ok += w[i].ok;
        errors += w[i].errors;
        resumed += w[i].resumed;
        nlat += w[i].nlat;
        if (w[i].finished > end)
            end = w[i].finished;
        if (!first_error[0] && w[i].first_error[0])
            first_error = w[i].first_error;
    }
    double *all = malloc(sizeof(double) * (size_t)(nlat ? nlat : 1));
    long k = 0;
    for (int i = 0; i < opt_conns; i++)
        for (long j = 0; j < w[i].nlat; j++)
            all[k++] = w[i].lat[j];
    qsort(all, (size_t)nlat, sizeof(double), cmp);
    double p50 = nlat ? all[(nlat * 50 + 99) / 100 - 1] : 0, p99 = nlat ? all[(nlat * 99 + 99) / 100 - 1] : 0;
    double elapsed = end - start;
    printf("{\"tool\": \"tlsconn\", \"resume\": %s, \"conns\": %d, \"ok\": %ld, \"errors\": %ld, \"resumed\": %ld, "
           "\"elapsed_s\": %.3f, \"rate\": %.1f, \"p50_ms\": %.3f, \"p99_ms\": %.3f, \"first_error\": \"",
           opt_resume ? "true" : "false", opt_conns, ok, errors, resumed, elapsed, elapsed > 0 ? ok / elapsed : 0.0,
           p50, p99);
    for (const char *p = first_error; *p; p++)
        if (*p != '"' && *p != '\\' && (unsigned char)*p >= 0x20)
            putchar(*p);
    printf("\"}\n");
    return ok > 0 ? 0 : 1;
}
