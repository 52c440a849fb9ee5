/* _pump.c: the relay thread, no Python in it (its Python types are in _pump_py.c). Part of _relayc.

Why: relayed on the event loop, even in C, each read costs uvloop taking the interpreter lock twice
(buffer and callback), a bytes object, a call into the protocol, float objects, list appends and three
transport calls, several times nginx's CPU per chunk (docs/performance.md); and the measuring thread
waits on the same lock. Here one native thread, which never takes the interpreter lock, relays the
bodies themselves: epoll, read, find the end (_chunked.h), send, clock.

What Python hands over and gets back (relay_thread.ThreadRelay is the only user):
  Sink(loop side)  -- a queue of finished turns and an eventfd the event loop watches (one per loop).
  Turn(sink, upstream_fd, client_fd, framing)
                   -- the body of one exchange, relayed by the thread from now on: dup()s of both sockets
                      (Python's transports keep theirs; the upstream's reading is paused, the client's
                      write buffer is empty), the framing state copied from the C ChunkedEnd, and how
                      many bytes of the body to keep for measuring. Every read is written to the client as
                      it came (up to the body's end, not past it), stamped with CLOCK_MONOTONIC right after
                      read() and right after send(), and, while the bytes kept stay within that allowance,
                      kept with its times in the turn (take() hands them to the RecordBuilder). A read
                      past the allowance, and every read after it, is relayed and then forgotten (its
                      room in the buffer reused once the client took it): an unmeasured turn (allowance 0)
                      holds at most what the client has not taken, a measured one at most its cap more.
  The turn ends in the thread (the body's end, a framing error, the upstream's EOF or error, the client's
  error) or by Turn.cancel() from Python (the idle deadline, the client hanging up, closing); either way
  the thread touches neither socket afterwards and both dups are closed. A turn the thread ended goes to
  its sink, which wakes the loop: Sink.done() returns the turns' ids and ThreadRelay reports each to its
  exchange as the Python relay reports the same event (exchange.Exchange.relay_ended).

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
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "_pump.h"

struct pump_globals pump_g = {.mu = PTHREAD_MUTEX_INITIALIZER};
const char *const PUMP_OUTCOME_NAMES[] = {"none", "end", "framing", "upstream_eof", "upstream_error",
                                          "client_gone", "thread_error"};

/* The thread is never cancelled, so its reads and sends go straight to the kernel: glibc's recv() and
   send() are cancellation points that bracket the call with __pthread_enable/disable_asynccancel (a
   visible share of the thread's samples under perf: docs/performance.md, "Design figures"); syscall() is not one. */
static inline ssize_t
raw_recv(int fd, void *buf, size_t len, int flags)
{
    return syscall(SYS_recvfrom, fd, buf, len, flags, NULL, NULL);
}

static inline ssize_t
raw_send(int fd, const void *buf, size_t len, int flags)
{
    return syscall(SYS_sendto, fd, buf, len, flags, NULL, 0);
}

double
pump_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- lifetimes (callers hold pump_g.mu) ------------------------------------------------------ */

void
pump_sink_release(sink *k)
{
    if (--k->refs == 0) {
        close(k->efd);
        free(k);
    }
}

void
pump_turn_release(turn *t)
{
    if (--t->refs == 0) {
        pump_sink_release(t->sink);
        pthread_mutex_destroy(&t->mu);
        free(t->buf);
        free(t->marks);
        free(t);
    }
}

/* ---- the thread's side of a turn (callers hold t->mu) ----------------------------------------- */

void
pump_unwatch(turn *t)
{
    if (t->up_watched)
        epoll_ctl(pump_g.epfd, EPOLL_CTL_DEL, t->up_fd, NULL);
    if (t->cl_watched)
        epoll_ctl(pump_g.epfd, EPOLL_CTL_DEL, t->cl_fd, NULL);
    t->up_watched = t->cl_watched = 0;
    if (t->up_fd >= 0)
        close(t->up_fd);
    if (t->cl_fd >= 0)
        close(t->cl_fd);
    t->up_fd = t->cl_fd = -1;
}

int
pump_watch(turn *t, int client, int on)
{
    int fd = client ? t->cl_fd : t->up_fd;
    int *watched = client ? &t->cl_watched : &t->up_watched;
    if (on == *watched)
        return 0;
    if (!on) {
        *watched = 0;
        return epoll_ctl(pump_g.epfd, EPOLL_CTL_DEL, fd, NULL);
    }
    struct epoll_event ev = {.events = client ? EPOLLOUT : EPOLLIN | EPOLLRDHUP | EPOLLET,
                             .data.u64 = (uint64_t)(uintptr_t)t | client};
    if (epoll_ctl(pump_g.epfd, EPOLL_CTL_ADD, fd, &ev) < 0)
        return -1;
    *watched = 1;
    return 0;
}

void
pump_end_turn(turn *t, int outcome, int err_no, turn **ended)
{
    __atomic_sub_fetch(&pump_g.active, 1, __ATOMIC_RELAXED);
    t->state = T_ENDED;
    t->outcome = outcome;
    t->err_no = err_no;
    t->blocked = 0;
    pump_unwatch(t);
    t->next = *ended; /* handed to the sink after this batch */
    *ended = t;
}

/* the turns ended (a list through ->next) to their sinks, which wake their loops (callers hold pump_g.mu) */
void
pump_hand_over(turn *ended)
{
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
}

/* send what the client has not taken: 0 all taken, 1 some left, -1 error (errno) */
static int
flush(turn *t)
{
    while (t->sent < t->len) {
        ssize_t w = raw_send(t->cl_fd, t->buf + t->sent, t->len - t->sent, MSG_NOSIGNAL | MSG_DONTWAIT);
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

int
pump_grow(turn *t, size_t more)
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
        pump_end_turn(t, O_CLIENT_GONE, errno, ended);
        return;
    }
    if (r > 0)
        return;
    t->len = t->sent = t->kept; /* what was relayed and not kept: its room is free again */
    t->blocked = 0;
    if (t->end_seen) {
        pump_end_turn(t, O_END, 0, ended);
        return;
    }
    if (pump_watch(t, 1, 0) < 0 || pump_watch(t, 0, 1) < 0)
        pump_end_turn(t, O_THREAD_ERROR, errno, ended);
}

/* one recv() and what follows it; 1 when the turn goes on and more may be waiting: the read filled the
   room it had, or the peer has closed (``closing``: read on until the EOF or the error) */
static int
read_once(turn *t, int closing, turn **ended)
{
    /* straight into the turn's buffer (which keeps the body for measuring, up to its allowance): no copy */
    if (pump_grow(t, READ_ROOM) < 0) {
        pump_end_turn(t, O_THREAD_ERROR, ENOMEM, ended);
        return 0;
    }
    char *at = t->buf + t->len;
    size_t room = t->cap - t->len < READ_BYTES ? t->cap - t->len : READ_BYTES;
    ssize_t n;
    do /* MSG_DONTWAIT: never block the thread, whatever the socket's own flags say */
        n = raw_recv(t->up_fd, at, room, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    double t_read = pump_now();
    if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            pump_end_turn(t, O_UPSTREAM_ERROR, errno, ended);
        return 0;
    }
    if (n == 0) {
        pump_end_turn(t, O_UPSTREAM_EOF, 0, ended);
        return 0;
    }
    t->last_activity = t_read;
    __atomic_store(&pump_g.last_read, &t_read, __ATOMIC_RELAXED); /* read without a lock: any recent value does */
    cadence_read(&pump_g.cad, t_read);
    return pump_relay_read(t, (size_t)n, t_read, ended) && ((size_t)n == room || closing);
}

/* What follows a read of n bytes, read at t_read into the turn's buffer at t->len (by the thread, or by
   the event loop before the turn began: the reads that came with the response head, Turn's ``first``):
   find the body's end, send, keep. 1 when the turn goes on and the upstream may be read again. */
int
pump_relay_read(turn *t, size_t n, double t_read, turn **ended)
{
    char *at = t->buf + t->len;
    const char *err = NULL;
    ssize_t end = chunked_scan(&t->cs, at, n, &err, NULL, NULL);
    if (end == -2) { /* as the Python path: nothing of this read reaches the client */
        t->framing_error = err;
        pump_end_turn(t, O_FRAMING, 0, ended);
        return 0;
    }
    size_t take = end >= 0 ? (size_t)end : n;
    if (end >= 0 && (size_t)end != n)
        t->past_end = 1; /* the bytes past the end stay beyond t->len: never sent, never kept */
    int keep = !t->capped && take <= t->keep_left;
    if (keep && take && !pump_mem_take((long long)take, t->kept + take <= PUMP_SMALL_KEEP))
        keep = 0, t->capped_budget = 1; /* the process's budget is spent: relayed, not kept */
    t->len += take;
    int r = flush(t);
    int flush_errno = errno;
    double t_written = pump_now();
    if (keep) {
        t->keep_left -= take;
        t->kept = t->len;
        read_mark *m = &t->marks[t->nmarks++];
        m->end = t->len;
        m->t_read = t_read;
        m->t_written = t_written;
    }
    else {
        t->capped = 1; /* from here on nothing is kept: the reads kept are the body's first ones, in order */
        if (r == 0)
            t->len = t->sent = t->kept;
    }
    if (r < 0) {
        pump_end_turn(t, O_CLIENT_GONE, flush_errno, ended);
        return 0;
    }
    if (end >= 0)
        t->end_seen = 1;
    if (r > 0) { /* the client is slower than the upstream: hold the upstream until it has taken this */
        t->blocked = 1;
        if (pump_watch(t, 0, 0) < 0 || pump_watch(t, 1, 1) < 0)
            pump_end_turn(t, O_THREAD_ERROR, errno, ended);
        return 0;
    }
    if (end >= 0) {
        pump_end_turn(t, O_END, 0, ended);
        return 0;
    }
    return 1;
}

/* The upstream's socket is watched edge-triggered, as nginx watches its sockets (level-triggered epoll
   polls every socket it reported once more in the next epoll_wait, only to find most of them empty): read
   until a read leaves the socket empty, the turn ends, or the client holds us back (re-watching with
   EPOLL_CTL_ADD polls the socket afresh). A short read empties a TCP socket (recv copies all that is
   queued; bytes that arrive meanwhile raise a new edge), except of a pending EOF: the peer's FIN raises
   EPOLLRDHUP with the data it follows, and then the reads go on until the EOF itself. */
static long long
on_upstream_readable(turn *t, uint32_t events, turn **ended)
{
    int closing = (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0;
    long long reads = 1;
    while (read_once(t, closing, ended))
        reads++;
    return reads;
}

/* A short scheduler slice for the relay thread (Linux >= 6.12: EEVDF's per-task slice; an older kernel
   takes the call and ignores the slice). Why: the relay shares a core with Python (the event loop, the
   measuring thread); a read that arrives while one of them runs waited for that task's slice to end
   (milliseconds) before the relay's wake-up could preempt it. With a 0.1 ms slice, the shortest the kernel
   allows, it preempts at once, and added p99 per chunk falls by about two thirds with a smooth upstream
   (docs/performance.md, "Design figures"). Config's relay_slice_us sets it in
   microseconds (0: the kernel's default), given to Sink() and applied when the thread starts. The
   thread's nice value is kept. */
struct pump_sched_attr {
    uint32_t size, policy;
    uint64_t flags;
    int32_t nice;
    uint32_t priority;
    uint64_t runtime, deadline, period;
};

static long pump_slice_us; /* set by pump_start_locked, before the thread starts */
static int pump_nice;      /* likewise: the nice value the thread asks for; 0 leaves its own */

static void
pump_short_slice(void)
{
#ifdef SYS_sched_setattr
    long us = pump_slice_us;
    if (us <= 0)
        return;
    errno = 0;
    int nice = getpriority(PRIO_PROCESS, 0); /* this thread's (Linux: per thread); -1 may be a nice value */
    if (nice == -1 && errno != 0)
        return;
    struct pump_sched_attr a = {.size = sizeof a, .policy = 0 /* SCHED_OTHER */, .nice = nice,
                                .runtime = (uint64_t)us * 1000};
    (void)syscall(SYS_sched_setattr, 0, &a, 0); /* best effort: the relay works the same without it */
#endif
}

/* A higher weight for the relay thread than Python's: nice relay_nice (-10 by default; Config's relay_nice),
   where the process may lower a nice value (CAP_SYS_NICE, as root has, or an RLIMIT_NICE that allows it).
   Why: a decode step brings every stream's token at once, and the event loop's work for the turns that step
   ended and began comes in the same moments; at equal weight the relay, even with its short slice, waited
   for the loop there (p99 1-2.6 ms in a scheduler trace at C = 256), and the tokens at a step's end (a new
   turn's first among them: a server appends new requests to its batch) waited with it. With the weight the
   relay wins the core when both want it, and stays an ordinary task: the kernel's own deferred network
   work and every other process keep their share (real-time priority did not: docs/performance.md,
   "Design figures"). Without the privilege the call fails and the thread keeps the process's nice value.
   Linux's nice is per thread: Python's threads keep theirs. Set before the slice, which keeps it. Returns
   the thread's nice value then. */
static int
pump_weight(void)
{
    errno = 0;
    int nice = getpriority(PRIO_PROCESS, 0); /* this thread's; -1 may be a nice value */
    if (nice == -1 && errno != 0)
        return 0;
    if (pump_nice < 0 && pump_nice < nice && setpriority(PRIO_PROCESS, 0, pump_nice) == 0)
        return pump_nice;
    return nice;
}

static void *
pump_main(void *arg)
{
    pthread_setname_np(pthread_self(), "specproxy-relay"); /* what top -H and /proc/.../comm show */
    __atomic_store_n(&pump_g.nice, pump_weight(), __ATOMIC_RELAXED);
    pump_short_slice();
    struct epoll_event evs[MAX_EVENTS];
    for (;;) {
        int n = pump_wait_events(evs);
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
                ssize_t r = read(pump_g.wakefd, &count, sizeof count);
                (void)r;
                continue;
            }
            turn *t = (turn *)(uintptr_t)(tag & ~(uint64_t)1);
            pthread_mutex_lock(&t->mu);
            if (t->state == T_ACTIVE) {
                if (tag & 1)
                    on_client_writable(t, &ended);
                else
                    reads += on_upstream_readable(t, evs[i].events, &ended);
            }
            pthread_mutex_unlock(&t->mu);
        }
        pthread_mutex_lock(&pump_g.mu);
        pump_g.reads += reads;
        pump_hand_over(ended);
        turn *dead = pump_g.cancelled;
        pump_g.cancelled = NULL;
        while (dead != NULL) {
            turn *t = dead;
            dead = t->next;
            pump_turn_release(t);
        }
        pthread_mutex_unlock(&pump_g.mu);
    }
    return NULL;
}

/* a forked child has no relay thread (fork copies only the forking thread): it starts its own */
void
pump_after_fork_in_child(void)
{
    pthread_mutex_init(&pump_g.mu, NULL);
    pump_g.started = 0;
    pump_g.cancelled = NULL;
    pump_g.active = 0; /* the parent's turns are not this process's */
    pump_g.nice = 0;   /* nor its thread's nice value: the child's thread sets its own */
    cadence_forget(&pump_g.cad);
}

/* start the thread once per process, with a scheduler slice of slice_us and the nice value nice (pump_weight;
   0 leaves the process's); call with pump_g.mu held */
int
pump_start_locked(long slice_us, int nice)
{
    if (pump_g.started)
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
    pump_g.epfd = epfd;
    pump_g.wakefd = wakefd;
    pump_g.cancelled = NULL;
    pump_slice_us = slice_us;
    pump_nice = nice;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&pump_g.thread, &attr, pump_main, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        close(wakefd);
        close(epfd);
        errno = rc;
        return -1;
    }
    pump_g.started = 1;
    return 0;
}
