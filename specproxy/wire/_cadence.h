/* _cadence.h: when the server's next token should arrive, from the times its last ones did.

Why: at one stream, the wait a proxy adds to each token is two CPU wake-ups, its own and then the
client's. On a virtual machine whose idle vCPUs halt (cpuidle haltpoll with guest_halt_poll_ns = 0) a
halted vCPU's wake-up takes many times a running one's (scripts/bench_overhead.py prints this machine's).
An inference server decodes on a steady clock (one step per token per stream), so the relay thread can be
awake and polling when the next token comes, instead of halted: it learns the clock here, sleeps until
just before the next tick, and polls until the bytes arrive or the window passes (_pump.c, "the cadence
poll"). Polling also spares the client's wake-up, since its CPU has not yet gone idle when the token
arrives. The figures are in docs/performance.md, "Design figures".

What a "tick" is: the first read after a quiet gap (a batched engine sends every stream's token of a
step together: one tick per step, at any number of streams). The prediction is the latest tick plus
the period, when the last CADENCE_N periods agree (their spread is at most a quarter of their median);
the window is the margin plus the spread on each side, the thread's own timer wake-up before it, and at
most a tenth of the period in all. A late or early token is only a token that waited for the wake-up
as before; an irregular cadence (a prompt's processing, a speculative step of another length) turns the
prediction off until CADENCE_N regular periods have been seen again.

Pure functions of the times given (CLOCK_MONOTONIC seconds), so that Python can test them
(_relayc.Cadence); only the relay thread calls them on live reads.
*/
#ifndef SPECPROXY_CADENCE_H
#define SPECPROXY_CADENCE_H

#define CADENCE_N 4            /* periods that must agree */
#define CADENCE_QUIET_S 0.001  /* a read after this long without one starts a tick */
#define CADENCE_MIN_S 0.002    /* shorter periods: the thread is busy anyway */
#define CADENCE_MAX_S 1.0      /* longer ones: not a decode clock */
#define CADENCE_MARGIN_S 0.00015 /* each side of the predicted tick, beyond the periods' spread */
#define CADENCE_WAKE_S 0.0002  /* the timer's own wake-up, before the window (a halted vCPU's) */
#define CADENCE_SHARE 0.1      /* the most of a period spent polling */

typedef struct {
    double last_read; /* the latest read (0: none yet) */
    double tick;      /* the start of the latest tick */
    double periods[CADENCE_N];
    int n, at; /* periods recorded (up to CADENCE_N), the next slot */
} cadence;

/* a read at t; returns 1 when it started a tick */
static inline int
cadence_read(cadence *c, double t)
{
    int starts = c->last_read == 0.0 || t - c->last_read > CADENCE_QUIET_S;
    c->last_read = t;
    if (!starts)
        return 0;
    if (c->tick > 0.0) {
        c->periods[c->at] = t - c->tick;
        c->at = (c->at + 1) % CADENCE_N;
        if (c->n < CADENCE_N)
            c->n++;
    }
    c->tick = t;
    return 1;
}

/* forget the clock (no stream left to poll for: the next turn's first token comes after its prompt) */
static inline void
cadence_forget(cadence *c)
{
    c->last_read = c->tick = 0.0;
    c->n = c->at = 0;
}

/* 1, with the window [*from, *to] to poll in for the next tick, when the clock is regular; else 0 */
static inline int
cadence_window(const cadence *c, double *from, double *to)
{
    if (c->n < CADENCE_N)
        return 0;
    double s[CADENCE_N];
    for (int i = 0; i < CADENCE_N; i++) { /* insertion sort of four */
        double v = c->periods[i];
        int j = i;
        while (j > 0 && s[j - 1] > v) {
            s[j] = s[j - 1];
            j--;
        }
        s[j] = v;
    }
    double period = (s[CADENCE_N / 2 - 1] + s[CADENCE_N / 2]) / 2.0, spread = s[CADENCE_N - 1] - s[0];
    if (period < CADENCE_MIN_S || period > CADENCE_MAX_S || spread > period / 4.0)
        return 0;
    double before = CADENCE_WAKE_S + CADENCE_MARGIN_S + spread, after = CADENCE_MARGIN_S + spread;
    double most = CADENCE_SHARE * period;
    if (before + after > most) { /* shrink both sides alike */
        double k = most / (before + after);
        before *= k;
        after *= k;
    }
    double next = c->tick + period;
    *from = next - before;
    *to = next + after;
    return 1;
}

#endif
