"""The report's server side: what the server's own counters say over the same window as the turns.

Why: "Your server says 40.7 tok/s. Your users get 27.8." Three numbers of one window are put side by
side (tokens the server generated per second, accepted draft tokens per second, tokens delivered to
clients per second), with the operating point from the server's running-requests gauge beside the
proxy's own in-flight count, the mean acceptance length (MAL) from counter deltas, and forward passes
per second = per-stream decode speed / MAL.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specproxy.store.dataset import Turns, distinct
from specproxy.store.queries import Connection, lone_turn_mal, scrape_rows
from specproxy.observe.counters import ScrapeSample, running_distribution, window_counters
from specproxy.observe.server_metrics import Snapshot
from specproxy.analyze.stats import summarize

__all__ = ["server_section", "render_server"]

_FIELDS = ("requests_running", "requests_waiting", "generation_tokens_total", "prompt_tokens_total",
           "spec_drafts_total", "spec_draft_tokens_total", "spec_accepted_tokens_total",
           "spec_accept_length", "spec_accept_rate")


def _samples(conn: Connection, t0: float, t1: float) -> tuple[list[ScrapeSample], int, str | None]:
    """Stored scrapes in [t0, t1] as ScrapeSamples (wall time as their clock), the failed scrapes, and the
    latest failure's error."""
    rows = scrape_rows(conn, t0, t1, _FIELDS)
    samples, failures, last_error = [], 0, None
    for t_wall, instance_id, kind, error, *values in rows:
        if error is not None or kind is None:
            failures += 1
            last_error = error if error is not None else last_error
            continue
        snap = Snapshot(server_kind=kind, **dict(zip(_FIELDS, values)))
        samples.append(ScrapeSample(t_mono=t_wall, t_wall=t_wall, snapshot=snap, instance_id=instance_id or ""))
    return samples, failures, last_error


def _turn_counters(conn: Connection, rowids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lone turns' counter deltas joined (in SQL, by turn id) to these turns: the position of each
    joined turn in ``rowids`` (ascending) and its MAL, in the order the deltas were stored."""
    rows = lone_turn_mal(conn)
    if not rows:
        return np.empty(0, dtype=np.int64), np.empty(0)
    rid = np.array([r[0] for r in rows], dtype=np.int64)
    mal = np.array([r[1] for r in rows], dtype=float)  # NULL becomes NaN
    pos = np.searchsorted(rowids, rid)
    pos = np.minimum(pos, max(len(rowids) - 1, 0))
    hit = (rowids[pos] == rid) if len(rowids) else np.zeros(len(rid), dtype=bool)
    return pos[hit], mal[hit]


def _around(turns: Turns) -> tuple[float, float]:
    """The wall-time window the scrapes are read over: just around these (non-empty) turns."""
    start = turns.num["t_wall"]
    end = start + np.nan_to_num(turns.num["total_s"])
    return float(np.min(start)) - 60.0, float(np.max(end)) + 60.0


def server_section(conn: Connection, turns: Turns, *, span: Turns | None = None) -> dict[str, Any]:
    """Everything the server's counters add to a report over these turns' window.

    ``span``: all of the report's turns, failed ones included; when none of ``turns`` is there (every
    turn failed, e.g. the upstream never answered) the scrapes are counted over their window instead,
    so that the failed scrapes of that time are said, not "none recorded"."""
    window = turns if len(turns) or span is None else span
    if not len(window):
        return {"scrapes": 0}
    t0, t1 = _around(window)
    start = turns.num["t_wall"]
    samples, failures, last_error = _samples(conn, t0, t1)
    out: dict[str, Any] = {"scrapes": len(samples), "scrape_failures": failures, "last_scrape_error": last_error}
    instances = sorted({s.instance_id for s in samples if s.instance_id})
    turn_instances = sorted(str(i) for i in distinct(turns.txt["instance_id"]) if i)
    out["instances"] = instances
    out["turn_instances"] = turn_instances
    if not samples:
        return out
    out["server_kind"] = samples[-1].snapshot.server_kind
    running = running_distribution(samples)
    out["requests_running"] = _dist(running)
    out["proxy_in_flight"] = _dist(turns.num["concurrency"][np.isfinite(turns.num["concurrency"])])
    d = window_counters(samples, samples[0].t_mono, samples[-1].t_mono)
    streamed = turns.num["streamed"] == 1  # per-stream speed and tokens per chunk are theirs alone
    per_stream = summarize(turns.num["decode_tps"][streamed]).median
    if d is not None and d.seconds:
        w0, w1 = samples[0].t_wall, samples[-1].t_wall
        done = start + np.nan_to_num(turns.num["total_s"])
        inside = (done >= w0) & (done <= w1) & np.isfinite(turns.num["completion_tokens"])
        delivered = float(np.sum(turns.num["completion_tokens"][inside]))
        out["window"] = {
            "seconds": d.seconds,
            "segments": d.segments,
            "generated_tps": d.generated_tps,
            "accepted_draft_tps": d.accepted_tps,
            "delivered_tps": delivered / d.seconds if inside.any() else None,
            "mal": d.mal,
            "mal_source": d.mal_source,
            "acceptance_rate": d.acceptance_rate,
            "drafts": d.drafts,
            "draft_tokens": d.draft_tokens,
            "accepted_tokens": d.accepted_tokens,
            "forward_passes_per_s": per_stream / d.mal if per_stream is not None and d.mal else None,
        }
    # the join is over streamed turns: a non-streamed reply is one chunk of all its tokens, which says
    # nothing about steps, and it has no decode speed to divide by the MAL
    order = np.flatnonzero(streamed)
    order = order[np.argsort(turns.num["rowid"][order], kind="stable")]
    pos, mal = _turn_counters(conn, turns.num["rowid"][order])
    if len(pos):
        at = order[pos]  # the joined turns' indices in ``turns``
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


def _dist(values) -> dict[str, Any]:
    arr = np.asarray(list(values), dtype=float)
    arr = arr[np.isfinite(arr)]
    if not arr.size:
        return {"n": 0, "median": None, "p95": None, "max": None}
    return {"n": int(arr.size), "median": float(np.median(arr)), "p95": float(np.percentile(arr, 95)),
            "max": float(arr.max())}


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _scrape_counts(s: dict[str, Any]) -> str:
    """"N scrapes, M failed", and the latest failure's error when any failed."""
    text = f"{s.get('scrapes', 0)} scrapes, {s.get('scrape_failures', 0)} failed"
    error = s.get("last_scrape_error") if s.get("scrape_failures") else None
    return text + (f" (last error: {error})" if error else "")


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
    lines.append(f"  operating point: server running median {_f(r['median'], '{:.0f}')}, p95 {_f(r['p95'], '{:.0f}')}, "
                 f"max {_f(r['max'], '{:.0f}')}; through the proxy median {_f(p['median'], '{:.0f}')}, "
                 f"p95 {_f(p['p95'], '{:.0f}')}, max {_f(p['max'], '{:.0f}')} (never the configured ceiling)")
    w = s.get("window")
    if w:
        lines.append(f"  over {w['seconds']:.1f} s: server generated {_f(w['generated_tps'], '{:.1f}')} tok/s | "
                     f"accepted drafts {_f(w['accepted_draft_tps'], '{:.1f}')} tok/s | "
                     f"delivered to clients {_f(w['delivered_tps'], '{:.1f}')} tok/s")
        lines.append(f"  MAL {_f(w['mal'], '{:.2f}')} ({w['mal_source'] or 'no counters'}; acceptance rate "
                     f"{_f(w['acceptance_rate'], '{:.2f}')}) -> forward passes/s = per-stream decode speed / MAL = "
                     f"{_f(w['forward_passes_per_s'], '{:.1f}')}")
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
