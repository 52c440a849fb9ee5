"""Reading turns back out of SQLite as numpy columns, with the filters every report shares.

Why columns: a report over a million turns must take seconds, so it reads only the columns it needs
with one query and computes with numpy; no Record objects are built on the way. Missing values are
NaN in float columns (missing stays missing; it never becomes 0). Turning a million SQLite rows into
Python objects still costs seconds, so ``cache=True`` serves the same columns from the columnar cache
beside the database (column_cache.py), with the same filters and order applied in numpy.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime, timezone
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specproxy.errors import ConfigError
from specproxy.store.db import connect
from specproxy.store.turns import Turns

__all__ = ["NUMERIC", "Turns", "busy_seconds", "load_turns", "parse_time", "select_columns", "where_clause"]

NUMERIC = (
    "t_wall",
    "status",
    "concurrency",
    "conn_id",
    "ttft_s",
    "decode_s",
    "total_s",
    "completion_tokens",
    "reasoning_tokens",
    "tool_args_tokens",
    "usage_completion_tokens",
    "usage_prompt_tokens",
    "usage_cached_tokens",
    "usage_cache_write_tokens",
    "chunks",
    "tokens_per_chunk",
    "decode_tps",
    "prompt_tokens",
    "prompt_system_tokens",
    "prompt_tools_tokens",
    "prompt_history_tokens",
    "prompt_new_tokens",
    "proxy_delay_s",
    "streamed",
    "request_parsed",
    "measured",
    "prefix_reused_tokens",
    "tools_defined",
    "tools_called",
)
TEXT = ("id", "outcome", "label", "instance_id", "tokenizer", "content_class", "api", "client", "session",
        "prefix_break_part", "turn_diff", "tool_names", "model", "tenant", "proxy_name")


def parse_time(value: str | None) -> float | None:
    """An ISO-8601 time (UTC when no zone is given) or epoch seconds, to epoch seconds."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"cannot read time {value!r}: use ISO 8601 (2026-11-29T08:00) or epoch seconds") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def where_clause(*, label: str | None = None, since: float | None = None, until: float | None = None,
                 path: str | None = None, measured_only: bool = True) -> tuple[str, list]:
    """The SQL filter every reader of turns shares: a label, a wall-time window, a path; and, unless
    ``measured_only`` is false, measured turns only (the rows of other paths carry no figures)."""
    where, params = (["measured IS NOT 0"] if measured_only else []), []
    for clause, value in (("label IS ?", label), ("t_wall >= ?", since), ("t_wall < ?", until), ("path = ?", path)):
        if value is not None:
            where.append(clause)
            params.append(value)
    return (" WHERE " + " AND ".join(where) if where else ""), params


def load_turns(
    db: str | Path | sqlite3.Connection,
    *,
    label: str | None = None,
    since: float | None = None,
    until: float | None = None,
    path: str | None = None,
    columns: Sequence[str] | None = None,
    cache: bool = False,
    counts: dict[str, int] | None = None,
) -> Turns:
    """The measured turns (not the rows of other paths: ``measured`` false), oldest first (ties in insertion order), optionally one label and a wall-time
    window; ``num["rowid"]`` (int64) is always there.

    ``columns``: only these of NUMERIC and TEXT (default: all). ``cache``: serve them from the columnar
    cache beside the database (see column_cache), creating or extending it; the result is identical.
    ``counts``: when the cache served the turns, ``counts["unmeasured"]`` is set to the rows of other
    paths in the same window, counted from the same columns (so that nothing is read twice).
    """
    conn = db if isinstance(db, sqlite3.Connection) else connect(db, readonly=True)
    cols = tuple(columns) if columns is not None else NUMERIC + TEXT
    unknown = [c for c in cols if c not in NUMERIC and c not in TEXT]
    if unknown:
        raise ValueError(f"unknown turn columns: {unknown}")
    want_num = tuple(c for c in NUMERIC if c in cols or c == "t_wall")  # t_wall: len() and the order
    want_txt = tuple(c for c in TEXT if c in cols)
    try:
        if cache:
            from specproxy.store.column_cache import load_columns

            filters = ("label",) * (label is not None) + ("path",) * (path is not None)
            found = load_columns(conn, NUMERIC, tuple(dict.fromkeys((*want_num, "measured"))),
                                 tuple(dict.fromkeys(want_txt + filters)))
            if found is not None:
                return select_columns(found, want_num, want_txt, label=label, since=since, until=until, path=path,
                               counts=counts)
        return _load_sql(conn, want_num, want_txt, label=label, since=since, until=until, path=path)
    finally:
        if not isinstance(db, sqlite3.Connection):
            conn.close()


def _load_sql(conn: sqlite3.Connection, want_num: tuple[str, ...], want_txt: tuple[str, ...], **window) -> Turns:
    where, params = where_clause(**window)
    names = ("rowid", *want_num, *want_txt)
    sql = f"SELECT {', '.join(names)} FROM turns{where} ORDER BY t_wall, rowid"
    try:
        rows = conn.execute(sql, params).fetchall()
    except sqlite3.OperationalError as exc:
        raise ConfigError(f"cannot read turns: {exc} (is this a specproxy database?)") from None
    columns = list(zip(*rows)) if rows else [() for _ in names]
    num = {"rowid": np.array(columns[0], dtype=np.int64)}
    # sqlite NULL arrives as None; np.array(..., float) turns None into nan
    num.update({name: np.array(columns[1 + i], dtype=float) for i, name in enumerate(want_num)})
    txt = {name: np.array(columns[1 + len(want_num) + i], dtype=object) for i, name in enumerate(want_txt)}
    return Turns(num, txt)


def select_columns(found: Any, want_num: tuple[str, ...], want_txt: tuple[str, ...], *, label: str | None,
            since: float | None, until: float | None, path: str | None, counts: dict[str, int] | None = None) -> Turns:
    """The SQL path's WHERE and ORDER BY t_wall, rowid, on columns in rowid order (NULL t_wall first): the
    SQLite cache's columns, and the PostgreSQL cache's (already in ``(t_wall, seq)`` order: kept as is).
    The result holds the found columns and the selected positions: a column is copied only when read."""
    t = found.num["t_wall"]
    measured = found.num["measured"] != 0  # NULL (NaN) is a row from before unmeasured rows: measured
    whole = Turns({}, codes=found.codes)  # the filters compare codes, not objects
    mask = np.ones(len(t), dtype=bool)
    if label is not None:
        mask &= whole.is_("label", label)
    if since is not None:
        mask &= t >= since  # NaN (NULL) compares false, as in SQL
    if until is not None:
        mask &= t < until
    if path is not None:
        mask &= whole.is_("path", path)
    if counts is not None:  # as queries.unmeasured_rows counts them: measured = 0 (not NULL)
        counts["unmeasured"] = int(np.count_nonzero(mask & (found.num["measured"] == 0)))
    mask &= measured
    idx = np.flatnonzero(mask)
    tw = t if len(idx) == len(t) else t[idx]  # every row (the common case): no gather to check the order
    in_order = len(tw) < 2 or bool(np.all(tw[1:] >= tw[:-1]))  # rowid order is usually t_wall order already
    if not in_order:
        nulls = np.isnan(tw)
        idx = idx[np.lexsort((idx, np.where(nulls, 0.0, tw), ~nulls))]  # rowid order = idx order
    num = {"rowid": found.rowid, **{name: found.num[name] for name in want_num}}
    codes = {name: found.codes[name] for name in want_txt}
    everything = len(idx) == len(t) and in_order  # the common case: no positions, nothing to copy
    return Turns(num, codes=codes, positions=None if everything else idx)


def busy_seconds(starts: np.ndarray, ends: np.ndarray) -> float:
    """Length of the union of [start, end] intervals: the time at least one turn was in flight.

    Aggregate throughput divides by this rather than by first-start-to-last-end, so idle gaps between a
    person's chat turns (minutes, sometimes) do not count as the server being slow.
    """
    ok = np.isfinite(starts) & np.isfinite(ends)
    if not ok.any():
        return 0.0
    s, e = (starts, ends) if ok.all() else (starts[ok], ends[ok])  # every turn (the common case): no copies
    if len(s) > 1 and not np.all(s[1:] >= s[:-1]):  # turns come in start order: a sort only when they are not
        order = np.argsort(s, kind="stable")
        s, e = s[order], e[order]
    run_end = np.maximum.accumulate(e)
    # a new busy period starts where a start comes after every earlier end
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    period_end = np.append(run_end[idx[1:] - 1], run_end[-1])
    return float(np.sum(period_end - s[idx]))
