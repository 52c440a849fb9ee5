"""The A/B ratio: stat(b) / stat(a), its interval and its verdict (summaries of one figure are in
``summary``, the negative control in ``control``).

Why: on inference hardware one config varies a lot from run to run, and two restarts of the
same config can give non-overlapping intervals (docs/statistics.md). A bare median,
or an A/B that ignores which server instance served a request, gives confident numbers that are
wrong. Here every figure has n and an interval, and an A/B verdict is "faster", "slower" or
"not distinguishable", never more than the data carry; a comparison that cannot get an interval
says "no interval (why)", since "not distinguishable" would claim a comparison never made.
The request-level path runs ``ratio_batch`` (many comparisons at once) so that its calibration
is simulated on the code compare runs: tests/unit/test_aa_calibration.py, table in
docs/statistics.md (including the shapes where it misses: bimodal mixes). The false-positive rates and
coverages behind each choice below are in docs/statistics.md, "Figures behind the choices" (the seeded
simulations of tests/unit/test_stats.py).

* Ratios (``bootstrap_ratio``): each arm's bootstrap distribution of log(stat) gives a
  variance; the interval is exp(log(stat_b / stat_a) +- q * se), on the log scale because
  ratios are. Unit per arm: requests when it ran in one instance (or has no labels); whole
  instances when it ran in several (one-stage cluster bootstrap; resampling requests inside the
  drawn instances as well would count within-instance noise twice). With instances, the
  variance gets the k/(k-1) correction and q is Student t with Welch-Satterthwaite df from
  (instances - 1) per arm: a plain cluster-bootstrap percentile interval says "distinguishable"
  far too often in A/A tests with few instances. At request level, the mean gets exactly Welch
  (n/(n-1), df n-1; a z interval is too narrow at small n); a p95 uses the normal quantile,
  because the bootstrap variance of a quantile runs high at small n, which offsets it.
* The median at request level (both arms; what compare's per-turn rows run) is the exception:
  the percentile interval of log(median b) - log(median a) over a smoothed bootstrap (resamples
  from the linearly interpolated quantile function of each arm's log values), read at a
  calibrated tail (``median_tail``: the replicates' spread runs high, and is noisy), widened to
  the estimate if a bound misses it. A variance with a normal interval cannot fit a median whose
  sampling distribution jumps between modes (bimodal turn mixes): it was liberal at n = 8 and
  conservative at n = 60. When the other arm ran in several instances, the request-level arm
  contributes the variance of the same smoothed replicates to the t rule.
  A bootstrap quantile never materialises resamples: the order statistics of a resample are the
  sorted data (or the interpolated quantile function) at the order statistics of uniform
  indices, which are Beta distributed: O(n_boot) per arm after a sort. Instances:
  O(n_boot * k * log n).
* How the arms' server instances enter the variance, and when they force the verdict to
  "not distinguishable": ``instances``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Sequence

import numpy as np

from specproxy.analyze.arrays import check_level, clean_labelled
from specproxy.analyze.instances import instance_parts, unknown_instances_warning
from specproxy.analyze.order_stats import quantile
from specproxy.analyze.resample import STATS, boot_instances, boot_requests, finite_var, log_var, smoothed_log_medians
from specproxy.analyze.tdist import t_ppf, t_quantiles

__all__ = [
    "MEDIAN_EXCESS", "MIN_REQUESTS", "ND", "Ratio", "bootstrap_ratio", "combine", "median_excess", "median_tail",
    "no_interval", "percentile_interval", "ratio_batch",
]

MIN_REQUESTS = 5  # per arm; below this the bootstrap variance is too unstable (docs/statistics.md)
ND = "not distinguishable"


# ----------------------------------------------------------------------------- request-level rule

def _stat(x: np.ndarray, stat: str) -> float:
    q = STATS[stat]
    return float(x.mean()) if q is None else quantile(x, q)  # numpy's quantile, from a selection


def _request_log_reps(x_sorted: np.ndarray, stat: str, n_boot: int, rng) -> np.ndarray:
    """Replicates of log(stat) over requests per arm, for a batch of request-level arms: the
    smoothed bootstrap for the median, the plain one for the mean and p95."""
    if stat == "median":
        return smoothed_log_medians(x_sorted, n_boot, rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(boot_requests(x_sorted, stat, n_boot, rng))


def _request_component(log_reps: np.ndarray, stat: str, n: int) -> tuple[np.ndarray, float]:
    """(variance of log stat, df) of request-level arms, for the normal/t rule (``combine``): the
    mean gets exactly Welch (n/(n-1), df n-1); a quantile the normal quantile."""
    v = finite_var(log_reps)
    return (v * n / (n - 1), n - 1.0) if stat == "mean" else (v, math.inf)


# The smoothed bootstrap's variance of a log median runs high by a factor that fades with the arm's
# size n: 1 + a * n ** (-1/3), ``a`` by the parity of n (at an odd n the median is one order
# statistic, and the excess is larger). The constants are a Hall-Martin calibration of the nominal
# level, done once offline by simulation on shapes apart from the calibration test's, fitted
# jointly with the t quantile of ``median_tail`` (so the factor exceeds the plain variance ratio,
# 1.1-1.2): docs/statistics.md, "Medians". Even n first.
MEDIAN_EXCESS = (0.57, 0.78)
_NORMAL = NormalDist()


def median_excess(n: int) -> float:
    """How many times the true variance of log(median) the smoothed bootstrap's counts at size n,
    as ``median_tail`` corrects it (with the t quantile beside it)."""
    return 1.0 + MEDIAN_EXCESS[n % 2] * n ** (-1.0 / 3.0)


def percentile_interval(est: np.ndarray, arm_a: tuple[np.ndarray, int], arm_b: tuple[np.ndarray, int],
                        level: float, higher_is_better: bool, forced: bool = False):
    """The interval of a request-level median ratio, for a batch: a percentile interval of the
    replicates of log(median b) - log(median a) at a calibrated nominal level (``median_tail``),
    widened to the estimate where a bound falls on its wrong side (the estimate is the sample
    median ratio, the replicates are smoothed: they can disagree by a little). ``arm_*``: (log
    replicates, size n). Returns lo, hi, verdict as ``combine`` does."""
    est = np.asarray(est, dtype=float)
    d = arm_b[0] - arm_a[0]
    valid = np.isfinite(d).all(axis=1)
    tail = median_tail(arm_a[1], arm_b[1], level)
    lo, hi = np.exp(np.quantile(np.where(valid[:, None], d, 0.0), [tail, 1.0 - tail], axis=1))
    lo = np.where(valid, np.minimum(lo, est), np.nan)
    hi = np.where(valid, np.maximum(hi, est), np.nan)
    return lo, hi, _verdicts(lo, hi, valid, higher_is_better, forced)


def median_tail(n_a: int, n_b: int, level: float) -> float:
    """The tail probability at which ``percentile_interval`` reads the replicates so that it covers
    ``level``. Two errors of the replicates' spread offset each other, by how the arms balance: it
    runs high (``median_excess``), and it is itself an estimate, noisy as a variance with n - 1
    df. So the tail is that of t / sqrt(k) instead of the normal quantile: t the Student quantile
    with Welch-Satterthwaite df, k the excess of the variance of the difference, both from the
    arms' sizes (an arm's variance ~ 1/n). Equal arms: about 3% a side for 95%; a small arm
    against a large one: about 2% (the noise of the small arm's spread is not averaged out)."""
    var = (1.0 / n_a, 1.0 / n_b)
    true = [v / median_excess(n) for v, n in zip(var, (n_a, n_b))]
    df = sum(true) ** 2 / sum(t * t / (n - 1) for t, n in zip(true, (n_a, n_b)))
    q = t_ppf(1.0 - (1.0 - level) / 2.0, df) / math.sqrt(sum(var) / sum(true))
    return _NORMAL.cdf(-q)


def _verdicts(lo: np.ndarray, hi: np.ndarray, valid: np.ndarray, higher_is_better: bool,
              forced: bool) -> np.ndarray:
    """Faster/slower where the interval excludes 1, ND where it holds 1 or ``forced``, None where
    there is no interval."""
    verdict = np.full(lo.shape, ND, dtype=object)
    if not forced:
        out = valid & ((lo > 1.0) | (hi < 1.0))
        verdict[out] = np.where((lo[out] > 1.0) == higher_is_better, "faster", "slower")
    verdict[~valid] = None
    return verdict


def combine(est: np.ndarray, parts: Sequence[tuple[np.ndarray, float]], level: float,
             higher_is_better: bool, forced: bool = False):
    """The one rule from per-arm log variances to an interval and a verdict, for a batch.

    ``est``: B/A per comparison; ``parts``: (variance, df) of each independent component.
    The quantile is Student t with Welch-Satterthwaite df (normal when every df is infinite).
    Returns lo, hi, df, verdict (object array; None where a variance is NaN: no interval).
    ``forced``: the verdict cannot be faster/slower (the instance effect is unmeasured).
    """
    est = np.asarray(est, dtype=float)
    var = sum(np.broadcast_to(np.asarray(v, float), est.shape) for v, _ in parts)
    denom = sum(np.asarray(v, float) ** 2 / df for v, df in parts if math.isfinite(df))
    with np.errstate(divide="ignore", invalid="ignore"):
        df = np.where(np.asarray(denom) > 0, var * var / denom, math.inf)
    half = t_quantiles(1.0 - (1.0 - level) / 2.0, df) * np.sqrt(var)
    lo, hi = est * np.exp(-half), est * np.exp(half)
    return lo, hi, df, _verdicts(lo, hi, ~np.isnan(var), higher_is_better, forced)


def ratio_batch(a: np.ndarray, b: np.ndarray, *, higher_is_better: bool, stat: str = "median",
                n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict[str, np.ndarray]:
    """``bootstrap_ratio`` at request level for many comparisons at once: a (m, n_a), b (m, n_b)
    hold complete rows of values > 0. Returns arrays estimate, ci_low, ci_high, df, verdict (None
    where a bootstrap stat was 0). bootstrap_ratio calls this with m = 1, so simulations of its
    calibration run this same code, and with the same seed give the same numbers."""
    rng = np.random.default_rng(seed)
    xa, xb = np.sort(np.atleast_2d(a), axis=1), np.sort(np.atleast_2d(b), axis=1)
    est = _stat_rows(xb, stat) / _stat_rows(xa, stat)
    ra, rb = _request_log_reps(xa, stat, n_boot, rng), _request_log_reps(xb, stat, n_boot, rng)
    lo, hi, df, verdict = _request_interval(est, (ra, xa.shape[1]), (rb, xb.shape[1]), stat, level,
                                            higher_is_better)
    return {"estimate": est, "ci_low": lo, "ci_high": hi, "df": df, "verdict": verdict}


def _request_interval(est, arm_a: tuple, arm_b: tuple, stat: str, level: float, higher_is_better: bool,
                      forced: bool = False):
    """The one rule for two request-level arms, each (log replicates, n): the median's percentile
    interval, else the normal/t rule on the replicates' variances. Returns lo, hi, df, verdict."""
    if stat == "median":
        lo, hi, verdict = percentile_interval(est, arm_a, arm_b, level, higher_is_better, forced)
        return lo, hi, np.full(lo.shape, math.inf), verdict
    parts = [_request_component(reps, stat, n) for reps, n in (arm_a, arm_b)]
    return combine(est, parts, level, higher_is_better, forced)


def _stat_rows(x_sorted: np.ndarray, stat: str) -> np.ndarray:
    q = STATS[stat]
    return x_sorted.mean(axis=1) if q is None else np.quantile(x_sorted, q, axis=1)

# ----------------------------------------------------------------------------- Ratio

@dataclass(frozen=True)
class Ratio:
    """stat(b) / stat(a) with its interval; the verdict describes b (new) against a (baseline)."""
    estimate: float | None
    ci_low: float | None
    ci_high: float | None
    verdict: str  # "faster" | "slower" | "not distinguishable" | "no interval (why)"
    n_a: int
    n_b: int
    instances_a: int | None  # distinct cluster labels, None when no labels were given
    instances_b: int | None
    warnings: list[str] = dataclasses.field(default_factory=list)
    stat: str = "median"
    level: float = 0.95
    method: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def no_interval(why: str) -> str:
    """The verdict of a row that cannot get an interval: saying "not distinguishable" there
    would claim a comparison that was never made."""
    return f"no interval ({why})"


def bootstrap_ratio(a, b, *, higher_is_better: bool, stat: str = "median",
                    clusters_a: Sequence[Any] | None = None,
                    clusters_b: Sequence[Any] | None = None,
                    n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> Ratio:
    """Ratio stat(b)/stat(a) with a ``level`` interval and a verdict (see module docstring).

    ``higher_is_better``: True for speeds/throughput (b faster when the ratio is > 1), False for
    times such as ttft_s or total_s (b faster when the ratio is < 1). ``clusters_*``: the server
    instance id of each value. Values must be >= 0 (times, speeds, tokens).
    """
    if stat not in STATS:
        raise ValueError(f"stat must be one of {sorted(STATS)}, got {stat!r}")
    if n_boot < 200:
        raise ValueError("n_boot must be >= 200")
    check_level(level)
    xa, la, ua = clean_labelled(a, clusters_a)
    xb, lb, ub = clean_labelled(b, clusters_b)
    if (xa < 0).any() or (xb < 0).any():
        raise ValueError("bootstrap_ratio needs non-negative values (times, speeds, tokens)")
    ka = None if la is None else len(ua)
    kb = None if lb is None else len(ub)
    warnings: list[str] = []

    def result(est=None, lo=None, hi=None, verdict=ND, method=""):
        return Ratio(est, lo, hi, verdict, int(xa.size), int(xb.size), ka, kb, warnings,
                     stat, level, method)

    warnings += [f"no data in arm {name}" for name, x in (("a", xa), ("b", xb)) if not x.size]
    if warnings:
        return result(verdict=no_interval(warnings[0]))
    # a quantile is read off a selection, the same sorted or not; a mean is summed in sorted order, as it was
    sa, sb = (_stat(np.sort(x) if STATS[stat] is None else x, stat) for x in (xa, xb))
    if sa <= 0 or sb <= 0:
        warnings.append(f"{stat} is 0 in an arm: the ratio is undefined")
        return result(verdict=no_interval(f"{stat} is 0 in an arm"))
    est = sb / sa
    for name, x in (("a", xa), ("b", xb)):
        if x.size < MIN_REQUESTS:
            warnings.append(f"arm {name} has {x.size} values (< {MIN_REQUESTS}): no interval")
        elif stat == "p95" and x.size < 100:
            warnings.append(f"arm {name}: fewer than 5 values above its {stat}; "
                            "the interval is unreliable")
    if any(x.size < MIN_REQUESTS for x in (xa, xb)):
        return result(est, verdict=no_interval(f"fewer than {MIN_REQUESTS} values in an arm"))
    if (clusters_a is None) != (clusters_b is None):
        warnings.append(unknown_instances_warning("a" if clusters_a is None else "b"))
    rng = np.random.default_rng(seed)
    comps, reps = {}, {}  # arm -> (variance of log stat, df, unit); arm -> request-level log replicates
    for name, x, lab, k in (("a", xa, la, ka), ("b", xb, lb, kb)):
        if k is not None and k >= 2:
            v = log_var(boot_instances(x, lab, stat, n_boot, rng)) * k / (k - 1)
            comps[name] = (v, k - 1.0, f"{k} instances")
        else:  # the same draws as ratio_batch, so its simulations speak for this path
            reps[name] = _request_log_reps(np.sort(x)[None, :], stat, n_boot, rng)
            comps[name] = (*_request_component(reps[name], stat, x.size), "requests")
    parts, forced = instance_parts(comps, ka, kb, ua, ub, warnings)
    if len(reps) == 2:  # both arms at request level: ratio_batch's rule
        lo, hi, df, verdict = _request_interval(np.array([est]), (reps["a"], xa.size), (reps["b"], xb.size),
                                                stat, level, higher_is_better, forced)
    else:
        lo, hi, df, verdict = combine(np.array([est]), parts, level, higher_is_better, forced)
    if verdict[0] is None:
        warnings.append(f"a bootstrap {stat} was 0: no interval")
        return result(est, verdict=no_interval(f"a bootstrap {stat} was 0"))
    if len(reps) == 2 and stat == "median":
        method = "log-median smoothed bootstrap over requests in both arms; percentile interval at a calibrated tail"
    else:
        smoothed = " (smoothed)" if stat == "median" else ""
        units = {name: comps[name][2] + (smoothed if name in reps else "") for name in comps}
        method = (f"log-{stat} bootstrap SE over a: {units['a']}, b: {units['b']}; "
                  + ("normal quantile" if math.isinf(df[0]) else f"t quantile, df={df[0]:.1f}"))
    return result(est, float(lo[0]), float(hi[0]), str(verdict[0]), method)
