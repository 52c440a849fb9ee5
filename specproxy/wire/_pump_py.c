/* _pump_py.c: the relay thread's Python face: Sink and Turn (see _pump.c for what they mean), Cadence
(_cadence.h's predictor, for tests), and pump_module_init, which _relayc.c's module init calls. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "_pump.h"

/* ---- Python: Sink ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    sink *k;
} SinkObject;

static PyObject *
Sink_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"slice_us", "nice", NULL};
    long slice_us = 100;
    int nice = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|li:Sink", kwlist, &slice_us, &nice))
        return NULL;
    if (nice < -20 || nice > 0) {
        PyErr_SetString(PyExc_ValueError, "Sink: nice must be -20 to 0");
        return NULL;
    }
    SinkObject *self = (SinkObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    sink *k = calloc(1, sizeof(sink));
    if (k == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    k->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (k->efd < 0) {
        free(k);
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    k->refs = 1;
    k->slice_us = slice_us;
    k->nice = nice;
    self->k = k;
    return (PyObject *)self;
}

static void
Sink_dealloc(SinkObject *self)
{
    if (self->k != NULL) {
        pthread_mutex_lock(&pump_g.mu);
        turn *done = self->k->done; /* ended turns nobody will collect: the thread's references */
        self->k->done = NULL;
        while (done != NULL) {
            turn *t = done;
            done = t->next;
            pump_turn_release(t);
        }
        pump_sink_release(self->k);
        pthread_mutex_unlock(&pump_g.mu);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Sink_fileno(SinkObject *self, PyObject *unused)
{
    return PyLong_FromLong(self->k->efd);
}

static PyObject *
Sink_done(SinkObject *self, PyObject *unused)
{
    uint64_t count;
    ssize_t r = read(self->k->efd, &count, sizeof count); /* reset the wake-up; EAGAIN when none */
    (void)r;
    pthread_mutex_lock(&pump_g.mu);
    turn *done = self->k->done;
    self->k->done = NULL;
    pthread_mutex_unlock(&pump_g.mu);
    PyObject *ids = PyList_New(0);
    while (done != NULL) {
        turn *t = done;
        done = t->next;
        if (ids != NULL) {
            PyObject *id = PyLong_FromLongLong(t->id);
            if (id == NULL || PyList_Append(ids, id) < 0)
                Py_CLEAR(ids);
            Py_XDECREF(id);
        }
        pthread_mutex_lock(&pump_g.mu);
        pump_turn_release(t);
        pthread_mutex_unlock(&pump_g.mu);
    }
    return ids;
}

static PyMethodDef Sink_methods[] = {
    {"fileno", (PyCFunction)Sink_fileno, METH_NOARGS, "the eventfd that is readable when turns have ended"},
    {"done", (PyCFunction)Sink_done, METH_NOARGS, "the ids of the turns the thread ended since the last call"},
    {NULL}};

static PyTypeObject SinkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specproxy.wire._relayc.Sink",
    .tp_basicsize = sizeof(SinkObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Sink(slice_us=100, nice=0): where the relay thread puts the turns it ended, for one event loop "
              "to collect; if one of its turns starts the thread, slice_us is its scheduler slice and nice the "
              "nice value it asks for (0: the process's).",
    .tp_new = Sink_new,
    .tp_dealloc = (destructor)Sink_dealloc,
    .tp_methods = Sink_methods,
};

/* ---- Python: Turn ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    turn *t;
} TurnObject;

static PyTypeObject *ChunkedEndTypeRef; /* _relayc.c's ChunkedEnd, whose first field is its chunked_state */

typedef struct {
    PyObject_HEAD
    chunked_state s;
} ChunkedEndView;

/* The reads that came with the response head (``first``: (bytes, read time) each), relayed here, on the
   caller's thread, as the thread relays its own (pump_relay_read), before the turn is watched: the thread
   cannot see the turn meanwhile, so one that ends here (its whole body came with the head, or the client
   has gone) goes straight to its sink with the thread's reference. A turn still active is then watched:
   its upstream, or its client when the client did not take all of it. Called with t->mu held. */
static void
relay_first(turn *t, PyObject *first, Py_ssize_t nfirst)
{
    turn *ended = NULL;
    for (Py_ssize_t i = 0; i < nfirst && t->state == T_ACTIVE && !t->blocked; i++) {
        PyObject *r = PyList_GET_ITEM(first, i);
        PyObject *data = PyTuple_GET_ITEM(r, 0);
        size_t n = (size_t)PyBytes_GET_SIZE(data);
        if (pump_grow(t, n) < 0) {
            pump_end_turn(t, O_THREAD_ERROR, ENOMEM, &ended);
            break;
        }
        memcpy(t->buf + t->len, PyBytes_AS_STRING(data), n);
        pump_relay_read(t, n, PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(r, 1)), &ended);
    }
    if (t->state == T_ACTIVE && !t->blocked && pump_watch(t, 0, 1) < 0)
        pump_end_turn(t, O_THREAD_ERROR, errno, &ended);
    if (ended != NULL) {
        pthread_mutex_lock(&pump_g.mu);
        pump_hand_over(ended);
        pthread_mutex_unlock(&pump_g.mu);
    }
}

static PyObject *
Turn_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *sink_obj, *framing, *first = NULL;
    int up, cl;
    Py_ssize_t keep = PY_SSIZE_T_MAX; /* bytes of the body to keep for measuring; by default all */
    if (!PyArg_ParseTuple(args, "O!iiO|nO!:Turn", &SinkType, &sink_obj, &up, &cl, &framing, &keep, &PyList_Type,
                          &first))
        return NULL;
    if (keep < 0) {
        PyErr_SetString(PyExc_ValueError, "Turn: keep must be >= 0");
        return NULL;
    }
    if (!Py_IS_TYPE(framing, ChunkedEndTypeRef)) {
        PyErr_SetString(PyExc_TypeError, "Turn needs the C ChunkedEnd as framing");
        return NULL;
    }
    Py_ssize_t nfirst = first != NULL ? PyList_GET_SIZE(first) : 0;
    for (Py_ssize_t i = 0; i < nfirst; i++) { /* all checked before a byte of them is sent */
        PyObject *r = PyList_GET_ITEM(first, i);
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(r, 0)) ||
            !PyFloat_Check(PyTuple_GET_ITEM(r, 1))) {
            PyErr_SetString(PyExc_TypeError, "Turn: first must be a list of (bytes, float) reads");
            return NULL;
        }
    }
    turn *t = calloc(1, sizeof(turn));
    if (t == NULL)
        return PyErr_NoMemory();
    pthread_mutex_init(&t->mu, NULL);
    t->cs = ((ChunkedEndView *)framing)->s;
    t->keep_left = (size_t)keep;
    t->last_activity = pump_now();
    t->up_fd = fcntl(up, F_DUPFD_CLOEXEC, 3);
    t->cl_fd = t->up_fd >= 0 ? fcntl(cl, F_DUPFD_CLOEXEC, 3) : -1;
    int failed = t->cl_fd < 0, err = errno;
    if (!failed) {
        pthread_mutex_lock(&pump_g.mu);
        sink *k = ((SinkObject *)sink_obj)->k;
        failed = pump_start_locked(k->slice_us, k->nice) < 0;
        err = errno;
        pthread_mutex_unlock(&pump_g.mu);
    }
    if (failed) {
        if (t->up_fd >= 0)
            close(t->up_fd);
        if (t->cl_fd >= 0)
            close(t->cl_fd);
        pthread_mutex_destroy(&t->mu);
        free(t);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    TurnObject *self = (TurnObject *)type->tp_alloc(type, 0);
    pthread_mutex_lock(&pump_g.mu);
    t->id = ++pump_g.next_id;
    t->sink = ((SinkObject *)sink_obj)->k;
    t->sink->refs++;
    t->refs = 1;
    pump_g.turns++;
    pthread_mutex_unlock(&pump_g.mu);
    pthread_mutex_lock(&t->mu); /* before the thread can see it */
    if (self == NULL || (nfirst == 0 && pump_watch(t, 0, 1) < 0)) {
        err = errno;
        t->state = T_CANCELLED;
        pump_unwatch(t);
        failed = 1;
    }
    else {
        __atomic_add_fetch(&pump_g.active, 1, __ATOMIC_RELAXED);
        pthread_mutex_lock(&pump_g.mu);
        t->refs = 2; /* this object, the thread */
        pthread_mutex_unlock(&pump_g.mu);
        if (nfirst > 0)
            relay_first(t, first, nfirst);
    }
    pthread_mutex_unlock(&t->mu);
    if (!failed) {
        self->t = t;
        return (PyObject *)self;
    }
    pthread_mutex_lock(&pump_g.mu); /* never watched: the thread never saw it */
    pump_turn_release(t);
    pthread_mutex_unlock(&pump_g.mu);
    if (self == NULL)
        return NULL;
    Py_DECREF(self);
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *
Turn_cancel(TurnObject *self, PyObject *unused)
{
    turn *t = self->t;
    int cancelled = 0;
    pthread_mutex_lock(&t->mu);
    if (t->state == T_ACTIVE) {
        __atomic_sub_fetch(&pump_g.active, 1, __ATOMIC_RELAXED);
        t->state = T_CANCELLED;
        t->blocked = 0;
        pump_unwatch(t);
        cancelled = 1;
    }
    pthread_mutex_unlock(&t->mu);
    if (cancelled) { /* the thread lets go after its next batch */
        pthread_mutex_lock(&pump_g.mu);
        t->next = pump_g.cancelled;
        pump_g.cancelled = t;
        uint64_t one = 1;
        ssize_t w = write(pump_g.wakefd, &one, sizeof one);
        (void)w;
        pthread_mutex_unlock(&pump_g.mu);
    }
    return PyBool_FromLong(cancelled);
}

static void
Turn_dealloc(TurnObject *self)
{
    turn *t = self->t;
    if (t != NULL) {
        Py_XDECREF(Turn_cancel(self, NULL)); /* a turn nobody holds cannot go on writing to a client */
        pthread_mutex_lock(&pump_g.mu);
        pump_turn_release(t);
        pthread_mutex_unlock(&pump_g.mu);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A turn the thread is done with hands its reads over from the last to the first, giving each stretch
   of TAKE_SHRINK_BYTES of its buffer back as soon as it is copied: one large response then costs its size
   once, not twice, while it changes hands (a large turn's peak RSS stays within about 1.5x what it
   keeps: docs/operations.md, "Memory"). A realloc that shrinks a buffer of that size unmaps its tail (glibc mremap). */
#define TAKE_SHRINK_BYTES (8u << 20)

static int
append_times(PyObject *rtimes, PyObject *wtimes, const read_mark *m)
{
    PyObject *r = PyFloat_FromDouble(m->t_read), *w = PyFloat_FromDouble(m->t_written);
    int bad = r == NULL || w == NULL || PyList_Append(rtimes, r) < 0 || PyList_Append(wtimes, w) < 0;
    Py_XDECREF(r);
    Py_XDECREF(w);
    return bad ? -1 : 0;
}

static int
take_ended(turn *t, PyObject *reads, PyObject *rtimes, PyObject *wtimes)
{
    /* the thread no longer touches t (not T_ACTIVE): its buffer is ours to shrink, then to free */
    size_t from = t->taken, to = t->nmarks;
    Py_ssize_t base = PyList_GET_SIZE(reads);
    for (size_t i = from; i < to; i++)
        if (PyList_Append(reads, Py_None) < 0 || append_times(rtimes, wtimes, &t->marks[i]) < 0)
            return -1;
    size_t copied = 0;
    for (size_t i = to; i-- > from;) {
        size_t start = i ? t->marks[i - 1].end : 0, end = t->marks[i].end;
        PyObject *b = PyBytes_FromStringAndSize(t->buf + start, (Py_ssize_t)(end - start));
        if (b == NULL)
            return -1;
        PyList_SET_ITEM(reads, base + (Py_ssize_t)(i - from), b); /* steals b; the slot held None */
        Py_DECREF(Py_None);
        copied += end - start;
        if (copied >= TAKE_SHRINK_BYTES && start > 0) {
            char *smaller = realloc(t->buf, start);
            if (smaller != NULL) {
                t->buf = smaller;
                t->cap = t->len = t->sent = start;
            }
            copied = 0;
        }
    }
    t->taken = to;
    free(t->buf);
    t->buf = NULL;
    t->cap = t->len = t->sent = 0;
    return 0;
}

static PyObject *
Turn_take(TurnObject *self, PyObject *args)
{
    /* take(reads, read_times, write_times): append the reads kept since the last take, with their times */
    PyObject *reads, *rtimes, *wtimes;
    if (!PyArg_ParseTuple(args, "O!O!O!:take", &PyList_Type, &reads, &PyList_Type, &rtimes, &PyList_Type,
                          &wtimes))
        return NULL;
    turn *t = self->t;
    pthread_mutex_lock(&t->mu);
    if (t->state != T_ACTIVE) {
        int bad = take_ended(t, reads, rtimes, wtimes);
        pthread_mutex_unlock(&t->mu);
        return bad ? NULL : Py_NewRef(Py_None);
    }
    size_t from = t->taken, to = t->nmarks;
    size_t start = from ? t->marks[from - 1].end : 0;
    PyObject *result = Py_None;
    for (size_t i = from; i < to; i++) {
        read_mark *m = &t->marks[i];
        PyObject *b = PyBytes_FromStringAndSize(t->buf + start, (Py_ssize_t)(m->end - start));
        int bad = b == NULL || PyList_Append(reads, b) < 0 || append_times(rtimes, wtimes, m) < 0;
        Py_XDECREF(b);
        if (bad) {
            result = NULL;
            break;
        }
        start = m->end;
        t->taken = i + 1;
    }
    pthread_mutex_unlock(&t->mu);
    return Py_XNewRef(result);
}

static PyObject *
Turn_outcome(TurnObject *self, void *closure)
{
    /* (name, errno or 0, framing error or None); ("none", 0, None) while active or once cancelled */
    turn *t = self->t;
    pthread_mutex_lock(&t->mu);
    int o = t->state == T_ENDED ? t->outcome : O_NONE, e = t->err_no;
    const char *f = t->framing_error;
    pthread_mutex_unlock(&t->mu);
    if (f != NULL && o == O_FRAMING)
        return Py_BuildValue("(sis)", PUMP_OUTCOME_NAMES[o], e, f);
    return Py_BuildValue("(siO)", PUMP_OUTCOME_NAMES[o], e, Py_None);
}

static PyObject *
Turn_get_last_activity(TurnObject *self, void *closure)
{
    pthread_mutex_lock(&self->t->mu);
    double t = self->t->last_activity;
    pthread_mutex_unlock(&self->t->mu);
    return PyFloat_FromDouble(t);
}

static PyObject *
Turn_get_blocked(TurnObject *self, void *closure)
{
    pthread_mutex_lock(&self->t->mu);
    int blocked = self->t->blocked;
    pthread_mutex_unlock(&self->t->mu);
    return PyBool_FromLong(blocked);
}

static PyObject *
Turn_get_past_end(TurnObject *self, void *closure)
{
    pthread_mutex_lock(&self->t->mu);
    int past_end = self->t->past_end;
    pthread_mutex_unlock(&self->t->mu);
    return PyBool_FromLong(past_end);
}

static PyObject *
Turn_get_capped(TurnObject *self, void *closure)
{
    pthread_mutex_lock(&self->t->mu);
    int capped = self->t->capped;
    pthread_mutex_unlock(&self->t->mu);
    return PyBool_FromLong(capped);
}

static PyObject *
Turn_get_capped_budget(TurnObject *self, void *closure)
{
    pthread_mutex_lock(&self->t->mu);
    int capped = self->t->capped_budget;
    pthread_mutex_unlock(&self->t->mu);
    return PyBool_FromLong(capped);
}

static PyObject *
Turn_get_kept(TurnObject *self, void *closure)
{
    pthread_mutex_lock(&self->t->mu);
    size_t kept = self->t->kept;
    pthread_mutex_unlock(&self->t->mu);
    return PyLong_FromSize_t(kept);
}

static PyObject *
Turn_get_id(TurnObject *self, void *closure)
{
    return PyLong_FromLongLong(self->t->id);
}

static PyObject *
Turn_get_active(TurnObject *self, void *closure)
{
    turn *t = self->t;
    pthread_mutex_lock(&t->mu);
    int active = t->state == T_ACTIVE;
    pthread_mutex_unlock(&t->mu);
    return PyBool_FromLong(active);
}

static PyMethodDef Turn_methods[] = {
    {"cancel", (PyCFunction)Turn_cancel, METH_NOARGS,
     "stop relaying (True if it was still active); on return the thread no longer touches the sockets"},
    {"take", (PyCFunction)Turn_take, METH_VARARGS,
     "take(reads, read_times, write_times): append the reads relayed since the last take, with their times"},
    {NULL}};

static PyGetSetDef Turn_getset[] = {
    {"outcome", (getter)Turn_outcome, NULL, "(name, errno, framing error) of a turn the thread ended", NULL},
    {"last_activity", (getter)Turn_get_last_activity, NULL, "the latest read or progress of a blocked write",
     NULL},
    {"blocked", (getter)Turn_get_blocked, NULL, "waiting for the client to take what was read", NULL},
    {"past_end", (getter)Turn_get_past_end, NULL, "bytes came after the body's end (not relayed)", NULL},
    {"capped", (getter)Turn_get_capped, NULL, "a read was relayed but not kept: past the keep allowance",
     NULL},
    {"capped_budget", (getter)Turn_get_capped_budget, NULL,
     "a read was not kept because the memory budget had no room for it", NULL},
    {"kept", (getter)Turn_get_kept, NULL, "bytes kept for measuring (charged to the memory budget)", NULL},
    {"id", (getter)Turn_get_id, NULL, "what Sink.done() returns for this turn", NULL},
    {"active", (getter)Turn_get_active, NULL, "the thread is relaying it", NULL},
    {NULL}};

static PyTypeObject TurnType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specproxy.wire._relayc.Turn",
    .tp_basicsize = sizeof(TurnObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Turn(sink, upstream_fd, client_fd, framing, keep=all, first=[]): a body relayed by the relay "
              "thread, keeping its first reads within keep bytes for measuring; first: reads that came with the "
              "response head, (bytes, perf_counter time) each, relayed before Turn returns.",
    .tp_new = Turn_new,
    .tp_dealloc = (destructor)Turn_dealloc,
    .tp_methods = Turn_methods,
    .tp_getset = Turn_getset,
};

/* ---- Python: Cadence (the relay thread's clock predictor, _cadence.h, on times the caller gives) ---- */

typedef struct {
    PyObject_HEAD
    cadence c;
} CadenceObject;

static PyObject *
Cadence_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (!PyArg_ParseTuple(args, ":Cadence"))
        return NULL;
    return type->tp_alloc(type, 0); /* zeroed: no reads yet */
}

static PyObject *
Cadence_read(CadenceObject *self, PyObject *arg)
{
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(cadence_read(&self->c, t));
}

static PyObject *
Cadence_forget(CadenceObject *self, PyObject *unused)
{
    cadence_forget(&self->c);
    Py_RETURN_NONE;
}

static PyObject *
Cadence_window(CadenceObject *self, PyObject *unused)
{
    double from, to;
    if (!cadence_window(&self->c, &from, &to))
        Py_RETURN_NONE;
    return Py_BuildValue("(dd)", from, to);
}

static PyMethodDef Cadence_methods[] = {
    {"read", (PyCFunction)Cadence_read, METH_O, "a read at t (seconds); True when it started a tick"},
    {"forget", (PyCFunction)Cadence_forget, METH_NOARGS, "forget the clock, as when no turn is left"},
    {"window", (PyCFunction)Cadence_window, METH_NOARGS,
     "(from, to): when to poll for the next tick; None when the clock is not regular enough to say"},
    {NULL}};

static PyTypeObject CadenceType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specproxy.wire._relayc.Cadence",
    .tp_basicsize = sizeof(CadenceObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The relay thread's predictor of the server's next token (_cadence.h), fed the times given.",
    .tp_new = Cadence_new,
    .tp_methods = Cadence_methods,
};

/* ---- module -------------------------------------------------------------------------------------- */

static PyObject *
pump_last_read(PyObject *module, PyObject *unused)
{
    double t;
    __atomic_load(&pump_g.last_read, &t, __ATOMIC_RELAXED);
    return PyFloat_FromDouble(t);
}

static PyObject *
pump_stats(PyObject *module, PyObject *unused)
{
    pthread_mutex_lock(&pump_g.mu);
    long long turns = pump_g.turns, reads = pump_g.reads;
    pthread_mutex_unlock(&pump_g.mu);
    return Py_BuildValue("{sLsLsisLsLsdsi}", "turns", turns, "reads", reads, "active",
                         __atomic_load_n(&pump_g.active, __ATOMIC_RELAXED), "poll_windows",
                         __atomic_load_n(&pump_g.poll_windows, __ATOMIC_RELAXED), "poll_hits",
                         __atomic_load_n(&pump_g.poll_hits, __ATOMIC_RELAXED), "poll_s",
                         (double)__atomic_load_n(&pump_g.poll_ns, __ATOMIC_RELAXED) * 1e-9, "nice",
                         __atomic_load_n(&pump_g.nice, __ATOMIC_RELAXED));
}

static PyObject *
pump_cadence_poll(PyObject *module, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    int was = __atomic_exchange_n(&pump_g.poll_on, on, __ATOMIC_RELAXED);
    return PyBool_FromLong(was);
}

static PyObject *
pump_mem_take_py(PyObject *module, PyObject *args)
{
    long long n;
    int small = 0;
    if (!PyArg_ParseTuple(args, "L|p:mem_take", &n, &small))
        return NULL;
    return PyBool_FromLong(pump_mem_take(n, small));
}

static PyObject *
pump_mem_give(PyObject *module, PyObject *arg)
{
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    __atomic_sub_fetch(&pump_g.mem_used, n, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyObject *
pump_mem_used(PyObject *module, PyObject *unused)
{
    return PyLong_FromLongLong(__atomic_load_n(&pump_g.mem_used, __ATOMIC_RELAXED));
}

static PyObject *
pump_set_mem_limit(PyObject *module, PyObject *args)
{
    long long limit, full;
    if (!PyArg_ParseTuple(args, "LL:set_mem_limit", &limit, &full))
        return NULL;
    __atomic_store_n(&pump_g.mem_limit, limit, __ATOMIC_RELAXED);
    __atomic_store_n(&pump_g.mem_full, full, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyMethodDef pump_functions[] = {
    {"mem_take", pump_mem_take_py, METH_VARARGS,
     "mem_take(n, small=False): charge n bytes to the memory budget (small: up to the whole of it, else up to "
     "the large share): True if they fit, else nothing is charged"},
    {"mem_give", pump_mem_give, METH_O, "give n bytes back to the memory budget"},
    {"mem_used", pump_mem_used, METH_NOARGS, "bytes charged to the memory budget now"},
    {"set_mem_limit", pump_set_mem_limit, METH_VARARGS,
     "set_mem_limit(large, full): the memory budget's share for large turns and the whole of it (<= 0: none)"},
    {"pump_last_read", pump_last_read, METH_NOARGS, "the relay thread's latest read (monotonic s; 0.0: none)"},
    {"pump_stats", pump_stats, METH_NOARGS,
     "the relay thread's counters: turns started, reads relayed, turns active now, cadence-poll windows, "
     "those in which something arrived, seconds spent polling, and its nice value (0 before it runs)"},
    {"set_cadence_poll", pump_cadence_poll, METH_O,
     "allow (True) or forbid (False) the relay thread's cadence poll; returns the previous setting"},
    {NULL}};

PUMP_HIDDEN int
pump_module_init(PyObject *m, PyTypeObject *chunked_end_type)
{
    ChunkedEndTypeRef = chunked_end_type;
    if (pthread_atfork(NULL, NULL, pump_after_fork_in_child) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "pthread_atfork failed");
        return -1;
    }
    if (PyType_Ready(&SinkType) < 0 || PyType_Ready(&TurnType) < 0 || PyType_Ready(&CadenceType) < 0)
        return -1;
    if (PyModule_AddObjectRef(m, "Sink", (PyObject *)&SinkType) < 0 ||
        PyModule_AddObjectRef(m, "Turn", (PyObject *)&TurnType) < 0 ||
        PyModule_AddObjectRef(m, "Cadence", (PyObject *)&CadenceType) < 0 ||
        PyModule_AddIntConstant(m, "POLL_MAX_TURNS", POLL_MAX_TURNS) < 0)
        return -1;
    return PyModule_AddFunctions(m, pump_functions);
}
