/* _relayc: the relay's per-read path in C, and (in _pump.c, same module) the relay thread.

The relay thread is what ships by default (upstream.RELAY_MODE "thread"): it takes a chunked body off the
event loop altogether. This file's per-read path ("loop") relays that body on the event loop when the
thread is switched off or cannot take a turn (TLS, bytes still queued for the client).

Why: at 256 concurrent streams the proxy's event loop thread spent ~5 us of Python per relayed chunk
in UpstreamConn.data_received/_body/ChunkedEnd.feed/RecordBuilder.on_bytes (py-spy, scripts/
bench_overhead.py), about half of what nginx spends on the whole chunk. This module does the same work
without Python frames, for the one case that carries almost every chunk: a body being relayed with its
chunked framing passed through verbatim (upstream.PASS mode, ChunkedEnd framing).

What it does per read is exactly upstream.UpstreamConn._body's PASS branch: a clock read, finding the
body's end (ChunkedEnd.feed, ported), cutting bytes past it, the write to the client's transport, a
clock read, three list appends; the end, a framing error, a closing client or a full client buffer
are handed to the Python methods (_complete, _truncated, _client_gone, _pause) that the Python path
calls. The Python code stays the reference: upstream.py uses it whenever this module is missing or
switched off, and tests/unit/test_relayc.py checks the two give the same results.

Types:
  ChunkedEnd  -- ChunkedEnd.feed(data) -> -1 or the index just past the body's end (no payload
                 collection: the DECHUNK mode uses the Python class).
  RelayBase   -- base class of upstream.UpstreamConn: the attributes the hot path reads (state,
                 last_read, reusable, framing, pool, _high) live in its C struct, and data_received is
                 C; when the fast path is not armed (_fast_attach) it calls self._data_received_py.
  Turn, Sink  -- the relay thread's (see _pump.c).
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>
#include <time.h>

#include "_chunked.h"

/* _pump_py.c: adds the relay thread's Sink, Turn, pump_last_read and pump_stats to the module */
__attribute__((visibility("hidden"))) int pump_module_init(PyObject *m, PyTypeObject *chunked_end_type);

#define STATE_BODY 3 /* upstream._BODY */

static PyObject *FramingError = NULL; /* http1.FramingError, given by set_framing_error() */

static PyObject *s_data_received_py, *s_last_read, *s_truncated, *s_client_gone, *s_complete, *s_pause;
static PyObject *s_ok, *s_client_disconnected;

static inline double
monotonic_now(void)
{
    /* time.perf_counter() on Linux is CLOCK_MONOTONIC: the same clock as every other stamp */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- ChunkedEnd ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    chunked_state s;
} ChunkedEnd;

/* -1: the body goes on; >= 0: the index in d just past the body's last byte; -2: error set */
static Py_ssize_t
chunked_feed(ChunkedEnd *self, const char *d, Py_ssize_t n)
{
    const char *err = NULL;
    Py_ssize_t end = chunked_scan(&self->s, d, n, &err);
    if (end == -2) {
        if (err == NULL)
            PyErr_NoMemory();
        else
            PyErr_SetString(FramingError ? FramingError : PyExc_ValueError, err);
    }
    return end;
}

static PyObject *
ChunkedEnd_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"collect", NULL};
    int collect = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p", kwlist, &collect))
        return NULL;
    if (collect) {
        PyErr_SetString(PyExc_ValueError, "the C ChunkedEnd does not collect payload (use http1.ChunkedEnd)");
        return NULL;
    }
    ChunkedEnd *self = (ChunkedEnd *)type->tp_alloc(type, 0);
    return (PyObject *)self;
}

static PyObject *
ChunkedEnd_feed(ChunkedEnd *self, PyObject *data)
{
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t end = chunked_feed(self, view.buf, view.len);
    PyBuffer_Release(&view);
    if (end == -2)
        return NULL;
    return PyLong_FromSsize_t(end);
}

static PyObject *
ChunkedEnd_payload(ChunkedEnd *self, void *closure)
{
    Py_RETURN_NONE; /* never collects: upstream._body's DECHUNK branch is not used with this class */
}

static PyMethodDef ChunkedEnd_methods[] = {
    {"feed", (PyCFunction)ChunkedEnd_feed, METH_O,
     "feed(data) -> -1 while the body goes on, else the index in data just past its last byte."},
    {NULL}};

static PyMemberDef ChunkedEnd_members[] = {
    {"rem", T_PYSSIZET, offsetof(ChunkedEnd, s.rem), READONLY, "bytes of the current chunk still to skip"},
    {NULL}};

static PyGetSetDef ChunkedEnd_getset[] = {{"payload", (getter)ChunkedEnd_payload, NULL, "always None", NULL},
                                          {NULL}};

static PyTypeObject ChunkedEndType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specproxy.wire._relayc.ChunkedEnd",
    .tp_basicsize = sizeof(ChunkedEnd),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Where a chunked body ends, fed read by read (a port of http1.ChunkedEnd, no payload).",
    .tp_new = ChunkedEnd_new,
    .tp_methods = ChunkedEnd_methods,
    .tp_members = ChunkedEnd_members,
    .tp_getset = ChunkedEnd_getset,
};

/* ---- RelayBase -------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    int state;
    char reusable;
    char fast; /* armed by _fast_attach: framing is a ChunkedEnd here, the mode is PASS */
    double last_read;
    Py_ssize_t high;
    PyObject *framing;
    PyObject *pool;
    PyObject *w_write, *w_is_closing, *w_bufsize; /* the client transport's bound methods */
    PyObject *reads, *rtimes, *wtimes;            /* the turn's RecordBuilder lists, or NULL */
} RelayBase;

static void
relay_detach(RelayBase *self)
{
    self->fast = 0;
    Py_CLEAR(self->w_write);
    Py_CLEAR(self->w_is_closing);
    Py_CLEAR(self->w_bufsize);
    Py_CLEAR(self->reads);
    Py_CLEAR(self->rtimes);
    Py_CLEAR(self->wtimes);
}

static int
RelayBase_traverse(RelayBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->framing);
    Py_VISIT(self->pool);
    Py_VISIT(self->w_write);
    Py_VISIT(self->w_is_closing);
    Py_VISIT(self->w_bufsize);
    Py_VISIT(self->reads);
    Py_VISIT(self->rtimes);
    Py_VISIT(self->wtimes);
    return 0;
}

static int
RelayBase_clear(RelayBase *self)
{
    relay_detach(self);
    Py_CLEAR(self->framing);
    Py_CLEAR(self->pool);
    return 0;
}

static void
RelayBase_dealloc(RelayBase *self)
{
    PyObject_GC_UnTrack(self);
    RelayBase_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
RelayBase_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    RelayBase *self = (RelayBase *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->reusable = 1;
        self->high = 65536;
    }
    return (PyObject *)self;
}

static PyObject *
RelayBase_fast_attach(RelayBase *self, PyObject *args)
{
    PyObject *out, *builder;
    if (!PyArg_ParseTuple(args, "OO", &out, &builder))
        return NULL;
    if (self->framing == NULL || !PyObject_TypeCheck(self->framing, &ChunkedEndType)) {
        PyErr_SetString(PyExc_TypeError, "_fast_attach needs the C ChunkedEnd as framing");
        return NULL;
    }
    relay_detach(self);
    self->w_write = PyObject_GetAttrString(out, "write");
    self->w_is_closing = PyObject_GetAttrString(out, "is_closing");
    self->w_bufsize = PyObject_GetAttrString(out, "get_write_buffer_size");
    if (!self->w_write || !self->w_is_closing || !self->w_bufsize) {
        relay_detach(self);
        return NULL;
    }
    if (builder != Py_None) {
        self->reads = PyObject_GetAttrString(builder, "reads");
        self->rtimes = PyObject_GetAttrString(builder, "read_times");
        self->wtimes = PyObject_GetAttrString(builder, "write_times");
        if (!self->reads || !self->rtimes || !self->wtimes || !PyList_Check(self->reads) ||
            !PyList_Check(self->rtimes) || !PyList_Check(self->wtimes)) {
            relay_detach(self);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "the builder's reads/read_times/write_times must be lists");
            return NULL;
        }
    }
    self->fast = 1;
    Py_RETURN_NONE;
}

static PyObject *
RelayBase_fast_detach(RelayBase *self, PyObject *unused)
{
    relay_detach(self);
    Py_RETURN_NONE;
}

/* self.<name>(arg) or self.<name>(a, b); returns 0 or -1 */
static int
call_self(RelayBase *self, PyObject *name, PyObject *a, PyObject *b)
{
    PyObject *r = b ? PyObject_CallMethodObjArgs((PyObject *)self, name, a, b, NULL)
                    : PyObject_CallMethodOneArg((PyObject *)self, name, a);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *
RelayBase_data_received(RelayBase *self, PyObject *data)
{
    if (!self->fast || self->state != STATE_BODY || !PyBytes_CheckExact(data) || self->framing == NULL ||
        !Py_IS_TYPE(self->framing, &ChunkedEndType))
        return PyObject_CallMethodOneArg((PyObject *)self, s_data_received_py, data);

    double t_read = monotonic_now();
    self->last_read = t_read;
    PyObject *t_read_obj = PyFloat_FromDouble(t_read);
    if (t_read_obj == NULL)
        return NULL;
    PyObject *result = NULL, *sent = NULL;
    if (self->pool != NULL && PyObject_SetAttr(self->pool, s_last_read, t_read_obj) < 0)
        goto done; /* the measuring worker waits for a gap in these */

    Py_ssize_t n = PyBytes_GET_SIZE(data);
    Py_ssize_t end = chunked_feed((ChunkedEnd *)self->framing, PyBytes_AS_STRING(data), n);
    if (end == -2) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *reason = PyUnicode_FromFormat("malformed chunked framing from the upstream (%S)", value);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        if (reason != NULL && call_self(self, s_truncated, reason, NULL) == 0)
            result = Py_NewRef(Py_None);
        Py_XDECREF(reason);
        goto done;
    }
    if (end >= 0 && end != n) {
        sent = PyBytes_FromStringAndSize(PyBytes_AS_STRING(data), end);
        if (sent == NULL)
            goto done;
        self->reusable = 0; /* bytes past the end of the response nobody asked for */
    }
    else {
        sent = Py_NewRef(data);
    }

    PyObject *r = PyObject_CallNoArgs(self->w_is_closing);
    if (r == NULL)
        goto done;
    int closing = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (closing < 0)
        goto done;
    if (closing) {
        if (call_self(self, s_client_gone, s_client_disconnected, NULL) == 0)
            result = Py_NewRef(Py_None);
        goto done;
    }
    r = PyObject_CallOneArg(self->w_write, sent);
    if (r == NULL)
        goto done;
    Py_DECREF(r);
    double t_written = monotonic_now();

    if (self->reads != NULL) { /* RecordBuilder.on_bytes */
        PyObject *t_written_obj = PyFloat_FromDouble(t_written);
        if (t_written_obj == NULL)
            goto done;
        int bad = PyList_Append(self->reads, sent) < 0 || PyList_Append(self->rtimes, t_read_obj) < 0 ||
                  PyList_Append(self->wtimes, t_written_obj) < 0;
        Py_DECREF(t_written_obj);
        if (bad)
            goto done;
    }
    if (end >= 0) {
        if (call_self(self, s_complete, s_ok, Py_None) < 0)
            goto done;
    }
    else if (self->w_bufsize != NULL) {
        r = PyObject_CallNoArgs(self->w_bufsize);
        if (r == NULL)
            goto done;
        Py_ssize_t size = PyLong_AsSsize_t(r);
        Py_DECREF(r);
        if (size == -1 && PyErr_Occurred())
            goto done;
        if (size > self->high) {
            r = PyObject_CallMethodNoArgs((PyObject *)self, s_pause);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        }
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(t_read_obj);
    Py_XDECREF(sent);
    return result;
}

static PyMethodDef RelayBase_methods[] = {
    {"data_received", (PyCFunction)RelayBase_data_received, METH_O,
     "asyncio.Protocol.data_received: the PASS/chunked body path in C, else self._data_received_py(data)."},
    {"_fast_attach", (PyCFunction)RelayBase_fast_attach, METH_VARARGS,
     "_fast_attach(out, builder): relay the body from data_received in C to the transport out."},
    {"_fast_detach", (PyCFunction)RelayBase_fast_detach, METH_NOARGS, "drop what _fast_attach kept"},
    {NULL}};

static PyMemberDef RelayBase_members[] = {
    {"state", T_INT, offsetof(RelayBase, state), 0, NULL},
    {"reusable", T_BOOL, offsetof(RelayBase, reusable), 0, NULL},
    {"last_read", T_DOUBLE, offsetof(RelayBase, last_read), 0, NULL},
    {"_high", T_PYSSIZET, offsetof(RelayBase, high), 0, NULL},
    {"framing", T_OBJECT, offsetof(RelayBase, framing), 0, NULL},
    {"pool", T_OBJECT, offsetof(RelayBase, pool), 0, NULL},
    {NULL}};

static PyObject *
RelayBase_fast_get(RelayBase *self, void *closure)
{
    return PyBool_FromLong(self->fast);
}

static PyGetSetDef RelayBase_getset[] = {
    {"_fast", (getter)RelayBase_fast_get, NULL, "the C body path is armed", NULL}, {NULL}};

static PyTypeObject RelayBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specproxy.wire._relayc.RelayBase",
    .tp_basicsize = sizeof(RelayBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Base of upstream.UpstreamConn: the per-read body path in C.",
    .tp_new = RelayBase_new,
    .tp_traverse = (traverseproc)RelayBase_traverse,
    .tp_clear = (inquiry)RelayBase_clear,
    .tp_dealloc = (destructor)RelayBase_dealloc,
    .tp_methods = RelayBase_methods,
    .tp_members = RelayBase_members,
    .tp_getset = RelayBase_getset,
};

/* ---- module ----------------------------------------------------------------------------------- */

static PyObject *
set_framing_error(PyObject *module, PyObject *cls)
{
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "set_framing_error needs an Exception subclass");
        return NULL;
    }
    Py_XSETREF(FramingError, Py_NewRef(cls));
    Py_RETURN_NONE;
}

static PyObject *
monotonic(PyObject *module, PyObject *unused)
{
    return PyFloat_FromDouble(monotonic_now());
}

static PyMethodDef module_methods[] = {
    {"set_framing_error", set_framing_error, METH_O, "the exception ChunkedEnd.feed raises"},
    {"monotonic", monotonic, METH_NOARGS, "the clock the C path stamps reads with (CLOCK_MONOTONIC, seconds)"},
    {NULL}};

static struct PyModuleDef relayc_module = {
    PyModuleDef_HEAD_INIT, "specproxy.wire._relayc", "The relay's per-read path in C (see upstream.py).", -1,
    module_methods};

PyMODINIT_FUNC
PyInit__relayc(void)
{
    if (PyType_Ready(&ChunkedEndType) < 0 || PyType_Ready(&RelayBaseType) < 0)
        return NULL;
#define INTERN(var, text)                                                                                  \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                                  \
        return NULL;
    INTERN(s_data_received_py, "_data_received_py");
    INTERN(s_last_read, "last_read");
    INTERN(s_truncated, "_truncated");
    INTERN(s_client_gone, "_client_gone");
    INTERN(s_complete, "_complete");
    INTERN(s_pause, "_pause");
    INTERN(s_ok, "ok");
    INTERN(s_client_disconnected, "client disconnected");
#undef INTERN
    PyObject *m = PyModule_Create(&relayc_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "ChunkedEnd", (PyObject *)&ChunkedEndType) < 0 ||
        PyModule_AddObjectRef(m, "RelayBase", (PyObject *)&RelayBaseType) < 0 ||
        pump_module_init(m, &ChunkedEndType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
