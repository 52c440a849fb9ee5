/* _pump.c: the relay thread. Part of the _relayc extension (its module init calls pump_module_init).

Why: with the per-read path in C (_relayc.c), the event loop still paid ~4 us of user-space CPU per
relayed chunk at 256 streams against nginx's ~1.6 (scripts/bench_overhead.py; perf): uvloop takes the
interpreter lock twice per read (buffer and callback), makes a bytes object and calls the protocol,
whose C path then makes float objects, appends to lists and calls three transport methods. The
measuring thread then waits on the same lock. Here one native thread, which never takes the
interpreter lock, relays the bodies themselves: epoll, read, find the end (_chunked.h), send, clock.

What Python hands over and gets back (upstream.UpstreamConn is the only user):
  Sink(loop side)  -- a queue of finished turns and an eventfd the event loop watches (one per loop).
  Turn(sink, upstream_fd, client_fd, framing)
                   -- the body of one exchange, relayed by the thread from now on: dup()s of both sockets
                      (Python's transports keep theirs; the upstream's reading is paused, the client's
                      write buffer is empty), the framing state copied from the C ChunkedEnd. Every read
                      is written to the client as it came (up to the body's end, not past it), stamped
                      with CLOCK_MONOTONIC right after read() and right after send(), and kept with its
                      times in the turn (take() hands them to the RecordBuilder).
  The turn ends in the thread (the body's end, a framing error, the upstream's EOF or error, the client's
  error) or by Turn.cancel() from Python (the idle deadline, the client hanging up, closing); either way
  the thread touches neither socket afterwards and both dups are closed. A turn the thread ended goes to
  its sink, which wakes the loop: Sink.done() returns the turns' ids and Python calls the same edges as
  the per-read path (_complete, _truncated, _client_gone).

Backpressure: a read the client's socket does not take at once stays in the turn; the thread stops
reading the upstream (the kernel's buffers push back on the server) until the client has taken it.

Lifetimes: a turn is freed when both Python's object and the thread have let go of it. The thread
lets go of a turn it ended after the epoll batch in which it ended it (another event of that batch may
name it), of a cancelled one after the batch that follows the cancel (the cancel removed its sockets
from the epoll set first, so no later batch names it). Locks: a turn's own mutex guards its state
(the thread holds it while handling one event; cancel takes it), then the global one guards the lists
and counts; never the other way round.
*/

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pthread_setname_np */
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "_chunked.h"

#define READ_BYTES 65536 /* one read() at most; also the most a blocked client can leave us holding */
#define MAX_EVENTS 128

static double
pump_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

enum { T_ACTIVE, T_ENDED, T_CANCELLED };
enum { O_NONE, O_END, O_FRAMING, O_UPSTREAM_EOF, O_UPSTREAM_ERROR, O_CLIENT_GONE, O_NO_MEMORY };
static const char *OUTCOME_NAMES[] = {"none", "end", "framing", "upstream_eof", "upstream_error",
                                      "client_gone", "no_memory"};

typedef struct {
    size_t end; /* the read's last byte + 1, in buf */
    double t_read, t_written;
} read_mark;

struct sink;

typedef struct turn {
    pthread_mutex_t mu;
    int state;                 /* T_*: only T_ACTIVE turns are touched by the thread */
    int outcome, err_no;       /* O_*, and errno for the *_ERROR/CLIENT_GONE outcomes */
    const char *framing_error; /* a static string */
    int past_end;              /* the read that held the end had bytes after it (not relayed) */
    int up_fd, cl_fd;          /* our dups; -1 once closed */
    int up_watched, cl_watched;
    int end_seen;              /* the end was read; the last bytes may still wait for the client */
    int blocked;               /* waiting for the client to take bytes */
    chunked_state cs;
    char *buf;
    size_t len, cap, sent; /* buf[sent:len] is what the client has not taken yet */
    read_mark *marks;
    size_t nmarks, capmarks, taken;
    double last_activity; /* the latest read, or the latest progress of a blocked write */
    int refs;             /* Python's object, the thread: under g.mu */
    long long id;
    struct sink *sink;
    struct turn *next; /* on one of the lists below */
} turn;

typedef struct sink {
    int efd;    /* eventfd: written when done goes from empty to not */
    turn *done; /* ended by the thread, not yet returned by Sink.done() (holds the thread's refs) */
    int refs;   /* Python's object and each turn: under g.mu */
} sink;

static struct {
    pthread_mutex_t mu;
    int started;
    int epfd;
    int wakefd; /* in the epoll set with tag 0: a cancel wakes the thread so that it lets go promptly */
    pthread_t thread;
    turn *cancelled; /* cancelled by Python, waiting for the thread to let go after its next batch */
    long long next_id;
    double last_read; /* the latest read of any turn (the measuring worker waits for a gap) */
    long long turns, reads;
} g = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* ---- lifetimes (callers hold g.mu) ------------------------------------------------------------ */

static void
sink_release(sink *k)
{
    if (--k->refs == 0) {
        close(k->efd);
        free(k);
    }
}

static void
turn_release(turn *t)
{
    if (--t->refs == 0) {
        sink_release(t->sink);
        pthread_mutex_destroy(&t->mu);
        free(t->buf);
        free(t->marks);
        free(t);
    }
}

/* ---- the thread's side of a turn (callers hold t->mu) ----------------------------------------- */

static void
unwatch(turn *t)
{
    if (t->up_watched)
        epoll_ctl(g.epfd, EPOLL_CTL_DEL, t->up_fd, NULL);
    if (t->cl_watched)
        epoll_ctl(g.epfd, EPOLL_CTL_DEL, t->cl_fd, NULL);
    t->up_watched = t->cl_watched = 0;
    if (t->up_fd >= 0)
        close(t->up_fd);
    if (t->cl_fd >= 0)
        close(t->cl_fd);
    t->up_fd = t->cl_fd = -1;
}

static int
watch(turn *t, int client, int on)
{
    int fd = client ? t->cl_fd : t->up_fd;
    int *watched = client ? &t->cl_watched : &t->up_watched;
    if (on == *watched)
        return 0;
    if (!on) {
        *watched = 0;
        return epoll_ctl(g.epfd, EPOLL_CTL_DEL, fd, NULL);
    }
    struct epoll_event ev = {.events = client ? EPOLLOUT : EPOLLIN, .data.u64 = (uint64_t)(uintptr_t)t | client};
    if (epoll_ctl(g.epfd, EPOLL_CTL_ADD, fd, &ev) < 0)
        return -1;
    *watched = 1;
    return 0;
}

static void
end_turn(turn *t, int outcome, int err_no, turn **ended)
{
    t->state = T_ENDED;
    t->outcome = outcome;
    t->err_no = err_no;
    t->blocked = 0;
    unwatch(t);
    t->next = *ended; /* handed to the sink after this batch */
    *ended = t;
}

/* send what the client has not taken: 0 all taken, 1 some left, -1 error (errno) */
static int
flush(turn *t)
{
    while (t->sent < t->len) {
        ssize_t w = send(t->cl_fd, t->buf + t->sent, t->len - t->sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 1;
            return -1;
        }
        t->sent += (size_t)w;
        t->last_activity = pump_now();
    }
    return 0;
}

static int
grow(turn *t, size_t more)
{
    if (t->len + more > t->cap) {
        size_t cap = t->cap ? t->cap : 4096;
        while (cap < t->len + more)
            cap *= 2;
        char *b = realloc(t->buf, cap);
        if (b == NULL)
            return -1;
        t->buf = b;
        t->cap = cap;
    }
    if (t->nmarks == t->capmarks) {
        size_t cap = t->capmarks ? t->capmarks * 2 : 64;
        read_mark *m = realloc(t->marks, cap * sizeof(read_mark));
        if (m == NULL)
            return -1;
        t->marks = m;
        t->capmarks = cap;
    }
    return 0;
}

static void
on_client_writable(turn *t, turn **ended)
{
    int r = flush(t);
    if (r < 0) {
        end_turn(t, O_CLIENT_GONE, errno, ended);
        return;
    }
    if (r > 0)
        return;
    t->blocked = 0;
    if (t->end_seen) {
        end_turn(t, O_END, 0, ended);
        return;
    }
    if (watch(t, 1, 0) < 0 || watch(t, 0, 1) < 0)
        end_turn(t, O_NO_MEMORY, errno, ended);
}

static void
on_upstream_readable(turn *t, char *rbuf, turn **ended)
{
    ssize_t n;
    do /* MSG_DONTWAIT: never block the thread, whatever the socket's own flags say */
        n = recv(t->up_fd, rbuf, READ_BYTES, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    double t_read = pump_now();
    if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            end_turn(t, O_UPSTREAM_ERROR, errno, ended);
        return;
    }
    if (n == 0) {
        end_turn(t, O_UPSTREAM_EOF, 0, ended);
        return;
    }
    t->last_activity = t_read;
    __atomic_store(&g.last_read, &t_read, __ATOMIC_RELAXED); /* read without a lock: any recent value does */
    const char *err = NULL;
    ssize_t end = chunked_scan(&t->cs, rbuf, n, &err);
    if (end == -2) { /* as the per-read path: nothing of this read reaches the client */
        t->framing_error = err;
        end_turn(t, err ? O_FRAMING : O_NO_MEMORY, 0, ended);
        return;
    }
    size_t take = (size_t)(end >= 0 ? end : n);
    if (end >= 0 && end != n)
        t->past_end = 1;
    if (grow(t, take) < 0) {
        end_turn(t, O_NO_MEMORY, ENOMEM, ended);
        return;
    }
    memcpy(t->buf + t->len, rbuf, take);
    t->len += take;
    int r = flush(t);
    double t_written = pump_now();
    read_mark *m = &t->marks[t->nmarks++];
    m->end = t->len;
    m->t_read = t_read;
    m->t_written = t_written;
    if (r < 0) {
        end_turn(t, O_CLIENT_GONE, errno, ended);
        return;
    }
    if (end >= 0)
        t->end_seen = 1;
    if (r > 0) { /* the client is slower than the upstream: hold the upstream until it has taken this */
        t->blocked = 1;
        if (watch(t, 0, 0) < 0 || watch(t, 1, 1) < 0)
            end_turn(t, O_NO_MEMORY, errno, ended);
        return;
    }
    if (end >= 0)
        end_turn(t, O_END, 0, ended);
}

static void *
pump_main(void *arg)
{
    static char rbuf[READ_BYTES];
    pthread_setname_np(pthread_self(), "specproxy-relay"); /* what top -H and /proc/.../comm show */
    struct epoll_event evs[MAX_EVENTS];
    for (;;) {
        int n = epoll_wait(g.epfd, evs, MAX_EVENTS, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            break; /* the epoll descriptor itself is gone: nothing left to serve */
        }
        turn *ended = NULL;
        long long reads = 0;
        for (int i = 0; i < n; i++) {
            uint64_t tag = evs[i].data.u64;
            if (tag == 0) {
                uint64_t count;
                ssize_t r = read(g.wakefd, &count, sizeof count);
                (void)r;
                continue;
            }
            turn *t = (turn *)(uintptr_t)(tag & ~(uint64_t)1);
            pthread_mutex_lock(&t->mu);
            if (t->state == T_ACTIVE) {
                if (tag & 1)
                    on_client_writable(t, &ended);
                else {
                    on_upstream_readable(t, rbuf, &ended);
                    reads++;
                }
            }
            pthread_mutex_unlock(&t->mu);
        }
        pthread_mutex_lock(&g.mu);
        g.reads += reads;
        while (ended != NULL) { /* to their sinks: the thread's reference goes with each */
            turn *t = ended;
            ended = t->next;
            sink *k = t->sink;
            int was_empty = k->done == NULL;
            t->next = k->done;
            k->done = t;
            if (was_empty) {
                uint64_t one = 1;
                ssize_t w = write(k->efd, &one, sizeof one);
                (void)w; /* an eventfd write fails only when its counter would overflow: already signalled */
            }
        }
        turn *dead = g.cancelled;
        g.cancelled = NULL;
        while (dead != NULL) {
            turn *t = dead;
            dead = t->next;
            turn_release(t);
        }
        pthread_mutex_unlock(&g.mu);
    }
    return NULL;
}

/* a forked child has no relay thread (fork copies only the forking thread): it starts its own */
static void
pump_after_fork_in_child(void)
{
    pthread_mutex_init(&g.mu, NULL);
    g.started = 0;
    g.cancelled = NULL;
}

/* start the thread once per process; call with g.mu held */
static int
pump_start_locked(void)
{
    if (g.started)
        return 0;
    int epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0)
        return -1;
    int wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 0};
    if (wakefd < 0 || epoll_ctl(epfd, EPOLL_CTL_ADD, wakefd, &ev) < 0) {
        int err = errno;
        if (wakefd >= 0)
            close(wakefd);
        close(epfd);
        errno = err;
        return -1;
    }
    g.epfd = epfd;
    g.wakefd = wakefd;
    g.cancelled = NULL;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&g.thread, &attr, pump_main, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        close(wakefd);
        close(epfd);
        errno = rc;
        return -1;
    }
    g.started = 1;
    return 0;
}

/* ---- Python: Sink ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    sink *k;
} SinkObject;

static PyObject *
Sink_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (!PyArg_ParseTuple(args, ":Sink"))
        return NULL;
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
    self->k = k;
    return (PyObject *)self;
}

static void
Sink_dealloc(SinkObject *self)
{
    if (self->k != NULL) {
        pthread_mutex_lock(&g.mu);
        turn *done = self->k->done; /* ended turns nobody will collect: the thread's references */
        self->k->done = NULL;
        while (done != NULL) {
            turn *t = done;
            done = t->next;
            turn_release(t);
        }
        sink_release(self->k);
        pthread_mutex_unlock(&g.mu);
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
    pthread_mutex_lock(&g.mu);
    turn *done = self->k->done;
    self->k->done = NULL;
    pthread_mutex_unlock(&g.mu);
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
        pthread_mutex_lock(&g.mu);
        turn_release(t);
        pthread_mutex_unlock(&g.mu);
    }
    return ids;
}

static PyMethodDef Sink_methods[] = {
    {"fileno", (PyCFunction)Sink_fileno, METH_NOARGS, "the eventfd that is readable when turns have ended"},
    {"done", (PyCFunction)Sink_done, METH_NOARGS, "the ids of the turns the thread ended since the last call"},
    {NULL}};

static PyTypeObject SinkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specproxy._relayc.Sink",
    .tp_basicsize = sizeof(SinkObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Where the relay thread puts the turns it ended, for one event loop to collect.",
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

static PyObject *
Turn_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *sink_obj, *framing;
    int up, cl;
    if (!PyArg_ParseTuple(args, "O!iiO:Turn", &SinkType, &sink_obj, &up, &cl, &framing))
        return NULL;
    if (!Py_IS_TYPE(framing, ChunkedEndTypeRef)) {
        PyErr_SetString(PyExc_TypeError, "Turn needs the C ChunkedEnd as framing");
        return NULL;
    }
    turn *t = calloc(1, sizeof(turn));
    if (t == NULL)
        return PyErr_NoMemory();
    pthread_mutex_init(&t->mu, NULL);
    t->cs = ((ChunkedEndView *)framing)->s;
    t->last_activity = pump_now();
    t->up_fd = fcntl(up, F_DUPFD_CLOEXEC, 3);
    t->cl_fd = t->up_fd >= 0 ? fcntl(cl, F_DUPFD_CLOEXEC, 3) : -1;
    int failed = t->cl_fd < 0, err = errno;
    if (!failed) {
        pthread_mutex_lock(&g.mu);
        failed = pump_start_locked() < 0;
        err = errno;
        pthread_mutex_unlock(&g.mu);
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
    pthread_mutex_lock(&g.mu);
    t->id = ++g.next_id;
    t->sink = ((SinkObject *)sink_obj)->k;
    t->sink->refs++;
    t->refs = 1;
    g.turns++;
    pthread_mutex_unlock(&g.mu);
    pthread_mutex_lock(&t->mu); /* before the thread can see it */
    if (self == NULL || watch(t, 0, 1) < 0) {
        err = errno;
        t->state = T_CANCELLED;
        unwatch(t);
        failed = 1;
    }
    else {
        pthread_mutex_lock(&g.mu);
        t->refs = 2; /* this object, the thread */
        pthread_mutex_unlock(&g.mu);
    }
    pthread_mutex_unlock(&t->mu);
    if (!failed) {
        self->t = t;
        return (PyObject *)self;
    }
    pthread_mutex_lock(&g.mu); /* never watched: the thread never saw it */
    turn_release(t);
    pthread_mutex_unlock(&g.mu);
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
        t->state = T_CANCELLED;
        t->blocked = 0;
        unwatch(t);
        cancelled = 1;
    }
    pthread_mutex_unlock(&t->mu);
    if (cancelled) { /* the thread lets go after its next batch */
        pthread_mutex_lock(&g.mu);
        t->next = g.cancelled;
        g.cancelled = t;
        uint64_t one = 1;
        ssize_t w = write(g.wakefd, &one, sizeof one);
        (void)w;
        pthread_mutex_unlock(&g.mu);
    }
    return PyBool_FromLong(cancelled);
}

static void
Turn_dealloc(TurnObject *self)
{
    turn *t = self->t;
    if (t != NULL) {
        Py_XDECREF(Turn_cancel(self, NULL)); /* a turn nobody holds cannot go on writing to a client */
        pthread_mutex_lock(&g.mu);
        turn_release(t);
        pthread_mutex_unlock(&g.mu);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
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
    size_t from = t->taken, to = t->nmarks;
    size_t start = from ? t->marks[from - 1].end : 0;
    PyObject *result = Py_None;
    for (size_t i = from; i < to; i++) {
        read_mark *m = &t->marks[i];
        PyObject *b = PyBytes_FromStringAndSize(t->buf + start, (Py_ssize_t)(m->end - start));
        PyObject *r = PyFloat_FromDouble(m->t_read);
        PyObject *w = PyFloat_FromDouble(m->t_written);
        int bad = b == NULL || r == NULL || w == NULL || PyList_Append(reads, b) < 0 ||
                  PyList_Append(rtimes, r) < 0 || PyList_Append(wtimes, w) < 0;
        Py_XDECREF(b);
        Py_XDECREF(r);
        Py_XDECREF(w);
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
        return Py_BuildValue("(sis)", OUTCOME_NAMES[o], e, f);
    return Py_BuildValue("(siO)", OUTCOME_NAMES[o], e, Py_None);
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
    {"id", (getter)Turn_get_id, NULL, "what Sink.done() returns for this turn", NULL},
    {"active", (getter)Turn_get_active, NULL, "the thread is relaying it", NULL},
    {NULL}};

static PyTypeObject TurnType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specproxy._relayc.Turn",
    .tp_basicsize = sizeof(TurnObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Turn(sink, upstream_fd, client_fd, framing): a body relayed by the relay thread.",
    .tp_new = Turn_new,
    .tp_dealloc = (destructor)Turn_dealloc,
    .tp_methods = Turn_methods,
    .tp_getset = Turn_getset,
};

/* ---- module -------------------------------------------------------------------------------------- */

static PyObject *
pump_last_read(PyObject *module, PyObject *unused)
{
    double t;
    __atomic_load(&g.last_read, &t, __ATOMIC_RELAXED);
    return PyFloat_FromDouble(t);
}

static PyObject *
pump_stats(PyObject *module, PyObject *unused)
{
    pthread_mutex_lock(&g.mu);
    long long turns = g.turns, reads = g.reads;
    pthread_mutex_unlock(&g.mu);
    return Py_BuildValue("{sLsL}", "turns", turns, "reads", reads);
}

static PyMethodDef pump_functions[] = {
    {"pump_last_read", pump_last_read, METH_NOARGS, "the relay thread's latest read (monotonic s; 0.0: none)"},
    {"pump_stats", pump_stats, METH_NOARGS, "turns started and reads relayed by the relay thread"},
    {NULL}};

int
pump_module_init(PyObject *m, PyTypeObject *chunked_end_type)
{
    ChunkedEndTypeRef = chunked_end_type;
    if (pthread_atfork(NULL, NULL, pump_after_fork_in_child) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "pthread_atfork failed");
        return -1;
    }
    if (PyType_Ready(&SinkType) < 0 || PyType_Ready(&TurnType) < 0)
        return -1;
    if (PyModule_AddObjectRef(m, "Sink", (PyObject *)&SinkType) < 0 ||
        PyModule_AddObjectRef(m, "Turn", (PyObject *)&TurnType) < 0)
        return -1;
    return PyModule_AddFunctions(m, pump_functions);
}
