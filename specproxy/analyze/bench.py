"""A benchmark's figures: per-stream and aggregate throughput at each concurrency, with intervals.

Why apart from the report: ``specproxy report`` reads the operating point a turn happened to see;
a benchmark set it, and ran each operating point in rounds (repeats, on one or several server
instances). So here the unit of the aggregate is the round: delivered tokens over the round's span
(first request to last byte, on the proxy's clock), one value per round, and its interval is over
rounds, or over server instances (each instance's mean) when the arm ran in several. The two units
catch different variance: instances catch restart-to-restart variation (what a second start of the
same server would show); rounds of one instance catch only run-to-run drift within that instance, so
with one instance the output says restart variance is not in its intervals. Per-stream figures are
medians over every completed streamed turn of the level; their interval is over the same unit
(instances, else rounds: compare's clustered rule, since turns of one instance or round share its
offset and pooling them would leave that variance out), and over turns (the median's order-statistic
interval) for a level that ran in fewer than ``MIN_ROUNDS`` rounds of one instance: a t interval on
one degree of freedom is too wide to read.
Turns are the proxy's own Records: every figure was decided where it is for proxied traffic.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specproxy.analyze.slo import attainment, capacity, met
from specproxy.analyze.summary import mean_ci, summarize, summarize_clustered
from specproxy.analyze.wording import plural
from specproxy.config import Slo
from specproxy.record import Record

__all__ = ["MIN_ROUNDS", "ONE_INSTANCE_NOTE", "Round", "geometric_mean_ci", "render_bench", "summarize_bench"]

# Fewer rounds of one instance than this: per-stream intervals over turns. Over 2 rounds the t quantile
# (1 df) is 12.7, so the interval spans a factor of several even when the rounds agree closely.
MIN_ROUNDS = 3
ONE_INSTANCE_NOTE = ("one server instance: restart-to-restart variance is not in these intervals; use --restart-cmd "
                     "with --instances K")


@dataclass
class Round:
    """One pass of the workload at one concurrency on one server instance of one arm."""

    arm: str
    instance: int
    level: int
    repeat: int
    records: list[Record] = field(default_factory=list)
    sent: int = 0  # requests sent; each gives one Record
    prompt_len: int | None = None  # a prefill probe's prompt length (words asked for); None otherwise
    first_error: str | None = None  # what the first failed request of the round got
    gone: str | None = None  # set when the server went away mid-round (what the failures said): it stopped sending
    late_s: list[float] = field(default_factory=list)  # open loop: how long after its scheduled time each was sent


def _vals(records: Sequence[Record], name: str) -> np.ndarray:
    return np.array([getattr(r, name) if getattr(r, name) is not None else np.nan for r in records], dtype=float)


def records_met(slo: Slo, records: Sequence[Record]) -> np.ndarray:
    """``analyze/slo.py``'s ``met`` over a round's records: 1 met, 0 not, NaN not judged."""
    return met(slo, np.array([r.outcome for r in records], dtype=object), _vals(records, "ttft_s"),
               _vals(records, "decode_tps"), _vals(records, "total_s"),
               np.array([r.label for r in records], dtype=object))


def round_aggregate(rnd: Round, slo: Slo | None = None) -> float | None:
    """Delivered tokens of the round's completed turns over its span (first request to last end); with
    ``slo``, goodput: the tokens of those of them that met it over the same span (0 when none did)."""
    spans = [(r.t_request, r.t_done) for r in rnd.records if r.t_request is not None and r.t_done is not None]
    good = records_met(slo, rnd.records) == 1.0 if slo is not None else np.ones(len(rnd.records), dtype=bool)
    counted = [(r.completion_tokens, g) for r, g in zip(rnd.records, good)
               if r.outcome == "ok" and r.completion_tokens is not None]
    if not spans or not counted:
        return None
    span = max(end for _, end in spans) - min(start for start, _ in spans)
    return sum(t for t, g in counted if g) / span if span > 0 else None


def geometric_mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float | None, float | None, float | None]:
    """(geometric mean, low, high) of a few replicates of a throughput: Student's t interval of the mean of
    their logarithms, exponentiated. It cannot reach zero or below, as a t interval on the values does on
    few, spread replicates (it was clipped at 0: "112.0 [0.0, 243.8]"), and it is exact when the
    replicates are lognormal (a throughput's spread is a factor); docs/statistics.md has its calibration.
    The ends are None below 2 values, or when a value is not positive (no logarithm: no interval)."""
    x = np.asarray([v for v in values if v is not None and v == v], dtype=float)
    if x.size == 0:
        return None, None, None
    if (x <= 0).any():
        return float(x.mean()), None, None
    if x.size < 2:
        return float(x[0]), None, None
    logs = np.log(x)
    center = float(np.exp(logs.mean()))
    _, lo, hi = mean_ci(logs, level)
    return center, float(np.exp(lo)), float(np.exp(hi))


def _prefill_tps(r: Record) -> float | None:
    """Prompt tokens over TTFT: what a max_tokens=1 probe measures (prefill plus one step)."""
    prompt = r.prompt_tokens if r.prompt_tokens is not None else r.usage_prompt_tokens
    if prompt is None or not r.ttft_s:
        return None
    return prompt / r.ttft_s


def _level_summary(rounds: list[Round], phase: str | None, slo: Slo | None = None) -> dict[str, Any]:
    records = [r for rnd in rounds for r in rnd.records]
    ok = [r for r in records if r.outcome == "ok"]
    streamed = [r for r in ok if r.streamed]
    # per-stream figures: the interval over the same unit as the aggregate's, when there are several
    instances = {rnd.instance for rnd in rounds}
    per_unit = "instances" if len(instances) > 1 else "rounds" if len(rounds) >= MIN_ROUNDS else "turns"
    cluster_of = {id(r): (rnd.instance if per_unit == "instances" else i)
                  for i, rnd in enumerate(rounds) for r in rnd.records}

    def per_stream(recs: list[Record], values) -> dict[str, Any]:
        values = list(values)
        if per_unit == "turns":
            out = summarize(values).to_dict()
        else:
            out = summarize_clustered(values, [cluster_of[id(r)] for r in recs]).to_dict()
        units = len({cluster_of[id(r)] for r, v in zip(recs, values) if v is not None and v == v})
        out = {**out, "unit": per_unit, "n_units": out["n"] if per_unit == "turns" else units}
        if per_unit == "turns" and len(rounds) > 1:
            out["note"] = f"fewer than {MIN_ROUNDS} rounds"  # said in the table, beside "N turns"
        return out
    by_instance: dict[int, list[float]] = defaultdict(list)
    for rnd in rounds:
        value = round_aggregate(rnd)
        if value is not None:
            by_instance[rnd.instance].append(value)
    if len(by_instance) > 1:
        unit, values = "instances", [float(np.mean(v)) for v in by_instance.values()]
    else:
        unit, values = "rounds", [v for vs in by_instance.values() for v in vs]
    mean, lo, hi = geometric_mean_ci(values)
    errors: dict[str, int] = defaultdict(int)
    for r in records:
        if r.outcome != "ok":
            errors[r.outcome] += 1
    out: dict[str, Any] = {
        "level": rounds[0].level, "prompt_len": rounds[0].prompt_len, "rounds": len(rounds), "instances": len({rnd.instance for rnd in rounds}),
        "turns": len(records), "ok": len(ok), "streamed": len(streamed), "errors": dict(errors),
        "sent": sum(rnd.sent for rnd in rounds),
        "decode_tps": per_stream(streamed, _vals(streamed, "decode_tps")),
        "ttft_s": per_stream(streamed, _vals(streamed, "ttft_s")),
        "total_s": summarize(_vals(ok, "total_s")).to_dict(),
        "aggregate_tps": {"mean": mean, "ci_low": lo, "ci_high": hi, "n": len(values), "unit": unit},
    }
    if phase == "prefill":  # one token out: no decode speed or throughput, which must not pass for one
        del out["decode_tps"], out["aggregate_tps"]
        out["prompt_tokens"] = summarize([r.prompt_tokens if r.prompt_tokens is not None else r.usage_prompt_tokens
                                          for r in streamed]).to_dict()
        out["prefill_tps"] = per_stream(streamed, [_prefill_tps(r) for r in streamed])
        out["more_than_one_token"] = sum((_out_tokens(r) or 0) > 1 for r in ok)
    if slo is not None:
        out["slo"] = _level_slo(rounds, records, slo)
    return out


def _level_slo(rounds: list[Round], records: list[Record], slo: Slo) -> dict[str, Any]:
    """The level's share of judged turns that met ``slo`` with its Wilson interval (over the level's turns,
    every round and instance pooled), and goodput as the aggregate is taken: tokens of the turns that met
    it over each round's span, geometric mean over rounds or instances."""
    share = attainment(records_met(slo, records))
    by_instance: dict[int, list[float]] = defaultdict(list)
    for rnd in rounds:
        value = round_aggregate(rnd, slo)
        if value is not None:
            by_instance[rnd.instance].append(value)
    values = ([float(np.mean(v)) for v in by_instance.values()] if len(by_instance) > 1
              else [v for vs in by_instance.values() for v in vs])
    mean, lo, hi = geometric_mean_ci(values)
    return {**share, "goodput_tps": {"mean": mean, "ci_low": lo, "ci_high": hi, "n": len(values),
                                     "unit": "instances" if len(by_instance) > 1 else "rounds"}}


def _out_tokens(r: Record) -> int | None:
    return r.completion_tokens if r.completion_tokens is not None else r.usage_completion_tokens


def _prefill_warning(levels: list[dict[str, Any]]) -> str | None:
    """A prefill probe asks for one token; a server that sent more ignored the limit, and its turns
    were not prefill plus one step."""
    over = sum(lv["more_than_one_token"] for lv in levels)
    if not over:
        return None
    ok = sum(lv["ok"] for lv in levels)
    return (f"{over} of {ok} prefill probe turns got more than one output token: the server ignored the probe's "
            "limit of 1, so their turns are not prefill plus one step (TTFT and prefill tok/s still stand)")


def summarize_bench(rounds: Sequence[Round], *, phase: str | None = None, warmup: int = 0,
                    restarts: bool = False, slo: Slo | None = None, slo_target: float | None = None) -> dict[str, Any]:
    """Per arm, per concurrency level (and per prompt length for a prefill probe): the figures above. With
    ``slo``, each level's share of turns that met it and goodput; with ``slo_target`` too, each arm's
    highest concurrency whose share stays at or above it (``analyze/slo.py``'s ``capacity``)."""
    arms: dict[str, dict[Any, list[Round]]] = {}
    for rnd in rounds:
        arms.setdefault(rnd.arm, {}).setdefault((rnd.level, rnd.prompt_len or 0), []).append(rnd)
    out: dict[str, Any] = {"phase": phase, "warmup_per_instance": warmup, "restarts": restarts, "arms": [],
                           "slo": None if slo is None else slo.as_dict(), "slo_target": slo_target}
    warnings = []
    for arm, levels in arms.items():
        out["arms"].append({
            "arm": arm,
            "instances": len({rnd.instance for ls in levels.values() for rnd in ls}),
            "levels": [_level_summary(levels[level], phase, slo) for level in sorted(levels)],
        })
        if slo is not None and slo_target is not None and phase != "prefill":
            out["arms"][-1]["slo_capacity"] = capacity(
                [(lv["level"], lv["slo"]) for lv in out["arms"][-1]["levels"]], slo_target)
        if phase == "prefill" and (warning := _prefill_warning(out["arms"][-1]["levels"])):
            warnings.append(f"arm {arm}: {warning}" if len(arms) > 1 else warning)
    out["warnings"] = warnings
    # rounds of one instance share its start: an interval over them has no restart in it
    single = any(arm["instances"] == 1 for arm in out["arms"])
    out["restart_variance_note"] = (ONE_INSTANCE_NOTE.replace("instance:", "instance per arm:", 1)
                                    if single and len(arms) > 1 else ONE_INSTANCE_NOTE if single else None)
    return out


def _sig3(v: float) -> str:
    """Three significant digits, never fewer decimals than that needs: a TTFT bound of 0.0004 s must not
    print as 0.000, which reads as a measured zero."""
    if v == 0 or not math.isfinite(v):
        return f"{v:.3f}"
    return f"{v:.{max(0, 2 - math.floor(math.log10(abs(v))))}f}"


def _ci(s: dict[str, Any], fmt) -> str:
    """Median [low, high]; ``fmt`` a format string or a function of the value."""
    if s.get("median") is None:
        return "-"
    f = fmt.format if isinstance(fmt, str) else fmt
    ci = f" [{f(s['ci_low'])}, {f(s['ci_high'])}]" if s.get("ci_low") is not None else ""
    return f(s["median"]) + ci


def _over(lv: dict[str, Any]) -> str:
    """What the intervals are over: one unit when per-stream and aggregate agree, else each's. Only the
    figures the row has count: without token counts the per-stream unit is TTFT's, and there is no
    aggregate."""
    agg = lv.get("aggregate_tps")
    ps = lv["ttft_s" if lv.get("prefill_tps") is not None or lv["decode_tps"].get("median") is None
            else "decode_tps"]
    per_stream = plural(ps.get("n_units"), ps.get("unit", "turns")[:-1])
    if ps.get("note"):  # why over turns when there were rounds
        per_stream += f" ({ps['note']})"
    if agg is None or agg["mean"] is None:  # a prefill probe, or no token counts: no aggregate
        return per_stream
    aggregate = plural(agg["n"], agg["unit"][:-1])
    return aggregate if per_stream == aggregate else f"{per_stream} / {aggregate}"


def _agg(a: dict[str, Any]) -> str:
    if a["mean"] is None:
        return "-"
    ci = f" [{a['ci_low']:.1f}, {a['ci_high']:.1f}]" if a["ci_low"] is not None else ""
    return f"{a['mean']:.1f}{ci}"


def _slo_lines(arm: dict[str, Any], slo: dict[str, Any]) -> list[str]:
    """Per level: the share of turns that met the SLO [95% Wilson CI] and goodput beside aggregate; then the
    highest concurrency whose share stays at or above the target, by the share and by its lower bound."""
    lines = [f"  SLO {slo['text']}: {'concurrency':>11} {'judged':>6} {'share met [95% CI]':>24}  "
             f"{'goodput tok/s [95% CI]':>26}  {'aggregate tok/s':>16}"]
    pad = " " * (len(slo["text"]) + 6)
    for lv in arm["levels"]:
        a = lv["slo"]
        share = "-" if a["share"] is None else (f"{a['share'] * 100:.1f}% [{a['ci_low'] * 100:.1f}, "
                                                f"{a['ci_high'] * 100:.1f}]")
        agg = lv.get("aggregate_tps")
        lines.append(f"  {pad}{lv['level']:>11} {a['n']:>6} {share:>24}  {_agg(a['goodput_tps']):>26}  "
                     f"{'-' if agg is None or agg['mean'] is None else format(agg['mean'], '.1f'):>16}")
    cap = arm.get("slo_capacity")
    if cap is not None:
        def said(level: int | None) -> str:
            return "none of the levels swept" if level is None else f"concurrency {level}"
        lines.append(f"  highest concurrency whose share met stays at or above {cap['target'] * 100:g}%: "
                     f"{said(cap['point'])} (by the share); {said(cap['confident'])} (by its 95% lower bound: "
                     "what the sweep shows with confidence)")
    return lines


def render_bench(s: dict[str, Any]) -> str:
    lines = []
    phase = s.get("phase")
    for arm in s["arms"]:
        unverified = [i for i in s.get("restarts_unverified") or [] if i.startswith(arm["arm"] + "#")]
        instances = plural(arm["instances"], "server instance") + (
            "" if not s["restarts"] else " (restarted before each; not verified: the server did not show "
            "whether each restart started a new process)" if unverified else
            " (restarted before each, each a new process)")
        lines.append(f"bench arm {arm['arm']}: {instances}; "
                     + (f"{plural(s['warmup_per_instance'], 'warm-up request')} per instance ran first and "
                        "is not counted" if s["warmup_per_instance"] else "no warm-up requests")
                     + (f"; phase probe: {phase}" if phase else ""))
        if phase == "prefill":  # max_tokens 1: no decode to speak of, so no decode or throughput column
            lines.append(f"  {'concurrency':>11} {'prompt tok':>10} {'turns':>6} {'errors':>6}  "
                         f"{'TTFT s [95% CI]':>26}  {'prefill tok/s [95% CI]':>28}  intervals over")
        else:
            lines.append(f"  {'concurrency':>11} {'turns':>6} {'errors':>6}  {'per-stream tok/s [95% CI]':>26}  "
                         f"{'TTFT s [95% CI]':>26}  {'aggregate tok/s [95% CI]':>26}  intervals over")
        for lv in arm["levels"]:
            agg, errors_n = lv.get("aggregate_tps"), sum(lv["errors"].values())
            if phase == "prefill":
                pt = lv["prompt_tokens"]["median"]
                lines.append(f"  {lv['level']:>11} {'-' if pt is None else f'{pt:.0f}':>10} {lv['turns']:>6} "
                             f"{errors_n:>6}  {_ci(lv['ttft_s'], _sig3):>26}  {_ci(lv['prefill_tps'], '{:.0f}'):>28}  "
                             f"{_over(lv)}")
            else:
                lines.append(f"  {lv['level']:>11} {lv['turns']:>6} {errors_n:>6}  "
                             f"{_ci(lv['decode_tps'], '{:.1f}'):>26}  {_ci(lv['ttft_s'], _sig3):>26}  "
                             f"{_agg(agg):>26}  {_over(lv)}")
        if s.get("slo") is not None and phase != "prefill":
            lines.extend(_slo_lines(arm, s["slo"]))
        errors = defaultdict(int)
        for lv in arm["levels"]:
            for k, v in lv["errors"].items():
                errors[k] += v
        if errors:
            lines.append("  errors: " + ", ".join(f"{v} {k}" for k, v in sorted(errors.items()))
                         + " (kept in the database; not in the figures)")
    if phase != "prefill":
        lines.append("  per-stream: the median over turns of one stream's decode speed (what one user gets); aggregate: "
                     "tokens of all streams over each round's span (what the server delivers), geometric mean over "
                     "rounds or instances (its interval: t on the logs, never below 0); each interval is over the "
                     "server instances when there are several, else over "
                     f"the rounds (per-stream: over turns below {MIN_ROUNDS} rounds), as the last column says")
    if s.get("restart_variance_note"):
        lines.append(f"  {s['restart_variance_note']}")
    if s.get("tokenizer") is False:
        lines.append("  no tokenizer: tokens were not counted, so tok/s are '-' (bench --tokenizer hf:DIR counts "
                     "them); TTFT, times and errors are measured")
    if phase == "prefill":
        lines.append("  prefill probe (max_tokens 1): prefill tok/s = prompt tokens / TTFT; not a decode figure")
    elif phase == "decode":
        lines.append("  decode probe (short prompt, long output): per-stream decode speed is the figure to read")
    return "\n".join(lines) + "\n"
