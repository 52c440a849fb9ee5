"""Aggregate throughput (delivered tokens / busy time) and its A/B ratio over whole turns.

Why not resample token counts with the busy time held fixed: when every turn delivers the same
number of tokens (fixed-length benchmark outputs) every resample has the same total, and the
interval has no width at all; an A/A pair then reads "slower" with B/A 0.983 [0.983, 0.983].
What varies from turn to turn is tokens AND time, so a turn must be resampled with its time.

Why not resample turns at their own times and recompute the union of their [start, end): at
concurrency > 1 a resample that draws one turn twice does not add its time twice (the copy
overlaps itself), while one that misses a turn may open a gap; the union is not a sum over
turns, so the bootstrap of it has no clear relation to the sampling variance.

What is done: each turn gets its share of the busy time, the integral over its span of
1/(turns in flight). The shares add up exactly to the busy time (the union), so

    aggregate = sum(tokens) / busy = sum(tokens_i) / sum(share_i)

is a ratio of sums over turns. Its log-scale variance is the jackknife's: each turn is left
out in turn, log((sum t - t_i) / (sum w - w_i)), var = (n - 1)/n * sum of squared deviations,
with a t quantile of n - 1 df per arm (Welch-Satterthwaite across the arms), as the mean is
treated in ``stats``. The delta method (linearised ratio) gave the same on smooth shapes but an
interval several times too narrow with a bimodal mix of short and long turns (docs/statistics.md;
``_share_component``). Deterministic, O(n log n), vectorised over many arms
for the calibration simulation (tests/unit/test_aa_calibration.py).

At concurrency > 1 most of the variance is not turn-to-turn but the mean concurrency: how
unevenly the clients finish (the ramp-down). The jackknife sees it only through the last turns'
shares: too wide on smooth shapes, too narrow with a bimodal mix. Where each turn's lane is
known (the client connection it came on: an HTTP/1.1 connection carries one turn at a time, so a
closed-loop client with keep-alive is one serial chain), the arm's schedule is replayed instead
(``_replay_component``): every lane keeps its turn count and first start, its slots get turns
resampled from the whole arm with resampled gaps between them, and the busy time is recomputed.
That varies the ramp-down as sampling does. Lanes inferred from the data (no connection known)
mix clients and fail, and so do busy periods (closed-loop clients keep the server busy without a
gap): without known lanes, or when lanes are one turn long (a connection per request), the
jackknife is used. The replays are seeded, so an interval is reproducible.

When a few turns carry most of the tokens the ratio of sums rests on them, and an arm's sample
may have missed them altogether (a mix of short and long turns, few turns per arm); that arm then
looks homogeneous, its interval is narrow and the estimate extreme, and no per-arm variance can
see a mode its sample lacks. So the row first counts each arm's
*effective* turns (``effective_turns``): its turn count times Kish's design factor of both arms'
token counts pooled, (sum t)^2 / (N sum t^2): the arm that missed the long turns is judged with
the other arm's. Below ``MIN_REQUESTS`` effective turns in an arm there is no interval, as below
that many turns. Tokens do not change under a pure speed-up, so the gate keeps every interval
scale-equivariant.

Server instances follow the same rule as every other row (``stats.instance_parts``): an arm
in several instances resamples whole instances (sum of tokens over sum of shares per
instance); each arm in its own single instance gets no faster/slower verdict.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from specproxy.analyze.arrays import BOOT_CHUNK, Coded, check_level, clean_labelled, coded, take_last
from specproxy.analyze.instances import instance_parts, unknown_instances_warning
from specproxy.analyze.resample import boot_instance_ratio, log_var
from specproxy.analyze.stats import MIN_REQUESTS, Ratio, combine, no_interval

__all__ = ["busy_shares", "busy_throughput", "union_length", "lanes_usable", "aggregate_arms", "aggregate_ratio",
           "aggregate_batch", "effective_turns", "lumpy_reason", "N_REPLAY"]

N_REPLAY = 400  # schedule replays per arm: the SD of a replay variance is ~7% of it


def busy_shares(starts, ends) -> np.ndarray:
    """Each turn's share of the busy time: the integral over [start, end) of 1/(turns in flight).

    ``starts``/``ends``: (n,) or (arms, n), finite, end >= start. The shares of an arm sum to
    the length of the union of its intervals (``dataset.busy_seconds``). O(n log n) per arm.
    """
    s, e = np.atleast_2d(np.asarray(starts, float)), np.atleast_2d(np.asarray(ends, float))
    m, n = s.shape
    times = np.concatenate([s, e], axis=1)
    order = np.argsort(times, axis=1, kind="stable")  # at a tie a start sorts first: a
    # zero-length turn gets a zero share. Each temporary goes once read, and the arithmetic is done in
    # place: a month's arm is 10M events, 76 MB an array, and a dozen of them at once was compare's peak.
    seg = np.diff(take_last(times, order), axis=1)
    del times
    in_flight = np.cumsum(np.where(order < n, np.int8(1), np.int8(-1)), axis=1, dtype=np.int32)[:, :-1]  # after
    np.divide(seg, np.maximum(in_flight, 1), out=seg)  # each event, before the next: its segment's share per turn
    seg[in_flight <= 0] = 0.0
    del in_flight
    g = np.zeros((m, 2 * n))
    np.cumsum(seg, axis=1, out=g[:, 1:])
    del seg
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.broadcast_to(np.arange(2 * n), order.shape), axis=1)
    del order
    out = take_last(g, pos[:, n:])
    out -= take_last(g, pos[:, :n])
    return out.reshape(np.shape(starts))


def busy_throughput(tokens, starts, ends) -> float | None:
    """sum(tokens) / busy time; None with no turns or no busy time."""
    t = np.asarray(tokens, float)
    w = busy_shares(starts, ends)
    return float(t.sum() / w.sum()) if t.size and w.sum() > 0 else None


def effective_turns(tokens_a, tokens_b) -> tuple[np.ndarray, np.ndarray]:
    """Each arm's effective number of turns for the ratio of sums: its turn count times the
    design factor (sum t)^2 / (N sum t^2) of both arms' token counts pooled (N turns in all);
    rows of arrays, as ``aggregate_batch``. With equal arms that is half of Kish's effective
    sample size of the pooled tokens; every turn alike gives each arm its turn count.

    Why pooled: an arm whose sample missed the long turns looks homogeneous on its own; next to
    the other arm's long turns it shows how few turns the comparison rests on. Why tokens and not
    time shares: tokens do not change when one arm is uniformly faster, so whether a comparison
    gets an interval does not depend on the speed-up it measures. NaN where no arm has tokens."""
    ta, tb = np.atleast_2d(np.asarray(tokens_a, float)), np.atleast_2d(np.asarray(tokens_b, float))
    pooled = np.concatenate([ta, tb], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = pooled.sum(axis=1) ** 2 / (pooled.shape[1] * (pooled * pooled).sum(axis=1))
    return ta.shape[1] * factor, tb.shape[1] * factor


def _too_lumpy(eff_a, eff_b):
    """Whether an arm has fewer than ``MIN_REQUESTS`` effective turns (False where undefined)."""
    return np.minimum(eff_a, eff_b) < MIN_REQUESTS


def lumpy_reason(eff_a: float, eff_b: float, n_a: int, n_b: int) -> str | None:
    """Why the row has no interval when an arm has too few effective turns (``effective_turns``);
    None when both have enough (or the count is undefined: no tokens)."""
    if not _too_lumpy(eff_a, eff_b):
        return None
    name, eff = min((("a", eff_a), ("b", eff_b)), key=lambda x: x[1])
    where = "per arm" if n_a == n_b else f"in arm {name}"
    return f"a few turns carry most of the tokens: {eff:.1f} effective turns {where}, {MIN_REQUESTS} needed"


def _share_component(t: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float]:
    """(variance of log(sum t / sum w), df) per arm (rows), by the jackknife over turns; NaN
    where a leave-one-out arm has no tokens or no busy time (no log scale there).

    Why the jackknife and not the delta method: the delta method linearises the ratio, which
    is far from linear when a few long turns carry most of the tokens and time (a 70/30 mix of
    short and long turns): the one long turn of a small sample moves the ratio several times more
    than its throughput's deviation, which is all the linearised residuals see. Leaving each turn out
    measures that leverage; on smooth shapes both give the same interval."""
    n = t.shape[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        loo = np.log((t.sum(axis=1, keepdims=True) - t) / (w.sum(axis=1, keepdims=True) - w))
        v = (n - 1) / n * ((loo - loo.mean(axis=1, keepdims=True)) ** 2).sum(axis=1)
    return np.where(np.isfinite(v), v, np.nan), n - 1.0


def union_length(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Length of the union of [start, end) intervals along the last axis (any leading shape)."""
    order = np.argsort(starts, axis=-1)
    s, e = take_last(starts, order), take_last(ends, order)
    reach = np.maximum.accumulate(e, axis=-1)  # the latest end so far: a turn adds what lies beyond it
    before = np.concatenate([np.full(s.shape[:-1] + (1,), -np.inf), reach[..., :-1]], axis=-1)
    return np.maximum(0.0, e - np.maximum(s, before)).sum(axis=-1)


def lanes_usable(lanes: np.ndarray | None, n: int) -> bool:
    """Whether an arm's lanes carry a schedule to replay: known for every turn, with at least two
    turns per lane on average. A client that opens a connection per request makes every lane one
    turn long: no chain of turns, no ramp-down to replay (the jackknife over turns is used)."""
    return lanes is not None and n >= 2 * (int(np.max(lanes)) + 1)


def _replay_component(t: np.ndarray, s: np.ndarray, e: np.ndarray, lanes: np.ndarray, n_replay: int,
                      rng) -> tuple[np.ndarray, float]:
    """(variance of log(sum t / busy time), df) per arm (rows) by replaying its schedule.

    A lane is a serial chain of turns (one client connection). Each replay keeps the number of
    turns of every lane and the lane's first start, fills the lane's slots with turns drawn with
    replacement from the whole arm (tokens with duration) separated by gaps drawn from the arm's
    gaps between consecutive turns of a lane, and recomputes the busy time as the union of the
    replayed turns. So the replays vary what the per-turn jackknife cannot see at concurrency > 1:
    the mean concurrency, set by how unevenly the lanes finish. Variance of the log over the
    replays with the n/(n - 1) correction, n - 1 df (as the jackknife). ``lanes``: codes 0..k-1
    per turn, rows as ``t``; every row needs at least one gap (``lanes_usable``).
    """
    m, n = t.shape
    order = np.lexsort((s, lanes), axis=-1)  # by lane, then start
    lane = np.take_along_axis(lanes, order, -1)
    so, eo = np.take_along_axis(s, order, -1), np.take_along_axis(e, order, -1)
    first = np.ones((m, n), bool)
    first[:, 1:] = lane[:, 1:] != lane[:, :-1]
    gaps = np.where(first, np.nan, so - np.concatenate([eo[:, :1], eo[:, :-1]], axis=1))
    gaps = np.sort(np.maximum(gaps, 0.0), axis=1)  # a lane's gaps first, the NaNs (lane starts) last
    n_gaps = (~first).sum(axis=1)
    head = np.maximum.accumulate(np.where(first, np.arange(n), 0), axis=1)  # each slot's lane start
    offset = np.take_along_axis(so - so.min(axis=1, keepdims=True), head, 1)
    d = e - s
    one_lane = not first[:, 1:].any()  # every arm one chain: its turns never overlap, busy = their durations
    chunk = max(1, BOOT_CHUNK // (n_replay * n))
    out = np.empty(m)
    for lo in range(0, m, chunk):
        rows = slice(lo, min(m, lo + chunk))
        k = rows.stop - rows.start
        pick = rng.integers(0, n, (k, n_replay, n))
        gap_pick = (rng.random((k, n_replay, n)) * n_gaps[rows, None, None]).astype(np.int64)
        tok = take_last(t[rows, None, :], pick).sum(axis=2)
        dur = take_last(d[rows, None, :], pick)
        if one_lane:  # the same replay; the union of a chain's turns is the sum of their durations
            with np.errstate(divide="ignore", invalid="ignore"):
                out[rows] = log_var(tok / dur.sum(axis=2))
            continue
        gap = np.where(first[rows, None, :], 0.0, take_last(gaps[rows, None, :], gap_pick))
        step = gap + dur
        done = np.cumsum(step, axis=2)  # sum of steps up to and including each slot
        before_lane = take_last(done - step, np.broadcast_to(head[rows, None, :], step.shape))
        start = offset[rows, None, :] + done - dur - before_lane
        with np.errstate(divide="ignore", invalid="ignore"):
            out[rows] = log_var(tok / union_length(start, start + dur))
    return out * n / (n - 1), n - 1.0


def _variance_component(t, w, s, e, lanes, n_replay, rng) -> tuple[np.ndarray, float, str]:
    """The per-arm variance of the log aggregate at turn level: the schedule replay where the
    arm's lanes are known and usable, the jackknife over turns otherwise."""
    if lanes_usable(lanes, t.shape[1]):
        return (*_replay_component(t, s, e, lanes, n_replay, rng), "lanes (schedule replay)")
    return (*_share_component(t, w), "turns (jackknife)")


def aggregate_batch(tokens_a, starts_a, ends_a, tokens_b, starts_b, ends_b, *, lanes_a=None, lanes_b=None,
                    n_replay: int = N_REPLAY, seed: int = 0, level: float = 0.95) -> dict[str, np.ndarray]:
    """B/A aggregate throughput at turn level for many comparisons at once (rows of arrays,
    complete values). ``lanes_a``/``lanes_b``: each turn's lane code 0..k-1 (rows as the turns),
    or None when unknown. Returns arrays estimate, ci_low, ci_high, verdict (None: no interval,
    e.g. fewer than ``MIN_REQUESTS`` effective turns in an arm: ci_low/ci_high NaN there),
    effective_a, effective_b.
    ``aggregate_ratio`` runs this same code for a single comparison without instances."""
    rng = np.random.default_rng(seed)
    comps = []
    for tokens, starts, ends, lanes in ((tokens_a, starts_a, ends_a, lanes_a), (tokens_b, starts_b, ends_b, lanes_b)):
        t = np.atleast_2d(np.asarray(tokens, float))
        s, e = np.atleast_2d(np.asarray(starts, float)), np.atleast_2d(np.asarray(ends, float))
        lanes = None if lanes is None else np.broadcast_to(np.asarray(lanes, np.int64), t.shape)
        w = busy_shares(s, e)
        comps.append((t, w, _variance_component(t, w, s, e, lanes, n_replay, rng)))
    (ta, wa, ca), (tb, wb, cb) = comps
    with np.errstate(divide="ignore", invalid="ignore"):
        est = (tb.sum(1) / wb.sum(1)) / (ta.sum(1) / wa.sum(1))
    lo, hi, df, verdict = combine(est, [ca[:2], cb[:2]], level, higher_is_better=True)
    eff_a, eff_b = effective_turns(ta, tb)
    lumpy = _too_lumpy(eff_a, eff_b)
    lo, hi = np.where(lumpy, np.nan, lo), np.where(lumpy, np.nan, hi)
    verdict = np.where(lumpy, None, verdict)
    return {"estimate": est, "ci_low": lo, "ci_high": hi, "df": df, "verdict": verdict,
            "effective_a": eff_a, "effective_b": eff_b, "method_a": ca[2], "method_b": cb[2]}


def aggregate_ratio(a: tuple, b: tuple, *, clusters_a: Sequence[Any] | Coded | None = None,
                    clusters_b: Sequence[Any] | Coded | None = None, lanes_a: Sequence[Any] | Coded | None = None,
                    lanes_b: Sequence[Any] | Coded | None = None, n_boot: int = 2000, n_replay: int = N_REPLAY,
                    seed: int = 0, level: float = 0.95) -> Ratio:
    """B/A of aggregate throughput; ``a`` and ``b`` are (tokens, starts, ends) of each arm's
    turns (rows with a missing field are dropped). ``clusters_*``: each turn's server instance;
    ``lanes_*``: each turn's lane (any hashable, e.g. the client connection it came on; None where
    unknown, which leaves the arm's lanes unknown), either as a sequence or ``Coded``. See the module
    docstring for the method."""
    return aggregate_arms(a, b, clusters_a=clusters_a, clusters_b=clusters_b, lanes_a=lanes_a, lanes_b=lanes_b,
                          n_boot=n_boot, n_replay=n_replay, seed=seed, level=level)[0]


def aggregate_arms(a: tuple, b: tuple, *, clusters_a: Sequence[Any] | Coded | None = None,
                   clusters_b: Sequence[Any] | Coded | None = None, lanes_a: Sequence[Any] | Coded | None = None,
                   lanes_b: Sequence[Any] | Coded | None = None, n_boot: int = 2000, n_replay: int = N_REPLAY,
                   seed: int = 0, level: float = 0.95) -> tuple[Ratio, float | None, float | None]:
    """``aggregate_ratio``, and each arm's aggregate throughput (``busy_throughput`` of its complete turns)
    from the same busy shares: compare shows all three, and the shares are most of the cost (a sort of
    every start and end)."""
    check_level(level)
    arms, schedules, warnings = {}, {}, []
    for name, (tokens, starts, ends), clusters, lanes in (("a", a, clusters_a, lanes_a), ("b", b, clusters_b, lanes_b)):
        t, s, e = (np.asarray(v, float) for v in (tokens, starts, ends))
        keep = np.isfinite(t) & np.isfinite(s) & np.isfinite(e)
        if not keep.all():  # (each column copied once, and only then)
            t, s, e = t[keep], s[keep], e[keep]
        if (e < s).any() or (t < 0).any():
            raise ValueError("a turn ends before it starts, or has negative tokens")
        labels = None if clusters is None else coded(clusters)[keep]
        _, lab, uniq = clean_labelled(t, labels)
        arms[name] = (t, busy_shares(s, e), lab, uniq)
        schedules[name] = (s, e, _lane_codes(lanes, keep))
    (ta, wa, la, ua), (tb, wb, lb, ub) = arms["a"], arms["b"]
    ka = None if la is None else len(ua)
    kb = None if lb is None else len(ub)
    values = tuple(float(t.sum() / w.sum()) if t.size and w.sum() > 0 else None for t, w, _, _ in arms.values())

    def result(est=None, lo=None, hi=None, verdict="", method=""):
        return (Ratio(est, lo, hi, verdict, int(ta.size), int(tb.size), ka, kb, warnings, "aggregate", level, method),
                *values)

    for name, (t, w, _, _) in arms.items():
        if t.size < MIN_REQUESTS:
            warnings.append(f"arm {name} has {t.size} complete turns (< {MIN_REQUESTS}): no interval")
        elif w.sum() <= 0 or t.sum() <= 0:
            warnings.append(f"arm {name} has no {'busy time' if w.sum() <= 0 else 'tokens'}: no interval")
    est = None
    if ta.size and tb.size and min(wa.sum(), wb.sum(), ta.sum()) > 0:
        est = float((tb.sum() / wb.sum()) / (ta.sum() / wa.sum()))
    if warnings:
        return result(est, verdict=no_interval(warnings[0].split(": no interval")[0]))
    lumpy = lumpy_reason(*(float(x[0]) for x in effective_turns(ta, tb)), ta.size, tb.size)
    if lumpy:
        warnings.append(f"{lumpy}: no interval (the effective count weighs each turn by its tokens; "
                        "a mix of short and long turns needs more turns per arm)")
        return result(est, verdict=no_interval(lumpy))
    if (clusters_a is None) != (clusters_b is None):
        warnings.append(unknown_instances_warning("a" if clusters_a is None else "b"))
    rng = np.random.default_rng(seed)
    comps = {}
    for name, (t, w, lab, uniq) in arms.items():
        k = len(uniq)
        if lab is not None and k >= 2:
            v = log_var(boot_instance_ratio(t, w, lab, n_boot, rng)) * k / (k - 1)
            comps[name] = (v, k - 1.0, f"{k} instances")
        else:
            s, e, lanes = schedules[name]
            comps[name] = _variance_component(t[None, :], w[None, :], s[None, :], e[None, :],
                                              None if lanes is None else lanes[None, :], n_replay, rng)
    parts, forced = instance_parts(comps, ka, kb, ua, ub, warnings)
    lo, hi, df, verdict = combine(np.array([est]), parts, level, True, forced)
    if verdict[0] is None:
        why = "leaving one turn out (or a replay) left no tokens or no busy time"
        warnings.append(f"{why}: no interval")
        return result(est, verdict=no_interval(why))
    method = (f"log ratio-of-sums (tokens / busy-time shares) SE over a: {comps['a'][2]}, "
              f"b: {comps['b'][2]}; " + ("normal quantile" if math.isinf(df[0]) else f"t quantile, df={df[0]:.1f}"))
    return result(est, float(lo[0]), float(hi[0]), str(verdict[0]), method)


def _lane_codes(lanes: Sequence[Any] | Coded | None, keep: np.ndarray) -> np.ndarray | None:
    """Lane labels of the kept turns as codes 0..k-1 in the order they first occur; None when not given or
    unknown (None) for a kept turn."""
    if lanes is None:
        return None
    lanes = coded(lanes)
    if len(lanes) != keep.size:
        raise ValueError(f"{len(lanes)} lane labels for {keep.size} turns")
    kept = lanes[keep]
    if None in kept.values and (kept.codes == kept.values.index(None)).any():
        return None
    return clean_labelled(np.zeros(len(kept)), kept)[1]
