/* _pump_wait.c: how the relay thread waits for its next events (_pump.c's loop calls pump_wait_events).
   Apart from the relaying because it is its own concern: when to block and when to poll. */
#include <errno.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "_pump.h"

/* ---- waiting: blocked, or polling around the server's next token ------------------------------

The cadence poll (why, and how the next token's time is predicted: _cadence.h). With few streams
(POLL_MAX_TURNS: where a stream's own per-token wait is what its user feels; more streams keep the thread
busy anyway, and polling would cost CPU per chunk), a regular clock, and Python's leave (pump_g.poll_on:
serve's --cadence-poll, by default only while the machine has a core idle, cadence_poll.py), the thread
sleeps until just before the predicted token, then polls epoll without blocking until something arrives
or the window passes; then it blocks as ever. Measured on this project's benchmark at C = 1: see
docs/performance.md ("Design figures"). */

/* epoll_wait for up to `s` seconds, to the microsecond where the kernel has epoll_pwait2 (Linux >= 5.11);
   else to the millisecond below (the window starts at most 1 ms early) */
static int
wait_for(struct epoll_event *evs, double s)
{
#ifdef SYS_epoll_pwait2
    static int no_pwait2;
    if (!no_pwait2) {
        struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
        long n = syscall(SYS_epoll_pwait2, pump_g.epfd, evs, MAX_EVENTS, &ts, NULL, 0);
        if (n >= 0 || errno != ENOSYS)
            return (int)n;
        no_pwait2 = 1;
    }
#endif
    return epoll_wait(pump_g.epfd, evs, MAX_EVENTS, (int)(s * 1000.0));
}

/* the thread's next batch of events: blocked until something comes, or, when the cadence poll applies,
   asleep until the window, then polling through it */
int
pump_wait_events(struct epoll_event *evs)
{
    for (;;) {
        int active = __atomic_load_n(&pump_g.active, __ATOMIC_RELAXED);
        if (active == 0)
            cadence_forget(&pump_g.cad); /* the next turn's first token comes after its prompt: a clock anew */
        double from, to, now = 0.0;
        if (active == 0 || active > POLL_MAX_TURNS || !__atomic_load_n(&pump_g.poll_on, __ATOMIC_RELAXED) ||
            !cadence_window(&pump_g.cad, &from, &to) || (now = pump_now()) >= to)
            return epoll_wait(pump_g.epfd, evs, MAX_EVENTS, -1);
        if (now < from) {
            int n = wait_for(evs, from - now);
            if (n != 0)
                return n; /* something came before the window (or an error): handled, then the window again */
            continue;     /* the window opens: is it still wanted (the turns may have ended meanwhile)? */
        }
        double start = now;
        int n;
        while ((n = epoll_wait(pump_g.epfd, evs, MAX_EVENTS, 0)) == 0 && (now = pump_now()) < to)
            ;
        if (n > 0)
            now = pump_now();
        __atomic_add_fetch(&pump_g.poll_windows, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&pump_g.poll_ns, (long long)((now - start) * 1e9), __ATOMIC_RELAXED);
        if (n > 0)
            __atomic_add_fetch(&pump_g.poll_hits, 1, __ATOMIC_RELAXED);
        if (n != 0)
            return n;
        /* missed: the token is late, or none is coming; the window has passed, so the next round blocks */
    }
}
