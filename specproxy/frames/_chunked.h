/* _chunked.h: where an HTTP/1.1 chunked body ends, read by read (a port of http1.ChunkedEnd.feed).

Shared by _relayc.c (the per-read path on the event loop) and _pump.c (the relay thread). It touches no
Python object and allocates with malloc, so the relay thread can run it without the interpreter lock. */
#ifndef SPECPROXY_CHUNKED_H
#define SPECPROXY_CHUNKED_H

#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "_hex.h"

#define MAX_LINE_BYTES 4096 /* http1.MAX_LINE_BYTES: a partial size/trailer line longer is malformed */

typedef struct {
    ssize_t rem;      /* bytes of the current chunk (payload and its CRLF) still to skip */
    int trailers;     /* after the last chunk: reading trailer lines */
    ssize_t line_len; /* a size or trailer line split across reads */
    char line[MAX_LINE_BYTES];
} chunked_state;

/* -1: the body goes on; >= 0: the index in d just past the body's last byte; -2: malformed, *err says
   why (a static string), or out of memory (*err == NULL). */
static ssize_t
chunked_scan(chunked_state *s, const char *d, ssize_t n, const char **err)
{
    ssize_t rem = s->rem;
    if (rem >= n) { /* the whole read is inside one chunk */
        s->rem = rem - n;
        return -1;
    }
    ssize_t i = rem;
    s->rem = 0;
    while (i < n) {
        const char *nl = memchr(d + i, '\n', (size_t)(n - i));
        if (nl == NULL) {
            ssize_t k = n - i;
            if (s->line_len + k > MAX_LINE_BYTES) {
                *err = "a chunk-size line too long";
                return -2;
            }
            memcpy(s->line + s->line_len, d + i, (size_t)k);
            s->line_len += k;
            return -1;
        }
        ssize_t j = nl - d;
        const char *line = d + i;
        ssize_t len = j - i;
        char *joined = NULL;
        if (s->line_len) { /* the line began in an earlier read */
            joined = malloc((size_t)(s->line_len + len + 1));
            if (joined == NULL) {
                *err = NULL;
                return -2;
            }
            memcpy(joined, s->line, (size_t)s->line_len);
            memcpy(joined + s->line_len, d + i, (size_t)len);
            len += s->line_len;
            line = joined;
            s->line_len = 0;
        }
        i = j + 1;
        if (len && line[len - 1] == '\r')
            len--;
        if (s->trailers) {
            free(joined);
            if (len == 0)
                return i;
            continue;
        }
        /* size_text = line.split(b";", 1)[0].strip(b" \t"): 1 to 15 hex digits */
        const char *semi = memchr(line, ';', (size_t)len);
        ssize_t a = 0, b = semi ? semi - line : len;
        while (a < b && (line[a] == ' ' || line[a] == '\t'))
            a++;
        while (b > a && (line[b - 1] == ' ' || line[b - 1] == '\t'))
            b--;
        long long size = 0;
        int bad = (a == b || b - a > 15);
        for (ssize_t k = a; !bad && k < b; k++) {
            int v = hex_value((unsigned char)line[k]);
            if (v < 0)
                bad = 1;
            else
                size = size * 16 + v;
        }
        free(joined);
        if (bad) {
            *err = "malformed chunk size";
            return -2;
        }
        if (size == 0) {
            s->trailers = 1;
            continue;
        }
        ssize_t end = i + (ssize_t)size + 2; /* the payload and its CRLF */
        if (end > n) {
            s->rem = end - n;
            return -1;
        }
        if (d[end - 2] != '\r' || d[end - 1] != '\n') {
            *err = "chunk payload not followed by CRLF";
            return -2;
        }
        i = end;
    }
    return -1;
}

#endif
