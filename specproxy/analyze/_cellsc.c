/* A report table's cells read in one pass per column: specproxy.analyze.by_cell's native path.
 *
 * Why: a table (by concurrency, prompt length, content class, proxy, server instance) has up to a few
 * dozen cells over a month's ten million turns. Cell by cell, each cell's rows were found, their positions
 * composed with the selection's, and each column gathered and then filtered: every column copied twice per
 * table and the positions once more. Here each column is read once, through the selection's positions, and
 * each value lands in its cell's part of one buffer (finite_by_cell), or feeds its cell's running busy time
 * (throughput_by_cell). by_cell's reference functions (numpy, cell by cell) are what these are held to,
 * bit for bit: a cell's values keep the order of its rows, so its mean and order statistics are the same.
 *
 * The GIL is released during the passes: the report's figures run on two threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the cells' column: one signed integer per row, of any width numpy narrows it to (-1: in no cell) */
typedef struct {
    const char *p;
    int width;
} Cells;

static inline int64_t cell_at(const Cells *c, Py_ssize_t i) {
    switch (c->width) {
    case 1: return ((const int8_t *)c->p)[i];
    case 2: return ((const int16_t *)c->p)[i];
    case 4: return ((const int32_t *)c->p)[i];
    default: return ((const int64_t *)c->p)[i];
    }
}

/* the inputs every pass shares: the rows (a selection's positions into the columns, or every row), their
 * cells (or one cell of every row), and which rows count (or all) */
typedef struct {
    Py_buffer pos, cells, mask;
    int has_pos, has_cells, has_mask;
    Py_ssize_t rows;   /* rows read: len(positions), else the columns' length */
    Py_ssize_t n;      /* the columns' length: every position must be below it */
    Py_ssize_t ncell;
    Cells c;
} Rows;

static void rows_release(Rows *r) {
    if (r->has_pos) PyBuffer_Release(&r->pos);
    if (r->has_cells) PyBuffer_Release(&r->cells);
    if (r->has_mask) PyBuffer_Release(&r->mask);
}

static int optional_buffer(PyObject *obj, Py_buffer *view, int *has) {
    *has = 0;
    if (obj == Py_None) return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    *has = 1;
    return 0;
}

/* the rows of columns of ``n`` values; -1 with an exception set */
static int rows_open(Rows *r, PyObject *pos, PyObject *cells, PyObject *mask, Py_ssize_t ncell, Py_ssize_t n) {
    memset(r, 0, sizeof *r);
    r->ncell = ncell;
    if (ncell < 1) {
        PyErr_SetString(PyExc_ValueError, "at least one cell");
        return -1;
    }
    if (optional_buffer(pos, &r->pos, &r->has_pos) < 0 || optional_buffer(cells, &r->cells, &r->has_cells) < 0 ||
        optional_buffer(mask, &r->mask, &r->has_mask) < 0) {
        rows_release(r);
        return -1;
    }
    r->rows = n;
    if (r->has_pos) {
        if (r->pos.itemsize != 8 || (strcmp(r->pos.format, "q") && strcmp(r->pos.format, "l"))) {
            PyErr_SetString(PyExc_TypeError, "positions must be int64");
            goto fail;
        }
        r->rows = r->pos.len / 8;
    }
    r->n = n;
    if (r->has_cells) {
        int w = (int)r->cells.itemsize;
        const char *f = r->cells.format;
        int is_signed = f[0] == 'b' || f[0] == 'h' || f[0] == 'i' || f[0] == 'l' || f[0] == 'q';
        if (!is_signed || (w != 1 && w != 2 && w != 4 && w != 8) || r->cells.len / w != r->rows) {
            PyErr_SetString(PyExc_TypeError, "cells must be signed integers, one per row");
            goto fail;
        }
        r->c.p = r->cells.buf;
        r->c.width = w;
    }
    if (r->has_mask && (r->mask.itemsize != 1 || r->mask.len != r->rows)) {
        PyErr_SetString(PyExc_TypeError, "mask must be bool, one per row");
        goto fail;
    }
    return 0;
fail:
    rows_release(r);
    return -1;
}

/* the cell of row i, or -1 when the row does not count */
static inline int64_t cell_of(const Rows *r, Py_ssize_t i) {
    if (r->has_mask && !((const uint8_t *)r->mask.buf)[i]) return -1;
    return r->has_cells ? cell_at(&r->c, i) : 0;
}

static inline Py_ssize_t row_at(const Rows *r, Py_ssize_t i) {
    return r->has_pos ? (Py_ssize_t)((const int64_t *)r->pos.buf)[i] : i;
}

static int double_column(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || strcmp(view->format, "d")) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s must be float64", what);
        return -1;
    }
    return 0;
}

/* per cell, the rows that count, as each cell's start in a buffer of them all (ncell + 1 entries, the last
 * the total); *bad set when a cell number is past ncell */
static Py_ssize_t *capacities(const Rows *r, int *bad) {
    Py_ssize_t *cap = calloc((size_t)r->ncell + 1, sizeof *cap);
    if (!cap) return NULL;
    const uint8_t *mask = r->has_mask ? r->mask.buf : NULL;
    if (!r->has_cells) {
        Py_ssize_t n = r->rows;
        if (mask) {
            n = 0;
            for (Py_ssize_t i = 0; i < r->rows; i++) n += mask[i] != 0;
        }
        cap[1] = n;
    } else if (r->c.width == 1) {
        const int8_t *cells = (const int8_t *)r->c.p;
        /* by cell + 128 (every int8, the negative ones in no cell), four tables taking turns: a cell's rows
         * come in runs, and one counter incremented row after row waits for its own last store each time */
        Py_ssize_t counts[4][256] = {{0}};
        Py_ssize_t i = 0;
        if (mask) {
            for (; i + 4 <= r->rows; i += 4)
                for (int t = 0; t < 4; t++) counts[t][mask[i + t] ? cells[i + t] + 128 : 0]++;
            for (; i < r->rows; i++) counts[0][mask[i] ? cells[i] + 128 : 0]++;
        } else {
            for (; i + 4 <= r->rows; i += 4)
                for (int t = 0; t < 4; t++) counts[t][cells[i + t] + 128]++;
            for (; i < r->rows; i++) counts[0][cells[i] + 128]++;
        }
        for (Py_ssize_t c = 0; c < 128; c++) {
            Py_ssize_t k = counts[0][c + 128] + counts[1][c + 128] + counts[2][c + 128] + counts[3][c + 128];
            if (c < r->ncell) cap[c + 1] = k;
            else if (k) *bad = 1;
        }
    } else {
        for (Py_ssize_t i = 0; i < r->rows; i++) {
            int64_t c = cell_of(r, i);
            if (c >= r->ncell) *bad = 1;
            else if (c >= 0) cap[c + 1]++;
        }
    }
    for (Py_ssize_t c = 0; c < r->ncell; c++) cap[c + 1] += cap[c]; /* now each cell's start */
    return cap;
}

/* the values of x at the rows but NaN, each to its cell's write pointer (dst), *inf set when one is
 * infinite; 0, or -1 for a position outside the columns. One loop per kind of rows, the common ones without
 * a branch per value. */
#define FINITE_LOOP(CELL, ROW)                                                       \
    for (Py_ssize_t i = 0; i < r->rows; i++) {                                     \
        int64_t c = (CELL);                                                          \
        if (c < 0) continue;                                                         \
        Py_ssize_t row = (ROW);                                                      \
        if ((size_t)row >= (size_t)r->n) return -1;                                 \
        double v = x[row];                                                           \
        *dst[c] = v;                                                                 \
        dst[c] += !isnan(v);                                                         \
        *inf |= isinf(v);                                                            \
    }

static int finite_pass(const Rows *r, const double *x, double **dst, int *inf) {
    const int64_t *pos = r->has_pos ? r->pos.buf : NULL;
    const uint8_t *mask = r->has_mask ? r->mask.buf : NULL;
    if (!r->has_cells && !mask) {
        double *out = dst[0];
        if (pos) {
            for (Py_ssize_t i = 0; i < r->rows; i++) {
                int64_t row = pos[i];
                if ((uint64_t)row >= (uint64_t)r->n) return -1;
                double v = x[row];
                *out = v;
                out += !isnan(v);
                *inf |= isinf(v);
            }
        } else {
            for (Py_ssize_t i = 0; i < r->rows; i++) {
                double v = x[i];
                *out = v;
                out += !isnan(v);
                *inf |= isinf(v);
            }
        }
        dst[0] = out;
        return 0;
    }
    if (r->has_cells && r->c.width == 1 && pos) {
        const int8_t *cells = (const int8_t *)r->c.p;
        if (mask) {
            FINITE_LOOP(mask[i] ? cells[i] : -1, pos[i])
        } else {
            FINITE_LOOP(cells[i], pos[i])
        }
        return 0;
    }
    FINITE_LOOP(cell_of(r, i), row_at(r, i))
    return 0;
}

static PyObject *ssize_list(const Py_ssize_t *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *x = PyLong_FromSsize_t(v[i]);
        if (!x) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

/* alloc(count): a new writable float64 buffer of count values (numpy's np.empty: its large arrays are
 * advised into huge pages, where 4 KB page faults were half of a pass's time); NULL with an exception set */
static PyObject *allocated(PyObject *alloc, Py_ssize_t count, Py_buffer *view) {
    PyObject *obj = PyObject_CallFunction(alloc, "n", count);
    if (!obj) return NULL;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        Py_DECREF(obj);
        return NULL;
    }
    if (view->itemsize != 8 || strcmp(view->format, "d") || view->len != count * 8) {
        PyBuffer_Release(view);
        Py_DECREF(obj);
        PyErr_SetString(PyExc_TypeError, "alloc must return count float64 values");
        return NULL;
    }
    return obj;
}

PyDoc_STRVAR(finite_by_cell_doc,
"finite_by_cell(values, positions, cells, ncell, mask, alloc) -> (buffer, starts, counts, infinite)\n\n"
"Each cell's values of ``values`` (float64) but NaN at the rows ``positions`` (int64, or None: every row), in\n"
"row order, in one buffer of float64 from alloc(count): cell c's are ``counts[c]`` values from ``starts[c]``;\n"
"``infinite``: whether one of them is infinite (a figure is a number or missing, never inf).\n"
"``cells``: the\n"
"cell of each row (signed integers, -1: none; None: all in cell 0); ``mask``: which rows count (bool, or None).");

static PyObject *finite_by_cell(PyObject *self, PyObject *args) {
    PyObject *values_obj, *pos_obj, *cells_obj, *mask_obj, *alloc;
    Py_ssize_t ncell;
    if (!PyArg_ParseTuple(args, "OOOnOO", &values_obj, &pos_obj, &cells_obj, &ncell, &mask_obj, &alloc)) return NULL;
    Py_buffer values;
    if (double_column(values_obj, &values, "values") < 0) return NULL;
    Rows r;
    if (rows_open(&r, pos_obj, cells_obj, mask_obj, ncell, values.len / 8) < 0) {
        PyBuffer_Release(&values);
        return NULL;
    }
    PyObject *result = NULL, *buf = NULL;
    Py_ssize_t *start = NULL, *count = calloc((size_t)ncell, sizeof *count);
    double **dst = calloc((size_t)ncell, sizeof *dst);
    int bad = 0, outside = 0, inf = 0;
    if (!count || !dst) goto nomem;
    Py_BEGIN_ALLOW_THREADS
    start = capacities(&r, &bad);
    Py_END_ALLOW_THREADS
    if (!start) goto nomem;
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "a cell number past ncell");
        goto done;
    }
    Py_buffer view;
    buf = allocated(alloc, start[ncell], &view);
    if (!buf) goto done;
    double *out = view.buf;
    for (Py_ssize_t c = 0; c < ncell; c++) dst[c] = out + start[c];
    const double *x = values.buf;
    Py_BEGIN_ALLOW_THREADS
    outside = finite_pass(&r, x, dst, &inf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (outside) {
        PyErr_SetString(PyExc_IndexError, "a position outside the columns");
        goto done;
    }
    for (Py_ssize_t c = 0; c < ncell; c++) count[c] = dst[c] - (out + start[c]);
    {
        PyObject *s = ssize_list(start, ncell), *n = ssize_list(count, ncell);
        if (s && n) result = Py_BuildValue("OOOO", buf, s, n, inf ? Py_True : Py_False);
        Py_XDECREF(s);
        Py_XDECREF(n);
    }
    goto done;
nomem:
    PyErr_NoMemory();
done:
    Py_XDECREF(buf);
    free(start);
    free(count);
    free(dst);
    rows_release(&r);
    PyBuffer_Release(&values);
    return result;
}

PyDoc_STRVAR(throughput_by_cell_doc,
"throughput_by_cell(t_wall, total_s, tokens, positions, cells, ncell, alloc)\n"
"    -> (n, tokens, exact, in_order, periods, starts, counts)\n\n"
"Per cell, over its rows with a finite token count: how many (n), their tokens added in row order, whether\n"
"that sum is exact (every count a whole number >= 0, the sum within 2**53: any order adds to it), whether\n"
"the rows that have a finite start and end (start + total_s) start in order, and the lengths of their busy\n"
"periods (the union of [start, end] as numpy's running maximum finds it) in one buffer from alloc(count): cell\n"
"c's are counts[c] from starts[c]. A cell not in order, or not exact, is left to the caller.");

typedef struct {
    Py_ssize_t n, periods;
    double tokens, first, run_end, last;
    int exact, in_order, started;
} CellBusy;

static PyObject *throughput_by_cell(PyObject *self, PyObject *args) {
    PyObject *t_obj, *d_obj, *k_obj, *pos_obj, *cells_obj, *alloc;
    Py_ssize_t ncell;
    if (!PyArg_ParseTuple(args, "OOOOOnO", &t_obj, &d_obj, &k_obj, &pos_obj, &cells_obj, &ncell, &alloc)) return NULL;
    Py_buffer tv, dv, kv;
    if (double_column(t_obj, &tv, "t_wall") < 0) return NULL;
    if (double_column(d_obj, &dv, "total_s") < 0) {
        PyBuffer_Release(&tv);
        return NULL;
    }
    if (double_column(k_obj, &kv, "tokens") < 0) {
        PyBuffer_Release(&tv);
        PyBuffer_Release(&dv);
        return NULL;
    }
    PyObject *result = NULL, *buf = NULL;
    Py_ssize_t *start = NULL, *count = NULL;
    CellBusy *cb = NULL;
    Rows r;
    if (dv.len != tv.len || kv.len != tv.len) {
        PyErr_SetString(PyExc_ValueError, "the three columns must be as long");
        goto release_columns;
    }
    if (rows_open(&r, pos_obj, cells_obj, Py_None, ncell, tv.len / 8) < 0) goto release_columns;
    cb = calloc((size_t)ncell, sizeof *cb);
    count = calloc((size_t)ncell, sizeof *count);
    if (!cb || !count) goto nomem;
    for (Py_ssize_t c = 0; c < ncell; c++) cb[c].exact = cb[c].in_order = 1;
    int bad = 0, outside = 0;
    Py_BEGIN_ALLOW_THREADS
    start = capacities(&r, &bad);
    Py_END_ALLOW_THREADS
    if (!start) goto nomem;
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "a cell number past ncell");
        goto done;
    }
    Py_buffer view;
    buf = allocated(alloc, start[ncell], &view); /* pages never written are never touched */
    if (!buf) goto done;
    double *periods = view.buf;
    const double *t = tv.buf, *d = dv.buf, *k = kv.buf;
    const double exact_limit = 9007199254740992.0; /* 2**53 */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < r.rows; i++) {
        int64_t c = cell_of(&r, i);
        if (c < 0) continue;
        Py_ssize_t row = row_at(&r, i);
        if ((size_t)row >= (size_t)r.n) {
            outside = 1;
            break;
        }
        double tok = k[row];
        if (!isfinite(tok)) continue;
        CellBusy *b = &cb[c];
        b->n++;
        b->tokens += tok;
        if (tok < 0 || tok != floor(tok) || b->tokens > exact_limit) b->exact = 0;
        double s = t[row], e = s + d[row];
        if (!(isfinite(s) && isfinite(e))) continue;
        if (!b->started) {
            b->started = 1;
            b->first = s;
            b->run_end = e;
        } else {
            if (s < b->last) b->in_order = 0;
            if (s > b->run_end) { /* a new period: the last one ends at the running maximum before it */
                periods[start[c] + count[c]++] = b->run_end - b->first;
                b->first = s;
            }
            b->run_end = e > b->run_end ? e : b->run_end; /* numpy.maximum (no NaN here) */
        }
        b->last = s;
    }
    for (Py_ssize_t c = 0; c < ncell; c++)
        if (cb[c].started) periods[start[c] + count[c]++] = cb[c].run_end - cb[c].first;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (outside) {
        PyErr_SetString(PyExc_IndexError, "a position outside the columns");
        goto done;
    }
    {
        PyObject *n = PyList_New(ncell), *tok = PyList_New(ncell), *ex = PyList_New(ncell), *ord = PyList_New(ncell);
        PyObject *s = ssize_list(start, ncell), *cnt = ssize_list(count, ncell);
        int ok = n && tok && ex && ord && s && cnt;
        for (Py_ssize_t c = 0; ok && c < ncell; c++) {
            PyObject *a = PyLong_FromSsize_t(cb[c].n), *b = PyFloat_FromDouble(cb[c].tokens);
            if (!a || !b) {
                Py_XDECREF(a);
                Py_XDECREF(b);
                ok = 0;
                break;
            }
            PyList_SET_ITEM(n, c, a);
            PyList_SET_ITEM(tok, c, b);
            PyList_SET_ITEM(ex, c, PyBool_FromLong(cb[c].exact));
            PyList_SET_ITEM(ord, c, PyBool_FromLong(cb[c].in_order));
        }
        if (ok) result = PyTuple_Pack(7, n, tok, ex, ord, buf, s, cnt);
        Py_XDECREF(n);
        Py_XDECREF(tok);
        Py_XDECREF(ex);
        Py_XDECREF(ord);
        Py_XDECREF(s);
        Py_XDECREF(cnt);
    }
    goto done;
nomem:
    PyErr_NoMemory();
done:
    Py_XDECREF(buf);
    free(start);
    free(count);
    free(cb);
    rows_release(&r);
release_columns:
    PyBuffer_Release(&tv);
    PyBuffer_Release(&dv);
    PyBuffer_Release(&kv);
    return result;
}

/* out: a writable int8 buffer of one value per row; -1 with an exception set */
static int int8_out(PyObject *obj, Py_buffer *view, Py_ssize_t rows) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 1 || strcmp(view->format, "b") || view->len != rows) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "out must be int8, one per row");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(buckets_doc,
"buckets(values, positions, edges, inclusive, out)\n\n"
"Each row's bucket into out (int8): how many of ``edges`` (ascending, at most 127) its value of ``values``\n"
"(float64) at ``positions`` (int64, or None: every row) is above (with ``inclusive``: at or above); -1\n"
"where the value is not a finite number.");

static PyObject *buckets(PyObject *self, PyObject *args) {
    PyObject *values_obj, *pos_obj, *edges_obj, *out_obj;
    int inclusive;
    if (!PyArg_ParseTuple(args, "OOO!pO", &values_obj, &pos_obj, &PyTuple_Type, &edges_obj, &inclusive, &out_obj))
        return NULL;
    Py_ssize_t nedge = PyTuple_GET_SIZE(edges_obj);
    if (nedge > 127) {
        PyErr_SetString(PyExc_ValueError, "at most 127 edges");
        return NULL;
    }
    /* padded to a multiple of 8 with +inf (no finite value is above it, or at it), and one more +inf: the
     * search over eight reads one past its last edge */
    double edges[129];
    Py_ssize_t padded = (nedge + 7) / 8 * 8;
    if (!padded) padded = 8;
    for (Py_ssize_t e = 0; e <= padded; e++) {
        edges[e] = INFINITY;
        if (e < nedge) {
            edges[e] = PyFloat_AsDouble(PyTuple_GET_ITEM(edges_obj, e));
            if (edges[e] == -1.0 && PyErr_Occurred()) return NULL;
        }
    }
    Py_buffer values, out;
    if (double_column(values_obj, &values, "values") < 0) return NULL;
    Rows r;
    if (rows_open(&r, pos_obj, Py_None, Py_None, 1, values.len / 8) < 0) {
        PyBuffer_Release(&values);
        return NULL;
    }
    PyObject *result = NULL;
    if (int8_out(out_obj, &out, r.rows) == 0) {
        const double *x = values.buf, *ed8 = edges;
        int8_t *o = out.buf;
        int outside = 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < r.rows; i++) {
            Py_ssize_t row = row_at(&r, i);
            if ((size_t)row >= (size_t)r.n) {
                outside = 1;
                break;
            }
            double v = x[row];
            int k = 0;
            if (padded == 8) { /* the count of edges below v by a search of four steps, without a branch */
                if (inclusive) {
                    k += (ed8[k + 3] <= v) * 4;
                    k += (ed8[k + 1] <= v) * 2;
                    k += (ed8[k] <= v);
                    k += (ed8[k] <= v);
                } else {
                    k += (ed8[k + 3] < v) * 4;
                    k += (ed8[k + 1] < v) * 2;
                    k += (ed8[k] < v);
                    k += (ed8[k] < v);
                }
            } else {
                for (Py_ssize_t e = 0; e < padded; e++) k += inclusive ? v >= edges[e] : v > edges[e];
            }
            o[i] = isfinite(v) ? (int8_t)k : -1;
        }
        Py_END_ALLOW_THREADS
        PyBuffer_Release(&out);
        if (outside) PyErr_SetString(PyExc_IndexError, "a position outside the columns");
        else result = Py_NewRef(Py_None);
    }
    rows_release(&r);
    PyBuffer_Release(&values);
    return result;
}

static int int32_codes(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 4 || (strcmp(view->format, "i") && strcmp(view->format, "l"))) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "codes must be int32");
        return -1;
    }
    return 0;
}

/* the slot of row i's text code among nvalues + 1 (its code, or nvalues for NULL); -1 with *why set to 1
 * for a position outside the columns, 2 for a code past the values */
static inline int64_t code_slot(const Rows *r, const int32_t *c, int64_t nvalues, Py_ssize_t i, int *why) {
    Py_ssize_t row = row_at(r, i);
    if ((size_t)row >= (size_t)r->n) {
        *why = 1;
        return -1;
    }
    int64_t code = c[row];
    if (code < -1 || code >= nvalues) {
        *why = 2;
        return -1;
    }
    return code < 0 ? nvalues : code;
}

/* every row's slot (code_slot) written out: with ``table``, out[i] = table[slot]; else seen[slot] = 1.
 * Runs without the interpreter lock; 0, or why it stopped (code_slot's) */
static int walk_codes(const Rows *r, const int32_t *c, int64_t nvalues, const int8_t *table, int8_t *out,
                      char *seen) {
    int why = 0;
    for (Py_ssize_t i = 0; i < r->rows; i++) {
        int64_t slot = code_slot(r, c, nvalues, i, &why);
        if (slot < 0) break;
        if (table) out[i] = table[slot];
        else seen[slot] = 1;
    }
    return why;
}

static void code_error(int why) {
    PyErr_SetString(PyExc_IndexError, why == 1 ? "a position outside the columns" : "a code past the values");
}

PyDoc_STRVAR(code_cells_doc,
"code_cells(codes, positions, per_code, out)\n\n"
"Each row's cell into out (int8): per_code[code] of its text code in ``codes`` (int32, -1 for NULL) at\n"
"``positions`` (int64, or None: every row); per_code (int8) holds one cell per value, then NULL's.");

static PyObject *code_cells(PyObject *self, PyObject *args) {
    PyObject *codes_obj, *pos_obj, *per_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &codes_obj, &pos_obj, &per_obj, &out_obj)) return NULL;
    Py_buffer codes, per, out;
    if (int32_codes(codes_obj, &codes) < 0) return NULL;
    if (PyObject_GetBuffer(per_obj, &per, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&codes);
        return NULL;
    }
    PyObject *result = NULL;
    Rows r;
    if (per.itemsize != 1 || strcmp(per.format, "b") || per.len < 1) {
        PyErr_SetString(PyExc_TypeError, "per_code must be int8, one per value and NULL's last");
        goto release;
    }
    if (rows_open(&r, pos_obj, Py_None, Py_None, 1, codes.len / 4) < 0) goto release;
    if (int8_out(out_obj, &out, r.rows) == 0) {
        int why;
        Py_BEGIN_ALLOW_THREADS
        why = walk_codes(&r, codes.buf, per.len - 1, per.buf, out.buf, NULL);
        Py_END_ALLOW_THREADS
        PyBuffer_Release(&out);
        if (why) code_error(why);
        else result = Py_NewRef(Py_None);
    }
    rows_release(&r);
release:
    PyBuffer_Release(&per);
    PyBuffer_Release(&codes);
    return result;
}

PyDoc_STRVAR(codes_present_doc,
"codes_present(codes, positions, nvalues) -> bytes\n\n"
"Which of ``nvalues`` text codes the rows hold (``codes`` int32 at ``positions``, int64 or None: every\n"
"row): one byte per value, 1 where some row holds it, then one for NULL (-1).");

static PyObject *codes_present(PyObject *self, PyObject *args) {
    PyObject *codes_obj, *pos_obj;
    Py_ssize_t nvalues;
    if (!PyArg_ParseTuple(args, "OOn", &codes_obj, &pos_obj, &nvalues)) return NULL;
    if (nvalues < 0) {
        PyErr_SetString(PyExc_ValueError, "nvalues must be >= 0");
        return NULL;
    }
    Py_buffer codes;
    if (int32_codes(codes_obj, &codes) < 0) return NULL;
    Rows r;
    if (rows_open(&r, pos_obj, Py_None, Py_None, 1, codes.len / 4) < 0) {
        PyBuffer_Release(&codes);
        return NULL;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, nvalues + 1);
    if (result) {
        char *seen = PyBytes_AS_STRING(result);
        memset(seen, 0, (size_t)nvalues + 1);
        int why;
        Py_BEGIN_ALLOW_THREADS
        why = walk_codes(&r, codes.buf, nvalues, NULL, NULL, seen);
        Py_END_ALLOW_THREADS
        if (why) {
            Py_CLEAR(result);
            code_error(why);
        }
    }
    rows_release(&r);
    PyBuffer_Release(&codes);
    return result;
}

PyDoc_STRVAR(cell_counts_doc,
"cell_counts(cells, ncell, mask) -> list\n\n"
"How many rows each cell 0..ncell-1 holds: ``cells`` one signed integer per row (-1: none), ``mask`` which\n"
"rows count (bool, or None: all).");

static PyObject *cell_counts(PyObject *self, PyObject *args) {
    PyObject *cells_obj, *mask_obj;
    Py_ssize_t ncell;
    if (!PyArg_ParseTuple(args, "OnO", &cells_obj, &ncell, &mask_obj)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(cells_obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    Py_ssize_t rows = view.itemsize ? view.len / view.itemsize : 0;
    PyBuffer_Release(&view);
    Rows r;
    if (rows_open(&r, Py_None, cells_obj, mask_obj, ncell, rows) < 0) return NULL;
    int bad = 0;
    Py_ssize_t *start;
    Py_BEGIN_ALLOW_THREADS
    start = capacities(&r, &bad);
    Py_END_ALLOW_THREADS
    rows_release(&r);
    if (!start) return PyErr_NoMemory();
    PyObject *result = NULL;
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "a cell number past ncell");
    } else {
        for (Py_ssize_t c = ncell; c > 0; c--) start[c] -= start[c - 1];
        result = ssize_list(start + 1, ncell);
    }
    free(start);
    return result;
}

static PyMethodDef methods[] = {
    {"cell_counts", cell_counts, METH_VARARGS, cell_counts_doc},
    {"finite_by_cell", finite_by_cell, METH_VARARGS, finite_by_cell_doc},
    {"throughput_by_cell", throughput_by_cell, METH_VARARGS, throughput_by_cell_doc},
    {"buckets", buckets, METH_VARARGS, buckets_doc},
    {"code_cells", code_cells, METH_VARARGS, code_cells_doc},
    {"codes_present", codes_present, METH_VARARGS, codes_present_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cellsc", "A report table's cells in one pass per column.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__cellsc(void) { return PyModule_Create(&module); }
