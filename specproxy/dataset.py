"""Reading turns back out of SQLite as numpy columns, with the filters every report shares.

Why columns: a report over a million turns must take seconds, so it reads only the columns it needs
with one query and computes with numpy; no Record objects are built on the way. Missing values are
NaN in float columns (missing stays missing; it never becomes 0).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from .errors import ConfigError
from .store import connect

__all__ = ["NUMERIC", "Turns", "busy_seconds", "load_turns", "parse_time", "where_clause"]

NUMERIC = (
    "t_wall",
    "status",
    "concurrency",
    "ttft_s",
    "decode_s",
    "total_s",
    "completion_tokens",
    "reasoning_tokens",
    "tool_args_tokens",
    "usage_completion_tokens",
    "usage_prompt_tokens",
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
)
TEXT = ("id", "outcome", "label", "instance_id", "tokenizer", "content_class")


@dataclass
class Turns:
    """Columns of the selected turns: ``num[name]`` float arrays, ``txt[name]`` object arrays."""

    num: dict[str, np.ndarray]
    txt: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.num["t_wall"])

    def select(self, mask: np.ndarray) -> Turns:
        return Turns({k: v[mask] for k, v in self.num.items()}, {k: v[mask] for k, v in self.txt.items()})

    @property
    def ok(self) -> np.ndarray:
        return self.txt["outcome"] == "ok"


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
                 path: str | None = None) -> tuple[str, list]:
    """The SQL filter every reader of turns shares: a label, a wall-time window, a path."""
    where, params = [], []
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
) -> Turns:
    """The measured turns, oldest first, optionally one label and a wall-time window."""
    conn = db if isinstance(db, sqlite3.Connection) else connect(db, readonly=True)
    where, params = where_clause(label=label, since=since, until=until, path=path)
    cols = NUMERIC + TEXT
    sql = f"SELECT {', '.join(cols)} FROM turns{where} ORDER BY t_wall"
    try:
        rows = conn.execute(sql, params).fetchall()
    except sqlite3.OperationalError as exc:
        raise ConfigError(f"cannot read turns: {exc} (is this a specproxy database?)") from None
    finally:
        if not isinstance(db, sqlite3.Connection):
            conn.close()
    n_num = len(NUMERIC)
    if rows:
        columns = list(zip(*rows))
    else:
        columns = [() for _ in cols]
    num = {name: np.array(columns[i], dtype=float) if rows else np.empty(0) for i, name in enumerate(NUMERIC)}
    # sqlite NULL arrives as None; np.array(..., float) turns None into nan
    txt = {name: np.array(columns[n_num + i], dtype=object) for i, name in enumerate(TEXT)}
    return Turns(num, txt)


def busy_seconds(starts: np.ndarray, ends: np.ndarray) -> float:
    """Length of the union of [start, end] intervals: the time at least one turn was in flight.

    Aggregate throughput divides by this rather than by first-start-to-last-end, so idle gaps between a
    person's chat turns (minutes, sometimes) do not count as the server being slow.
    """
    ok = np.isfinite(starts) & np.isfinite(ends)
    if not ok.any():
        return 0.0
    order = np.argsort(starts[ok], kind="stable")
    s, e = starts[ok][order], ends[ok][order]
    run_end = np.maximum.accumulate(e)
    # a new busy period starts where a start comes after every earlier end
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    period_end = np.append(run_end[idx[1:] - 1], run_end[-1])
    return float(np.sum(period_end - s[idx]))
