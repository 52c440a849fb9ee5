/* _chunked.h: the native HTTP/1.1 chunked-framing parser, fed read by read (RFC 9112 7.1).

One parser for every native path: the relay thread (wire/_pump.c) finds where a body ends with it, the
relay's Python face of it is wire/_relayc.c's ChunkedEnd, and the measuring's join (_scanc.c) takes the
payload out with it. frames/chunked.py's ChunkedEnd is its reference: the same rules, the same messages,
at the same read, whatever the read boundaries (tests/unit/test_relayc.py, tests/unit/test_chunked.py).

Strict, because a proxy that passes framing on verbatim must not pass on framing the client could read
differently: every line ends with CRLF (a bare LF or a bare CR is malformed), chunk data is followed by
CRLF (checked even when it falls in the next read), a size is 1 to 15 hex digits (no sign, no leading
space; spaces before an extension or the CRLF are allowed), a chunk extension follows RFC 9112 7.1.1
(`*( BWS ";" BWS token [ BWS "=" BWS ( token / quoted-string ) ] )`), a trailer line is a header field (a
token, a colon, a value with no control byte but HTAB), and no size or trailer line is longer than
CHUNKED_MAX_LINE bytes, decided as soon as it is certain, whatever the read sizes. A control byte in an
extension or a trailer, or a trailer line a client could read as something else, is refused rather than
passed on. Each line is checked once, when it is complete: nothing is added per payload byte.

It touches no Python object and never allocates, so the relay thread runs it without the interpreter lock;
a line split across reads waits in the state's own buffer (at most CHUNKED_MAX_LINE + 1 bytes). */
#ifndef SPECPROXY_CHUNKED_H
#define SPECPROXY_CHUNKED_H

#include <string.h>
#include <sys/types.h>

#include "_hex.h"

#define CHUNKED_MAX_LINE 4096 /* chunked.MAX_LINE_BYTES: a size or trailer line's most bytes, CRLF aside */
#define CHUNKED_MAX_DIGITS 15

typedef struct {
    ssize_t rem;      /* bytes of the current chunk (payload and its CRLF) still due */
    int trailers;     /* after the last chunk: reading trailer lines */
    ssize_t line_len; /* a size or trailer line begun in an earlier read, in line[] */
    char line[CHUNKED_MAX_LINE + 1];
} chunked_state;

static const char CHUNKED_TOO_LONG[] = "a chunk-size or trailer line over 4096 bytes";
static const char CHUNKED_BARE_LF[] = "a chunk-size or trailer line not ended by CRLF";
static const char CHUNKED_BARE_CR[] = "a bare CR in a chunk-size or trailer line";
static const char CHUNKED_BAD_SIZE[] = "malformed chunk size";
static const char CHUNKED_NO_CRLF[] = "chunk data not followed by CRLF";
static const char CHUNKED_BAD_EXT[] = "malformed chunk extension";
static const char CHUNKED_BAD_TRAILER[] = "malformed trailer field";

/* RFC 9110 5.6.2 tchar */
static inline int
chunked_tchar(unsigned char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c != 0 && memchr("!#$%&'*+-.^_`|~", c, 15) != NULL);
}

/* The end of the token starting at p (p itself when there is none). */
static inline const char *
chunked_token(const char *p, const char *end)
{
    while (p < end && chunked_tchar((unsigned char)*p))
        p++;
    return p;
}

static inline const char *
chunked_bws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    return p;
}

/* The extensions p[0:end] (from the first ';'; the CR is not in it) well formed: 1, else 0. */
static int
chunked_ext_ok(const char *p, const char *end)
{
    while (p < end) {
        if (*p != ';')
            return 0;
        p = chunked_bws(p + 1, end);
        const char *t = chunked_token(p, end);
        if (t == p)
            return 0;
        p = chunked_bws(t, end);
        if (p < end && *p == '=') {
            p = chunked_bws(p + 1, end);
            if (p < end && *p == '"') { /* quoted-string: qdtext or a quoted-pair, then DQUOTE */
                for (p++;; p++) {
                    if (p >= end)
                        return 0;
                    unsigned char c = (unsigned char)*p;
                    if (c == '"')
                        break;
                    if (c == '\\') {
                        if (++p >= end)
                            return 0;
                        c = (unsigned char)*p;
                    }
                    if ((c < 0x20 && c != '\t') || c == 0x7f)
                        return 0;
                }
                p++;
            } else {
                t = chunked_token(p, end);
                if (t == p)
                    return 0;
                p = t;
            }
            p = chunked_bws(p, end);
        }
    }
    return 1;
}

/* A trailer line (its CR aside, not empty) is a header field: token ":" value, the value with no control
   byte but HTAB (so no obs-fold either: a line starting with a space has no token). */
static int
chunked_trailer_ok(const char *p, const char *end)
{
    const char *t = chunked_token(p, end);
    if (t == p || t == end || *t != ':')
        return 0;
    for (t++; t < end; t++) {
        unsigned char c = (unsigned char)*t;
        if ((c < 0x20 && c != '\t') || c == 0x7f)
            return 0;
    }
    return 1;
}

/* One complete line (without its LF), or NULL when it is fine; *size is its chunk size (size lines). */
static const char *
chunked_line(const char *line, ssize_t len, int trailers, long long *size)
{
    int cr = len > 0 && line[len - 1] == '\r';
    if (len - cr > CHUNKED_MAX_LINE)
        return CHUNKED_TOO_LONG;
    if (!cr)
        return CHUNKED_BARE_LF;
    len--;
    if (len > 0 && memchr(line, '\r', (size_t)len) != NULL)
        return CHUNKED_BARE_CR;
    if (trailers)
        return len == 0 || chunked_trailer_ok(line, line + len) ? NULL : CHUNKED_BAD_TRAILER;
    const char *semi = memchr(line, ';', (size_t)len);
    ssize_t b = semi ? semi - line : len;
    while (b > 0 && (line[b - 1] == ' ' || line[b - 1] == '\t'))
        b--;
    if (b == 0 || b > CHUNKED_MAX_DIGITS)
        return CHUNKED_BAD_SIZE;
    long long v = 0;
    for (ssize_t k = 0; k < b; k++) {
        int h = hex_value((unsigned char)line[k]);
        if (h < 0)
            return CHUNKED_BAD_SIZE;
        v = v * 16 + h;
    }
    if (semi != NULL && !chunked_ext_ok(semi, line + len))
        return CHUNKED_BAD_EXT;
    *size = v;
    return NULL;
}

/* Feed one read d[0:n]. -1: the body goes on; >= 0: the index in d just past the body's last byte (the
   end of the trailer section); -2: malformed, *err says why (one of the CHUNKED_* strings). With olen
   given, *olen grows by the read's payload bytes, and with out given too they are copied to out + *olen
   (out has room for n more bytes). */
static inline ssize_t /* inline: a header's function, unused by some of the files that include it */
chunked_scan(chunked_state *s, const char *d, ssize_t n, const char **err, char *out, ssize_t *olen)
{
    ssize_t i = 0, rem = s->rem;
    for (;;) {
        if (rem) { /* in a chunk: its payload, then its CRLF */
            ssize_t avail = n - i;
            if (rem - 2 >= avail) { /* the rest of the read is payload: the usual case for long chunks */
                if (olen != NULL && avail > 0) {
                    if (out != NULL)
                        memcpy(out + *olen, d + i, (size_t)avail);
                    *olen += avail;
                }
                s->rem = rem - avail;
                return -1;
            }
            if (olen != NULL && rem > 2) {
                if (out != NULL)
                    memcpy(out + *olen, d + i, (size_t)(rem - 2));
                *olen += rem - 2;
            }
            ssize_t crlf = i + rem - 2; /* where the CRLF starts, in d (before d when it began earlier) */
            for (ssize_t k = crlf < i ? i : crlf; k < n && k < crlf + 2; k++) {
                if (d[k] != (k == crlf ? '\r' : '\n')) {
                    *err = CHUNKED_NO_CRLF;
                    return -2;
                }
            }
            if (rem > avail) {
                s->rem = rem - avail;
                return -1;
            }
            i += rem;
            rem = 0;
        }
        s->rem = 0;
        if (i >= n)
            return -1;
        const char *nl = memchr(d + i, '\n', (size_t)(n - i));
        ssize_t j = nl ? nl - d : n, k = j - i;
        if (s->line_len + k > CHUNKED_MAX_LINE + 1) { /* over the limit, CR or not */
            *err = CHUNKED_TOO_LONG;
            return -2;
        }
        if (nl == NULL) { /* the line goes on in the next read */
            memcpy(s->line + s->line_len, d + i, (size_t)k);
            s->line_len += k;
            if (s->line_len - (s->line[s->line_len - 1] == '\r') > CHUNKED_MAX_LINE) {
                *err = CHUNKED_TOO_LONG;
                return -2;
            }
            return -1;
        }
        const char *line = d + i;
        ssize_t len = k;
        if (s->line_len) { /* the line began in an earlier read */
            memcpy(s->line + s->line_len, d + i, (size_t)k);
            line = s->line;
            len = s->line_len + k;
            s->line_len = 0;
        }
        i = j + 1;
        long long size = 0;
        const char *bad = chunked_line(line, len, s->trailers, &size);
        if (bad != NULL) {
            *err = bad;
            return -2;
        }
        if (s->trailers) {
            if (len == 1) /* the empty line: the body ends here */
                return i;
            continue;
        }
        if (size == 0)
            s->trailers = 1;
        else
            rem = (ssize_t)size + 2;
    }
}

#endif
