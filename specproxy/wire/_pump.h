/* _pump.h: the relay thread's shared pieces (see _pump.c for why and how it works): a turn, a sink, the
thread's globals, and what _pump.c (the thread) gives _pump_py.c (its Python types). Nothing here is
visible outside the _relayc module. */
#ifndef SPECPROXY_PUMP_H
#define SPECPROXY_PUMP_H

#include <pthread.h>
#include <stddef.h>
#include <sys/epoll.h>
#include <sys/types.h>

#include "_cadence.h"
#include "_chunked.h"

#define PUMP_HIDDEN __attribute__((visibility("hidden")))

#define READ_BYTES 65536 /* one recv() at most; also the most a blocked client can leave us holding */
#define READ_ROOM 16384  /* the least room a recv() gets in the turn's buffer (which then doubles) */
#define MAX_EVENTS 128
#define PUMP_SMALL_KEEP (64 * 1024) /* a turn's first bytes kept, charged as a small turn's (pump_mem_take) */
#define POLL_MAX_TURNS 4 /* the most turns for which the relay thread polls (_pump.c, the cadence poll) */

enum { T_ACTIVE, T_ENDED, T_CANCELLED };
/* how a turn ended; O_THREAD_ERROR: the thread itself could not go on (memory, epoll), with its errno */
enum { O_NONE, O_END, O_FRAMING, O_UPSTREAM_EOF, O_UPSTREAM_ERROR, O_CLIENT_GONE, O_THREAD_ERROR };

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
    size_t kept;           /* buf[:kept] holds the reads kept for measuring (marks end there) */
    size_t keep_left;      /* bytes more that may be kept; a read past it, and every later one, is not */
    int capped;            /* a read was not kept: it did not fit in keep_left */
    int capped_budget;     /* ... because the process's memory budget had no room for it (pump_mem_take) */
    read_mark *marks;
    size_t nmarks, capmarks, taken;
    double last_activity; /* the latest read, or the latest progress of a blocked write */
    int refs;             /* Python's object, the thread: under g.mu */
    long long id;
    struct sink *sink;
    struct turn *next; /* on one of the lists below */
} turn;

typedef struct sink {
    int efd;       /* eventfd: written when done goes from empty to not */
    long slice_us; /* the thread's scheduler slice, if this sink's turn starts it (Sink(slice_us)) */
    int nice;      /* the nice value it asks for, likewise (Sink(nice); 0: the process's) */
    turn *done; /* ended by the thread, not yet returned by Sink.done() (holds the thread's refs) */
    int refs;   /* Python's object and each turn: under g.mu */
} sink;

struct pump_globals {
    pthread_mutex_t mu;
    int started;
    int epfd;
    int wakefd; /* in the epoll set with tag 0: a cancel wakes the thread so that it lets go promptly */
    pthread_t thread;
    turn *cancelled; /* cancelled by Python, waiting for the thread to let go after its next batch */
    long long next_id;
    double last_read; /* the latest read of any turn (the measuring worker waits for a gap) */
    long long turns, reads;
    int active;  /* turns the thread relays now (atomic: Python adds, either side takes away) */
    int poll_on; /* the cadence poll is allowed (atomic: set by Python, read by the thread) */
    cadence cad; /* the server's clock, as the thread's reads see it (the thread's alone) */
    long long poll_windows, poll_hits; /* windows polled, and those in which something arrived (atomic) */
    long long poll_ns;                 /* time spent polling (atomic) */
    int nice;                          /* the thread's nice value, once it runs (atomic; _pump.c) */
    long long mem_used;  /* bytes charged to the process's memory budget (atomic; both sides take and give) */
    long long mem_limit; /* the budget's share for large turns; <= 0: none (atomic: set by Python) */
    long long mem_full;  /* the whole budget, for small ones; <= 0: none */
};

extern PUMP_HIDDEN struct pump_globals pump_g;
extern PUMP_HIDDEN const char *const PUMP_OUTCOME_NAMES[];

/* Charge n bytes to the memory budget if they fit (1), else charge nothing (0). Lock-free: the relay thread
   takes for each read it keeps, Python takes for request bodies and gives back what measuring let go of.
   ``small``: the first PUMP_SMALL_KEEP bytes of a turn, or a small body, may use the whole budget
   (mem_full); anything else stops at mem_limit, so that large turns cannot lock small ones out. */
static inline int
pump_mem_take(long long n, int small)
{
    long long limit = __atomic_load_n(small ? &pump_g.mem_full : &pump_g.mem_limit, __ATOMIC_RELAXED);
    long long now = __atomic_add_fetch(&pump_g.mem_used, n, __ATOMIC_RELAXED);
    if (limit > 0 && now > limit) {
        __atomic_sub_fetch(&pump_g.mem_used, n, __ATOMIC_RELAXED);
        return 0;
    }
    return 1;
}

PUMP_HIDDEN double pump_now(void);                     /* CLOCK_MONOTONIC seconds: perf_counter's clock */
PUMP_HIDDEN void pump_sink_release(sink *k);           /* callers hold pump_g.mu */
PUMP_HIDDEN void pump_turn_release(turn *t);           /* callers hold pump_g.mu */
PUMP_HIDDEN int pump_watch(turn *t, int client, int on); /* callers hold t->mu */
PUMP_HIDDEN int pump_grow(turn *t, size_t more);        /* room for a read of more bytes; callers hold t->mu */
PUMP_HIDDEN int pump_relay_read(turn *t, size_t n, double t_read, turn **ended); /* callers hold t->mu */
PUMP_HIDDEN void pump_end_turn(turn *t, int outcome, int err_no, turn **ended);  /* callers hold t->mu */
PUMP_HIDDEN void pump_hand_over(turn *ended);           /* callers hold pump_g.mu */
PUMP_HIDDEN void pump_unwatch(turn *t);                /* callers hold t->mu; closes the dups */
PUMP_HIDDEN int pump_start_locked(long slice_us, int nice); /* callers hold pump_g.mu */
PUMP_HIDDEN void pump_after_fork_in_child(void);
PUMP_HIDDEN int pump_wait_events(struct epoll_event *evs); /* the thread's next batch (_pump_wait.c) */

#endif
