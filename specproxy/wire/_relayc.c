/* _relayc: the relay thread (_pump.c, _pump_py.c) and the native chunked-framing parser's Python face.

The relay thread is the one native relay: once a response's head is out and its body is a chunked stream
passed through, the exchange (exchange.py) hands the body to it through relay_thread.ThreadRelay (see
_pump.c for why). Where the thread cannot take a turn (a TLS upstream, bytes still queued for the client)
or relay = "python" says so, the body is relayed on the event loop by relay.PythonRelay, the reference the
thread is tested against.

Types:
  ChunkedEnd  -- _chunked.h's parser, fed from Python: feed(data) -> -1 or the index just past the body's
                 end; raises chunked.FramingError with the reference's words. The Python relay feeds it the
                 reads that came before the thread took the turn; Turn copies its state from it.
  Turn, Sink  -- the relay thread's (see _pump.c).

Functions:
  tcp_acked   -- tcp_acked(fd) -> the bytes the peer's TCP acknowledged (TCP_INFO), or None where the kernel
                 does not say; sockets.acked_bytes reads it once a turn, and its Python reference builds a
                 socket object around the descriptor (and asks the kernel its address) for the same figure.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <limits.h>
#include <string.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <linux/tcp.h>

#include "_chunked.h"

/* _pump_py.c: adds the relay thread's Sink, Turn, pump_last_read and pump_stats to the module */
__attribute__((visibility("hidden"))) int pump_module_init(PyObject *m, PyTypeObject *chunked_end_type);

static PyObject *FramingError = NULL; /* specproxy.frames.chunked.FramingError, imported at module init */

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
    Py_ssize_t end = chunked_scan(&self->s, d, n, &err, NULL, NULL);
    if (end == -2)
        PyErr_SetString(FramingError, err);
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
        PyErr_SetString(PyExc_ValueError, "the C ChunkedEnd does not collect payload (use chunked.ChunkedEnd)");
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
    Py_RETURN_NONE; /* never collects: a body unframed for the client uses chunked.ChunkedEnd */
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
    .tp_doc = "Where a chunked body ends, fed read by read (_chunked.h; chunked.ChunkedEnd is its reference).",
    .tp_new = ChunkedEnd_new,
    .tp_methods = ChunkedEnd_methods,
    .tp_members = ChunkedEnd_members,
    .tp_getset = ChunkedEnd_getset,
};

/* ---- module ----------------------------------------------------------------------------------- */

/* ---- tcp_acked ------------------------------------------------------------------------------- */

static PyObject *
relayc_tcp_acked(PyObject *module, PyObject *arg)
{
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT_MAX) {
        errno = EBADF;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    struct tcp_info info;
    socklen_t len = sizeof info;
    memset(&info, 0, sizeof info);
    if (getsockopt((int)fd, IPPROTO_TCP, TCP_INFO, &info, &len) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (len < offsetof(struct tcp_info, tcpi_bytes_acked) + sizeof info.tcpi_bytes_acked)
        Py_RETURN_NONE; /* a kernel older than 4.1: no such field */
    return PyLong_FromUnsignedLongLong(info.tcpi_bytes_acked);
}

static PyMethodDef module_methods[] = {
    {"tcp_acked", relayc_tcp_acked, METH_O,
     "tcp_acked(fd) -> bytes of ours the peer's TCP acknowledged on socket fd (TCP_INFO), or None where the "
     "kernel does not say; raises OSError (a closed descriptor, not a TCP socket)."},
    {NULL}};

static struct PyModuleDef relayc_module = {
    PyModuleDef_HEAD_INIT, "specproxy.wire._relayc", "The relay thread and the native chunked-framing parser (see relay_thread.py).", -1,
    module_methods};

PyMODINIT_FUNC
PyInit__relayc(void)
{
    if (PyType_Ready(&ChunkedEndType) < 0)
        return NULL;
    if (FramingError == NULL) {
        PyObject *chunked = PyImport_ImportModule("specproxy.frames.chunked");
        if (chunked == NULL)
            return NULL;
        FramingError = PyObject_GetAttrString(chunked, "FramingError");
        Py_DECREF(chunked);
        if (FramingError == NULL)
            return NULL;
    }
    PyObject *m = PyModule_Create(&relayc_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "ChunkedEnd", (PyObject *)&ChunkedEndType) < 0 ||
        pump_module_init(m, &ChunkedEndType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
