"""The negative control: one arm against itself, split into random halves.

Why: every interval is calibrated for independent turns (docs/statistics.md); a control on real data
says whether that holds there (drift in an instance, sessions, a machine that got quieter). It must
itself be calibrated, or its verdict is noise: an arm in several server instances is split by
instance, and with few instances the split is lopsided. With 3 instances the only split is 1 against
2, and the lone instance borrows the other half's instance-to-instance variance from 2 instances (one
degree of freedom): in seeded A/A simulations (tests/unit/test_control_calibration.py, table in
docs/statistics.md) that control called a difference in 10-13% of arms with lognormal restart effects
and 25% when one instance of three ran 2.3x faster; with 2 instances (1 against 1) it can never give a
verdict. From 4 instances per arm it keeps to the promise (at most 7%) on every shape simulated. So an
arm in 2 or 3 instances gets "no interval (a negative control over instances needs at least 4 per
arm ...)" instead of a verdict.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from specproxy.analyze.arrays import clean_labelled
from specproxy.analyze.stats import Ratio, bootstrap_ratio, no_interval

__all__ = ["MIN_CONTROL_INSTANCES", "negative_control", "too_few_instances"]

# the fewest server instances per arm a negative control over instances is calibrated at (module docstring)
MIN_CONTROL_INSTANCES = 4


def too_few_instances(k: int, least: int = MIN_CONTROL_INSTANCES) -> str:
    """Why a control over ``k`` instances (2 <= k < least) gives no verdict."""
    return f"{k} instances: a negative control over instances needs at least {least} per arm"


def negative_control(values, clusters: Sequence[Any] | None = None, *, seed: int = 0,
                     stat: str = "median", n_boot: int = 2000, level: float = 0.95,
                     higher_is_better: bool = True, min_instances: int = MIN_CONTROL_INSTANCES) -> Ratio:
    """A against A: split one arm into random halves and compare them with ``bootstrap_ratio``.

    With several instances the split is by instance (whole instances to each half), else by
    request. Should be "not distinguishable" about ``level`` of the time; when it is not, the
    instrument or the assumption of independent requests is broken. ``higher_is_better`` as in
    ``bootstrap_ratio``: False for times (TTFT, whole turn), so that a verdict names the right
    direction. An arm in 2 to ``min_instances - 1`` instances cannot be split into a calibrated
    control: "no interval" and why (the halves' sizes and the estimate are still given).
    """
    x, lab, uniq = clean_labelled(values, clusters)
    rng = np.random.default_rng(seed)
    k = len(uniq)
    if k >= 2:
        perm = rng.permutation(k)
        in_a = np.isin(lab, perm[: k // 2])
    else:
        in_a = np.zeros(x.size, dtype=bool)
        in_a[rng.permutation(x.size)[: x.size // 2]] = True
    ca, cb = (None, None) if lab is None else (lab[in_a], lab[~in_a])
    r = bootstrap_ratio(x[in_a], x[~in_a], higher_is_better=higher_is_better, stat=stat, clusters_a=ca,
                        clusters_b=cb, n_boot=n_boot, seed=int(rng.integers(2**32)), level=level)
    if 2 <= k < min_instances:
        why = too_few_instances(k, min_instances)
        warning = (f"this arm ran in {k} server instances, so a split by instance is {k // 2} against "
                   f"{k - k // 2}: a negative control over instances needs at least {min_instances} per arm to be "
                   "calibrated (docs/statistics.md): run the arm in more server instances (restarts)")
        return Ratio(r.estimate, None, None, no_interval(why), r.n_a, r.n_b, r.instances_a, r.instances_b,
                     [warning], stat, level, "")
    return r
