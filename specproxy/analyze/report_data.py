"""The report's figures: what users actually got, as a JSON-able dict (``report`` renders it as text).

Why a dict first: ``--json`` and the text are two renderings of one computation, so they cannot
disagree. Every figure that summarises comes with n, median, p95 and a 95% interval; every cell says
which cell it is (concurrency bucket, prompt-length bucket); at each concurrency both per-stream and
aggregate throughput are computed, with which one to read there.

Streamed and non-streamed turns are two populations. A non-streamed reply arrives at once: its
"TTFT" is the whole response time, it has no decode time or speed, and it is one chunk of all its
tokens. So every stream figure (TTFT, decode speed and time, tokens per chunk, the tables' TTFT,
per-stream speed and tokens per chunk, the per-turn MAL join) is over streamed turns only, and
non-streamed turns get their own figures (whole response time, tokens). Figures that mean the same for
both kinds (prompt make-up, the operating point, aggregate throughput, the server's counters) are over
all completed turns.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from specproxy.store.dataset import Turns
from specproxy.store.source import WindowData
from specproxy.analyze.prefix_cache import PREFIX_CACHE_COLUMNS, prefix_cache_section
from specproxy.analyze.server_report import server_section
from specproxy.analyze.speedup import required_decode_speedup, window_speedups
from specproxy.analyze.groups import GROUP_COLUMNS, by_group, cost_section
from specproxy.analyze.cells import (CONCURRENCY_BUCKETS, PROMPT_BUCKETS, bucket_side, concurrency_buckets, groups,
                                    prompt_buckets)
from specproxy.analyze.slo import attainment, met_of_turns
from specproxy.analyze.by_cell import (cell_counts, finite_by_cell, release_scratch, scratch, text_cells, text_values,
                                      throughput_by_cell, throughput_of)
from specproxy.analyze.deferred import figures_in_parallel, later, part, resolved
from specproxy.analyze.summary import summarize, summarize_finite
from specproxy.config import Slo

__all__ = ["ENGINE_SPEEDUPS", "NON_STREAMED_FIGURES", "PROMPT_PARTS", "REPORT_COLUMNS", "USER_FIGURES",
           "aggregate_throughput", "build_report", "report_columns", "streamed_mask"]

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


def _column_summary(turns: Turns, col: str, scale: float) -> dict[str, Any]:
    """``summarize`` of column ``col`` of ``turns`` times ``scale``, as a dict: its finite values read through
    the turns' positions in one pass (``by_cell``), not a selected copy filtered into another (the same
    values, in the same order)."""
    values, positions = turns.source(col)
    (finite,) = finite_by_cell(values, positions, None, 1, alloc=scratch)  # read before the next use
    turns.release(col)
    return (summarize_finite(finite) if scale == 1.0 else summarize(finite * scale)).to_dict()


def aggregate_throughput(turns: Turns) -> dict[str, Any]:
    """Delivered tokens / the time at least one of these turns was in flight (wall clock: ``throughput_of``).

    Over streamed and non-streamed turns alike: a non-streamed turn keeps the server busy and its
    tokens are delivered as surely as a streamed one's, only at once. Leaving it out would drop its
    tokens but not the time it overlapped streamed turns, and understate what the card put out.
    """
    return throughput_of(turns.num["t_wall"], turns.num["total_s"], turns.num["completion_tokens"])


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
    The figures that depend only on their own columns are computed on a small thread pool meanwhile
    (``deferred``): the same figures, in the same order.
    """
    try:
        with figures_in_parallel():
            return resolved(_figures(data, source=source, prices=prices, by=by, slo=slo))
    finally:
        release_scratch()  # this thread's (on one core the figures ran here); the pool's went with its threads


def _figures(data: WindowData, *, source: str, prices: Mapping | None, by: str | None,
             slo: Slo | None) -> dict[str, Any]:
    """``build_report``'s dict, some figures in it still Futures (``deferred.resolved`` reads them)."""
    turns, window = data.turns, data.window.as_dict()
    n_all = len(turns)
    outcomes: dict[str, int] = {}
    for o, count in turns.counts("outcome").items():
        outcomes[str(o)] = outcomes.get(str(o), 0) + count
    ok = turns.select(turns.ok) if n_all else turns
    report: dict[str, Any] = {
        "source": source,
        "turns": n_all,
        "outcomes": outcomes,
        "first_t_wall": float(np.min(turns.num["t_wall"])) if n_all else None,
        "last_t_wall": float(np.max(turns.num["t_wall"])) if n_all else None,
        "tokenizers": sorted({str(t) for t in turns.distinct("tokenizer") if t}),
        "labels": sorted({str(t) for t in turns.distinct("label") if t}),
        "window": window,
        # the whole database, loaded only when the window selects nothing: None otherwise
        "database_turns": data.database if not n_all else None,
        # other paths' rows in the same window: forwarded and recorded, never part of a figure
        "unmeasured": data.unmeasured,
    }
    is_streamed = streamed_mask(ok)
    every = bool(is_streamed.all())
    streamed = ok if every else ok.select(is_streamed, columns=STREAM_COLUMNS)
    whole = ok.select(~is_streamed, columns=("t_wall", *(col for _, col, *_ in NON_STREAMED_FIGURES)))
    # completed turns of each kind: "user" is over the first, "non_streamed" over the second
    report["completed_turns"] = {"streamed": len(streamed), "non_streamed": len(whole)}
    report["user"] = {key: later(_column_summary, streamed, col, scale) for key, col, _, scale, _ in USER_FIGURES}
    report["non_streamed"] = {key: later(_column_summary, whole, col, scale)
                              for key, col, _, scale, _ in NON_STREAMED_FIGURES}
    report["usage_vs_delivered"] = later(_usage_gap, ok)
    report["prompt"] = later(_prompt, ok)
    report["by_concurrency"] = _by_concurrency(ok, None if every else is_streamed)
    report["by_prompt_length"] = _by_prompt_length(streamed)
    report["by_content_class"] = _by_content_class(streamed)
    report["operating_point"] = {"concurrency": later(_column_summary, ok, "concurrency", 1.0)}
    report["whole_turn"] = later(_whole_turn, ok, is_streamed)
    report["prefix_cache"] = later(prefix_cache_section, ok)
    report["cost"] = cost_section(turns, prices) if n_all else None
    report["by"] = by_group(turns, by, prices) if by and n_all else None
    report["by_proxy"] = _by_name(ok, None if every else is_streamed, "proxy_name")
    report["by_instance"] = _by_name(ok, None if every else is_streamed, "instance_id")
    if slo is not None:
        report["slo"] = _slo(turns, slo) if n_all else {"objective": slo.as_dict(), "overall": None,
                                                       "by_concurrency": []}
    if data.scrapes is not None and data.lone is not None:
        # its per-stream speed is the user figure's median (the same values, in the same order)
        report["server"] = later(functools.partial(
            server_section, data.scrapes, data.lone, ok, span=turns, until=window["until"],
            per_stream=resolved(report["user"]["decode_tps"])["median"]))
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
    """Our delivered count beside the server's own usage count, where both exist (the completed turns'
    ``completion_tokens`` and ``usage_completion_tokens``)."""
    ours, theirs = ok.num["completion_tokens"], ok.num["usage_completion_tokens"]
    both = np.isfinite(ours) & np.isfinite(theirs)
    ours, theirs = ours[both], theirs[both]  # each selected once: the sums and the difference read them
    diff = theirs - ours
    return {
        "n": int(both.sum()),
        "delivered_tokens": float(ours.sum()) if both.any() else None,
        "usage_tokens": float(theirs.sum()) if both.any() else None,
        "median_usage_minus_delivered": float(np.median(diff)) if both.any() else None,
    }


def _prompt(ok: Turns) -> dict[str, Any]:
    """Each part's median tokens per turn, and its share of all prompt tokens: the parts' sums over the
    turns that have every part, over those turns' prompt tokens. The parts of a turn add up to its
    prompt, so the shares add up to 1 (the medians need not add up to the median prompt, and shares of
    it did not: ~70%)."""
    # each column read once (a month's column is a copy): its summary, its sum and whether it is whole, then
    # let go of before the next; the sums over the split turns are the sums when every turn is split (the
    # common case), else read again over those turns
    summaries: dict[str, dict[str, Any]] = {}
    sums: dict[str, float] = {}
    whole: np.ndarray | None = None
    for col in ("prompt_tokens", *PROMPT_PARTS):
        values = ok.num[col]
        summaries[col] = summarize(values).to_dict()
        sums[col] = float(np.sum(values))
        whole = np.isfinite(values) if whole is None else whole & np.isfinite(values)
        del values
    split = int(np.count_nonzero(whole))
    if split != len(whole):
        sums = {col: float(np.sum(ok.num[col][whole])) for col in sums}
    tokens = sums["prompt_tokens"]
    out: dict[str, Any] = {"prompt_tokens": summaries["prompt_tokens"], "split_turns": split,
                           "split_tokens": tokens if split else None}
    for name in PROMPT_PARTS:
        part_tokens = sums[name] if split else None
        out[name] = {**summaries[name], "tokens": part_tokens,
                     "share_of_prompt_tokens": part_tokens / tokens if split and tokens > 0 else None}
    return out


def _cells(turns: Turns, key: str, names: Any, index: np.ndarray, extra, is_streamed: np.ndarray | None,
           throughput: bool = False, summaries: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One row per non-empty cell of ``index`` (each turn's cell, -1: none): which cell it is, then n, TTFT
    and per-stream speed over the cell's streamed turns (``is_streamed``, None when all were), plus
    ``extra(b, turns_in_cell, aggregate)`` (``aggregate``: its aggregate throughput over all its turns, with
    ``throughput``, else None) and the summary of each of ``summaries``' columns over all its turns.

    Each column is read once for the whole table, through the turns' positions (``by_cell``), on the
    report's pool: a cell's values are the ones a selection of its turns held, in the same order."""
    ncell = len(names)
    whole = cell_counts(index, ncell)
    mine = whole if is_streamed is None else cell_counts(index, ncell, is_streamed)
    stream = {col: later(_cell_summaries, turns, col, index, ncell, is_streamed) for col in ("ttft_s", "decode_tps")}
    over_all = {col: later(_cell_summaries, turns, col, index, ncell, None) for col in summaries}
    agg = later(_cell_throughputs, turns, index, ncell) if throughput else None
    rows = []
    for b in np.flatnonzero(whole).tolist():
        row = {key: names[b], "n": int(mine[b]), "ttft_s": part(stream["ttft_s"], b),
               "per_stream_tps": part(stream["decode_tps"], b),
               **extra(b, int(whole[b]), None if agg is None else part(agg, b))}
        row.update({col: part(figures, b) for col, figures in over_all.items()})
        rows.append(row)
    return rows


def _cell_summaries(turns: Turns, col: str, index: np.ndarray, ncell: int, mask: np.ndarray | None) -> list[dict]:
    """Each cell's summary of ``col`` over its turns that ``mask`` keeps (None: all)."""
    values, positions = turns.source(col)
    cells = finite_by_cell(values, positions, index, ncell, mask, alloc=scratch)  # read before the next use
    turns.release(col)
    return [summarize_finite(v).to_dict() for v in cells]


def _cell_throughputs(turns: Turns, index: np.ndarray, ncell: int) -> list[dict[str, Any]]:
    """Each cell's aggregate throughput over all its turns (``aggregate_throughput`` of each)."""
    (t_wall, positions), (total_s, _), (tokens, _) = (turns.source(c) for c in ("t_wall", "total_s", "completion_tokens"))
    got = throughput_by_cell(t_wall, total_s, tokens, positions, index, ncell)
    for c in ("t_wall", "total_s", "completion_tokens"):
        turns.release(c)
    return got


def _by_concurrency(ok: Turns, is_streamed: np.ndarray | None) -> list[dict[str, Any]]:
    """Stream figures over each cell's streamed turns; aggregate throughput (with its own n) over all its
    turns, as concurrency counts every turn in flight; and which figure to read there (its median
    concurrency's, which the cell's range decides: ``bucket_side``)."""
    return _cells(ok, "concurrency", CONCURRENCY_BUCKETS, _buckets_of(ok, "concurrency", concurrency_buckets),
                  lambda b, n, agg: {"aggregate": agg, "read": bucket_side(b)}, is_streamed, throughput=True)


def _buckets_of(turns: Turns, col: str, bucketing) -> np.ndarray:
    """``bucketing`` (``concurrency_buckets``, ``prompt_buckets``) of column ``col`` of ``turns``, read through
    their positions."""
    values, positions = turns.source(col)
    index = bucketing(values, positions)
    turns.release(col)
    return index


def _by_prompt_length(streamed: Turns) -> list[dict[str, Any]]:
    return _cells(streamed, "prompt_tokens", PROMPT_BUCKETS, _buckets_of(streamed, "prompt_tokens", prompt_buckets),
                  lambda b, n, agg: {}, None)


def _by_name(ok: Turns, is_streamed: np.ndarray | None, column: str) -> list[dict[str, Any]]:
    """One row per proxy (``proxy_name``) or server instance (``instance_id``) when the completed turns
    come from more than one (else none): its turns, TTFT and per-stream speed over its streamed turns, and
    its aggregate throughput, so that one slow machine of a fleet shows beside the others. Rows by name;
    turns without a name (recorded before it was, or by a proxy that could not tell) are one row, None."""
    if column not in ok.txt or not len(ok):
        return []
    present = text_values(ok, column)
    known = sorted({str(v) for v in present if v is not None})
    order = [*known, None] if None in present else known
    if len(order) < 2:
        return []
    # None's row (and any value not equal to its name's text): after the named ones
    index = text_cells(ok, column, {name: i for i, name in enumerate(known)}, default=len(known))
    key = "proxy" if column == "proxy_name" else "instance"
    return _cells(ok, key, order, index, lambda b, n, agg: {"turns": n, "aggregate": agg}, is_streamed,
                  throughput=True)


CONTENT_CLASSES = ("prose", "code", "tool_call")


def _by_content_class(streamed: Turns) -> list[dict[str, Any]]:
    """Code, prose and tool calls apart: acceptance (tokens per chunk, decode speed) differs by class.
    Over streamed turns: a non-streamed reply is one chunk of all its tokens, not an acceptance length."""
    index = text_cells(streamed, "content_class", {name: i for i, name in enumerate(CONTENT_CLASSES)})
    return _cells(streamed, "content_class", CONTENT_CLASSES, index, lambda b, n, agg: {}, None,
                  summaries=("tokens_per_chunk",))


def _whole_turn(ok: Turns, streamed: np.ndarray) -> dict[str, Any]:
    """The speedup a user would feel for engine decode speedups, from this traffic (the streamed ones of the
    completed turns).

    TTFT held (prefill does not get faster when decoding does), in the before-a-change form, over the
    window's summed TTFT and decode time: the exact ratio of all users' turn time before and after.
    """
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
