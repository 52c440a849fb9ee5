"""The pictures as HTML with inline SVG, drawn on the server: one self-contained document.

Why no charting library: a few bar and line charts need no more than SVG rectangles and polylines, and
a page drawn here opens from a file with the network off (``report --html``) and needs nothing but
text on each live update (the events carry the redrawn content). No script or style is fetched.

Every figure printed carries ``data-figure`` (its path in ``report --json``, keys joined by ``/``) and ``data-value`` (the
exact number), so a reader, or a test, can check the page against the JSON report.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from html import escape
from typing import Any

import orjson

from specproxy.analyze.report import why_empty
from specproxy.analyze.wording import plural

__all__ = ["document", "fragment"]

W, H = 560, 170  # a chart's size; margins inside it
ML, MR, MT, MB = 46, 12, 18, 26
PARTS = (("prompt_system_tokens", "system", "#8c6bb1"), ("prompt_tools_tokens", "tools", "#dd8452"),
         ("prompt_history_tokens", "history", "#937860"), ("prompt_new_tokens", "new", "#55a868"))
TTFT_COLOR, DECODE_COLOR, REST_COLOR = "#c44e52", "#4c72b0", "#b0b0b0"
SLO_MISSED_COLOR = "#222"  # the mark beside a recent turn that missed the page's SLO
USER_FIGURES = (("ttft_s", "TTFT (s)", "{:.3f}"), ("decode_tps", "decode speed, per stream (tok/s)", "{:.1f}"),
                ("decode_s", "decode time (s)", "{:.3f}"), ("total_s", "whole turn (s)", "{:.3f}"),
                ("completion_tokens", "completion tokens", "{:.0f}"), ("tokens_per_chunk", "tokens per chunk", "{:.2f}"),
                ("proxy_delay_ms", "proxy delay (ms)", "{:.3f}"))
MIN_CONCURRENCY_SLOTS = 8  # the operating point's x axis shows at least 1..8 in flight
DIST_TITLES = {"ttft_s": ("TTFT (s)", "{:.3f}"), "decode_tps": ("decode speed per stream (tok/s)", "{:.0f}"),
               "tokens_per_chunk": ("tokens per chunk", "{:.2f}")}

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em;color:#222;background:#fcfcfc}
h1{font-size:1.3em;margin:0 0 .2em}h2{font-size:1.05em;margin:1.4em 0 .4em}
.grid{display:flex;flex-wrap:wrap;gap:1.2em}.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.6em}
table{border-collapse:collapse}td,th{padding:2px 8px;text-align:right}th{font-weight:600}td:first-child,th:first-child{text-align:left}
svg text{font:11px system-ui,sans-serif;fill:#444}.turn{cursor:pointer}.turn:hover rect{opacity:.75}
svg text.mark,.ceiling text{paint-order:stroke;stroke:#fff;stroke-width:3px}
.muted{color:#777}.error{color:#b00}#record{white-space:pre-wrap;font:12px monospace;max-height:24em;overflow:auto;background:#f4f4f4;padding:.5em}
.legend i{display:inline-block;width:10px;height:10px;margin:0 3px 0 10px}
"""

SCRIPT = """
document.addEventListener('click', function (e) {
  var t = e.target.closest ? e.target.closest('.turn') : null;
  if (!t) return;
  var pre = document.getElementById('record');
  pre.textContent = JSON.stringify(JSON.parse(t.getAttribute('data-record')), null, 2);
  pre.setAttribute('data-turn-id', t.getAttribute('data-turn-id'));
  var change = document.getElementById('turn-change');
  var c = JSON.parse(t.getAttribute('data-change') || 'null');
  change.textContent = c ? c.text : 'not a completed turn of a session: nothing to compare';
  change.setAttribute('data-turn-id', t.getAttribute('data-turn-id'));
});
"""

LIVE_SCRIPT = """
(function () {
  var token = new URLSearchParams(location.search).get('token');
  var url = '/_specproxy/events' + (token ? '?token=' + encodeURIComponent(token) : '');
  var status = document.getElementById('status'), updates = 0;
  var es = new EventSource(url);
  es.onmessage = function (e) {
    document.getElementById('content').innerHTML = JSON.parse(e.data).html;
    updates += 1;
    document.body.setAttribute('data-updates', String(updates));
    status.textContent = 'live: updated ' + new Date().toISOString().slice(11, 19) + ' UTC';
  };
  es.onerror = function () { status.textContent = 'not connected: retrying'; };
})();
"""


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def _fig(path: str, v: Any, fmt: str) -> str:
    """A figure as a table cell that says where it comes from in ``report --json``."""
    value = "" if v is None else repr(float(v))
    return f'<td data-figure="{escape(path)}" data-value="{value}">{_f(v, fmt)}</td>'


def _utc(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _svg(body: str, title: str, w: int = W, h: int = H, cls: str = "", data: dict[str, float] | None = None) -> str:
    """A chart; ``data``: its scales as ``data-*`` attributes (pixels per unit), for a reader to check."""
    attrs = "".join(f' data-{k}="{v!r}"' for k, v in (data or {}).items())
    return (f'<svg class="{cls}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img"{attrs} '
            f'aria-label="{escape(title)}"><text x="{ML}" y="12" font-weight="600">{escape(title)}</text>{body}</svg>')


def _axes(x_lo: str, x_hi: str, y_hi: str, w: int = W, h: int = H) -> str:
    return (f'<line x1="{ML}" y1="{h - MB}" x2="{w - MR}" y2="{h - MB}" stroke="#999"/>'
            f'<line x1="{ML}" y1="{MT}" x2="{ML}" y2="{h - MB}" stroke="#999"/>'
            f'<text x="{ML}" y="{h - 8}">{escape(x_lo)}</text>'
            f'<text x="{w - MR}" y="{h - 8}" text-anchor="end">{escape(x_hi)}</text>'
            f'<text x="{ML - 4}" y="{MT + 8}" text-anchor="end">{escape(y_hi)}</text>')


# --- sections -----------------------------------------------------------------------------------------


def _header(r: dict[str, Any]) -> str:
    outcomes = ", ".join(f"{v} {escape(k)}" for k, v in sorted(r["outcomes"].items())) or "none"
    labels = f"; labels {escape(', '.join(r['labels']))}" if r.get("labels") else ""
    win = r.get("window") or {}
    parts = [f"label {escape(str(win['label']))}"] if win.get("label") is not None else []
    parts += [f"{k} {_utc(win[k])} UTC" for k in ("since", "until") if win.get(k) is not None]
    said = f"; window: {', '.join(parts)}" if parts else ""
    attrs = "".join(f' data-window-{k}="{escape(repr(win[k]) if k != "label" else win[k])}"'
                    for k in ("label", "since", "until") if win.get(k) is not None)
    return (f'<p class="window"{attrs}><b data-figure="turns" data-value="{r["turns"]}">{r["turns"]}</b> turns '
            f'({outcomes}), {_utc(r["first_t_wall"])} to {_utc(r["last_t_wall"])} UTC; tokenizer '
            f'{escape(", ".join(r["tokenizers"]) or "none")}{labels}{said}</p>')


def _figures(r: dict[str, Any]) -> str:
    kinds = r["completed_turns"]
    rows = "".join(
        f'<tr><td>{label}</td>{_fig(f"user/{key}/n", r["user"][key]["n"], "{:.0f}")}'
        f'{_fig(f"user/{key}/median", r["user"][key]["median"], fmt)}{_fig(f"user/{key}/p95", r["user"][key]["p95"], fmt)}'
        f'<td>[{_f(r["user"][key]["ci_low"], fmt)}, {_f(r["user"][key]["ci_high"], fmt)}]</td></tr>'
        for key, label, fmt in USER_FIGURES)
    apart = f"; {kinds['non_streamed']} non-streamed apart" if kinds["non_streamed"] else ""
    return (f'<h2>What users got ({kinds["streamed"]} streamed turns that completed{apart})</h2>'
            f'<table class="card"><tr><th>figure</th><th>n</th><th>median</th><th>p95</th><th>95% CI of the median</th></tr>'
            f'{rows}</table>')


_SHARES = (("system", "system prompt", "#8a63d2"), ("tools", "tool definitions", "#d2691e"),
           ("history", "history", "#4682b4"), ("new", "new input", "#2e8b57"), ("output", "output", "#999"))


def _cost(c: dict[str, Any] | None) -> str:
    """The report's cost (``report --prices``): the total by price, and a bar of what each prompt part
    costs of every dollar. Nothing without a price table."""
    if c is None:
        return ""
    unpriced = "; ".join(f"{n} {escape(why)}" for why, n in c["unpriced"].items())
    rows = "".join(f'<tr><td>{escape(k.replace("_", " "))}</td>{_fig(f"cost/kinds/{k}", v, "${:.4f}")}</tr>'
                   for k, v in (c["kinds"] or {}).items())
    table = (f'<table class="card"><tr><th>priced turns</th>{_fig("cost/priced", c["priced"], "{:.0f}")}</tr>'
             f'<tr><th>total (USD)</th>{_fig("cost/usd", c["usd"], "${:.4f}")}</tr>'
             f'<tr><td>per turn</td>{_fig("cost/usd_per_turn", c["usd_per_turn"], "${:.4f}")}</tr>{rows}</table>')
    share = c["parts"]["of_every_dollar"]
    bar = ""
    if share:
        x, rects, keys = 0.0, [], []
        for key, name, color in _SHARES:
            w = share[key] * (W - 20)
            rects.append(f'<rect x="{10 + x:.1f}" y="30" width="{w:.1f}" height="30" fill="{color}"><title>{name} '
                         f'${share[key]:.2f}</title></rect>')
            keys.append(f'<span data-figure="cost/parts/of_every_dollar/{key}" data-value="{share[key]!r}">'
                        f'<b style="color:{color}">{name}</b> ${share[key]:.2f}</span>')
            x += w
        bar = (_svg("".join(rects), f"of every $1 (over {c['parts']['turns']} priced turns whose prompt was split)",
                    h=80, cls="cost") + f'<p class="muted">{" · ".join(keys)}</p>')
    models = escape(", ".join(c["models_priced"]))
    return (f'<h2>Cost at the given prices (models priced: {models})</h2>'
            + (f'<p class="muted">not priced: {unpriced}</p>' if unpriced else "")
            + f'<div class="grid">{table}<div>{bar}</div></div>')


def _by(b: dict[str, Any] | None) -> str:
    """``report --by``'s table: per group, turns, speed, tokens and cost."""
    if b is None:
        return ""
    priced = any(g["cost"] is not None for g in b["groups"])
    head = ("<tr><th>" + escape(b["key"]) + "</th><th>turns</th><th>completed</th><th>TTFT p50 s</th><th>tok/s p50</th>"
            "<th>prompt tokens</th><th>output tokens</th><th>server cached</th>"
            + ("<th>cost</th><th>per turn</th><th>tools of $1</th>" if priced else "") + "</tr>")
    rows = []
    for i, g in enumerate(b["groups"]):
        p = f"by/groups/{i}"
        cells = (f'<td>{escape(str(g["group"]))}</td>{_fig(p + "/turns", g["turns"], "{:.0f}")}'
                 f'{_fig(p + "/completed", g["completed"], "{:.0f}")}{_fig(p + "/ttft_p50_s", g["ttft_p50_s"], "{:.3f}")}'
                 f'{_fig(p + "/decode_tps_p50", g["decode_tps_p50"], "{:.1f}")}'
                 f'{_fig(p + "/prompt_tokens", g["prompt_tokens"], "{:,.0f}")}'
                 f'{_fig(p + "/completion_tokens", g["completion_tokens"], "{:,.0f}")}'
                 f'{_fig(p + "/server_cached_share", g["server_cached_share"], "{:.0%}")}')
        if priced:
            c = g["cost"]
            tools = (c["parts"]["of_every_dollar"] or {}).get("tools")
            cells += (f'{_fig(p + "/cost/usd", c["usd"], "${:.4f}")}{_fig(p + "/cost/usd_per_turn", c["usd_per_turn"], "${:.4f}")}'
                      f'{_fig(p + "/cost/parts/of_every_dollar/tools", tools, "${:.2f}")}')
        rows.append(f"<tr>{cells}</tr>")
    return f'<h2>By {escape(b["key"])}</h2><table class="card">{head}{"".join(rows)}</table>'


def _slo(s: dict[str, Any] | None) -> str:
    """The SLO table (report --slo, serve's slo): per concurrency and over the window, the share of judged
    turns that met it with its interval, and goodput beside aggregate throughput."""
    if s is None:
        return ""
    head = f'<h2>SLO {escape(s["objective"]["text"])}: turns that met it</h2>'
    if s["overall"] is None or not s["overall"]["n"]:
        return head + '<p class="muted">no judged turns in this window</p>'
    rows = ""
    for i, (name, a) in enumerate([*((row["concurrency"], row) for row in s["by_concurrency"]), ("all", s["overall"])]):
        path = "slo/overall" if name == "all" else f"slo/by_concurrency/{i}"
        rows += (f'<tr><td>{escape(name)}</td>{_fig(f"{path}/n", a["n"], "{:.0f}")}{_fig(f"{path}/met", a["met"], "{:.0f}")}'
                 f'{_fig(f"{path}/share", a["share"], "{:.3f}")}<td>[{_f(a["ci_low"])}, {_f(a["ci_high"])}]</td>'
                 f'{_fig(f"{path}/aggregate_tps", a["aggregate_tps"], "{:.1f}")}'
                 f'{_fig(f"{path}/goodput_tps", a["goodput_tps"], "{:.1f}")}{_fig(f"{path}/not_judged", a["not_judged"], "{:.0f}")}</tr>')
    return (head + '<table class="card slo"><tr><th>concurrency</th><th>judged</th><th>met</th><th>share met</th>'
            '<th>95% CI (Wilson)</th><th>aggregate tok/s</th><th>goodput tok/s</th><th>not judged</th></tr>'
            f'{rows}</table>')


def _turns(recent: list[dict[str, Any]], changes: list[dict[str, Any] | None] | None = None) -> str:
    """Each recent turn: TTFT then decode (then the rest of the turn) as one bar, its prompt make-up beside."""
    if not recent:
        return '<h2>Recent turns</h2><p class="muted">none yet</p>'
    row_h, gap, left, bar_w, part_w = 12, 3, 8, 330, 190
    h = MT + len(recent) * (row_h + gap) + 8
    t_max = max((t["total_s"] or 0.0) for t in recent) or 1.0
    p_max = max((t["prompt_tokens"] or 0) for t in recent) or 1
    out = []
    for i, t in enumerate(recent):
        y = MT + i * (row_h + gap)
        ttft, decode, total = t["ttft_s"] or 0.0, t["decode_s"] or 0.0, t["total_s"] or 0.0
        rest = max(total - ttft - decode, 0.0)
        x, rects = left, []
        for width, color, kind in ((ttft, TTFT_COLOR, "ttft"), (decode, DECODE_COLOR, "decode"), (rest, REST_COLOR, "rest")):
            px = width / t_max * bar_w
            if px > 0:
                rects.append(f'<rect class="{kind}" x="{x:.1f}" y="{y}" width="{px:.1f}" height="{row_h}" fill="{color}"/>')
            x += px
        x = left + bar_w + 20
        for field, name, color in PARTS:
            px = (t[field] or 0) / p_max * part_w
            if px > 0:
                rects.append(f'<rect class="part part-{name}" x="{x:.1f}" y="{y}" width="{px:.1f}" height="{row_h}" '
                             f'fill="{color}"/>')
            x += px
        title = (f'{t["outcome"]}: TTFT {_f(t["ttft_s"])} s, decode {_f(t["decode_s"])} s, total {_f(t["total_s"])} s; '
                 f'{_f(t["completion_tokens"], "{:.0f}")} tokens; prompt {_f(t["prompt_tokens"], "{:.0f}")} tokens')
        slo = ""
        if "slo_met" in t:  # judged by the page's SLO (snapshot): a mark at the bar's end when it missed
            said = {True: "met", False: "not met", None: "not judged"}[t["slo_met"]]
            title += f"; SLO {said}"
            slo = f' data-slo-met="{said}"'
            if t["slo_met"] is False:
                rects.append(f'<rect class="slo-missed" x="{left + bar_w + 6}" y="{y}" width="8" height="{row_h}" '
                             f'fill="{SLO_MISSED_COLOR}"/>')
        record = escape(orjson.dumps(t).decode(), quote=True)
        change = escape(orjson.dumps(changes[i] if changes else None).decode(), quote=True)
        outline = "" if t["outcome"] == "ok" else f'<rect x="2" y="{y}" width="4" height="{row_h}" fill="#000"/>'
        hit = f'<rect x="0" y="{y}" width="{left + bar_w + 20 + part_w}" height="{row_h}" fill="transparent"/>'
        out.append(f'<g class="turn outcome-{escape(t["outcome"])}" data-turn-id="{escape(t["id"])}"{slo} '
                   f'data-record="{record}" data-change="{change}"><title>{escape(title)}</title>{hit}{outline}{"".join(rects)}</g>')
    missed = (f'<i style="background:{SLO_MISSED_COLOR}"></i>missed the SLO &nbsp; '
              if any("slo_met" in t for t in recent) else "")
    legend = ('<p class="legend"><i style="background:%s"></i>TTFT<i style="background:%s"></i>decode'
              '<i style="background:%s"></i>rest of the turn &nbsp; %sprompt:'
              % (TTFT_COLOR, DECODE_COLOR, REST_COLOR, missed)
              + "".join(f'<i style="background:{c}"></i>{n}' for _, n, c in PARTS)
              + f' &nbsp; <span class="muted">(longest turn {t_max:.2f} s, largest prompt {p_max:.0f} tokens;'
                ' click a turn for its record)</span></p>')
    svg = _svg("".join(out), f"The newest {len(recent)} turns, oldest first", w=left + bar_w + 20 + part_w + 10, h=h,
               cls="turns", data={"px-per-s": bar_w / t_max, "px-per-token": part_w / p_max})
    return f'<h2>Recent turns</h2><div class="card">{svg}{legend}</div>'


def _histogram(key: str, d: dict[str, Any], summary: dict[str, Any] | None) -> str:
    title, fmt = DIST_TITLES[key]
    if not d["n"]:
        return _svg('<text x="60" y="80">no streamed turns</text>', title, cls=f"dist dist-{key}")
    edges, counts = d["edges"], d["counts"]
    top = max(counts) or 1
    pw, ph = W - ML - MR, H - MT - MB
    bw = pw / len(counts)
    bars = "".join(f'<rect class="bin" data-count="{c}" data-lo="{edges[i]!r}" data-hi="{edges[i + 1]!r}" '
                   f'x="{ML + i * bw:.1f}" y="{H - MB - c / top * ph:.1f}" width="{max(bw - 1, 1):.1f}" '
                   f'height="{c / top * ph:.1f}" fill="{DECODE_COLOR}"><title>{c}</title></rect>'
                   for i, c in enumerate(counts) if c)
    marks = ""
    if summary is not None and summary.get("median") is not None and edges[-1] > edges[0]:
        for row, (name, color) in enumerate((("median", "#000"), ("p95", TTFT_COLOR))):
            v = summary[name]
            if v is not None:
                x = ML + (v - edges[0]) / (edges[-1] - edges[0]) * pw
                # each label on its own row; right of its line, or left of it near the right edge
                right = x > ML + pw * 0.6
                tx, anchor = (x - 3, "end") if right else (x + 3, "start")
                marks += (f'<line x1="{x:.1f}" y1="{MT}" x2="{x:.1f}" y2="{H - MB}" stroke="{color}" stroke-dasharray="3 2"/>'
                          f'<text class="mark mark-{name}" x="{tx:.1f}" y="{MT + 10 + 14 * row}" text-anchor="{anchor}" '
                          f'fill="{color}">{name} {_f(v, fmt)}</text>')
    body = bars + marks + _axes(_f(edges[0], fmt), _f(edges[-1], fmt), str(top))
    return _svg(body, f"{title}: {plural(d['n'], 'streamed turn')}", cls=f"dist dist-{key}")


def _concurrency(c: dict[str, Any], op: dict[str, Any]) -> str:
    title = f"Operating point: turns by how many were in flight (median {_f(op['median'], '{:.0f}')})"
    if not c["n"]:
        return _svg('<text x="60" y="80">no completed turns</text>', title, cls="dist dist-concurrency")
    values, counts = c["values"], c["counts"]
    top = max(counts)
    hi = max(max(values), MIN_CONCURRENCY_SLOTS)  # one value alone is a bar, not a block across the chart
    pw, ph = W - ML - MR, H - MT - MB
    bw = pw / hi
    bars = "".join(f'<rect class="level" data-concurrency="{v}" data-count="{n}" x="{ML + (v - 1) * bw:.1f}" '
                   f'y="{H - MB - n / top * ph:.1f}" width="{max(bw - 1, 1):.1f}" '
                   f'height="{n / top * ph:.1f}" fill="{DECODE_COLOR}"><title>{v} in flight: {plural(n, "turn")}</title></rect>'
                   for v, n in zip(values, counts))
    return _svg(bars + _axes("1", str(hi), str(top)), title, cls="dist dist-concurrency")


def _xy(x: float, y: float, x0: float, x1: float, y1: float) -> tuple[float, float]:
    """A point's place in a chart whose x axis runs from x0 to x1 and y axis from 0 to y1."""
    return ML + (x - x0) / (x1 - x0 or 1.0) * (W - ML - MR), H - MB - y / y1 * (H - MT - MB)


def _polyline(points: list[tuple[float, float]], x0: float, x1: float, y1: float, color: str, dash: str = "",
              cls: str = "") -> str:
    pts = " ".join("{:.1f},{:.1f}".format(*_xy(x, y, x0, x1, y1)) for x, y in points)
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return f'<polyline class="{cls}" points="{pts}" fill="none" stroke="{color}" stroke-width="2"{extra}/>'


def _dots(points: list[tuple[float, float]], x0: float, x1: float, y1: float, color: str, cls: str) -> str:
    """A marker on each point of a line, carrying its numbers (``data-x``, ``data-value``): a line of one
    point is then still seen, and each point can be read back."""
    return "".join('<circle class="{}" data-x="{!r}" data-value="{!r}" cx="{:.1f}" cy="{:.1f}" r="2.5" fill="{}"/>'
                   .format(cls, x, y, *_xy(x, y, x0, x1, y1), color) for x, y in points)


def _runs(rows: list[dict[str, Any]], key: str) -> list[list[tuple[float, float]]]:
    """The points of ``key`` in runs of adjacent slots that have it: a slot where no turn started (no row),
    or with no value, breaks the line instead of it being drawn straight across the gap."""
    runs: list[list[tuple[float, float]]] = []
    prev = None
    for k, r in enumerate(rows):
        slot = r.get("slot", k)
        if r[key] is None:
            prev = None
            continue
        if prev is None or slot != prev + 1:
            runs.append([])
        runs[-1].append((r["t_wall"], r[key]))
        prev = slot
    return runs


def _timeline(rows: list[dict[str, Any]]) -> str:
    title = "Per-stream decode speed (median) and aggregate throughput over time, tok/s"
    per_runs, agg_runs = _runs(rows, "per_stream_tps"), _runs(rows, "aggregate_tps")
    per, agg = [p for run in per_runs for p in run], [p for run in agg_runs for p in run]
    if not per and not agg:
        return _svg('<text x="60" y="80">no completed turns</text>', title, cls="timeline")
    x0, x1 = rows[0]["t_wall"], rows[-1]["t_wall"]
    top = max(v for _, v in per + agg) * 1.1 or 1.0
    body = ("".join(_polyline(run, x0, x1, top, DECODE_COLOR, cls="aggregate") for run in agg_runs)
            + _dots(agg, x0, x1, top, DECODE_COLOR, "aggregate")
            + "".join(_polyline(run, x0, x1, top, TTFT_COLOR, "5 3", cls="per-stream") for run in per_runs)
            + _dots(per, x0, x1, top, TTFT_COLOR, "per-stream")
            + _axes(_utc(x0)[11:], _utc(x1)[11:], f"{top:.0f}")
            + f'<text x="{W // 2}" y="{H - 8}" text-anchor="middle"><tspan fill="{DECODE_COLOR}">aggregate</tspan> '
              f'<tspan fill="{TTFT_COLOR}">per stream</tspan></text>')
    return _svg(body, title, cls="timeline", data={"x0": x0, "x1": x1, "top": top})


def _speedup(curve: dict[str, Any], w: dict[str, Any]) -> str:
    title = "Whole-turn speedup users would feel, by engine decode speedup (TTFT held)"
    points = [(s, v) for s, v in curve["points"] if v is not None]
    if not points:
        return _svg('<text x="60" y="80">no streamed turns with TTFT and decode time</text>', title, cls="speedup")
    ceiling = curve["max_speedup"]
    finite = ceiling is not None and math.isfinite(ceiling)
    # the y axis reaches the ceiling when that leaves the curve readable; else the ceiling is marked at the top
    on_scale = finite and ceiling < 2 * points[-1][1]
    top = max(max(v for _, v in points), ceiling if on_scale else 0) * 1.08
    x0, x1 = points[0][0], points[-1][0]
    d1 = min(x1, top)  # the diagonal (whole turns as fast as the engine) ends where it leaves the chart
    body = (_polyline(points, x0, x1, top, DECODE_COLOR, cls="curve") + _dots(points, x0, x1, top, DECODE_COLOR, "curve")
            + (_polyline([(x0, x0), (d1, d1)], x0, x1, top, "#ccc", "2 3", cls="diagonal") if d1 > x0 else ""))
    if finite:
        # on scale: labelled above its line at the right, clear of the curve that nears it there; off scale:
        # a line along the top, labelled below it at the left, where the curve starts low
        y = _xy(x0, ceiling, x0, x1, top)[1] if on_scale else MT
        say = f"ceiling {ceiling:.2f}x" + ("" if on_scale else " \u2191 above this scale")
        tx, ty, anchor = (W - MR, y - 4, "end") if on_scale else (ML + 4, y + 12, "start")
        body += (f'<g class="ceiling" data-value="{ceiling!r}" data-on-scale="{int(on_scale)}">'
                 f'<line x1="{ML}" y1="{y:.1f}" x2="{W - MR}" y2="{y:.1f}" stroke="{TTFT_COLOR}" stroke-width="2" '
                 f'stroke-dasharray="5 3"/><text x="{tx}" y="{ty:.1f}" text-anchor="{anchor}" fill="{TTFT_COLOR}">'
                 f'{say}</text></g>')
    elif ceiling is not None:  # no TTFT at all: nothing caps the speedup
        body += f'<text class="ceiling" x="{W - MR}" y="{MT + 12}" text-anchor="end">no ceiling (no time before the first token)</text>'
    body += _axes(f"decode {x0:g}x", f"{x1:g}x", f"{top:.2f}x")
    cells = "".join(f'<tr><td>engine decode {s}x</td>{_fig(f"whole_turn/speedups/{s}", v, "{:.2f}")}</tr>'
                    for s, v in w["speedups"].items())
    share = w.get("ttft_share")
    table = (f'<table><tr><th>decode speedup</th><th>whole turn</th></tr>{cells}'
             f'<tr><td>ceiling (decode infinitely fast)</td>{_fig("whole_turn/max_speedup", w["max_speedup"], "{:.2f}")}</tr>'
             f'<tr><td>TTFT share of users\' time</td>{_fig("whole_turn/ttft_share", share, "{:.3f}")}</tr></table>')
    return f'<div>{_svg(body, title, cls="speedup", data={"x0": x0, "x1": x1, "top": top})}{table}</div>'


def _server(s: dict[str, Any] | None) -> str:
    if not s or not s.get("scrapes"):
        return '<h2>Server\'s own counters</h2><p class="muted">none scraped for this window</p>'
    w = s.get("window")
    head = (f'<h2>Server\'s own counters ({escape(str(s.get("server_kind")))}; {plural(s["scrapes"], "scrape")}, '
            f'{s.get("scrape_failures", 0)} failed)</h2>')
    if not w:
        return head + '<p class="muted">not enough scrapes for a window yet</p>'
    bars = [("generated", "server/window/generated_tps", w["generated_tps"]),
            ("accepted drafts", "server/window/accepted_draft_tps", w["accepted_draft_tps"]),
            ("delivered", "server/window/delivered_tps", w["delivered_tps"])]
    top = max((v for _, _, v in bars if v), default=0.0) or 1.0
    body = "".join(f'<text x="{ML}" y="{MT + 14 + i * 34}">{name}</text>'
                   f'<rect class="rate" data-figure="{path}" data-value="{"" if v is None else repr(float(v))}" '
                   f'x="{ML + 100}" y="{MT + 4 + i * 34}" width="{(v or 0) / top * (W - ML - MR - 170):.1f}" '
                   f'height="14" fill="{DECODE_COLOR}"/><text x="{W - MR}" y="{MT + 15 + i * 34}" '
                   f'text-anchor="end">{_f(v, "{:.1f}")} tok/s</text>' for i, (name, path, v) in enumerate(bars))
    table = "".join(f'<tr><td>{name} tok/s</td>{_fig(path, v, "{:.1f}")}</tr>' for name, path, v in bars)
    table += (f'<tr><td>MAL ({escape(str(w["mal_source"] or "no counters"))})</td>{_fig("server/window/mal", w["mal"], "{:.2f}")}</tr>'
              f'<tr><td>forward passes/s</td>{_fig("server/window/forward_passes_per_s", w["forward_passes_per_s"], "{:.1f}")}</tr>')
    title = f"over {w['seconds']:.1f} s" + (f", {w['padding_share'] * 100:.0f}% outside the turns: coarse scrapes, "
                                             "no rates" if w.get("coarse") else "")
    chart = _svg(body, title, h=130, cls="server", data={"px-per-tps": (W - ML - MR - 170) / top})
    return head + f'<div class="grid">{chart}<table class="card">{table}</table></div>'


def _prefix_cache(pc: dict[str, Any] | None) -> str:
    """Predicted reusable against reused by the server, lost, and the lost part's TTFT (report's
    ``prefix_cache``); nothing when no turn has both counts."""
    if not pc or not pc["turns"]:
        return ""
    cells = [("turns with both counts", "turns", "{:.0f}"), ("predicted reusable tokens", "predicted_tokens", "{:,.0f}"),
             ("reused by the server", "reused_tokens", "{:,.0f}"), ("lost tokens", "lost_tokens", "{:,.0f}"),
             ("turns that lost", "turns_with_loss", "{:.0f}"), ("share reused", "reused_share", "{:.1%}")]
    rows = "".join(f"<tr><td>{name}</td>{_fig(f'prefix_cache/{key}', pc[key], fmt)}</tr>" for name, key, fmt in cells)
    fit, cost = pc.get("fit"), pc.get("lost_ttft_s")
    if fit is not None:
        rows += (f"<tr><td>TTFT per 1k uncached tokens (ms)</td>"
                 f"{_fig('prefix_cache/fit/ms_per_1k_uncached', fit['ms_per_1k_uncached'], '{:.1f}')}"
                 f"<td>[{_f(fit['ms_per_1k_lo'], '{:.1f}')}, {_f(fit['ms_per_1k_hi'], '{:.1f}')}]</td></tr>")
    if cost is not None:
        rows += (f"<tr><td>the lost part's TTFT (s)</td>{_fig('prefix_cache/lost_ttft_s/s', cost['s'], '{:.3f}')}"
                 f"<td>[{_f(cost['lo'])}, {_f(cost['hi'])}]</td></tr>")
    return (f'<h2>Prefix cache: predicted against reused</h2><table class="card prefix-cache">'
            f'<tr><th>figure</th><th>value</th><th>95% CI</th></tr>{rows}</table>')
def _by_name(r: dict[str, Any]) -> str:
    """The report's by-proxy and by-instance tables (when the turns come from more than one)."""
    out = []
    for key, title in (("proxy", "By proxy"), ("instance", "By server instance")):
        rows = "".join(
            f'<tr><td>{escape("-" if row[key] is None else str(row[key]))}</td><td>{row["turns"]}</td><td>{row["n"]}</td>'
            f'<td>{_f(row["ttft_s"]["median"])}</td><td>{_f(row["per_stream_tps"]["median"], "{:.1f}")} '
            f'[{_f(row["per_stream_tps"]["ci_low"], "{:.1f}")}, {_f(row["per_stream_tps"]["ci_high"], "{:.1f}")}]</td>'
            f'<td>{_f(row["aggregate"]["tps"], "{:.1f}")}</td></tr>' for row in r.get(f"by_{key}") or ())
        if rows:
            out.append(f'<h2>{title}</h2><table class="card" id="by-{key}"><tr><th>{key}</th><th>completed turns</th>'
                       f'<th>streamed</th><th>TTFT p50 s</th><th>per-stream tok/s [95% CI]</th>'
                       f'<th>aggregate tok/s</th></tr>{rows}</table>')
    return "".join(out)


def fragment(snap: dict[str, Any], note: str = "") -> str:
    """The content of the page: what each live event replaces. ``note``: a line of HTML above it (the live
    page's store line)."""
    r, p = snap["report"], snap["pictures"]
    if not r["turns"]:
        return note + _header(r) + f'<p class="muted">{escape(why_empty(r))}</p>'
    dists = "".join(_histogram(k, d, r["user"].get(k)) for k, d in p["distributions"].items())
    return (note + _header(r) + _figures(r) + _slo(r.get("slo")) + _prefix_cache(r.get("prefix_cache")) + _cost(r.get("cost"))
            + _by(r.get("by")) + _turns(snap["recent"], snap.get("changes"))
            + f'<h2>Distributions</h2><div class="grid">{dists}{_concurrency(p["concurrency"], r["operating_point"]["concurrency"])}</div>'
            + f'<h2>Throughput</h2><div class="grid">{_timeline(p["timeline"])}</div>'
            + f'<h2>Speedup</h2><div class="grid">{_speedup(p["speedup_curve"], r["whole_turn"])}</div>'
            + _by_name(r) + _server(r.get("server")))


def document(snap: dict[str, Any], *, live: bool, title: str, note: str = "") -> str:
    """The whole page: styles and script inline, nothing fetched (the live page's events excepted)."""
    status = ('<p id="status" class="muted">live: connecting</p>' if live
              else f'<p class="muted">specproxy report, written {_utc(datetime.now(timezone.utc).timestamp())} UTC</p>')
    script = SCRIPT + (LIVE_SCRIPT if live else "")
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
            f'<body data-updates="0"><h1>{escape(title)}</h1>{status}<div id="content">{fragment(snap, note)}</div>'
            f'<h2>Record of the turn clicked</h2><p id="turn-change" class="muted">click a turn above</p>'
            f'<pre id="record" class="muted">click a turn above</pre>'
            f'<script>{script}</script></body></html>')
