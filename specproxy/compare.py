"""``specproxy compare A B``: an A/B verdict that survives noise and restarts.

Why: the same config varies 15-19% run to run, and two restarts of one config can give
non-overlapping intervals. So every ratio B/A comes with a 95% interval and a verdict (faster,
slower, or not distinguishable when the interval contains 1); requests are grouped by server
instance, and when an arm spans several instances the interval is computed over instances. An arm
that ran in one instance only is flagged: an A/B inside one server instance is confounded with it.

An arm is a label (``X-Specproxy-Label`` or ``--label`` at serve time) or a time window written
``@START..END`` (ISO 8601, UTC unless a zone is given; either end may be empty).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

import numpy as np

from .aggregate import aggregate_ratio, busy_throughput
from .dataset import Turns, load_turns, parse_time
from .errors import ConfigError
from .stats import bootstrap_ratio, negative_control

__all__ = ["Arm", "compare", "negative_control_report", "parse_arm", "render_compare"]

# (key, column, label, higher is better)
METRICS = (
    ("decode_tps", "decode_tps", "per-stream decode speed (tok/s)", True),
    ("ttft_s", "ttft_s", "TTFT (s)", False),
    ("total_s", "total_s", "whole turn (s)", False),
)


@dataclass(frozen=True)
class Arm:
    name: str
    label: str | None = None
    since: float | None = None
    until: float | None = None


def parse_arm(spec: str) -> Arm:
    """``NAME`` is a label; ``@START..END`` is a time window."""
    if not spec.startswith("@"):
        return Arm(name=spec, label=spec)
    start, sep, end = spec[1:].partition("..")
    if not sep:
        raise ConfigError(f"arm {spec!r}: a time window is written @START..END (either end may be empty)")
    return Arm(name=spec, since=parse_time(start) if start else None, until=parse_time(end) if end else None)


# the columns a comparison reads
COMPARE_COLUMNS = ("t_wall", "total_s", "ttft_s", "decode_tps", "completion_tokens", "outcome", "instance_id")


def _load(conn: sqlite3.Connection, arm: Arm, cache: bool = False) -> Turns:
    turns = load_turns(conn, label=arm.label, since=arm.since, until=arm.until, columns=COMPARE_COLUMNS, cache=cache)
    return turns.select(turns.ok) if len(turns) else turns


def _clusters(turns: Turns) -> np.ndarray | None:
    ids = turns.txt["instance_id"]
    if not len(ids) or all(i is None for i in ids):
        return None
    return np.array([str(i) if i is not None else "unknown" for i in ids], dtype=object)


def _aggregate_ratio(a: Turns, b: Turns, seed: int) -> dict[str, Any]:
    """B/A of aggregate throughput (delivered tokens / busy time) over whole turns, tokens with
    their start and end (aggregate.py says why and how); instances as in every other row."""
    def arm(t: Turns):
        start = t.num["t_wall"]
        return t.num["completion_tokens"], start, start + t.num["total_s"]

    def value(t: Turns) -> float | None:
        tokens, start, end = arm(t)
        known = np.isfinite(tokens) & np.isfinite(start) & np.isfinite(end)
        return busy_throughput(tokens[known], start[known], end[known])

    r = aggregate_ratio(arm(a), arm(b), clusters_a=_clusters(a), clusters_b=_clusters(b), seed=seed)
    return {"a": value(a), "b": value(b), "estimate": r.estimate, "ci_low": r.ci_low, "ci_high": r.ci_high,
            "verdict": r.verdict, "warnings": r.warnings}


def compare(conn: sqlite3.Connection, a: Arm, b: Arm, *, seed: int = 0, cache: bool = False) -> dict[str, Any]:
    ta, tb = _load(conn, a, cache), _load(conn, b, cache)
    if not len(ta) or not len(tb):
        empty = a.name if not len(ta) else b.name
        raise ConfigError(f"arm {empty!r} has no completed turns in this database")
    ca, cb = _clusters(ta), _clusters(tb)
    rows = []
    for key, col, label, higher in METRICS:
        r = bootstrap_ratio(ta.num[col], tb.num[col], higher_is_better=higher, clusters_a=ca, clusters_b=cb, seed=seed)
        rows.append({"metric": key, "label": label, "higher_is_better": higher,
                     "a_median": _median(ta.num[col]), "b_median": _median(tb.num[col]), **r.to_dict()})
    agg = _aggregate_ratio(ta, tb, seed)
    rows.append({"metric": "aggregate_tps", "label": "aggregate throughput (tok/s)", "higher_is_better": True,
                 "a_median": agg["a"], "b_median": agg["b"], "estimate": agg["estimate"], "ci_low": agg["ci_low"],
                 "ci_high": agg["ci_high"], "verdict": agg["verdict"], "warnings": agg["warnings"],
                 "n_a": len(ta), "n_b": len(tb), "instances_a": None if ca is None else len(set(ca)),
                 "instances_b": None if cb is None else len(set(cb))})
    return {"a": a.name, "b": b.name, "n_a": len(ta), "n_b": len(tb),
            "instances_a": None if ca is None else len(set(ca)), "instances_b": None if cb is None else len(set(cb)),
            "rows": rows}


def negative_control_report(conn: sqlite3.Connection, a: Arm, *, seed: int = 0, cache: bool = False) -> dict[str, Any]:
    """A against A: the arm split into random halves (by instance when it has several)."""
    ta = _load(conn, a, cache)
    if not len(ta):
        raise ConfigError(f"arm {a.name!r} has no completed turns in this database")
    ca = _clusters(ta)
    rows = []
    for key, col, label, higher in METRICS:
        r = negative_control(ta.num[col], ca, seed=seed)
        rows.append({"metric": key, "label": label, "higher_is_better": higher,
                     "a_median": None, "b_median": None, **r.to_dict()})
    return {"a": a.name, "b": f"{a.name} (other half)", "n_a": len(ta), "n_b": len(ta), "negative_control": True,
            "instances_a": None if ca is None else len(set(ca)), "instances_b": None, "rows": rows}


def _median(x: np.ndarray) -> float | None:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else None


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def render_compare(r: dict[str, Any]) -> str:
    def inst(n):
        return "?" if n is None else str(n)

    lines = []
    if r.get("negative_control"):
        lines.append(f"negative control: {r['a']} split into two random halves ({r['n_a']} turns, "
                     f"{inst(r['instances_a'])} server instances). Every row should be 'not distinguishable'.")
    else:
        lines.append(f"compare B={r['b']} ({r['n_b']} turns, {inst(r['instances_b'])} instances) against "
                     f"A={r['a']} ({r['n_a']} turns, {inst(r['instances_a'])} instances)")
    lines.append(f"  {'figure':34} {'A':>10} {'B':>10} {'B/A':>7}  {'95% CI':>16}  verdict")
    warnings: list[str] = []
    for row in r["rows"]:
        ci = f"[{_f(row['ci_low'])}, {_f(row['ci_high'])}]" if row.get("ci_low") is not None else "-"
        verdict = row["verdict"]
        if verdict in ("faster", "slower") and not row["higher_is_better"]:
            verdict += f" (B's {row['metric']} is {'lower' if verdict == 'faster' else 'higher'})"
        lines.append(f"  {row['label']:34} {_f(row['a_median'], '{:.3f}'):>10} {_f(row['b_median'], '{:.3f}'):>10} "
                     f"{_f(row['estimate'], '{:.3f}'):>7}  {ci:>16}  {verdict}")
        for w in row.get("warnings") or []:
            if w not in warnings:
                warnings.append(w)
    for w in warnings:
        lines.append(f"  warning: {w}")
    return "\n".join(lines) + "\n"
