"""The report's server side: what the server's own counters say over the same window as the turns.

Why: "Your server says 40.7 tok/s. Your users get 27.8." Three numbers of one window are put side by
side (tokens the server generated per second, accepted draft tokens per second, tokens delivered to
clients per second), with the operating point from the server's running-requests gauge beside the
proxy's own in-flight count, the mean acceptance length (MAL) from counter deltas, and forward passes
per second = per-stream decode speed / MAL.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import numpy as np

from specproxy.store.dataset import Turns
from specproxy.store.source import SCRAPE_FIELDS, LoneJoins, Scrapes
from specproxy.observe.counters import COUNTER_FIELDS, ScrapeSample, restart_reason, stretch_counters
from specproxy.observe.server_metrics import Snapshot
from specproxy.analyze.deferred import later
from specproxy.analyze.summary import median_p95_max, summarize
from specproxy.analyze.wording import plural

__all__ = ["server_section", "render_server"]


def _failures(scrapes: Scrapes, ok: np.ndarray, t0: float, t1: float) -> tuple[int, str | None]:
    """The failed scrapes in [t0, t1] and the latest failure's error."""
    lo, hi = np.searchsorted(scrapes.t_wall, t0, side="left"), np.searchsorted(scrapes.t_wall, t1, side="right")
    failed = np.flatnonzero(~ok[lo:hi]) + lo
    errors = [e for e in scrapes.error[failed].tolist() if e is not None]
    return len(failed), (errors[-1] if errors else None)


def _sample(scrapes: Scrapes, i: int) -> ScrapeSample:
    """Stored scrape ``i`` as the ScrapeSample ``serve`` saw (wall time as its clock; None for NULL)."""
    fields = {f: (None if np.isnan(v) else v) for f, v in ((f, float(scrapes.num[f][i])) for f in SCRAPE_FIELDS)}
    latency = fields.pop("latency_s")  # the scrape's, not the page's
    t = float(scrapes.t_wall[i])
    snap = Snapshot(server_kind=scrapes.server_kind[i], **fields)
    return ScrapeSample(t_mono=t, t_wall=t, snapshot=snap, instance_id=scrapes.instance_id[i] or "", latency_s=latency)


def _stretches(scrapes: Scrapes, idx: np.ndarray) -> list[tuple[int, int]]:
    """The restart-free stretches of the successful scrapes ``idx`` (time order), as (first, last)
    positions in ``idx``: where ``window_counters`` would split them (another instance, or
    ``restart_reason``), found without a sample per scrape. A stored scrape keeps no start time and
    no per-position counts, so between two of them ``restart_reason`` can only see a changed server
    kind or a counter that went down: only the pairs where the columns show one of those, or another
    instance, are asked (``tests/unit/test_server_report.py`` holds this to ``window_counters``)."""
    if len(idx) < 2:
        return [(0, len(idx) - 1)] if len(idx) else []
    inst, kind = scrapes.instance_id[idx], scrapes.server_kind[idx]
    maybe = (inst[1:] != inst[:-1]) | (kind[1:] != kind[:-1])
    for f in COUNTER_FIELDS:
        x = scrapes.num[f][idx]
        maybe |= x[1:] < x[:-1]  # NaN (not exposed) compares false, as None is skipped
    cuts = []
    for j in np.flatnonzero(maybe).tolist():
        a, b = _sample(scrapes, int(idx[j])), _sample(scrapes, int(idx[j + 1]))
        if a.instance_id != b.instance_id or restart_reason(a.snapshot, b.snapshot) is not None:
            cuts.append(j + 1)
    starts, ends = [0, *cuts], [*cuts, len(idx)]
    return [(s, e - 1) for s, e in zip(starts, ends)]


def _counters(scrapes: Scrapes, idx: np.ndarray):
    """``window_counters`` over the successful scrapes ``idx`` (all of the window), on columns."""
    parts = [(s, e) for s, e in _stretches(scrapes, idx) if e > s]
    ends = [(_sample(scrapes, int(idx[s])), _sample(scrapes, int(idx[e]))) for s, e in parts]
    in_parts = np.zeros(len(idx), dtype=bool)
    for s, e in parts:
        in_parts[s:e + 1] = True
    g = scrapes.num["spec_accept_length"][idx]
    running = np.nan_to_num(scrapes.num["requests_running"][idx])
    gauges = g[in_parts & ~np.isnan(g) & (running > 0)].tolist()
    return stretch_counters(ends, gauges)


def _turn_counters(lone: LoneJoins, rowids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lone turns' counter deltas joined (by turn id, in the store) to these turns: the position of each
    joined turn in ``rowids`` (ascending) and its MAL, in the order the deltas were stored."""
    rid, mal = lone.rowid, lone.mal
    if not len(rid):
        return np.empty(0, dtype=np.int64), np.empty(0)
    pos = np.searchsorted(rowids, rid)
    pos = np.minimum(pos, max(len(rowids) - 1, 0))
    hit = (rowids[pos] == rid) if len(rowids) else np.zeros(len(rid), dtype=bool)
    return pos[hit], mal[hit]


def _last_at_or_before(t: np.ndarray, ok: np.ndarray | None, at: float) -> float | None:
    i = int(np.searchsorted(t, at, side="right"))
    idx = np.flatnonzero(ok[:i]) if ok is not None else np.arange(i)
    return float(t[idx[-1]]) if len(idx) else None


def _first_sent_at_or_after(t: np.ndarray, sent: np.ndarray, ok: np.ndarray | None, at: float,
                            not_after: float | None) -> float | None:
    """The ``t_wall`` of the first scrape sent at or after ``at`` (``Scrapes.sent``; a ``t_wall`` is never
    before its sending, so the search starts at ``at`` in ``t``) and not after ``not_after``."""
    i = int(np.searchsorted(t, at, side="left"))
    j = len(t) if not_after is None else int(np.searchsorted(t, not_after, side="right"))
    keep = sent[i:j] >= at
    idx = np.flatnonzero(keep & ok[i:j] if ok is not None else keep)
    return float(t[i + idx[0]]) if len(idx) else None


# Padding (scraped time outside the turns) above this share of the span: the rates would be diluted by
# as much, so counts are given instead of rates (docs/report.md)
COARSE_SHARE = 0.10
# fewer scrapes than this while the turns were in flight: the values seen, not a median and p95
MIN_RUNNING_SCRAPES = 5


def _turn_times(turns: Turns) -> tuple[np.ndarray, np.ndarray]:
    start = turns.num["t_wall"]
    return start, start + np.nan_to_num(turns.num["total_s"])


def _span(scrapes: Scrapes, times: tuple[np.ndarray, np.ndarray], until: float | None) -> dict[str, Any]:
    """The scrapes the counters are read between, fixed by the turns alone (so a report gives the same
    figures whenever it runs): the last successful scrape at or before the first turn's start (its page
    was built before its ``t_wall``) and the first sent at or after the last turn's end (its page was
    built after its sending: a scrape sent before the end whose headers came after it may predate the
    server's count of the last turn), never past ``until``. Where there is none, the nearest one inside
    the turns' time (the span then cuts them: said by ``cut_s``). ``from``/``to``: where the failed
    scrapes are counted: from the same start (the last attempt before the turns when none succeeded) to
    the first attempt, failed or not, sent after the last turn's end. ``scrapes``: the store's
    (``Source.load``), which hold every scrape these bounds can be. ``times``: the turns' (``_turn_times``)."""
    start, end = times
    first, last = float(np.min(start)), float(np.max(end))
    stop = last if until is None else min(last, until)
    t, sent, ok = scrapes.t_wall, scrapes.sent(), scrapes.ok()
    s1 = _first_sent_at_or_after(t, sent, ok, last, until)
    if s1 is None:
        s1 = _last_at_or_before(t, ok, stop)
    s0 = _last_at_or_before(t, ok, first)
    if s0 is None and s1 is not None:
        s0 = _first_sent_at_or_after(t, sent, ok, first, s1)
    lo = s0 if s0 is not None else (_last_at_or_before(t, None, first) or first)
    after = _first_sent_at_or_after(t, sent, None, last, until)  # the first attempt after, failed or not
    hi = max(s1 if s1 is not None else stop, after if after is not None else stop)
    return {"from": lo, "to": max(hi, lo), "first_scrape": s0, "last_scrape": s1, "turns_from": first,
            "turns_to": last}


def _ascending(x: np.ndarray) -> bool:
    """No element below the one before (NaN: not ascending): then a stable argsort is the identity."""
    return bool(np.all(x[1:] >= x[:-1]))


def _busy(t: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Which times ``t`` fall while at least one of the turns [start, end] was in flight."""
    if _ascending(start):  # turns come in start order: the stable sort would not move one
        s, e = start, np.maximum.accumulate(end)
    else:
        order = np.argsort(start, kind="stable")
        s, e = start[order], np.maximum.accumulate(end[order])
    i = np.searchsorted(s, t, side="right") - 1  # the last turn started at or before t
    return (i >= 0) & (e[np.maximum(i, 0)] >= t)


def _window(d, span: dict[str, Any], delivered: float | None, per_stream: float | None,
            w0: float, w1: float) -> dict[str, Any]:
    """The counters over the span: rates, unless the span's padding would dilute them (then counts)."""
    first, last = span["turns_from"], span["turns_to"]
    seconds = w1 - w0
    padding = max(0.0, min(first, w1) - w0) + max(0.0, w1 - max(last, w0))
    share = padding / seconds if seconds > 0 else None
    coarse = share is not None and share > COARSE_SHARE
    rate = (lambda v: None) if coarse else (lambda v: v)
    return {
        "seconds": d.seconds,
        "from": w0, "to": w1,
        "turns_from": first, "turns_to": last,
        "padding_s": padding,
        "padding_share": share,
        "cut_s": max(0.0, last - w1),  # the turns' time after the span's end (--until, or no scrape yet)
        "coarse": coarse,
        "segments": d.segments,
        "generated_tps": rate(d.generated_tps),
        "accepted_draft_tps": rate(d.accepted_tps),
        "delivered_tps": rate(delivered / d.seconds) if delivered is not None else None,
        "generated_tokens": d.generated_tokens,
        "delivered_tokens": delivered,
        "mal": d.mal,
        "mal_source": d.mal_source,
        "acceptance_rate": d.acceptance_rate,
        "drafts": d.drafts,
        "draft_tokens": d.draft_tokens,
        "accepted_tokens": d.accepted_tokens,
        "forward_passes_per_s": per_stream / d.mal if per_stream is not None and d.mal else None,
        # the server's prefix cache over the same span (counts: a hit rate is not diluted by idle time)
        "prefix_cache_queries": d.prefix_cache_queries,
        "prefix_cache_hits": d.prefix_cache_hits,
        "prefix_cache_hit_rate": d.prefix_cache_hit_rate,
    }


_UNSET: Any = object()


def server_section(scrapes: Scrapes, lone: LoneJoins, turns: Turns, *, span: Turns | None = None,
                   until: float | None = None, per_stream: float | None = _UNSET) -> dict[str, Any]:
    """Everything the server's counters add to a report over these turns' window.

    ``span``: all of the report's turns, failed ones included; when none of ``turns`` is there (every
    turn failed, e.g. the upstream never answered) the scrapes are counted over their window instead,
    so that the failed scrapes of that time are said, not "none recorded". ``until``: the report's
    --until: no scrape after it is read. ``scrapes`` and ``lone``: the window's, loaded by the store
    (``store.source.Source.load`` with ``server=True``). ``per_stream``: the median decode speed of
    ``turns``' streamed turns when the caller has it already (the report's own figure): not found again."""
    window = turns if len(turns) or span is None else span
    if not len(window):
        return {"scrapes": 0}
    times = _turn_times(window)  # the turns' own when they are the window (the usual case): found once
    bounds = _span(scrapes, times, until)
    ok = scrapes.ok()
    failures, last_error = _failures(scrapes, ok, bounds["from"], bounds["to"])
    s0, s1 = bounds["first_scrape"], bounds["last_scrape"]
    # the counters over the successful scrapes of the span (none when no successful scrape bounds the turns)
    if s0 is None or s1 is None:
        idx = np.empty(0, dtype=np.int64)
    else:
        t = scrapes.t_wall
        lo = np.searchsorted(t, max(s0, bounds["from"]), side="left")
        hi = np.searchsorted(t, min(s1, bounds["to"]), side="right")
        idx = np.flatnonzero(ok[lo:hi]) + lo
    out: dict[str, Any] = {"scrapes": len(idx), "scrape_failures": failures, "last_scrape_error": last_error}
    instances = sorted({i for i in scrapes.instance_id[idx].tolist() if i})
    turn_instances = sorted(str(i) for i in turns.distinct("instance_id") if i)
    out["instances"] = instances
    out["turn_instances"] = turn_instances
    if not len(idx):
        return out
    out["server_kind"] = scrapes.server_kind[idx[-1]]
    out["span"] = {k: bounds[k] for k in ("first_scrape", "last_scrape", "turns_from", "turns_to")}
    start, done = (times if window is turns else _turn_times(turns)) if len(turns) else (np.empty(0), np.empty(0))
    # the server's running requests at the scrapes taken while these turns were in flight: idle time
    # between and around them is not their operating point (not exposed: left out, never 0)
    t_idx = scrapes.t_wall[idx]
    busy = _busy(t_idx, start, done) if len(turns) else np.zeros(len(idx), bool)
    out["requests_running"] = _dist(scrapes.num["requests_running"][idx][busy], MIN_RUNNING_SCRAPES)
    out["proxy_in_flight"] = later(_dist, turns.num["concurrency"])  # _dist drops the missing
    d = _counters(scrapes, idx)
    streamed = turns.num["streamed"] == 1  # per-stream speed and tokens per chunk are theirs alone
    if per_stream is _UNSET:
        per_stream = summarize(turns.num["decode_tps"][streamed]).median
    if d is not None and d.seconds:
        w0, w1 = float(t_idx[0]), float(t_idx[-1])
        tokens = turns.num["completion_tokens"]
        inside = (done >= w0) & (done <= w1) & np.isfinite(tokens)
        delivered = float(np.sum(tokens[inside])) if inside.any() else None
        out["window"] = _window(d, bounds, delivered, per_stream, w0, w1)
    # the join is over streamed turns: a non-streamed reply is one chunk of all its tokens, which says
    # nothing about steps, and it has no decode speed to divide by the MAL
    order = np.flatnonzero(streamed)
    rowids = turns.num["rowid"][order]
    if not _ascending(rowids):  # stored in start order, turns are in rowid order already: nothing to sort
        order = order[np.argsort(rowids, kind="stable")]
        rowids = turns.num["rowid"][order]
    pos, mal = _turn_counters(lone, rowids)
    if len(pos):
        at = order[pos]  # the joined turns' indices in ``turns``
        # in the turns' order (start time), not the order the deltas were stored: that order is one proxy's,
        # and a fleet's database interleaves its proxies' by when each shipped, so the sums under the means
        # would differ in their last bits between the fleet's database and a union of its proxies' files
        by_turn = np.argsort(at, kind="stable")
        at, mal = at[by_turn], mal[by_turn]
        with np.errstate(divide="ignore", invalid="ignore"):
            fwd = np.where((mal != 0) & np.isfinite(mal), turns.num["decode_tps"][at] / mal, np.nan)
        # the same turns' tokens per chunk, beside their MAL: equal only on a server that streams once
        # per decoding step (llama.cpp streams once per token, so there it stays ~1 whatever the MAL)
        tpc = turns.num["tokens_per_chunk"][at]
        out["lone_turns"] = {
            "joined": len(pos),
            "alone": int(np.sum(streamed & (turns.num["concurrency"] == 1))),
            "mal": summarize(mal).to_dict(),
            "tokens_per_chunk": summarize(tpc).to_dict(),
            "forward_passes_per_s": summarize(fwd).to_dict(),
        }
    return out


def _dist(values, least: int = 1) -> dict[str, Any]:
    """n, median, p95 and max; below ``least`` values, the values themselves instead of a median and p95."""
    # an array as it is (list() of 10M turns' concurrency made 10M Python floats first)
    arr = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=float)
    arr = arr[np.isfinite(arr)]
    if not arr.size:
        return {"n": 0, "median": None, "p95": None, "max": None}
    if arr.size < least:
        return {"n": int(arr.size), "median": None, "p95": None, "max": float(arr.max()),
                "values": [float(v) for v in arr]}
    median, p95, top = median_p95_max(arr)
    return {"n": int(arr.size), "median": median, "p95": p95, "max": top}


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _scrape_counts(s: dict[str, Any]) -> str:
    """"N scrapes, M failed", and the latest failure's error when any failed."""
    text = f"{plural(s.get('scrapes', 0), 'scrape')}, {s.get('scrape_failures', 0)} failed"
    error = s.get("last_scrape_error") if s.get("scrape_failures") else None
    return text + (f" (last error: {error})" if error else "")


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M:%S.%f")[:-4]


def _window_lines(w: dict[str, Any]) -> list[str]:
    """The span the counters were read over, said; then the rates, or the counts when the span's
    padding (scraped time outside the turns) would dilute the rates by more than ``COARSE_SHARE``."""
    span = (f"  over {w['seconds']:.1f} s, between the scrapes at {_clock(w['from'])} and {_clock(w['to'])} UTC "
            f"(the turns ran from {_clock(w['turns_from'])} to {_clock(w['turns_to'])})")
    if w["padding_share"] is not None:
        span += f": {w['padding_s']:.2f} s of it ({w['padding_share'] * 100:.0f}%) outside the turns"
    if w["cut_s"] > 0:
        span += (f"; the turns' last {w['cut_s']:.2f} s are after the last scrape read (--until, or none taken "
                 "since), and the turns that ended then are not in the delivered count")
    lines = [span]
    if w["coarse"]:
        lines.append(f"  the scrape interval is coarse against this window: rates over it would be diluted by up to "
                     f"{w['padding_share'] * 100:.0f}%, so counts instead: server generated "
                     f"{_f(w['generated_tokens'], '{:.0f}')} tokens | accepted drafts {_f(w['accepted_tokens'], '{:.0f}')} | "
                     f"delivered to clients {_f(w['delivered_tokens'], '{:.0f}')}")
    else:
        lines.append(f"  server generated {_f(w['generated_tps'], '{:.1f}')} tok/s | "
                     f"accepted drafts {_f(w['accepted_draft_tps'], '{:.1f}')} tok/s | "
                     f"delivered to clients {_f(w['delivered_tps'], '{:.1f}')} tok/s")
    return lines


def render_server(s: dict[str, Any]) -> list[str]:
    lines = [""]
    if not s.get("scrapes"):
        if s.get("scrape_failures"):
            lines.append(f"Server's own counters: {_scrape_counts(s)}: nothing from the server for this window")
        else:
            lines.append("Server's own counters: none recorded for this window (serve scrapes the upstream's /metrics)")
        return lines
    n_inst = len(s["instances"])
    lines.append(f"Server's own counters ({s['server_kind']}; {_scrape_counts(s)}; "
                 f"{n_inst} server instance{'s' if n_inst != 1 else ''})")
    r, p = s["requests_running"], s["proxy_in_flight"]
    proxy = (f"through the proxy median {_f(p['median'], '{:.0f}')}, p95 {_f(p['p95'], '{:.0f}')}, "
             f"max {_f(p['max'], '{:.0f}')} (never the configured ceiling)")
    if r.get("values"):
        seen = ", ".join(f"{v:.0f}" for v in r["values"])
        lines.append(f"  operating point: server running {seen} at the {plural(r['n'], 'scrape')} taken while these "
                     f"turns were in flight (too few for a median and p95: the scrape interval is coarse against "
                     f"them); {proxy}")
    elif not r["n"]:
        lines.append(f"  operating point: server running: no scrape was taken while these turns were in flight (the "
                     f"scrape interval is coarse against them); {proxy}")
    else:
        lines.append(f"  operating point: server running median {_f(r['median'], '{:.0f}')}, p95 {_f(r['p95'], '{:.0f}')}, "
                     f"max {_f(r['max'], '{:.0f}')} (at the {plural(r['n'], 'scrape')} taken while these turns were in flight); "
                     f"{proxy}")
    w = s.get("window")
    if not w and s.get("span"):
        lines.append("  no counters over these turns yet: no two successful scrapes around them (the span closes at "
                     "the first scrape after the last turn's end)")
    if w:
        lines.extend(_window_lines(w))
        lines.append(f"  MAL {_f(w['mal'], '{:.2f}')} ({w['mal_source'] or 'no counters'}; acceptance rate "
                     f"{_f(w['acceptance_rate'], '{:.2f}')}) -> forward passes/s = per-stream decode speed / MAL = "
                     f"{_f(w['forward_passes_per_s'], '{:.1f}')}")
        if w.get("prefix_cache_queries") is not None:
            lines.append(f"  prefix cache (the server's counters): {_f(w['prefix_cache_hits'], '{:,.0f}')} of "
                         f"{_f(w['prefix_cache_queries'], '{:,.0f}')} prompt tokens looked up were found "
                         f"(hit rate {_f(w['prefix_cache_hit_rate'], '{:.1%}')})")
        if w["segments"] > 1:
            lines.append(f"  the window spans {w['segments']} server instances (restarts): counts are summed per instance")
    lt = s.get("lone_turns")
    if lt:
        lines.append(f"  streamed turns that ran alone joined with their own counter deltas: "
                     f"{lt['joined']} of {lt['alone']}; "
                     f"per-turn MAL median {_f(lt['mal']['median'], '{:.2f}')} beside tokens per chunk median "
                     f"{_f(lt['tokens_per_chunk']['median'], '{:.2f}')}, forward passes/s median "
                     f"{_f(lt['forward_passes_per_s']['median'], '{:.1f}')}")
    return lines
