"""Aggregate throughput (delivered tokens / busy time) and its A/B ratio over whole turns.

Why not resample token counts with the busy time held fixed: when every turn delivers the same
number of tokens (fixed-length benchmark outputs) every resample has the same total, and the
interval has no width at all; an A/A pair then reads "slower" with B/A 0.983 [0.983, 0.983].
What varies from turn to turn is tokens AND time, so a turn must be resampled with its time.

Why not resample turns and recompute the union of their [start, end) intervals: at
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
for the calibration simulation (tests/unit/test_aa_calibration.py). At concurrency > 1 most of the
variance is not turn-to-turn but the mean concurrency (how unevenly the clients finish), which
the jackknife sees only through the last turns' shares: too wide on smooth shapes, too narrow
with a bimodal mix (docs/statistics.md). Busy periods (runs of overlapping turns) as the unit
fail because closed-loop clients keep the server busy without a gap (1-4 of them); replaying the
schedule needs the clients, which are not recorded, and lanes inferred from the data mix them.

Server instances follow the same rule as every other row (``stats.instance_parts``): an arm
in several instances resamples whole instances (sum of tokens over sum of shares per
instance); each arm in its own single instance gets no faster/slower verdict.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from specproxy.analyze.arrays import check_level, clean_labelled
from specproxy.analyze.stats import (MIN_REQUESTS, Ratio, boot_instance_ratio, combine, instance_parts, log_var,
                                     no_interval)

__all__ = ["busy_shares", "busy_throughput", "aggregate_ratio", "aggregate_batch"]


def busy_shares(starts, ends) -> np.ndarray:
    """Each turn's share of the busy time: the integral over [start, end) of 1/(turns in flight).

    ``starts``/``ends``: (n,) or (arms, n), finite, end >= start. The shares of an arm sum to
    the length of the union of its intervals (``dataset.busy_seconds``). O(n log n) per arm.
    """
    s, e = np.atleast_2d(np.asarray(starts, float)), np.atleast_2d(np.asarray(ends, float))
    m, n = s.shape
    times = np.concatenate([s, e], axis=1)
    order = np.argsort(times, axis=1, kind="stable")  # at a tie a start sorts first: a
    step = np.where(order < n, 1, -1)                 # zero-length turn gets a zero share
    in_flight = np.cumsum(step, axis=1)[:, :-1]  # after each event, before the next
    seg = np.diff(np.take_along_axis(times, order, axis=1), axis=1)
    per_turn = np.where(in_flight > 0, seg / np.maximum(in_flight, 1), 0.0)
    g = np.concatenate([np.zeros((m, 1)), np.cumsum(per_turn, axis=1)], axis=1)
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.broadcast_to(np.arange(2 * n), order.shape), axis=1)
    out = np.take_along_axis(g, pos[:, n:], axis=1) - np.take_along_axis(g, pos[:, :n], axis=1)
    return out.reshape(np.shape(starts))


def busy_throughput(tokens, starts, ends) -> float | None:
    """sum(tokens) / busy time; None with no turns or no busy time."""
    t = np.asarray(tokens, float)
    w = busy_shares(starts, ends)
    return float(t.sum() / w.sum()) if t.size and w.sum() > 0 else None


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


def aggregate_batch(tokens_a, starts_a, ends_a, tokens_b, starts_b, ends_b, *, level: float = 0.95
                    ) -> dict[str, np.ndarray]:
    """B/A aggregate throughput at turn level for many comparisons at once (rows of arrays,
    complete values). Returns arrays estimate, ci_low, ci_high, verdict (None: no interval).
    ``aggregate_ratio`` runs this same code for a single comparison without instances."""
    ta, tb = np.atleast_2d(np.asarray(tokens_a, float)), np.atleast_2d(np.asarray(tokens_b, float))
    wa, wb = busy_shares(starts_a, ends_a), busy_shares(starts_b, ends_b)
    wa, wb = np.atleast_2d(wa), np.atleast_2d(wb)
    with np.errstate(divide="ignore", invalid="ignore"):
        est = (tb.sum(1) / wb.sum(1)) / (ta.sum(1) / wa.sum(1))
    lo, hi, df, verdict = combine(est, [_share_component(ta, wa), _share_component(tb, wb)], level,
                                   higher_is_better=True)
    return {"estimate": est, "ci_low": lo, "ci_high": hi, "df": df, "verdict": verdict}


def aggregate_ratio(a: tuple, b: tuple, *, clusters_a: Sequence[Any] | None = None,
                    clusters_b: Sequence[Any] | None = None, n_boot: int = 2000, seed: int = 0,
                    level: float = 0.95) -> Ratio:
    """B/A of aggregate throughput; ``a`` and ``b`` are (tokens, starts, ends) of each arm's
    turns (rows with a missing field are dropped). See the module docstring for the method."""
    check_level(level)
    arms, warnings = {}, []
    for name, (tokens, starts, ends), clusters in (("a", a, clusters_a), ("b", b, clusters_b)):
        t, s, e = (np.asarray(v, float) for v in (tokens, starts, ends))
        keep = np.isfinite(t) & np.isfinite(s) & np.isfinite(e)
        if (e[keep] < s[keep]).any() or (t[keep] < 0).any():
            raise ValueError("a turn ends before it starts, or has negative tokens")
        labels = None if clusters is None else np.asarray(list(clusters), dtype=object)[keep]
        _, lab, uniq = clean_labelled(t[keep], labels)
        arms[name] = (t[keep], busy_shares(s[keep], e[keep]), lab, uniq)
    (ta, wa, la, ua), (tb, wb, lb, ub) = arms["a"], arms["b"]
    ka = None if la is None else len(ua)
    kb = None if lb is None else len(ub)

    def result(est=None, lo=None, hi=None, verdict="", method=""):
        return Ratio(est, lo, hi, verdict, int(ta.size), int(tb.size), ka, kb, warnings,
                     "aggregate", level, method)

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
    if (clusters_a is None) != (clusters_b is None):
        warnings.append(f"arm {'a' if clusters_a is None else 'b'} has no instance labels: its "
                        "restart-to-restart variance is not in the interval")
    rng = np.random.default_rng(seed)
    comps = {}
    for name, (t, w, lab, uniq) in arms.items():
        k = len(uniq)
        if lab is not None and k >= 2:
            v = log_var(boot_instance_ratio(t, w, lab, n_boot, rng)) * k / (k - 1)
            comps[name] = (v, k - 1.0, f"{k} instances")
        else:
            v, df = _share_component(t[None, :], w[None, :])
            comps[name] = (v, df, "turns (jackknife)")
    parts, forced = instance_parts(comps, ka, kb, ua, ub, warnings)
    lo, hi, df, verdict = combine(np.array([est]), parts, level, True, forced)
    if verdict[0] is None:
        why = "leaving one turn out left no tokens or no busy time"
        warnings.append(f"{why}: no interval")
        return result(est, verdict=no_interval(why))
    method = (f"log ratio-of-sums (tokens / busy-time shares) SE over a: {comps['a'][2]}, "
              f"b: {comps['b'][2]}; " + ("normal quantile" if math.isinf(df[0]) else f"t quantile, df={df[0]:.1f}"))
    return result(est, float(lo[0]), float(hi[0]), str(verdict[0]), method)
