/* Rows of a SQLite query straight into column buffers, without a Python object per value.
 *
 * Why: building the columnar cache of a month (10 million turns, ~45 columns) through the sqlite3
 * module makes ~450 million Python objects and took minutes; the same values read with the SQLite C API
 * into flat buffers take seconds. This is the fast path of ``store/column_reader.py``; that module's
 * plain Python reader is the reference it is checked against (tests/unit/test_columnsc.py), and what
 * runs without a compiler.
 *
 * read(path, sql, params, kinds, guard_sql) -> (guard, rows, buffers, dictionaries)
 *   kinds: one letter per result column: 'i' int64 (NULL is an error), 'f' float64 (NULL is NaN),
 *   't' int32 codes into a dictionary of the column's distinct strings in order of first appearance
 *   (NULL is -1). guard_sql (or None): a query run first in the same read transaction; its first
 *   column's integer is returned as ``guard`` (None without one), so that the caller can tell that
 *   the rows come from the state it checked. A value of another type than its column's kind (text in a
 *   numeric column, a number in a text one) raises Unsupported: the caller reads with the reference.
 * The GIL is released while SQLite runs. The connection is opened without SQLite's own mutex (it is
 * this call's alone): the serialized mode locked it around every value read, a third of the time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <sqlite3.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static PyObject *Unsupported;

/* --- a growable buffer ------------------------------------------------------------------------ */

typedef struct {
    char *data;
    size_t len, cap;
} Buf;

static int buf_reserve(Buf *b, size_t more) {
    if (b->len + more <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + more)
        cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p)
        return -1;
    b->data = p;
    b->cap = cap;
    return 0;
}

/* Append n bytes of v; -1 when out of memory. */
static int buf_put(Buf *b, const void *v, size_t n) {
    if (buf_reserve(b, n) < 0)
        return -1;
    memcpy(b->data + b->len, v, n);
    b->len += n;
    return 0;
}

/* --- a dictionary of strings: open addressing, FNV-1a ------------------------------------------ */

typedef struct {
    char *s;
    int len;
    int32_t code;
} Entry;

typedef struct {
    Entry *slots;
    size_t cap, n;
    char **order; /* the strings by code */
    int *lens;
    size_t order_cap;
} Dict;

static uint64_t fnv(const unsigned char *s, int len) {
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < len; i++) {
        h ^= s[i];
        h *= 1099511628211ULL;
    }
    return h;
}

static int dict_grow(Dict *d) {
    size_t cap = d->cap ? d->cap * 2 : 64;
    Entry *slots = calloc(cap, sizeof(Entry));
    if (!slots)
        return -1;
    for (size_t i = 0; i < d->cap; i++) {
        Entry *e = &d->slots[i];
        if (!e->s)
            continue;
        size_t j = fnv((const unsigned char *)e->s, e->len) & (cap - 1);
        while (slots[j].s)
            j = (j + 1) & (cap - 1);
        slots[j] = *e;
    }
    free(d->slots);
    d->slots = slots;
    d->cap = cap;
    return 0;
}

/* The code of s (added when new), or -1 when out of memory. */
static int32_t dict_code(Dict *d, const char *s, int len) {
    if ((d->n + 1) * 2 > d->cap && dict_grow(d) < 0)
        return -1;
    size_t j = fnv((const unsigned char *)s, len) & (d->cap - 1);
    while (d->slots[j].s) {
        Entry *e = &d->slots[j];
        if (e->len == len && memcmp(e->s, s, (size_t)len) == 0)
            return e->code;
        j = (j + 1) & (d->cap - 1);
    }
    if (d->n >= INT32_MAX)
        return -1;
    char *copy = malloc((size_t)len + 1);
    if (!copy)
        return -1;
    memcpy(copy, s, (size_t)len);
    copy[len] = 0;
    if (d->n == d->order_cap) {
        size_t cap = d->order_cap ? d->order_cap * 2 : 16;
        char **order = realloc(d->order, cap * sizeof(char *));
        int *lens = order ? realloc(d->lens, cap * sizeof(int)) : NULL;
        if (order)
            d->order = order;
        if (!order || !lens) {
            free(copy);
            return -1;
        }
        d->lens = lens;
        d->order_cap = cap;
    }
    int32_t code = (int32_t)d->n;
    d->slots[j] = (Entry){copy, len, code};
    d->order[d->n] = copy;
    d->lens[d->n] = len;
    d->n++;
    return code;
}

static void dict_free(Dict *d) {
    for (size_t i = 0; i < d->n; i++)
        free(d->order[i]);
    free(d->order);
    free(d->lens);
    free(d->slots);
    memset(d, 0, sizeof(*d));
}

/* --- the read ------------------------------------------------------------------------------------ */

enum { OK = 0, E_SQLITE, E_MEMORY, E_TYPE, E_NULL };

typedef struct {
    int ncol;
    const char *kinds;
    Buf *bufs;
    Dict *dicts;
    long long rows;
    long long guard;
    int has_guard;
    int bad_col;
    char message[512];
} Job;

static int bind_params(sqlite3_stmt *st, PyObject *params) {
    /* called with the GIL held */
    Py_ssize_t n = PyTuple_GET_SIZE(params);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyTuple_GET_ITEM(params, i);
        int rc;
        if (v == Py_None)
            rc = sqlite3_bind_null(st, (int)i + 1);
        else if (PyLong_Check(v)) {
            long long x = PyLong_AsLongLong(v);
            if (x == -1 && PyErr_Occurred())
                return -1;
            rc = sqlite3_bind_int64(st, (int)i + 1, x);
        } else if (PyFloat_Check(v))
            rc = sqlite3_bind_double(st, (int)i + 1, PyFloat_AS_DOUBLE(v));
        else {
            PyErr_SetString(PyExc_TypeError, "params: int, float or None");
            return -1;
        }
        if (rc != SQLITE_OK) {
            PyErr_SetString(PyExc_RuntimeError, "cannot bind a parameter");
            return -1;
        }
    }
    return 0;
}

static int run_rows(sqlite3 *db, sqlite3_stmt *st, Job *job) {
    /* called without the GIL */
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        for (int c = 0; c < job->ncol; c++) {
            Buf *b = &job->bufs[c];
            int type = sqlite3_column_type(st, c);
            switch (job->kinds[c]) {
            case 'i': {
                if (type == SQLITE_NULL) {
                    job->bad_col = c;
                    return E_NULL;
                }
                if (type != SQLITE_INTEGER) {
                    job->bad_col = c;
                    return E_TYPE;
                }
                int64_t v = sqlite3_column_int64(st, c);
                if (buf_put(b, &v, 8) < 0)
                    return E_MEMORY;
                break;
            }
            case 'f': {
                double v;
                if (type == SQLITE_NULL)
                    v = NAN;
                else if (type == SQLITE_INTEGER)
                    v = (double)sqlite3_column_int64(st, c);
                else if (type == SQLITE_FLOAT)
                    v = sqlite3_column_double(st, c);
                else {
                    job->bad_col = c;
                    return E_TYPE;
                }
                if (buf_put(b, &v, 8) < 0)
                    return E_MEMORY;
                break;
            }
            default: { /* 't' */
                int32_t code;
                if (type == SQLITE_NULL)
                    code = -1;
                else if (type == SQLITE_TEXT) {
                    const char *s = (const char *)sqlite3_column_text(st, c);
                    int len = sqlite3_column_bytes(st, c);
                    if (!s)
                        return E_MEMORY;
                    code = dict_code(&job->dicts[c], s, len);
                    if (code < 0)
                        return E_MEMORY;
                } else {
                    job->bad_col = c;
                    return E_TYPE;
                }
                if (buf_put(b, &code, 4) < 0)
                    return E_MEMORY;
            }
            }
        }
        job->rows++;
    }
    if (rc != SQLITE_DONE) {
        snprintf(job->message, sizeof job->message, "%s", sqlite3_errmsg(db));
        return E_SQLITE;
    }
    return OK;
}

static int run_guard(sqlite3 *db, const char *guard_sql, Job *job) {
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(db, guard_sql, -1, &st, NULL);
    if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        job->has_guard = sqlite3_column_type(st, 0) != SQLITE_NULL;
        job->guard = sqlite3_column_int64(st, 0);
        rc = SQLITE_OK;
    } else if (rc == SQLITE_DONE)
        rc = SQLITE_OK;
    if (rc != SQLITE_OK)
        snprintf(job->message, sizeof job->message, "%s", sqlite3_errmsg(db));
    sqlite3_finalize(st);
    return rc == SQLITE_OK ? OK : E_SQLITE;
}

static PyObject *results(Job *job) {
    PyObject *bufs = PyList_New(job->ncol), *dicts = PyList_New(job->ncol), *out = NULL;
    if (!bufs || !dicts)
        goto done;
    for (int c = 0; c < job->ncol; c++) {
        PyObject *b = PyByteArray_FromStringAndSize(job->bufs[c].data ? job->bufs[c].data : "",
                                                    (Py_ssize_t)job->bufs[c].len);
        if (!b)
            goto done;
        PyList_SET_ITEM(bufs, c, b);
        free(job->bufs[c].data);
        job->bufs[c] = (Buf){0};
        PyObject *d = Py_None;
        if (job->kinds[c] == 't') {
            Dict *dd = &job->dicts[c];
            d = PyList_New((Py_ssize_t)dd->n);
            if (!d)
                goto done;
            for (size_t i = 0; i < dd->n; i++) {
                PyObject *s = PyUnicode_DecodeUTF8(dd->order[i], dd->lens[i], NULL);
                if (!s) {
                    Py_DECREF(d);
                    goto done;
                }
                PyList_SET_ITEM(d, (Py_ssize_t)i, s);
            }
        } else
            Py_INCREF(d);
        PyList_SET_ITEM(dicts, c, d);
    }
    PyObject *guard = job->has_guard ? PyLong_FromLongLong(job->guard) : Py_NewRef(Py_None);
    if (guard)
        out = Py_BuildValue("(NLOO)", guard, job->rows, bufs, dicts);
done:
    Py_XDECREF(bufs);
    Py_XDECREF(dicts);
    return out;
}

static PyObject *read_columns(PyObject *self, PyObject *args) {
    const char *path, *sql, *kinds, *guard_sql = NULL;
    PyObject *params;
    if (!PyArg_ParseTuple(args, "ssO!s|z", &path, &sql, &PyTuple_Type, &params, &kinds, &guard_sql))
        return NULL;
    Job job = {0};
    job.ncol = (int)strlen(kinds);
    for (int c = 0; c < job.ncol; c++)
        if (kinds[c] != 'i' && kinds[c] != 'f' && kinds[c] != 't') {
            PyErr_SetString(PyExc_ValueError, "kinds: one of i, f, t per column");
            return NULL;
        }
    job.kinds = kinds;
    job.bufs = calloc((size_t)job.ncol + 1, sizeof(Buf));
    job.dicts = calloc((size_t)job.ncol + 1, sizeof(Dict));
    if (!job.bufs || !job.dicts) {
        free(job.bufs);
        free(job.dicts);
        return PyErr_NoMemory();
    }
    PyObject *out = NULL;
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    int err = OK;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, NULL) != SQLITE_OK) {
        PyErr_Format(PyExc_RuntimeError, "cannot open %s: %s", path, db ? sqlite3_errmsg(db) : "out of memory");
        goto done;
    }
    sqlite3_busy_timeout(db, 5000);
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK) {
        PyErr_Format(PyExc_RuntimeError, "%s", sqlite3_errmsg(db));
        goto done;
    }
    if (sqlite3_column_count(st) != job.ncol) {
        PyErr_SetString(PyExc_ValueError, "kinds: one letter per result column");
        goto done;
    }
    if (bind_params(st, params) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    /* one read transaction: the guard and the rows see the same state of the file */
    err = sqlite3_exec(db, "BEGIN", NULL, NULL, NULL) == SQLITE_OK ? OK : E_SQLITE;
    if (err != OK)
        snprintf(job.message, sizeof job.message, "%s", sqlite3_errmsg(db));
    if (err == OK && guard_sql)
        err = run_guard(db, guard_sql, &job);
    if (err == OK)
        err = run_rows(db, st, &job);
    sqlite3_finalize(st);
    st = NULL;
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    Py_END_ALLOW_THREADS
    switch (err) {
    case OK:
        out = results(&job);
        break;
    case E_MEMORY:
        PyErr_NoMemory();
        break;
    case E_TYPE:
        PyErr_Format(Unsupported, "column %d holds a value of another type than %c", job.bad_col, kinds[job.bad_col]);
        break;
    case E_NULL:
        PyErr_Format(Unsupported, "column %d holds NULL", job.bad_col);
        break;
    default:
        PyErr_Format(PyExc_RuntimeError, "%s", job.message);
    }
done:
    sqlite3_finalize(st);
    sqlite3_close(db);
    for (int c = 0; c < job.ncol; c++) {
        free(job.bufs[c].data);
        dict_free(&job.dicts[c]);
    }
    free(job.bufs);
    free(job.dicts);
    return out;
}

static PyMethodDef methods[] = {
    {"read", read_columns, METH_VARARGS,
     "read(path, sql, params, kinds, guard_sql=None) -> (guard, rows, buffers, dictionaries)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_columnsc", NULL, -1, methods};

PyMODINIT_FUNC PyInit__columnsc(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Unsupported = PyErr_NewException("specproxy.store._columnsc.Unsupported", PyExc_ValueError, NULL);
    if (!Unsupported || PyModule_AddObject(m, "Unsupported", Unsupported) < 0) {
        Py_XDECREF(Unsupported);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(Unsupported);
    return m;
}
