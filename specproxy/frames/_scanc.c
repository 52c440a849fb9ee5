/* _scanc: the measuring's per-chunk scans in C.

Why: at many concurrent streams about half of the measuring thread's cost per chunk was in removing
the chunked framing and reading the stream (docs/performance.md, "Design figures"). These functions are
the chat stream's native reader's (measure/fast_texts.py): one pass over the bytes, no object per
chunk. The reference (frames/chunked.py, frames/sse.py with openai.read_chunk) reads every stream this
module is not built for (it is optional at install) or declines; tests/unit/test_measure_fast.py checks
that the native reader gives the reference's Texts and Records, the per-chunk metrics' gaps (chunk_gaps)
included.

join_frames(reads) -> (payload, ends, complete) | None
    HTTP/1.1 chunked reads through the native framing parser (_chunked.h, the relay's): the payloads
    joined, each read's cumulative payload end (chunked.dechunk_reads aligned 1:1, summed), and whether
    the body ended. None for malformed framing or bytes after the end: the reference says what is wrong.

template_run(buf, pos, prefix, head, dlen, closing) -> (count, size, text, nonempty, text_size)
    A run of a chunk template (measure/chunk_templates.py) from buf[pos]: how many events in a row are
    "prefix + body + head + <dlen digits> + closing" followed by a blank line (LF LF), where body is a
    JSON string's inside that is valid UTF-8 and needs no decision (no lone surrogate escape); their
    bytes with blank lines, their bodies' text joined, how many had text, and the bytes up to the end
    of the last that had. It stops before the first event that is not one; the caller reads that one.

chunk_gaps(buf, cum, times, skip, tail_chunk, bounds) -> ((count per bucket, ...), gap_sum) | None
    When a stream's chunks (events with data) arrived, bucketed, with no object per chunk: per read
    (read i holds buf[cum[i-1]:cum[i]], timed times[i]) the blank lines that end in it (LF LF pairs,
    counted without overlap from the start, as bytes.count, each in the read holding its second LF: in
    a stream the fast parse reads, each ends one event), less one per entry of skip (a read that ended
    an event with no data), plus one in the last read when tail_chunk (the tail event had data). The gaps
    between consecutive reads that completed chunks are counted per bucket of bounds (bisect_left: a
    gap equal to a bound is in its bucket; the last count is over the last bound), a read's further
    chunks as gaps of 0; gap_sum is the last such read's time less the first's. None with fewer than
    two chunks. What the reference's chunk times give bucketed by chunk_gaps.gap_buckets.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_chunked.h"
#include "_hex.h"

/* the value of four hex digits at p (a \\u escape's), or -1 */
static inline long
hex4(const unsigned char *p)
{
    long v = 0;
    for (int k = 0; k < 4; k++) {
        int d = hex_value(p[k]);
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* ---- join_frames --------------------------------------------------------------------------------- */

/* join_frames(reads, chunked, let_go=None): the body's payload as one bytes, with where each read's
   payload ends. It consumes the list: each read is let go of as soon as it is copied, and let_go() (the
   process's way to give freed heap pages back to the system) is called after every LET_GO_BYTES of them,
   so one large response costs its size about once while it is joined, not twice (docs/operations.md,
   "Memory"). A first pass over the framing finds the payload's exact size and refuses malformed framing
   (None, the list untouched: the reference says what is wrong); the second copies. Unframed reads
   (chunked false) are joined as they are. */

#define LET_GO_BYTES (16 << 20)

static int
frames_measure(PyObject *reads, Py_ssize_t nreads, chunked_state *cs, Py_ssize_t *size, int *ended)
{
    /* 1: well formed (size: the payload's bytes); 0: malformed or bytes after the end */
    Py_ssize_t olen = 0;
    for (Py_ssize_t r = 0; r < nreads; r++) {
        PyObject *item = PyList_GET_ITEM(reads, r);
        Py_ssize_t n = PyBytes_GET_SIZE(item);
        if (*ended) {
            if (n)
                return 0;
            continue;
        }
        const char *err = NULL;
        ssize_t end = chunked_scan(cs, PyBytes_AS_STRING(item), n, &err, NULL, &olen);
        if (end == -2 || (end >= 0 && end != n))
            return 0;
        *ended = end >= 0;
    }
    *size = olen;
    return 1;
}

static PyObject *
join_frames(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "join_frames(reads: list[bytes], chunked: bool, let_go=None)");
        return NULL;
    }
    PyObject *reads = args[0], *let_go = nargs == 3 && args[2] != Py_None ? args[2] : NULL;
    int chunked = PyObject_IsTrue(args[1]);
    if (chunked < 0)
        return NULL;
    Py_ssize_t nreads = PyList_GET_SIZE(reads), total = 0;
    for (Py_ssize_t r = 0; r < nreads; r++) {
        PyObject *item = PyList_GET_ITEM(reads, r);
        if (!PyBytes_CheckExact(item))
            Py_RETURN_NONE;
        total += PyBytes_GET_SIZE(item);
    }
    chunked_state *cs = NULL;
    int ended = 0;
    if (chunked) {
        cs = PyMem_Calloc(1, sizeof(chunked_state));
        if (cs == NULL)
            return PyErr_NoMemory();
        int ok = frames_measure(reads, nreads, cs, &total, &ended);
        memset(cs, 0, sizeof(chunked_state));
        if (!ok) {
            PyMem_Free(cs);
            Py_RETURN_NONE;
        }
    }
    PyObject *payload = PyBytes_FromStringAndSize(NULL, total);
    PyObject *ends = PyList_New(nreads);
    PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
    if (payload == NULL || ends == NULL || empty == NULL) {
        PyMem_Free(cs);
        Py_XDECREF(payload);
        Py_XDECREF(ends);
        Py_XDECREF(empty);
        return NULL;
    }
    char *out = PyBytes_AS_STRING(payload);
    Py_ssize_t olen = 0, freed = 0;
    for (Py_ssize_t r = 0; r < nreads; r++) {
        PyObject *item = PyList_GET_ITEM(reads, r);
        Py_ssize_t n = PyBytes_GET_SIZE(item);
        if (cs != NULL) {
            const char *err = NULL;
            chunked_scan(cs, PyBytes_AS_STRING(item), n, &err, out, &olen); /* measured well formed */
        } else {
            memcpy(out + olen, PyBytes_AS_STRING(item), (size_t)n);
            olen += n;
        }
        PyList_SET_ITEM(ends, r, PyLong_FromSsize_t(olen));
        PyList_SET_ITEM(reads, r, Py_NewRef(empty)); /* the read is let go of now */
        Py_DECREF(item);
        int failed = PyList_GET_ITEM(ends, r) == NULL;
        if (!failed && let_go != NULL && (freed += n) >= LET_GO_BYTES) {
            freed = 0;
            PyObject *called = PyObject_CallNoArgs(let_go);
            failed = called == NULL;
            Py_XDECREF(called);
        }
        if (failed) {
            PyMem_Free(cs);
            Py_DECREF(payload);
            Py_DECREF(ends);
            Py_DECREF(empty);
            return NULL;
        }
    }
    PyMem_Free(cs);
    Py_DECREF(empty);
    if (PyList_SetSlice(reads, 0, nreads, NULL) < 0) {
        Py_DECREF(payload);
        Py_DECREF(ends);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(3, payload, ends, (ended || !chunked) ? Py_True : Py_False);
    Py_DECREF(payload);
    Py_DECREF(ends);
    return result;
}

/* ---- template_run -------------------------------------------------------------------------------- */

/* Decode the inside of a JSON string, body[0:n], appending UTF-8 to out. Returns the bytes written, or -1
   when the body is not a JSON string's inside this function is sure of: a raw quote or control
   character, a bad or cut escape, a lone surrogate escape, or bytes that are not strict UTF-8 (each body
   is read alone, as the reference decodes each event alone). */
static Py_ssize_t
decode_body(const unsigned char *body, Py_ssize_t n, unsigned char *out)
{
    Py_ssize_t i = 0, o = 0;
    while (i < n) {
        unsigned char c = body[i];
        if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') {
            out[o++] = c;
            i++;
            continue;
        }
        if (c == '\\') {
            if (i + 1 >= n)
                return -1;
            unsigned char e = body[i + 1];
            unsigned char simple = 0;
            switch (e) {
            case '"': simple = '"'; break;
            case '\\': simple = '\\'; break;
            case '/': simple = '/'; break;
            case 'b': simple = '\b'; break;
            case 'f': simple = '\f'; break;
            case 'n': simple = '\n'; break;
            case 'r': simple = '\r'; break;
            case 't': simple = '\t'; break;
            case 'u': break;
            default: return -1;
            }
            if (e != 'u') {
                out[o++] = simple;
                i += 2;
                continue;
            }
            if (n - i < 6)
                return -1;
            long v = hex4(body + i + 2);
            if (v < 0)
                return -1;
            Py_UCS4 cp = (Py_UCS4)v;
            i += 6;
            if (cp >= 0xDC00 && cp <= 0xDFFF)
                return -1; /* a lone low surrogate */
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (n - i < 6 || body[i] != '\\' || body[i + 1] != 'u')
                    return -1; /* a lone high surrogate */
                long low = hex4(body + i + 2);
                if (low < 0xDC00 || low > 0xDFFF)
                    return -1;
                i += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (Py_UCS4)(low - 0xDC00);
            }
            if (cp < 0x80) {
                out[o++] = (unsigned char)cp;
            } else if (cp < 0x800) {
                out[o++] = (unsigned char)(0xC0 | (cp >> 6));
                out[o++] = (unsigned char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                out[o++] = (unsigned char)(0xE0 | (cp >> 12));
                out[o++] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
                out[o++] = (unsigned char)(0x80 | (cp & 0x3F));
            } else {
                out[o++] = (unsigned char)(0xF0 | (cp >> 18));
                out[o++] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
                out[o++] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
                out[o++] = (unsigned char)(0x80 | (cp & 0x3F));
            }
            continue;
        }
        if (c < 0x80)
            return -1; /* a raw quote or control character */
        /* strict UTF-8, as Python's decoder: no overlong form, no surrogate, nothing past U+10FFFF */
        Py_ssize_t need;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF)
            need = 1;
        else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            if (c == 0xE0)
                lo = 0xA0;
            else if (c == 0xED)
                hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            if (c == 0xF0)
                lo = 0x90;
            else if (c == 0xF4)
                hi = 0x8F;
        } else
            return -1;
        if (n - i <= need || body[i + 1] < lo || body[i + 1] > hi)
            return -1;
        for (Py_ssize_t k = 2; k <= need; k++)
            if ((body[i + k] & 0xC0) != 0x80)
                return -1;
        memcpy(out + o, body + i, (size_t)need + 1);
        o += need + 1;
        i += need + 1;
    }
    return o;
}

static PyObject *
template_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyBytes_CheckExact(args[0]) || !PyBytes_CheckExact(args[2]) ||
        !PyBytes_CheckExact(args[3]) || !PyBytes_CheckExact(args[5])) {
        PyErr_SetString(PyExc_TypeError, "template_run(buf, pos, prefix, head, dlen, closing): bytes, int, "
                                         "bytes, bytes, int, bytes");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    Py_ssize_t dlen = PyLong_AsSsize_t(args[4]);
    if ((pos == -1 || dlen == -1) && PyErr_Occurred())
        return NULL;
    const unsigned char *buf = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    const char *prefix = PyBytes_AS_STRING(args[2]), *head = PyBytes_AS_STRING(args[3]);
    const char *closing = PyBytes_AS_STRING(args[5]);
    Py_ssize_t plen = PyBytes_GET_SIZE(args[2]), hlen = PyBytes_GET_SIZE(args[3]);
    Py_ssize_t clen = PyBytes_GET_SIZE(args[5]);
    if (pos < 0 || pos > n || dlen < 0 || plen == 0) {
        PyErr_SetString(PyExc_ValueError, "template_run: pos outside buf, a negative dlen or an empty prefix");
        return NULL;
    }
    Py_ssize_t fixed = hlen + dlen + clen; /* an event's bytes after its body */
    /* the text grows with the run, not with what is left of the stream: a call that reads one event
       (two shapes taking turns) must not allocate the rest of the stream each time */
    unsigned char *out = NULL;
    Py_ssize_t cap = 0;
    Py_ssize_t olen = 0, count = 0, nonempty = 0, start = pos, text_end = pos;
    while (pos < n && n - pos >= plen && memcmp(buf + pos, prefix, (size_t)plen) == 0) {
        const unsigned char *lf = memchr(buf + pos, '\n', (size_t)(n - pos));
        if (lf == NULL)
            break; /* the stream's tail, not ended by a blank line */
        Py_ssize_t eol = lf - buf;
        if (eol + 1 >= n || buf[eol + 1] != '\n')
            break; /* not followed by a blank line */
        Py_ssize_t body_end = eol - fixed;
        if (body_end < pos + plen)
            break;
        const unsigned char *tail = buf + body_end;
        if (memcmp(tail, head, (size_t)hlen) != 0 || memcmp(tail + hlen + dlen, closing, (size_t)clen) != 0)
            break;
        if (dlen) {
            const unsigned char *digits = tail + hlen;
            Py_ssize_t k = 0;
            while (k < dlen && digits[k] >= '0' && digits[k] <= '9')
                k++;
            if (k < dlen || (dlen > 1 && digits[0] == '0'))
                break; /* not digits, or a leading zero (not JSON) */
        }
        Py_ssize_t body_len = body_end - pos - plen;
        if (cap - olen < body_len) { /* decoding never makes more bytes than it reads */
            Py_ssize_t want = olen + body_len > 2 * cap ? olen + body_len : 2 * cap;
            unsigned char *grown = PyMem_Realloc(out, (size_t)(want > 256 ? want : 256));
            if (grown == NULL) {
                PyMem_Free(out);
                return PyErr_NoMemory();
            }
            out = grown;
            cap = want > 256 ? want : 256;
        }
        Py_ssize_t wrote = decode_body(buf + pos + plen, body_len, out + olen);
        if (wrote < 0)
            break;
        olen += wrote;
        count++;
        pos = eol + 2;
        if (wrote > 0) { /* a body with bytes has text: every escape decodes to a character */
            nonempty++;
            text_end = pos;
        }
    }
    PyObject *text = PyUnicode_DecodeUTF8(out != NULL ? (const char *)out : "", olen, "strict");
    PyMem_Free(out);
    if (text == NULL)
        return NULL;
    return Py_BuildValue("(nnNnn)", count, pos - start, text, nonempty, text_end - start);
}

/* ---- chunk_gaps ---------------------------------------------------------------------------------- */

#define MAX_BOUNDS 64

/* bisect.bisect_left over bounds[0:n]: the first index whose bound is not below x (a gap equal to a
   bound falls in that bound's bucket, le); the same steps as CPython's, so equal for any input */
static inline Py_ssize_t
bisect_left(const double *bounds, Py_ssize_t n, double x)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (bounds[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static PyObject *
chunk_gaps(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyBytes_CheckExact(args[0]) || !PyList_CheckExact(args[1]) || !PyList_CheckExact(args[2])
        || !PyList_CheckExact(args[3]) || !PyTuple_CheckExact(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "chunk_gaps(buf, cum, times, skip, tail_chunk, bounds): bytes, list, list, list, bool, tuple");
        return NULL;
    }
    const char *buf = PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    PyObject *cum = args[1], *times = args[2], *skip = args[3];
    int tail_chunk = PyObject_IsTrue(args[4]);
    if (tail_chunk < 0)
        return NULL;
    Py_ssize_t nreads = PyList_GET_SIZE(cum), nbounds = PyTuple_GET_SIZE(args[5]);
    if (PyList_GET_SIZE(times) < nreads || nbounds > MAX_BOUNDS) {
        PyErr_SetString(PyExc_ValueError, "chunk_gaps: fewer times than reads, or too many bounds");
        return NULL;
    }
    double bounds[MAX_BOUNDS];
    for (Py_ssize_t b = 0; b < nbounds; b++) {
        bounds[b] = PyFloat_AsDouble(PyTuple_GET_ITEM(args[5], b));
        if (bounds[b] == -1.0 && PyErr_Occurred())
            return NULL;
    }
    /* per read, the events it ended: LF LF pairs counted without overlap, each in the read holding its second LF */
    long *per_read = PyMem_Calloc(nreads > 0 ? (size_t)nreads : 1, sizeof(long));
    if (per_read == NULL)
        return PyErr_NoMemory();
    Py_ssize_t pos = 0, start = 0, last_end = -1; /* last_end: the second LF of the last pair counted */
    for (Py_ssize_t r = 0; r < nreads; r++) {
        Py_ssize_t end = PyLong_AsSsize_t(PyList_GET_ITEM(cum, r));
        if (end == -1 && PyErr_Occurred())
            goto fail;
        if (end < start || end > n) {
            PyErr_SetString(PyExc_ValueError, "chunk_gaps: cum must be nondecreasing offsets within buf");
            goto fail;
        }
        long count = 0;
        while (pos < end) {
            const char *lf = memchr(buf + pos, '\n', (size_t)(end - pos));
            if (lf == NULL)
                break;
            Py_ssize_t i = lf - buf;
            if (i > 0 && buf[i - 1] == '\n' && i - 1 != last_end) {
                count++;
                last_end = i;
            }
            pos = i + 1;
        }
        pos = end;
        per_read[r] = count;
        start = end;
    }
    /* less the events that had no data, plus the tail when it had (timed by the last read) */
    for (Py_ssize_t k = 0, nskip = PyList_GET_SIZE(skip); k < nskip; k++) {
        Py_ssize_t r = PyLong_AsSsize_t(PyList_GET_ITEM(skip, k));
        if (r == -1 && PyErr_Occurred())
            goto fail;
        if (r < 0 || r >= nreads || per_read[r] == 0) {
            PyErr_SetString(PyExc_ValueError, "chunk_gaps: skip names a read that ended no event left");
            goto fail;
        }
        per_read[r]--;
    }
    if (tail_chunk) {
        if (nreads == 0) {
            PyErr_SetString(PyExc_ValueError, "chunk_gaps: a tail with no read");
            goto fail;
        }
        per_read[nreads - 1]++;
    }
    /* the gaps between consecutive reads that completed chunks; a read's further chunks: gaps of 0 */
    long long counts[MAX_BOUNDS + 1] = {0};
    long long total = 0;
    double first = 0.0, prev = 0.0;
    for (Py_ssize_t r = 0; r < nreads; r++) {
        long c = per_read[r];
        if (c == 0)
            continue;
        double t = PyFloat_AsDouble(PyList_GET_ITEM(times, r));
        if (t == -1.0 && PyErr_Occurred())
            goto fail;
        if (total == 0)
            first = t;
        else
            counts[bisect_left(bounds, nbounds, t - prev)]++;
        counts[0] += c - 1;
        total += c;
        prev = t;
    }
    PyMem_Free(per_read);
    if (total < 2)
        Py_RETURN_NONE;
    PyObject *out = PyTuple_New(nbounds + 1);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t b = 0; b <= nbounds; b++) {
        PyObject *v = PyLong_FromLongLong(counts[b]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, b, v);
    }
    return Py_BuildValue("(Nd)", out, prev - first);
fail:
    PyMem_Free(per_read);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"chunk_gaps", (PyCFunction)(void (*)(void))chunk_gaps, METH_FASTCALL,
     "chunk_gaps(buf, cum, times, skip, tail_chunk, bounds) -> ((count per bucket, ...), gap_sum) or None."},
    {"join_frames", (PyCFunction)(void (*)(void))join_frames, METH_FASTCALL,
     "join_frames(reads, chunked, let_go=None) -> (payload, ends, complete) or None: the reads joined "
     "(dechunked when chunked), each let go of as it is copied, let_go() called after every 16 MiB of them: "
     "the list is emptied (None: malformed framing, untouched)."},
    {"template_run", (PyCFunction)(void (*)(void))template_run, METH_FASTCALL,
     "template_run(buf, pos, prefix, head, dlen, closing) -> (count, size, text, nonempty, text_size)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef scanc_module = {
    PyModuleDef_HEAD_INIT, "specproxy.frames._scanc", "The measuring's per-chunk scans in C (see measure/fast_texts.py).", -1,
    module_methods};

PyMODINIT_FUNC
PyInit__scanc(void)
{
    return PyModule_Create(&scanc_module);
}
