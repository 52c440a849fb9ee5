/* Order statistics of a float64 array by radix selection: specproxy.analyze.order_stats's native path.
 *
 * Why: a report's summaries read a few order statistics (median, p95, the median's interval) of columns
 * of up to a month's ten million values. numpy.partition copies the column and then selects around each
 * rank in turn; here each value is read a few times in place and never moved, except the few that share
 * a rank's digit. order_stats.order_statistics_reference (numpy.partition) is what this is held to.
 *
 * How: every double maps to an unsigned key whose order is the values' order (-0.0 just below +0.0), so
 * the k-th smallest value is the k-th smallest key. A level counts the keys by a 16-bit digit, finds the
 * bucket each rank falls in, and copies out only those buckets' keys, which the next level resolves by the
 * next bits: the column by its keys' top 16 bits (its range found in the same pass), the copied-out keys
 * by the 16 bits just below the highest bit in which their range differs (select_ranks says when the
 * column is counted that way too). A bucket of one key value (every key equal) is its own answer. The GIL
 * is released throughout: the report's summaries run on two threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DIGIT_BITS 16
#define BUCKETS (1u << DIGIT_BITS)
#define MAX_RANKS 16
#define SMALL 64 /* at most this many keys: sorted outright */

static inline uint64_t key_of(double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return (u >> 63) ? ~u : (u | 0x8000000000000000ULL);
}

static inline double value_of(uint64_t k) {
    uint64_t u = (k >> 63) ? (k & ~0x8000000000000000ULL) : ~k;
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

static int cmp_keys(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static inline uint64_t key_at(const double *xd, const uint64_t *xk, size_t i) {
    return xd ? key_of(xd[i]) : xk[i];
}

/* where each rank falls among the buckets' counts: its slot (one per distinct bucket holding a rank), each
 * slot's bucket and how many keys lie below it; ranks ascending, so buckets ascending. Returns the slots. */
typedef struct {
    int slots;
    int slot_of_rank[MAX_RANKS];
    uint32_t bucket_of_slot[MAX_RANKS];
    size_t start_of_slot[MAX_RANKS];
} Slots;

static void find_slots(const uint32_t *counts, const size_t *r, int nr, Slots *sl) {
    sl->slots = 0;
    size_t below = 0;
    uint32_t b = 0;
    for (int j = 0; j < nr; j++) {
        while (below + counts[b] <= r[j]) below += counts[b++];
        if (!sl->slots || sl->bucket_of_slot[sl->slots - 1] != b) {
            sl->bucket_of_slot[sl->slots] = b;
            sl->start_of_slot[sl->slots] = below;
            sl->slots++;
        }
        sl->slot_of_rank[j] = sl->slots - 1;
    }
}

/* the largest of the slots' buckets */
static size_t largest_slot(const uint32_t *counts, const Slots *sl) {
    size_t most = 0;
    for (int s = 0; s < sl->slots; s++)
        if (counts[sl->bucket_of_slot[s]] > most) most = counts[sl->bucket_of_slot[s]];
    return most;
}

static int select_ranks(const double *xd, const uint64_t *xk, size_t n, const size_t *r, int nr, double *out);

/* the keys in the slots' buckets (by the digit at shift) copied out, each slot's ranks resolved in them */
static int resolve_slots(const double *xd, const uint64_t *xk, size_t n, const size_t *r, int nr, double *out,
                         const uint32_t *counts, const Slots *sl, int shift) {
    int rc = 0;
    uint64_t *buf[MAX_RANKS] = {0};
    size_t fill[MAX_RANKS] = {0};
    int8_t *want = malloc(BUCKETS);
    if (!want) return -1;
    memset(want, -1, BUCKETS);
    for (int s = 0; s < sl->slots; s++) {
        want[sl->bucket_of_slot[s]] = (int8_t)s;
        if (!(buf[s] = malloc((size_t)counts[sl->bucket_of_slot[s]] * sizeof(uint64_t)))) rc = -1;
    }
    if (rc == 0) {
        for (size_t i = 0; i < n; i++) {
            uint64_t k = key_at(xd, xk, i);
            int s = want[(k >> shift) & (BUCKETS - 1)];
            if (s >= 0) buf[s][fill[s]++] = k;
        }
        for (int s = 0; s < sl->slots && rc == 0; s++) {
            size_t local[MAX_RANKS];
            double got[MAX_RANKS];
            int m = 0, first = -1;
            for (int j = 0; j < nr; j++) {
                if (sl->slot_of_rank[j] != s) continue;
                if (first < 0) first = j;
                local[m++] = r[j] - sl->start_of_slot[s];
            }
            rc = select_ranks(NULL, buf[s], fill[s], local, m, got);
            for (int j = 0; j < m; j++) out[first + j] = got[j];
        }
    }
    for (int s = 0; s < sl->slots; s++) free(buf[s]);
    free(want);
    return rc;
}

/* out[j] = the r[j]-th smallest (0-based) of the n keys (xd's doubles when given, else xk), r ascending.
 * Returns 0, or -1 when memory ran out.
 *
 * A level reads the keys twice: once to count them by a digit (and find their range), once to copy out
 * the buckets holding a rank. The column itself (xd) is first counted by its keys' top 16 bits (sign,
 * exponent and four bits of mantissa) while its range is found in the same pass; when a rank's bucket
 * holds more than an eighth of the values (values packed into a sixteenth of a binade), it is counted again
 * by the 16 bits below the highest bit in which its range differs, as the copied-out keys always are. */
static int select_ranks(const double *xd, const uint64_t *xk, size_t n, const size_t *r, int nr, double *out) {
    if (n <= SMALL) {
        uint64_t keys[SMALL];
        for (size_t i = 0; i < n; i++) keys[i] = key_at(xd, xk, i);
        qsort(keys, n, sizeof keys[0], cmp_keys);
        for (int j = 0; j < nr; j++) out[j] = value_of(keys[r[j]]);
        return 0;
    }
    uint32_t *counts = calloc(BUCKETS, sizeof *counts);
    if (!counts) return -1;
    uint64_t lo = UINT64_MAX, hi = 0;
    Slots sl;
    int shift = -1;
    if (xd) {
        for (size_t i = 0; i < n; i++) {
            uint64_t k = key_of(xd[i]);
            lo = k < lo ? k : lo;
            hi = k > hi ? k : hi;
            counts[k >> (64 - DIGIT_BITS)]++;
        }
        if (lo != hi) {
            find_slots(counts, r, nr, &sl);
            if (largest_slot(counts, &sl) <= n / 8) shift = 64 - DIGIT_BITS;
            else memset(counts, 0, BUCKETS * sizeof *counts);
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            uint64_t k = xk[i];
            lo = k < lo ? k : lo;
            hi = k > hi ? k : hi;
        }
    }
    if (lo == hi) { /* one key value: every rank is it */
        for (int j = 0; j < nr; j++) out[j] = value_of(lo);
        free(counts);
        return 0;
    }
    if (shift < 0) {
        int top = 63 - __builtin_clzll(lo ^ hi); /* the highest bit in which the keys differ */
        shift = top + 1 - DIGIT_BITS;
        if (shift < 0) shift = 0;
        for (size_t i = 0; i < n; i++) counts[(key_at(xd, xk, i) >> shift) & (BUCKETS - 1)]++;
        find_slots(counts, r, nr, &sl);
    }
    int rc = resolve_slots(xd, xk, n, r, nr, out, counts, &sl, shift);
    free(counts);
    return rc;
}

PyDoc_STRVAR(select_doc,
"select(values, ranks) -> tuple of floats\n\n"
"The ranks[j]-th smallest (0-based) of values (a C-contiguous float64 buffer of finite values), for\n"
"ranks ascending, each below len(values), at most 16 of them.");

static PyObject *py_select(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *ranks_obj;
    if (!PyArg_ParseTuple(args, "y*O!", &view, &PyTuple_Type, &ranks_obj)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t nr = PyTuple_GET_SIZE(ranks_obj);
    size_t n = (size_t)view.len / sizeof(double);
    size_t r[MAX_RANKS];
    double out[MAX_RANKS];
    if (view.len % (Py_ssize_t)sizeof(double) || n >= UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "values: a float64 buffer of fewer than 2**32 values");
        goto done;
    }
    if (nr < 1 || nr > MAX_RANKS) {
        PyErr_SetString(PyExc_ValueError, "ranks: 1 to 16 of them");
        goto done;
    }
    for (Py_ssize_t j = 0; j < nr; j++) {
        Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(ranks_obj, j));
        if (v == -1 && PyErr_Occurred()) goto done;
        if (v < 0 || (size_t)v >= n || (j && (size_t)v < r[j - 1])) {
            PyErr_SetString(PyExc_ValueError, "ranks: ascending, each in [0, len(values))");
            goto done;
        }
        r[j] = (size_t)v;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = select_ranks((const double *)view.buf, NULL, n, r, (int)nr, out);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyTuple_New(nr);
    if (!result) goto done;
    for (Py_ssize_t j = 0; j < nr; j++) {
        PyObject *f = PyFloat_FromDouble(out[j]);
        if (!f) { Py_CLEAR(result); goto done; }
        PyTuple_SET_ITEM(result, j, f);
    }
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"select", py_select, METH_VARARGS, select_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_orderc",
                                    "Order statistics of float64 arrays by radix selection.", -1, methods};

PyMODINIT_FUNC PyInit__orderc(void) { return PyModule_Create(&module); }
