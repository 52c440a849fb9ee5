"""Goodput under a service-level objective: whether each turn met it, the share that did, and their tokens.

Why decided here, at analysis time, from the stored fields (``outcome``, ``ttft_s``, ``decode_tps``,
``total_s``) and not stored per turn: an objective is a question asked of the data, and users change it.
Judged when read, ``report --slo`` answers it for turns recorded before it was set, or under another, and
``compare`` can ask both arms the same one. The live page asks the same function (``met``) of the same
rows. docs/metrics.md ("Goodput under an SLO") is the contract. The rule itself (``met``, which turn
met it) is written once, in ``measure/slo_rule.py``, shared with the proxy's own ``/metrics``
(``specproxy_slo_turns``); this module reads it over stored turns and adds what a set of them says.

The share (``attainment``) is over judged turns, with the Wilson score interval for a proportion (exact
coverage in docs/statistics.md, "The share of turns that met an SLO"; the bootstrap intervals of the
other figures have no width when every turn met it, Wilson's does). Goodput is the delivered tokens of
the turns that met it over the same busy time as the cell's aggregate throughput (the time at least one
of its completed turns was in flight), so goodput <= aggregate, equal when every completed turn met it.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np

from specproxy.config import Slo
from specproxy.measure.slo_rule import NOT_JUDGED_OUTCOMES, met, tpot_s
from specproxy.store.dataset import Turns

__all__ = ["NOT_JUDGED_OUTCOMES", "SLO_COLUMNS", "attainment", "capacity", "met", "met_of_turns", "tpot_s", "wilson"]

# the columns the rule reads
SLO_COLUMNS = ("outcome", "ttft_s", "decode_tps", "total_s", "label")


def met_of_turns(slo: Slo, turns: Turns) -> np.ndarray:
    """``met`` over loaded turns (``SLO_COLUMNS`` among their columns; ``label`` too, for per-label objectives)."""
    return met(slo, turns.txt["outcome"], turns.num["ttft_s"], turns.num["decode_tps"], turns.num["total_s"],
               turns.txt.get("label"))


_NORMAL = NormalDist()


def wilson(k: int, n: int, level: float = 0.95) -> tuple[float | None, float | None]:
    """The Wilson score interval of a proportion k/n at ``level``; (None, None) when n = 0.

    Why Wilson and not the share +- z·SE (Wald): Wald has no width at 0 or n successes (an SLO every
    turn met reads [1, 1]) and covers far below the level near them, where SLO shares live; Wilson stays
    inside [0, 1] and near the level (exact coverage: docs/statistics.md)."""
    if n <= 0:
        return None, None
    z = _NORMAL.inv_cdf(0.5 + level / 2.0)
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # k = n (or 0) gives the bound exactly 1 (0) in exact arithmetic: say so, not 0.9999999999999999
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


def attainment(judged_met: np.ndarray, tokens: np.ndarray | None = None, busy_s: float | None = None,
               level: float = 0.95) -> dict[str, Any]:
    """The share of judged turns that met the SLO, its Wilson interval, and goodput.

    ``judged_met``: ``met``'s values for a set of turns; ``tokens``: their delivered tokens; ``busy_s``: the
    busy time the plain aggregate throughput of the same turns is over (None: no goodput)."""
    m = np.asarray(judged_met, dtype=float)
    judged = np.isfinite(m)
    n, k = int(judged.sum()), int((m == 1.0).sum())
    lo, hi = wilson(k, n, level)
    out: dict[str, Any] = {"n": n, "met": k, "not_met": n - k, "not_judged": int((~judged).sum()),
                           "share": k / n if n else None, "ci_low": lo, "ci_high": hi, "level": level,
                           "met_tokens": None, "goodput_tps": None}
    if tokens is not None and n:
        t = np.asarray(tokens, dtype=float)
        # null without token counts (no tokenizer) or with nothing judged; 0 when turns were and none met it
        if np.isfinite(t[judged]).any():
            out["met_tokens"] = float(t[(m == 1.0) & np.isfinite(t)].sum())
        if busy_s and out["met_tokens"] is not None:
            out["goodput_tps"] = out["met_tokens"] / busy_s
    return out


def capacity(levels: list[tuple[int, dict[str, Any]]], target: float) -> dict[str, Any]:
    """The highest concurrency whose SLO attainment stays at or above ``target``, from a sweep's levels
    (concurrency, ``attainment``) in ascending order, read two ways:

    * ``point``: the highest level such that at it and at every lower level the share is >= target;
    * ``confident``: the same with the interval's lower bound >= target (at the interval's level, the
      share there is at least the target: what a capacity plan can promise).

    "Stays": the first level below the target ends the scan, so a noisy pass at a higher level does not
    count. None where even the lowest level falls short (or has no judged turn)."""
    def highest(value) -> int | None:
        best = None
        for level, a in levels:
            v = value(a)
            if v is None or v < target:
                break
            best = level
        return best

    return {"target": target, "point": highest(lambda a: a["share"]),
            "confident": highest(lambda a: a["ci_low"])}
