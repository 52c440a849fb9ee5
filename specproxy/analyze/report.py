"""The report: what users actually got, as a JSON-able dict and as text.

Why a dict first: ``--json`` and the text are two renderings of one computation, so they cannot
disagree. Every figure that summarises comes with n, median, p95 and a 95% interval; every cell says
which cell it is (concurrency bucket, prompt-length bucket); at each concurrency both per-stream and
aggregate throughput are printed, with which one to read there.

Streamed and non-streamed turns are two populations. A non-streamed reply arrives at once: its
"TTFT" is the whole response time, it has no decode time or speed, and it is one chunk of all its
tokens. So every stream figure (TTFT, decode speed and time, tokens per chunk, the tables' TTFT,
per-stream speed and tokens per chunk, the per-turn MAL join) is over streamed turns only, and
non-streamed turns get their own figures (whole response time, tokens). Figures that mean the same for
both kinds (prompt make-up, the operating point, aggregate throughput, the server's counters) are over
all completed turns.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone
from collections.abc import Mapping
from typing import Any

import numpy as np

from specproxy.store.dataset import Turns, busy_seconds, distinct
from specproxy.store.source import WindowData
from specproxy.analyze.prefix_cache import PREFIX_CACHE_COLUMNS, prefix_cache_section, render_lines
from specproxy.analyze.server_report import render_server, server_section
from specproxy.analyze.speedup import required_decode_speedup, window_speedups
from specproxy.analyze.groups import GROUP_COLUMNS, by_group, cost_section, render_by, render_cost
from specproxy.analyze.cells import (CONCURRENCY_BUCKETS, PROMPT_BUCKETS, concurrency_buckets, groups, prompt_buckets,
                                    which_to_read)
from specproxy.analyze.slo import attainment, met_of_turns
from specproxy.analyze.summary import summarize
from specproxy.analyze.wording import plural
from specproxy.config import Slo

__all__ = ["ENGINE_SPEEDUPS", "REPORT_COLUMNS", "aggregate_throughput", "build_report", "render_slo", "render_text",
           "report_columns", "streamed_mask", "why_empty"]

ENGINE_SPEEDUPS = (1.25, 1.5, 2.0, 3.0)
WANTED_TURN_SPEEDUPS = (1.1, 1.25, 1.5, 2.0)

# (report key, column, label, unit scale, format): over streamed turns
USER_FIGURES = (
    ("ttft_s", "ttft_s", "TTFT (s)", 1.0, "{:.3f}"),
    ("decode_tps", "decode_tps", "decode speed, per stream (tok/s)", 1.0, "{:.1f}"),
    ("decode_s", "decode_s", "decode time (s)", 1.0, "{:.3f}"),
    ("total_s", "total_s", "whole turn (s)", 1.0, "{:.3f}"),
    ("completion_tokens", "completion_tokens", "completion tokens", 1.0, "{:.0f}"),
    ("tokens_per_chunk", "tokens_per_chunk", "tokens per chunk", 1.0, "{:.2f}"),
    ("proxy_delay_ms", "proxy_delay_s", "proxy delay (ms)", 1000.0, "{:.3f}"),
)
# the same for non-streamed turns: one response, its time and its tokens (nothing streamed to time)
NON_STREAMED_FIGURES = (
    ("total_s", "total_s", "whole response (s)", 1.0, "{:.3f}"),
    ("completion_tokens", "completion_tokens", "completion tokens", 1.0, "{:.0f}"),
    ("proxy_delay_ms", "proxy_delay_s", "proxy delay (ms)", 1000.0, "{:.3f}"),
)
PROMPT_PARTS = ("prompt_system_tokens", "prompt_tools_tokens", "prompt_history_tokens", "prompt_new_tokens")

# the columns build_report reads (with the server section): load only these
REPORT_COLUMNS = (
    "t_wall", "total_s", "ttft_s", "decode_s", "decode_tps", "completion_tokens", "usage_completion_tokens",
    "tokens_per_chunk", "proxy_delay_s", "concurrency", "streamed", "prompt_tokens", *PROMPT_PARTS,
    "outcome", "label", "tokenizer", "instance_id", "content_class", "proxy_name",
    *(c for c in PREFIX_CACHE_COLUMNS if c not in ("ttft_s", "streamed", "prompt_tokens", "outcome")),
)
# what the stream figures and the tables over streamed turns read
STREAM_COLUMNS = ("t_wall", "streamed", "prompt_tokens", "content_class", *(col for _, col, *_ in USER_FIGURES))


def report_columns(prices: Mapping | None = None, by: str | None = None) -> tuple[str, ...]:
    """``REPORT_COLUMNS``, and what the cost (with ``prices``) and the ``by`` table read besides."""
    if prices is None and by is None:
        return REPORT_COLUMNS
    extra = (*GROUP_COLUMNS, *((by,) if by else ()))
    return (*REPORT_COLUMNS, *(c for c in dict.fromkeys(extra) if c not in REPORT_COLUMNS))


def _summary(values: np.ndarray, scale: float = 1.0) -> dict[str, Any]:
    return summarize(values * scale).to_dict()


def aggregate_throughput(turns: Turns) -> dict[str, Any]:
    """Delivered tokens / the time at least one of these turns was in flight (wall clock).

    Over streamed and non-streamed turns alike: a non-streamed turn keeps the server busy and its
    tokens are delivered as surely as a streamed one's, only at once. Leaving it out would drop its
    tokens but not the time it overlapped streamed turns, and understate what the card put out.
    """
    start = turns.num["t_wall"]
    end = start + turns.num["total_s"]
    tokens = turns.num["completion_tokens"]
    known = np.isfinite(tokens)
    busy = busy_seconds(start[known], end[known])
    if not known.any() or busy <= 0:
        return {"n": int(known.sum()), "tokens": None, "busy_s": None, "tps": None}
    total = float(np.sum(tokens[known]))
    return {"n": int(known.sum()), "tokens": total, "busy_s": busy, "tps": total / busy}


def streamed_mask(turns: Turns) -> np.ndarray:
    """Which turns were streamed (the stream figures are theirs alone)."""
    return turns.num["streamed"] == 1


def build_report(data: WindowData, *, source: str = "", prices: Mapping | None = None,
                 by: str | None = None, slo: Slo | None = None) -> dict[str, Any]:
    """Everything ``specproxy report`` says, as plain data, from one window's data as the store loaded it
    (``Source.load(window, REPORT_COLUMNS, server=True, context=True)``; without ``server`` there is no
    server section, without ``context`` no count of other paths' rows).

    The window (label/since/until) is said back, and when it selects nothing the report says how many
    turns the database holds instead of "no turns recorded yet". ``prices`` (a price table by model) adds
    the cost of the window's turns; ``by`` (one of ``groups.BY_KEYS``) the table per client, session,
    label, tenant or model; both need ``report_columns(prices, by)`` loaded.
    With ``slo``, the ``slo`` section: the
    share of turns that met it and goodput, over the window and per concurrency (``analyze/slo.py``).
    """
    turns, window = data.turns, data.window.as_dict()
    n_all = len(turns)
    outcomes: dict[str, int] = {}
    for o, count in Counter(turns.txt["outcome"].tolist()).items():
        outcomes[str(o)] = outcomes.get(str(o), 0) + count
    ok = turns.select(turns.ok) if n_all else turns
    report: dict[str, Any] = {
        "source": source,
        "turns": n_all,
        "outcomes": outcomes,
        "first_t_wall": float(np.min(turns.num["t_wall"])) if n_all else None,
        "last_t_wall": float(np.max(turns.num["t_wall"])) if n_all else None,
        "tokenizers": sorted({str(t) for t in distinct(turns.txt["tokenizer"]) if t}),
        "labels": sorted({str(t) for t in distinct(turns.txt["label"]) if t}),
        "window": window,
        # the whole database, loaded only when the window selects nothing: None otherwise
        "database_turns": data.database if not n_all else None,
        # other paths' rows in the same window: forwarded and recorded, never part of a figure
        "unmeasured": data.unmeasured,
    }
    is_streamed = streamed_mask(ok)
    streamed = ok if is_streamed.all() else ok.select(is_streamed, columns=STREAM_COLUMNS)
    whole = ok.select(~is_streamed, columns=("t_wall", *(col for _, col, *_ in NON_STREAMED_FIGURES)))
    # completed turns of each kind: "user" is over the first, "non_streamed" over the second
    report["completed_turns"] = {"streamed": len(streamed), "non_streamed": len(whole)}
    report["user"] = {key: _summary(streamed.num[col], scale) for key, col, _, scale, _ in USER_FIGURES}
    report["non_streamed"] = {key: _summary(whole.num[col], scale) for key, col, _, scale, _ in NON_STREAMED_FIGURES}
    report["usage_vs_delivered"] = _usage_gap(ok)
    report["prompt"] = _prompt(ok)
    report["by_concurrency"] = _by_concurrency(ok)
    report["by_prompt_length"] = _by_prompt_length(streamed)
    report["by_content_class"] = _by_content_class(streamed)
    report["operating_point"] = {"concurrency": _summary(ok.num["concurrency"])}
    report["whole_turn"] = _whole_turn(ok)
    report["prefix_cache"] = prefix_cache_section(ok)
    report["cost"] = cost_section(turns, prices) if n_all else None
    report["by"] = by_group(turns, by, prices) if by and n_all else None
    report["by_proxy"] = _by_name(ok, "proxy_name")
    report["by_instance"] = _by_name(ok, "instance_id")
    if slo is not None:
        report["slo"] = _slo(turns, slo) if n_all else {"objective": slo.as_dict(), "overall": None,
                                                       "by_concurrency": []}
    if data.scrapes is not None and data.lone is not None:
        report["server"] = server_section(data.scrapes, data.lone, ok, span=turns, until=window["until"])
    return report


def _slo(turns: Turns, slo: Slo) -> dict[str, Any]:
    """The share of the window's measured turns that met ``slo`` (failed ones included: they did not), its
    interval and goodput, overall and per concurrency cell; each cell's plain aggregate throughput beside
    its goodput, over the same busy time (its completed turns')."""
    judged = met_of_turns(slo, turns)

    def cell(at: np.ndarray | None) -> dict[str, Any]:
        mine = turns if at is None else turns.select(at, columns=("t_wall", "total_s", "completion_tokens", "outcome"))
        m = judged if at is None else judged[at]
        done = mine.ok
        agg = aggregate_throughput(mine.select(done, columns=("t_wall", "total_s", "completion_tokens")))
        return {**attainment(m, mine.num["completion_tokens"], agg["busy_s"]), "aggregate_tps": agg["tps"]}

    rows = [{"concurrency": CONCURRENCY_BUCKETS[int(b)], **cell(at)}
            for b, at in groups(concurrency_buckets(turns.num["concurrency"]))]
    return {"objective": slo.as_dict(), "overall": cell(None), "by_concurrency": rows}


def _usage_gap(ok: Turns) -> dict[str, Any]:
    """Our delivered count beside the server's own usage count, where both exist."""
    ours, theirs = ok.num["completion_tokens"], ok.num["usage_completion_tokens"]
    both = np.isfinite(ours) & np.isfinite(theirs)
    diff = theirs[both] - ours[both]
    return {
        "n": int(both.sum()),
        "delivered_tokens": float(ours[both].sum()) if both.any() else None,
        "usage_tokens": float(theirs[both].sum()) if both.any() else None,
        "median_usage_minus_delivered": float(np.median(diff)) if both.any() else None,
    }


def _prompt(ok: Turns) -> dict[str, Any]:
    """Each part's median tokens per turn, and its share of all prompt tokens: the parts' sums over the
    turns that have every part, over those turns' prompt tokens. The parts of a turn add up to its
    prompt, so the shares add up to 1 (the medians need not add up to the median prompt, and shares of
    it did not: ~70%)."""
    total = ok.num["prompt_tokens"]
    out: dict[str, Any] = {"prompt_tokens": _summary(total)}
    whole = np.isfinite(total)
    for part in PROMPT_PARTS:
        whole &= np.isfinite(ok.num[part])
    tokens = float(np.sum(total[whole]))
    out["split_turns"] = int(whole.sum())
    out["split_tokens"] = tokens if whole.any() else None
    for part in PROMPT_PARTS:
        s = _summary(ok.num[part])
        s["tokens"] = float(np.sum(ok.num[part][whole])) if whole.any() else None
        s["share_of_prompt_tokens"] = s["tokens"] / tokens if whole.any() and tokens > 0 else None
        out[part] = s
    return out


def _percents(shares: list[float | None]) -> list[int | None]:
    """Shares as whole percents that add up to 100 (largest remainders), as the shares add up to 1."""
    if any(v is None for v in shares):
        return [None if v is None else round(v * 100) for v in shares]
    raw = [v * 100 for v in shares]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[:max(0, round(sum(raw)) - sum(out))]:
        out[i] += 1
    return out


def _cells(turns: Turns, key: str, names: Any, index: np.ndarray, extra,
           columns: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One row per non-empty cell: which cell it is, then n, TTFT and per-stream speed over the cell's
    streamed turns, plus ``extra(cell)`` over all its turns (``cell`` has ``columns`` besides those)."""
    rows = []
    for b, at in groups(index):
        cell = turns.select(at, columns=("t_wall", "streamed", "ttft_s", "decode_tps", *columns))
        streamed = streamed_mask(cell)
        rows.append({key: names[int(b)], "n": int(streamed.sum()), "ttft_s": _summary(cell.num["ttft_s"][streamed]),
                     "per_stream_tps": _summary(cell.num["decode_tps"][streamed]), **extra(cell)})
    return rows


def _by_concurrency(ok: Turns) -> list[dict[str, Any]]:
    """Stream figures over each cell's streamed turns; aggregate throughput (with its own n) and which
    figure to read over all its turns, as concurrency counts every turn in flight."""
    return _cells(ok, "concurrency", CONCURRENCY_BUCKETS, concurrency_buckets(ok.num["concurrency"]),
                  lambda cell: {"aggregate": aggregate_throughput(cell),
                                "read": which_to_read(float(np.median(cell.num["concurrency"])))},
                  columns=("total_s", "completion_tokens", "concurrency"))


def _by_prompt_length(streamed: Turns) -> list[dict[str, Any]]:
    return _cells(streamed, "prompt_tokens", PROMPT_BUCKETS, prompt_buckets(streamed.num["prompt_tokens"]),
                  lambda cell: {})


def _by_name(ok: Turns, column: str) -> list[dict[str, Any]]:
    """One row per proxy (``proxy_name``) or server instance (``instance_id``) when the completed turns
    come from more than one (else none): its turns, TTFT and per-stream speed over its streamed turns, and
    its aggregate throughput, so that one slow machine of a fleet shows beside the others. Rows by name;
    turns without a name (recorded before it was, or by a proxy that could not tell) are one row, None."""
    if column not in ok.txt or not len(ok):
        return []
    names = ok.txt[column]
    known = sorted({str(v) for v in names.tolist() if v is not None})
    order = [*known, None] if any(v is None for v in names.tolist()) else known
    if len(order) < 2:
        return []
    index = np.full(len(ok), len(known))  # None's row: after the named ones
    for i, name in enumerate(known):
        index[names == name] = i
    key = "proxy" if column == "proxy_name" else "instance"
    return _cells(ok, key, order, index,
                  lambda cell: {"turns": len(cell), "aggregate": aggregate_throughput(cell)},
                  columns=("total_s", "completion_tokens"))


CONTENT_CLASSES = ("prose", "code", "tool_call")


def _by_content_class(streamed: Turns) -> list[dict[str, Any]]:
    """Code, prose and tool calls apart: acceptance (tokens per chunk, decode speed) differs by class.
    Over streamed turns: a non-streamed reply is one chunk of all its tokens, not an acceptance length."""
    classes = streamed.txt["content_class"]
    index = np.full(len(streamed), -1)
    for i, name in enumerate(CONTENT_CLASSES):
        index[classes == name] = i
    return _cells(streamed, "content_class", CONTENT_CLASSES, index,
                  lambda cell: {"tokens_per_chunk": _summary(cell.num["tokens_per_chunk"])},
                  columns=("tokens_per_chunk",))


def _whole_turn(ok: Turns) -> dict[str, Any]:
    """The speedup a user would feel for engine decode speedups, from this traffic (streamed turns).

    TTFT held (prefill does not get faster when decoding does), in the before-a-change form, over the
    window's summed TTFT and decode time: the exact ratio of all users' turn time before and after.
    """
    streamed = streamed_mask(ok)
    w = window_speedups(ok.num["ttft_s"][streamed], ok.num["decode_s"][streamed], speedups=ENGINE_SPEEDUPS)
    n = w.n
    return {
        "n": n,
        "mean_ttft_s": w.ttft_s / n if n and w.ttft_s is not None else None,
        "mean_decode_s": w.decode_s / n if n and w.decode_s is not None else None,
        "ttft_share": w.ttft_share,
        "max_speedup": w.max_speedup if w.max_speedup is None or np.isfinite(w.max_speedup) else None,
        "speedups": {f"{s:g}": v for s, v in w.speedups.items()},
        # the inverse: the engine decode speedup a wanted whole-turn speedup needs (None: unreachable)
        "needed_decode_speedup": {f"{t:g}": (required_decode_speedup(w.ttft_s, w.decode_s, t) if n else None)
                                  for t in WANTED_TURN_SPEEDUPS},
    }


# --- text -------------------------------------------------------------------------------------------


def _fmt(value: Any, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def _ci(s: dict[str, Any], fmt: str) -> str:
    if s.get("ci_low") is None:
        return "-"
    return f"[{fmt.format(s['ci_low'])}, {fmt.format(s['ci_high'])}]"


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def why_empty(r: dict[str, Any]) -> str:
    """Why there is nothing to report: an empty database, or a window that selects none of its turns."""
    db = r.get("database_turns")
    others = plural(db["other"], "other-path request") if db and db.get("other") else ""
    if not db or not db["n"]:
        held = f" (the database holds {others} only)" if others else ""
        return f"no turns recorded yet{held}: point a client at the proxy's /v1 and chat"
    w = r.get("window") or {}
    parts = [f"label {w['label']}" if w.get("label") is not None else "",
             f"since {_utc(w['since'])} UTC" if w.get("since") is not None else "",
             f"until {_utc(w['until'])} UTC" if w.get("until") is not None else ""]
    where = ", ".join(p for p in parts if p)
    span = f" ({_utc(db['first_t_wall'])} to {_utc(db['last_t_wall'])} UTC)" if db["first_t_wall"] is not None else ""
    out = (f"no turns in this window{f' ({where})' if where else ''}; "
           f"the database holds {plural(db['n'], 'turn')}{span}{f' and {others}' if others else ''}")
    labels = db.get("labels")
    if w.get("label") is not None and labels is not None and w["label"] not in labels:
        shown = ", ".join(labels[:20]) + (f" and {len(labels) - 20} more" if len(labels) > 20 else "")
        out += f"; no turn has label {w['label']} ({f'its labels are {shown}' if labels else 'no turn has a label'})"
    return out


def _figure_rows(summaries: dict[str, Any], figures: tuple) -> list[str]:
    lines = [f"  {'figure':36} {'n':>6} {'median':>10} {'p95':>10}  95% CI"]
    for key, _, label, _, fmt in figures:
        s = summaries[key]
        lines.append(f"  {label:36} {s['n']:>6} {_fmt(s['median'], fmt):>10} {_fmt(s['p95'], fmt):>10}  {_ci(s, fmt)}")
    return lines


def _name_rows(rows: list[dict[str, Any]], key: str, title: str) -> list[str]:
    lines = [title, f"  {key:>20} {'turns':>6} {'n':>6} {'TTFT p50 s':>11} {'per-stream tok/s [95% CI]':>30} "
                    f"{'aggregate tok/s':>16}"]
    for row in rows:
        ps = row["per_stream_tps"]
        name = "-" if row[key] is None else str(row[key])
        lines.append(f"  {name[-20:]:>20} {row['turns']:>6} {row['n']:>6} {_fmt(row['ttft_s']['median'], '{:.3f}'):>11}"
                     f" {_fmt(ps['median'], '{:.1f}') + ' ' + _ci(ps, '{:.1f}'):>30}"
                     f" {_fmt(row['aggregate']['tps'], '{:.1f}'):>16}")
    return lines


def _share(a: dict[str, Any]) -> str:
    if a["share"] is None:
        return "-"
    return f"{a['share'] * 100:.1f}% [{a['ci_low'] * 100:.1f}, {a['ci_high'] * 100:.1f}]"


def render_slo(s: dict[str, Any]) -> list[str]:
    """The SLO section: the share of judged turns that met it with its 95% Wilson interval, and goodput
    beside aggregate throughput, overall and per concurrency."""
    o = s["overall"]
    lines = ["", f"SLO {s['objective']['text']}: turns that met it (failed turns did not; a turn lacking a figure "
             "the SLO names, or cut by its client, is not judged)"]
    if o is None or not o["n"]:
        lines.append("  no judged turns in this window")
        return lines
    lines.append(f"  {'concurrency':>11} {'judged':>7} {'met':>6} {'share met [95% CI]':>24} "
                 f"{'aggregate tok/s':>16} {'goodput tok/s':>14} {'not judged':>11}")
    for name, a in [*((row["concurrency"], row) for row in s["by_concurrency"]), ("all", o)]:
        lines.append(f"  {name:>11} {a['n']:>7} {a['met']:>6} {_share(a):>24} {_fmt(a['aggregate_tps'], '{:.1f}'):>16}"
                     f" {_fmt(a['goodput_tps'], '{:.1f}'):>14} {a['not_judged']:>11}")
    lines.append("  goodput: delivered tokens of the turns that met it over the same busy time as aggregate")
    return lines


def render_text(r: dict[str, Any]) -> str:
    lines: list[str] = []
    when = f", {_utc(r['first_t_wall'])} to {_utc(r['last_t_wall'])} UTC" if r["first_t_wall"] is not None else ""
    outcomes = ", ".join(f"{v} {k}" for k, v in sorted(r["outcomes"].items())) or "none"
    lines.append(f"specproxy report: {r['source']}: {plural(r['turns'], 'turn')} ({outcomes}){when}")
    if r.get("unmeasured"):
        lines.append(f"other paths: {plural(r['unmeasured'], 'request')} forwarded and recorded without figures "
                     "(not measured, not in any figure below)")
    if not r["turns"]:  # no tokenizer line: with no turns there is nothing to say which tokenizer counted
        lines.append(why_empty(r))
        return "\n".join(lines) + "\n"
    tok = ", ".join(r["tokenizers"]) or "none (token counts missing: start serve with --tokenizer)"
    lines.append(f"tokenizer: {tok}" + (f"; labels: {', '.join(r['labels'])}" if r["labels"] else ""))
    kinds = r["completed_turns"]
    lines.append("")
    lines.append(f"What users got ({kinds['streamed']} streamed turns that completed; 95% CI of the median)")
    lines.extend(_figure_rows(r["user"], USER_FIGURES))
    gap = r["usage_vs_delivered"]
    if gap["n"]:
        lines.append(
            f"  server usage.completion_tokens minus delivered tokens: median {_fmt(gap['median_usage_minus_delivered'], '{:+.0f}')}"
            f" over {plural(gap['n'], 'turn')}{', streamed or not' if kinds['non_streamed'] else ''}"
            " (the server may count tokens the client never saw, e.g. an end-of-turn token)"
        )
    if kinds["non_streamed"]:
        lines.append("")
        lines.append(f"Non-streamed turns ({kinds['non_streamed']} that completed: the reply arrives whole, "
                     "so no TTFT, decode speed or tokens per chunk; not in the figures above)")
        lines.extend(_figure_rows(r["non_streamed"], NON_STREAMED_FIGURES))
    p = r["prompt"]
    lines.append("")
    lines.append(f"Prompt make-up (median tokens per turn; share of all prompt tokens, over the {plural(p['split_turns'], 'turn')} "
                 "split into parts)")
    lines.append(f"  prompt_tokens {_fmt(p['prompt_tokens']['median'], '{:.0f}')} "
                 f"(p95 {_fmt(p['prompt_tokens']['p95'], '{:.0f}')}, n {p['prompt_tokens']['n']})")
    percents = _percents([p[part]["share_of_prompt_tokens"] for part in PROMPT_PARTS])
    for part, name, pct in zip(PROMPT_PARTS, ("system", "tools", "history", "new message"), percents):
        lines.append(f"  {name:12} {_fmt(p[part]['median'], '{:.0f}'):>8}  {_fmt(pct, '{:.0f}'):>3}%")
    sys_med, tools_med = p["prompt_system_tokens"]["median"], p["prompt_tools_tokens"]["median"]
    if sys_med or tools_med:
        lines.append(f"  -> the client injects {_fmt(sys_med, '{:.0f}')} tokens of system prompt and "
                     f"{_fmt(tools_med, '{:.0f}')} tokens of tool definitions every turn")
    if r.get("cost"):
        lines.append("")
        lines.extend(render_cost(r["cost"]))
    if r.get("by"):
        lines.append("")
        lines.extend(render_by(r["by"]))
    lines.append("")
    op = r["operating_point"]["concurrency"]
    lines.append(f"By concurrency (operating point: median {_fmt(op['median'], '{:.0f}')}, p95 {_fmt(op['p95'], '{:.0f}')}"
                 " in flight through the proxy; not the server's configured maximum)")
    mixed = bool(kinds["non_streamed"])
    if mixed:
        lines.append("  n, per-stream speed and TTFT: streamed turns; aggregate: all turns, streamed or not (n all)")
    lines.append(f"  {'concurrency':>11} {'n':>6} {'per-stream tok/s [95% CI]':>30} {'aggregate tok/s':>16}"
                 + (f" {'n all':>6}" if mixed else "") + f" {'TTFT p50 s':>11}  read")
    for row in r["by_concurrency"]:
        ps = row["per_stream_tps"]
        per = f"{_fmt(ps['median'], '{:.1f}')} {_ci(ps, '{:.1f}')}"
        lines.append(f"  {row['concurrency']:>11} {row['n']:>6} {per:>30} {_fmt(row['aggregate']['tps'], '{:.1f}'):>16}"
                     + (f" {row['aggregate']['n']:>6}" if mixed else "")
                     + f" {_fmt(row['ttft_s']['median'], '{:.3f}'):>11}  {row['read']}")
    if r["by_prompt_length"]:
        lines.append("")
        lines.append("By prompt length (streamed turns)")
        lines.append(f"  {'prompt tokens':>13} {'n':>6} {'TTFT p50 s':>11} {'per-stream tok/s':>17}")
        for row in r["by_prompt_length"]:
            lines.append(f"  {row['prompt_tokens']:>13} {row['n']:>6} {_fmt(row['ttft_s']['median'], '{:.3f}'):>11}"
                         f" {_fmt(row['per_stream_tps']['median'], '{:.1f}'):>17}")
    if r.get("by_content_class"):
        lines.append("")
        lines.append("By content class (streamed turns; speculative decoding accepts more of code than of prose)")
        lines.append(f"  {'class':>13} {'n':>6} {'TTFT p50 s':>11} {'per-stream tok/s':>17} {'tokens/chunk':>13}")
        for row in r["by_content_class"]:
            lines.append(f"  {row['content_class']:>13} {row['n']:>6} {_fmt(row['ttft_s']['median'], '{:.3f}'):>11}"
                         f" {_fmt(row['per_stream_tps']['median'], '{:.1f}'):>17}"
                         f" {_fmt(row['tokens_per_chunk']['median'], '{:.2f}'):>13}")
    for key, title in (("by_proxy", "By proxy (the fleet's proxies that saw these turns)"),
                       ("by_instance", "By server instance (each start of a server is one)")):
        if r.get(key):
            lines.append("")
            lines.extend(_name_rows(r[key], key.removeprefix("by_"), title))
    w = r["whole_turn"]
    lines.append("")
    if w["n"] and w["ttft_share"] is not None:
        lines.append(f"Whole-turn speedup a user would feel ({w['n']} streamed turns: mean TTFT {w['mean_ttft_s']:.3f} s"
                     f" + decode {w['mean_decode_s']:.3f} s; TTFT is {w['ttft_share'] * 100:.0f}% of the users' time)")
        lines.append("  " + "   ".join(f"engine decode {s}x -> {v:.2f}x" for s, v in w["speedups"].items()))
        ceiling = f"; no decode speedup can beat {w['max_speedup']:.2f}x" if w["max_speedup"] else ""
        lines.append(f"  (TTFT held: prefill does not get faster when decoding does{ceiling})")
        lines.append("  to make whole turns faster by: " + "   ".join(
            f"{t}x needs decode {v:.2f}x" if v is not None else f"{t}x is unreachable by decode alone"
            for t, v in w["needed_decode_speedup"].items()))
    else:
        lines.append("Whole-turn speedup: no streamed turns with both TTFT and decode time yet")
    pc = r.get("prefix_cache")
    if pc and pc["turns"]:
        lines.append("")
        lines.append(f"Prefix cache: predicted reusable (specproxy's prediction from each session's previous turn) "
                     f"against reused (the server's count), over {plural(pc['turns'], 'turn')} with both")
        lines += render_lines(pc)
        for c in pc["by_client"][:5]:
            lines += render_lines(c, "  ", f"{c['client']}: ")
    if "slo" in r:
        lines.extend(render_slo(r["slo"]))
    if "server" in r:
        lines.extend(render_server(r["server"]))
    return "\n".join(lines) + "\n"
