"""A query's rows as columns: numbers into float64/int64 arrays, text into int32 codes and a dictionary.

Why: the columnar cache (``column_cache.py``) is built from every row of ``turns``; through the sqlite3
module each value becomes a Python object first (a month of turns: ~450 million of them, minutes). The
C reader (``_columnsc.c``) reads the same rows with SQLite's C API into flat buffers. ``read_reference``
is the plain reader it is checked against (``tests/unit/test_columnsc.py``), and the one that runs when
the extension was not built or a value is of an unexpected type.

``kinds`` names each result column's type: ``i`` int64 (no NULL), ``f`` float64 (NULL is NaN), ``t``
text as int32 codes into a list of the column's distinct strings in order of first appearance (NULL is
-1). Both readers return the same arrays and dictionaries for the same rows.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

import numpy as np

try:
    from specproxy.store import _columnsc
except ImportError:  # no compiler at install: the reference reads everything
    _columnsc = None

__all__ = ["NATIVE", "Unsupported", "read_native", "read_reference"]

NATIVE = _columnsc is not None
_FETCH = 50_000
_DTYPES = {"i": np.int64, "f": np.float64, "t": np.int32}


class Unsupported(Exception):
    """The native reader cannot read these rows as asked (a value of another type, no extension): read
    them with ``read_reference``."""


ReadColumns = tuple[list[np.ndarray], list[list | None]]  # arrays, and each text column's values


def read_reference(conn: sqlite3.Connection, sql: str, params: Sequence, kinds: str) -> ReadColumns:
    """The rows of ``sql`` through the sqlite3 module, ``_FETCH`` at a time."""
    cur = conn.execute(sql, tuple(params))
    parts: list[list[np.ndarray]] = [[] for _ in kinds]
    lookup: list[dict] = [{} for _ in kinds]
    while rows := cur.fetchmany(_FETCH):
        for i, (kind, column) in enumerate(zip(kinds, zip(*rows))):
            if kind == "t":
                d = lookup[i]
                parts[i].append(np.array([-1 if v is None else d.setdefault(v, len(d)) for v in column], dtype=np.int32))
            else:
                parts[i].append(np.array(column, dtype=_DTYPES[kind]))  # float: NULL (None) becomes NaN
    arrays = [np.concatenate(p) if p else np.empty(0, _DTYPES[k]) for p, k in zip(parts, kinds)]
    return arrays, [list(d) if k == "t" else None for d, k in zip(lookup, kinds)]


def read_native(db: Path, sql: str, params: Sequence[int | float | None], kinds: str,
                guard_sql: str | None = None) -> tuple[int | None, ReadColumns]:
    """The rows of ``sql`` read by the C reader on its own read-only connection to ``db``, in one read
    transaction that first runs ``guard_sql`` (its integer is returned first, None without one): the
    caller compares it with what it checked on its own connection, since the two may see different
    states of the file. Raises ``Unsupported`` when the reference must read them instead."""
    if _columnsc is None:
        raise Unsupported("the C column reader was not built")
    try:
        guard, rows, buffers, dicts = _columnsc.read(str(db), sql, tuple(params), kinds, guard_sql)
    except _columnsc.Unsupported as exc:
        raise Unsupported(str(exc)) from None
    arrays = [np.frombuffer(b, dtype=_DTYPES[k]) if len(b) else np.empty(0, _DTYPES[k]) for b, k in zip(buffers, kinds)]
    for a in arrays:
        if len(a) != rows:
            raise RuntimeError("column reader: a buffer's length disagrees with the row count")
    return guard, (arrays, dicts)
