"""``specproxy compare A B``: an A/B verdict that survives noise and restarts.

Why: the same config varies a lot from run to run (docs/statistics.md), and two restarts of one config can give
non-overlapping intervals. So every ratio B/A comes with an interval (95% unless ``level`` says
otherwise: every row, and every rule under it, takes the same level) and a verdict (faster,
slower, or not distinguishable when the interval contains 1); requests are grouped by server
instance, and when an arm spans several instances the interval is computed over instances. An arm
that ran in one instance only is flagged: an A/B inside one server instance is confounded with it.

Streamed and non-streamed turns are never compared with each other: TTFT, decode speed and whole
turn are over streamed turns in both arms (a non-streamed "TTFT" is its whole response time), and
non-streamed turns get their own whole-response row when both arms have some. Aggregate throughput
(delivered tokens over busy time) means the same for both kinds and is over all turns.

An arm is a label (``X-Specproxy-Label`` or ``--label`` at serve time) or a time window written
``@START..END`` (ISO 8601, UTC unless a zone is given; either end may be empty).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from specproxy.analyze import arrays
from specproxy.analyze.arrays import Coded
from specproxy.analyze.aggregate import aggregate_arms
from specproxy.store.dataset import Turns, parse_time
from specproxy.store.turns import NULL
from specproxy.store.source import Window, WindowData
from specproxy.errors import ConfigError
from specproxy.analyze.control import negative_control
from specproxy.analyze.deferred import figures_in_parallel, later, resolved
from specproxy.analyze.slo import met_of_turns
from specproxy.config import Slo
from specproxy.analyze.workload import ROW_NEEDS, Workload, describe, differences, notes
from specproxy.analyze.instances import CONFOUNDED_WARNING, instance_warning
from specproxy.analyze.stats import bootstrap_ratio
from specproxy.analyze.summary import median_p95_max
from specproxy.analyze.wording import plural

__all__ = ["Arm", "check_level", "compare", "negative_control_report", "parse_arm", "render_compare"]

# (key, column, label, higher is better): over streamed turns in both arms
METRICS = (
    ("decode_tps", "decode_tps", "per-stream decode speed (tok/s)", True),
    ("ttft_s", "ttft_s", "TTFT, streamed (s)", False),
    ("total_s", "total_s", "whole turn, streamed (s)", False),
)
# over non-streamed turns in both arms, when both have some
NON_STREAMED_METRIC = ("total_s_non_streamed", "total_s", "whole response, non-streamed (s)", False)


@dataclass(frozen=True)
class Arm:
    name: str
    label: str | None = None
    since: float | None = None
    until: float | None = None

    @property
    def window(self) -> Window:
        """The turns this arm names, as the store loads them (``Source.load(arm.window, COMPARE_COLUMNS)``)."""
        return Window(self.label, self.since, self.until)


def parse_arm(spec: str) -> Arm:
    """``NAME`` is a label; ``@START..END`` is a time window."""
    if not spec.startswith("@"):
        return Arm(name=spec, label=spec)
    start, sep, end = spec[1:].partition("..")
    if not sep:
        raise ConfigError(f"arm {spec!r}: a time window is written @START..END (either end may be empty)")
    return Arm(name=spec, since=parse_time(start) if start else None, until=parse_time(end) if end else None)


# the columns a comparison reads
COMPARE_COLUMNS = ("t_wall", "total_s", "ttft_s", "decode_tps", "completion_tokens", "outcome", "instance_id",
                   "streamed", "conn_id", "prompt_tokens", "api", "label")


def _ok(data: WindowData) -> Turns:
    turns = data.turns
    return turns.select(turns.ok) if len(turns) else turns


def _no_turns(data: WindowData, arm: Arm) -> str:
    """Why an arm is empty, in one line: a label that no turn carries lists the labels that exist (an
    arm with turns, none completed, has its label)."""
    why = f"arm {arm.name!r} has no completed turns in this database"
    if arm.label is None or data.database is None:
        return why
    labels = data.database["labels"]
    if arm.label in labels:
        return why
    shown = ", ".join(labels[:20]) + (f" and {len(labels) - 20} more" if len(labels) > 20 else "")
    known = f"its labels are {shown}" if labels else "no turn in it has a label"
    return f"arm {arm.name!r}: no turn has this label ({known}; a time window is written @START..END)"


def _kinds(turns: Turns) -> tuple[Turns, Turns]:
    """The streamed turns and the non-streamed ones: two populations, never mixed in a row."""
    streamed = turns.num["streamed"] == 1
    return turns.select(streamed), turns.select(~streamed)


def _instances(clusters: Coded | None) -> set | None:
    return None if clusters is None else clusters.distinct()


def _clusters(turns: Turns) -> Coded | None:
    """Each turn's server instance as a label (its ``instance_id`` as text, "unknown" where NULL), from the
    column's codes: None when no turn's is known."""
    codes, values = turns.codes("instance_id")
    if not len(codes) or not (codes != NULL).any():
        return None
    table: dict[str, int] = {}
    per_code = np.array([table.setdefault(str(v), len(table)) for v in values]
                        + [table.setdefault("unknown", len(table))], dtype=np.int64)
    return Coded(per_code[codes], tuple(table))  # NULL (-1) reads the last entry: "unknown"


def _lanes(turns: Turns) -> Coded | None:
    """Each turn's lane: the client connection it came on (``conn_id``), or None for the arm when a
    turn's is unknown (recorded before conn_id): the aggregate's interval then uses the jackknife."""
    ids = turns.num["conn_id"]
    if not len(ids) or np.isnan(ids).all():
        return None
    distinct, codes = np.unique(ids, return_inverse=True)  # NaN (unknown) last, once
    table: dict[Any, int] = {}
    per_code = np.array([table.setdefault(None if math.isnan(i) else int(i), len(table)) for i in distinct.tolist()],
                        dtype=np.int64)
    return Coded(per_code[codes.reshape(-1)], tuple(table))


def _aggregate_ratio(a: Turns, b: Turns, ca: Coded | None, cb: Coded | None, seed: int, level: float) -> dict[str, Any]:
    """B/A of aggregate throughput (delivered tokens / busy time) over whole turns, tokens with
    their start and end (aggregate.py says why and how); instances as in every other row."""
    def arm(t: Turns):
        start = t.num["t_wall"]
        return t.num["completion_tokens"], start, start + t.num["total_s"]

    r, value_a, value_b = aggregate_arms(arm(a), arm(b), clusters_a=ca, clusters_b=cb,
                                         lanes_a=_lanes(a), lanes_b=_lanes(b), seed=seed, level=level)
    return {"a": value_a, "b": value_b, "estimate": r.estimate, "ci_low": r.ci_low, "ci_high": r.ci_high,
            "verdict": r.verdict, "warnings": r.warnings, "method": r.method}


def _ratio_row(metric: tuple, a: Turns, b: Turns, ca: Coded | None, cb: Coded | None, population: str, seed: int,
               level: float) -> dict[str, Any]:
    """B/A of one figure over two populations of turns (``ca``, ``cb``: their instances, ``_clusters``)."""
    key, col, label, higher = metric
    xa, xb = a.num[col], b.num[col]  # read once: a selection's column is copied on each read no one holds
    r = bootstrap_ratio(xa, xb, higher_is_better=higher, clusters_a=ca, clusters_b=cb, seed=seed, level=level)
    return {"metric": key, "label": label, "population": population, "higher_is_better": higher,
            "a_median": _median(xa), "b_median": _median(xb), **r.to_dict()}


def _count(clusters: Coded | None) -> int | None:
    """How many server instances an arm ran in (None: unknown)."""
    return None if clusters is None else len(clusters.distinct())


def _fit_instance_warning(warnings: list[str], ca: Coded | None, cb: Coded | None) -> list[str]:
    """A row's warnings with the confounding one that fits the arms' instances (the aggregate row
    says "inside one instance" whenever an arm ran in one), each once."""
    fitting = instance_warning(_instances(ca), _instances(cb))
    fitted = (fitting if w == CONFOUNDED_WARNING else w for w in warnings)
    return list(dict.fromkeys(w for w in fitted if w))


def _kind_counts(streamed: Turns, whole: Turns, arm: str) -> dict[str, int]:
    return {f"streamed_{arm}": len(streamed), f"non_streamed_{arm}": len(whole)}


def check_level(level: float) -> None:
    """A confidence level the intervals can be computed at (``arrays.check_level``'s rule): ConfigError,
    one line, otherwise."""
    try:
        arrays.check_level(level)
    except ValueError:
        raise ConfigError(f"--level must be between 0.5 and 1 (e.g. 0.95 or 0.99), got {level:g}") from None


def _slo_row(slo: Slo, data_a: WindowData, data_b: WindowData, seed: int, level: float) -> dict[str, Any]:
    """B/A of the share of judged turns that met ``slo`` (analyze/slo.py), failed turns included (they did
    not): the mean of each arm's met (1) / not met (0) values, by the rule every other row has
    (``bootstrap_ratio``: over instances when an arm ran in several, the lone-instance and confounding
    rules alike), higher is better. Its verdict reads "better" or "worse", not faster or slower."""
    (ma, ta), (mb, tb) = _judged(slo, data_a), _judged(slo, data_b)
    r = bootstrap_ratio(ma, mb, higher_is_better=True, stat="mean", clusters_a=_clusters(ta),
                        clusters_b=_clusters(tb), seed=seed, level=level).to_dict()
    return _slo_share_row(slo, r, float(ma.mean()) if ma.size else None, float(mb.mean()) if mb.size else None)


def _judged(slo: Slo, data: WindowData) -> tuple[np.ndarray, Turns]:
    """An arm's judged turns: their met (1) / not met (0) values, and their instances."""
    m = met_of_turns(slo, data.turns) if len(data.turns) else np.zeros(0)
    judged = np.isfinite(m)
    return m[judged], data.turns.select(judged, columns=("instance_id",)) if len(data.turns) else data.turns


def _slo_share_row(slo: Slo, r: dict[str, Any], a: float | None, b: float | None) -> dict[str, Any]:
    r["verdict"] = {"faster": "better", "slower": "worse"}.get(r["verdict"], r["verdict"])
    return {"metric": "slo_share", "label": "share that met the SLO", "population": "judged",
            "higher_is_better": True, "objective": slo.as_dict(), "a_median": a, "b_median": b, **r}


def compare(a: Arm, b: Arm, data_a: WindowData, data_b: WindowData, *, seed: int = 0,
            level: float = 0.95, slo: Slo | None = None) -> dict[str, Any]:
    """B/A for each figure, from each arm's turns as the store loaded them (``COMPARE_COLUMNS``); with
    ``slo``, a row for the share of turns that met it (``a_median``/``b_median`` hold the shares)."""
    check_level(level)
    if (a.label, a.since, a.until) == (b.label, b.since, b.until):
        raise ConfigError(f"compare {a.name} {b.name}: an arm against itself says nothing; to check the instrument "
                          f"on one arm, run `compare {a.name} --negative-control`")
    ta, tb = _ok(data_a), _ok(data_b)
    for arm, turns, data in ((a, ta, data_a), (b, tb, data_b)):
        if not len(turns):
            raise ConfigError(_no_turns(data, arm))
    ca, cb = _clusters(ta), _clusters(tb)
    (sa, na), (sb, nb) = _kinds(ta), _kinds(tb)
    streamed = (sa, sb, _clusters(sa), _clusters(sb))  # each arm's instances made once for its rows
    # the aggregate ratio (the arms' busy shares: a sort of every start and end, then its bootstrap) depends
    # on nothing the rows do and each draws from its own seeded generator: on a second core meanwhile
    # (``deferred``; on one core, here and now), the same figures in the same places
    with figures_in_parallel():
        agg = later(_aggregate_ratio, ta, tb, ca, cb, seed, level)
        rows = [_ratio_row(metric, *streamed, "streamed", seed, level) for metric in METRICS]
        if len(na) and len(nb):
            rows.append(_ratio_row(NON_STREAMED_METRIC, na, nb, _clusters(na), _clusters(nb), "non_streamed", seed,
                                   level))
        agg = resolved(agg)
    rows.append({"metric": "aggregate_tps", "label": "aggregate throughput (tok/s)", "population": "all",
                 "higher_is_better": True,
                 "a_median": agg["a"], "b_median": agg["b"], "estimate": agg["estimate"], "ci_low": agg["ci_low"],
                 "ci_high": agg["ci_high"], "verdict": agg["verdict"], "method": agg["method"],
                 "warnings": _fit_instance_warning(agg["warnings"], ca, cb), "level": level,
                 "n_a": len(ta), "n_b": len(tb), "instances_a": _count(ca), "instances_b": _count(cb)})
    if slo is not None:
        rows.append(_slo_row(slo, data_a, data_b, seed, level))
    arms = {"streamed": (sa, sb), "non_streamed": (na, nb), "all": (ta, tb)}
    arms = {k: (Workload(x), Workload(y)) for k, (x, y) in arms.items()}  # each feature computed once per arm
    arms["judged"] = arms["all"]
    for row in rows:
        _workload_guard(row, *arms[row["population"]])
    return {"a": a.name, "b": b.name, "level": level, "n_a": len(ta), "n_b": len(tb),
            **_kind_counts(sa, na, "a"), **_kind_counts(sb, nb, "b"),
            "instances_a": _count(ca), "instances_b": _count(cb),
            "rows": rows}


def _workload_guard(row: dict[str, Any], a: Workload, b: Workload) -> None:
    """A row whose figure depends on the workload (workload.py) gives no verdict where the arms'
    workloads differ materially: it says how (``workload_differs`` in JSON, a warning in the text)."""
    needs = ROW_NEEDS.get(row["metric"], ())
    diffs = differences(a, b, needs)
    row["workload_differs"] = diffs
    said = notes(a, b, needs)
    if said:
        row["warnings"] = [*row.get("warnings", []), *(f"{row['label']} depends on the workload: {n}" for n in said)]
    if not diffs:
        return
    said = "; ".join(describe(d) for d in diffs)
    if not row["verdict"].startswith("no interval"):
        row["verdict"] = f"no verdict (workloads differ: {', '.join(_short(d) for d in diffs)})"
    row["warnings"] = [*row.get("warnings", []), f"{row['label']} depends on the workload, and the arms' differ: "
                       f"{said} (docs/report.md)"]


def _short(diff: dict[str, Any]) -> str:
    if "ratio" in diff:
        return f"{diff['feature'].split('_')[0]} tokens {diff['ratio']:.2f}x"
    return "API mix" if diff["feature"] == "api" else "streamed share"


def _control_row(metric: tuple, turns: Turns, population: str, seed: int, level: float) -> dict[str, Any]:
    key, col, label, higher = metric
    r = negative_control(turns.num[col], _clusters(turns), seed=seed, level=level, higher_is_better=higher)
    return {"metric": key, "label": label, "population": population, "higher_is_better": higher,
            "a_median": None, "b_median": None, **r.to_dict()}


def negative_control_report(a: Arm, data: WindowData, *, seed: int = 0, level: float = 0.95,
                            slo: Slo | None = None) -> dict[str, Any]:
    """A against A: the arm split into random halves (by instance when it has several), within each
    kind: the stream rows split the streamed turns, the non-streamed row the non-streamed ones, so a
    half is never streamed turns against non-streamed ones. With ``slo``, the share row's halves split
    the judged turns."""
    check_level(level)
    ta = _ok(data)
    if not len(ta):
        raise ConfigError(_no_turns(data, a))
    ca = _clusters(ta)
    streamed, whole = _kinds(ta)
    rows = [_control_row(metric, streamed, "streamed", seed, level) for metric in METRICS]
    if len(whole) >= 2:  # a half each
        rows.append(_control_row(NON_STREAMED_METRIC, whole, "non_streamed", seed, level))
    if slo is not None:
        m, judged = _judged(slo, data)
        r = negative_control(m, _clusters(judged), seed=seed, level=level, stat="mean", higher_is_better=True)
        rows.append(_slo_share_row(slo, r.to_dict(), None, None))
    return {"a": a.name, "b": f"{a.name} (other half)", "level": level, "n_a": len(ta), "n_b": len(ta),
            "negative_control": True,
            **_kind_counts(streamed, whole, "a"),
            "instances_a": _count(ca), "instances_b": None, "rows": rows}


def _median(x: np.ndarray) -> float | None:
    """``numpy.median`` of the finite values, from order statistics (``median_p95_max``: the same bits)."""
    x = x[np.isfinite(x)]
    return median_p95_max(x)[0] if x.size else None


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _arm_text(r: dict[str, Any], arm: str, instance: str = "instance") -> str:
    """"16 turns: 8 streamed, 8 non-streamed; 2 instances" (the kinds only when there is a non-streamed one)."""
    n, whole = r[f"n_{arm}"], r.get(f"non_streamed_{arm}") or 0
    kinds = f": {r[f'streamed_{arm}']} streamed, {whole} non-streamed;" if whole else ","
    return f"{plural(n, 'turn')}{kinds} {plural(r[f'instances_{arm}'], instance)}"


def render_compare(r: dict[str, Any]) -> str:
    lines = []
    if r.get("negative_control"):
        within = " within each kind" if r.get("non_streamed_a") else ""
        lines.append(f"negative control: {r['a']} split into two random halves{within} "
                     f"({_arm_text(r, 'a', 'server instance')}). Every row should be 'not distinguishable'.")
    else:
        lines.append(f"compare B={r['b']} ({_arm_text(r, 'b')}) against A={r['a']} ({_arm_text(r, 'a')})")
    ci_head = f"{r.get('level', 0.95) * 100:g}% CI"
    lines.append(f"  {'figure':34} {'A':>10} {'B':>10} {'B/A':>7}  {ci_head:>16}  verdict")
    warnings: list[str] = []
    for row in r["rows"]:
        ci = f"[{_f(row['ci_low'])}, {_f(row['ci_high'])}]" if row.get("ci_low") is not None else "-"
        verdict = row["verdict"]
        if row["metric"] == "slo_share":
            warnings.append(f"SLO {row['objective']['text']}: the share of turns that met it, failed turns included "
                            "(as not met); A and B are the shares")
        if verdict in ("faster", "slower") and not row["higher_is_better"]:
            verdict += f" (B's {row['metric']} is {'lower' if verdict == 'faster' else 'higher'})"
        lines.append(f"  {row['label']:34} {_f(row['a_median'], '{:.3f}'):>10} {_f(row['b_median'], '{:.3f}'):>10} "
                     f"{_f(row['estimate'], '{:.3f}'):>7}  {ci:>16}  {verdict}")
        warnings.extend(row.get("warnings") or [])
    for w in dict.fromkeys(warnings):  # once each, whichever rows gave it
        lines.append(f"  warning: {w}")
    return "\n".join(lines) + "\n"
