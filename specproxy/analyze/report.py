"""The report as text: ``specproxy report``'s output, rendered from ``report_data.build_report``'s dict.

Why apart from the figures: ``--json`` and the text are two renderings of one computation, so this
module computes nothing: it lays out and words the figures the dict holds (which population each
table is over, which throughput to read), and says why a window is empty.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from specproxy.analyze.groups import render_by, render_cost
from specproxy.analyze.prefix_cache import render_lines
from specproxy.analyze.report_data import NON_STREAMED_FIGURES, PROMPT_PARTS, USER_FIGURES
from specproxy.analyze.server_report import render_server
from specproxy.analyze.wording import plural

__all__ = ["render_slo", "render_text", "why_empty"]


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


def _percents(shares: list[float | None]) -> list[int | None]:
    """Shares as whole percents that add up to 100 (largest remainders), as the shares add up to 1."""
    if any(v is None for v in shares):
        return [None if v is None else round(v * 100) for v in shares]
    raw = [v * 100 for v in shares]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[:max(0, round(sum(raw)) - sum(out))]:
        out[i] += 1
    return out


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
