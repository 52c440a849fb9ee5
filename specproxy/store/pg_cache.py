"""A columnar cache of a fleet's PostgreSQL ``turns``, checked day partition by day partition against the
database on every load.

Why: reading every turn of a fleet from PostgreSQL costs seconds per million (7.1 s at 1M turns,
docs/performance.md: the rows travel, psycopg makes objects of them); the same columns mapped from
``.npy`` files take a fraction of that. The cache is derived data and must never change a number: each
load checks it, and whatever it cannot vouch for is read from PostgreSQL again. The files are the SQLite
cache's (``column_segments.py``); what differs is where the cache lives, what keys it and how a change is
found.

Where: PostgreSQL has no file to put it beside, so in the user's cache directory,
``$XDG_CACHE_HOME/specproxy/pg-<hash>/`` (``~/.cache/specproxy/...`` without XDG_CACHE_HOME;
``$SPECPROXY_CACHE_DIR/pg-<hash>/`` when that is set), the hash
of the database's identity: the cluster's ``system_identifier`` (made by initdb, kept by a host rename
or a new address, different in every other cluster, a restored dump included) and the database's oid
(a second database of the cluster, a copy made from it as a template). Deleting the directory is always
safe; ``specproxy report --no-cache`` bypasses it. A directory that cannot be made or written means no
cache, never an error.

Why per day: ``turns`` is partitioned by UTC day (``sinks/pg_migrations.py``) and retention drops whole
days, so a day is the unit that changes together: each day's rows are a range of one segment, in
``(t_wall, seq)`` order, so the days in order are the whole table in the report's order. A build writes
every day into one segment (a load of every day is then its mapped files, no copy), a day read again
later gets a segment of its own (``_segments`` says why). Why not "rows
above the cached ``seq``": four proxies ship concurrently, and a batch can commit after another that took
higher ``seq`` values, so a row can appear below the cached maximum; late shipping adds rows to old days.

What keys it, checked on every load in one REPEATABLE READ snapshot (the check and the days re-read are
the same state of the database): the cache format and the cached columns; the database's identity; the
applied migrations (a new column rebuilds); per day, the partition's oid and ``relfilenode`` (a
partition dropped and made again, a TRUNCATE, a restore) and the day's count of changing statements,
``turn_days.changes`` (migration ``006_turn_days``: statement-level triggers on ``turns`` for INSERT,
DELETE and UPDATE add one to each day a statement touched, in the statement's transaction). A day whose
four values equal the cached ones is served from its segment; any other day is read again whole; a day
whose partition is gone (``prune``) leaves the cache. A window reads only the days it touches, and
when one of them changed and the window holds only part of it (the last hour, while proxies ship into
today), the window is read from PostgreSQL instead: a day is ~24 times the rows of an hour. Why a
counter and not ``count(*), sum(seq)`` per partition: that check scans every row, 0.5 s at 1M turns
(3.3 s at 10M, where a whole warm load takes 0.24 s); the counter is one row per day, read in
milliseconds. What the triggers cost a shipper: one statement per batch (docs/performance.md). A
database without ``turn_days`` (no proxy of this version has shipped to it yet) is read directly, and
``last_status`` says why; so is one with a partition that is not a day (``turns_YYYYMMDD``).

What it cannot see: a change made with the triggers off (``session_replication_role = replica``,
``ALTER TABLE ... DISABLE TRIGGER``) or written into a partition by its own name (statement triggers of
``turns`` fire only for statements on ``turns``; specproxy writes only there), and a change of the
cache's own files in place (``column_segments.py``). Delete the directory after such edits.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psycopg
from psycopg.types.composite import RecordLoader

from specproxy.store.column_cache import CACHED_TEXT, Columns
from specproxy.store.column_segments import (FORMAT, Invalid, Table, coded, load_segment, merge, read_manifest,
                                             write_manifest, write_segment)
from specproxy.store.dataset import NUMERIC
from specproxy.store.sinks.pg_retention import day_of
from specproxy.store.sinks.postgres import DAY_S

__all__ = ["TABLE", "cache_root", "load_columns"]

log = logging.getLogger("specproxy.cache")

TABLE = Table("turns", NUMERIC, CACHED_TEXT)
# what the last load did (tests, benchmarks): hit, build, update (N of M days read), narrow: why (the window read
# from PostgreSQL), unusable: why
last_status = "off"
MAX_SEGMENTS = 8


def cache_root() -> Path:
    """Where the caches of PostgreSQL databases go: ``$SPECPROXY_CACHE_DIR`` when set (the tests' own
    directory), else ``$XDG_CACHE_HOME/specproxy`` or ``~/.cache/specproxy``."""
    if os.environ.get("SPECPROXY_CACHE_DIR"):
        return Path(os.environ["SPECPROXY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specproxy"


@dataclass(frozen=True)
class _Day:
    """One day partition as the database holds it now: what its segment is checked against."""

    day: int
    oid: int
    relfilenode: int
    changes: int

    def key(self) -> dict:
        return {"day": self.day, "oid": self.oid, "relfilenode": self.relfilenode, "changes": self.changes}


def _state(conn: psycopg.Connection) -> tuple[dict, list[_Day]]:
    """The database's key and its day partitions, oldest first (``Invalid`` when the cache cannot know
    its rows are current)."""
    system = conn.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0]
    datoid = conn.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()[0]
    migrations = [r[0] for r in conn.execute("SELECT name FROM specproxy_migrations ORDER BY name")]
    if conn.execute("SELECT to_regclass('turn_days')").fetchone()[0] is None:
        raise Invalid("no turn_days (migration 006_turn_days): a database no proxy of this version has shipped to")
    changes = dict(conn.execute("SELECT day, changes FROM turn_days").fetchall())
    days = []
    for oid, name, node in conn.execute(
            "SELECT c.oid, c.relname, c.relfilenode FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'turns'::regclass"):
        day = day_of(name)
        if day is None:
            raise Invalid(f"partition {name} is not a day")
        days.append(_Day(day, int(oid), int(node), int(changes.get(day, 0))))
    key = {"format": FORMAT, "numeric": list(TABLE.numeric), "text": list(TABLE.text), "system": str(system),
           "datoid": int(datoid), "migrations": migrations}
    return key, sorted(days, key=lambda d: d.day)


def _cache_dir(key: dict) -> Path:
    ident = hashlib.sha256(f"{key['system']}/{key['datoid']}".encode()).hexdigest()[:16]
    return cache_root() / f"pg-{ident}"


def _read_day(conn: psycopg.Connection, day: int) -> tuple[dict[str, np.ndarray], dict]:
    """Every turn of one day, in ``(t_wall, seq)`` order: ``rowid`` (seq), every numeric column and the
    text columns as codes, and their dictionaries.

    How: the numbers packed by PostgreSQL into one binary string per row (as ``pg_source.py`` reads them),
    the text columns as one record per row (``ROW(...)::text``): a day's turns hold few distinct
    combinations of outcome, label, instance, model..., so each row costs one dictionary look-up and only
    the distinct records are parsed (2.5x faster than a value per text column and row)."""
    packed = " || ".join(["int8send(seq)", *(f"float8send(coalesce({c}::float8, 'NaN'))" for c in TABLE.numeric)])
    with conn.cursor(binary=True) as cur:
        rows = cur.execute(f"SELECT {packed}, ROW({', '.join(TABLE.text)})::text FROM turns "
                           "WHERE t_wall >= %s AND t_wall < %s", (day * DAY_S, (day + 1) * DAY_S)).fetchall()
    nums = np.frombuffer(b"".join(r[0] for r in rows), dtype=[("seq", ">i8"), *((c, ">f8") for c in TABLE.numeric)])
    combos: dict[str, int] = {}
    combo = np.fromiter((combos.setdefault(r[1], len(combos)) for r in rows), dtype=np.int32, count=len(rows))
    order = np.lexsort((nums["seq"], nums["t_wall"]))
    arrays = {"rowid": nums["seq"][order].astype(np.int64)}
    arrays.update({c: nums[c][order].astype(np.float64) for c in TABLE.numeric})
    loader = RecordLoader(0, conn)
    records = [loader.load(text.encode()) for text in combos]
    combo = combo[order]
    dicts: dict[str, list] = {}
    for i, name in enumerate(TABLE.text):
        values: dict[str, int] = {}
        per_combo = np.array([-1 if r[i] is None else values.setdefault(r[i], len(values)) for r in records],
                             dtype=np.int32)
        arrays[name] = per_combo[combo] if len(records) else np.empty(0, np.int32)
        dicts[name] = list(values)
    return arrays, dicts


class _Narrow(Exception):
    """A day the window covers in part changed: reading the window from PostgreSQL is cheaper than the day."""


def _write(cdir: Path, parts: list[tuple[_Day, dict[str, np.ndarray], dict]]) -> dict:
    """Days' rows (every column, each day's text dictionaries) as one segment, in the order given; its
    manifest entry, with each day's check and row range (``days``)."""
    arrays, dicts = merge(TABLE.text, [{"dicts": p[2]} for p in parts], [p[1] for p in parts])
    seg = write_segment(cdir, TABLE, arrays, dicts)
    bounds = np.cumsum([0, *(len(p[1]["rowid"]) for p in parts)]).tolist()
    seg["days"] = [{"check": d.key(), "start": a, "stop": b} for (d, _, _), a, b in zip(parts, bounds, bounds[1:])]
    return seg


def _fits(seg: dict, part: dict) -> bool:
    """Whether a day's entry is well formed: a check, and a range of the segment's rows."""
    try:
        return (isinstance(part["check"], dict) and "day" in part["check"]
                and 0 <= part["start"] <= part["stop"] <= seg["rows"])
    except (KeyError, TypeError):
        return False


def _segments(conn: psycopg.Connection, cdir: Path, key: dict, days: list[_Day], wanted: list[_Day],
              names: set[str], whole: Callable[[int], bool]) -> tuple[list[dict], list[dict[str, np.ndarray]], str]:
    """The ``names`` columns of the ``wanted`` days, as pieces to merge (text dictionaries, arrays), each
    day checked and the stale ones read again (and saved when the directory can be written), and what
    was done. ``_Narrow`` when a stale day is one the window does not cover ``whole``: an hour of today
    is not worth reading today.

    Why segments of several days: concatenating a week of day segments costs a copy of every column
    (1.1 s at 10M turns, more than all the rest of a warm load), while the days of one segment, in
    order, are a slice of its mapped files: no copy. So a build writes one segment of all its days,
    a later change one segment for each day read again (the old segment keeps its other days), and past
    ``MAX_SEGMENTS`` everything is written again as one."""
    entry = read_manifest(cdir).get("turns")
    old = [s for s in entry["segments"] if isinstance(s, dict)] if entry is not None and entry.get("key") == key else []
    where = {part["check"]["day"]: (seg, part) for seg in old for part in seg.get("days", []) if _fits(seg, part)}
    stale = {d.day for d in wanted if d.day not in where or where[d.day][1]["check"] != d.key()}
    for day in sorted(stale):
        if not whole(day):
            raise _Narrow(f"day {day} changed and the window holds part of it: read from PostgreSQL")
    files: dict[str, dict[str, np.ndarray]] = {}
    pieces: list[tuple[dict, dict[str, np.ndarray], int, int]] = []  # (dictionaries, columns, start, stop)
    fresh: list[tuple[_Day, dict[str, np.ndarray], dict]] = []
    for d in wanted:
        if d.day not in stale:
            seg, part = where[d.day]
            try:
                if seg["dir"] not in files:
                    files[seg["dir"]] = load_segment(cdir, TABLE, seg, names)
                if pieces and pieces[-1][1] is files[seg["dir"]] and pieces[-1][3] == part["start"]:
                    pieces[-1] = (*pieces[-1][:3], part["stop"])  # the next day of the same segment: one slice
                else:
                    pieces.append((seg["dicts"], files[seg["dir"]], part["start"], part["stop"]))
                continue
            except (Invalid, OSError, KeyError, TypeError, ValueError) as exc:
                log.info("column cache of PostgreSQL day %s read again: %s", d.day, exc)
                stale.add(d.day)
        arrays, dicts = _read_day(conn, d.day)
        fresh.append((d, arrays, dicts))
        pieces.append((dicts, arrays, 0, len(arrays["rowid"])))
    status = "hit" if not fresh else "build" if not old else f"update ({len(fresh)} of {len(wanted)} days read)"
    present = {d.day for d in days}
    if fresh or set(where) - present:  # new segments, or a dropped day's to remove
        try:
            _save(cdir, entry, key, old, fresh, stale, present)
        except OSError as exc:  # read-only or full: no cache, no error
            log.debug("column cache of PostgreSQL not written: %s", exc)
            status += " (not saved)"
    loaded = [{n: a[n][lo:hi] for n in names} for _, a, lo, hi in pieces]
    return [{"dicts": p[0]} for p in pieces], loaded, status


def _save(cdir: Path, entry: dict | None, key: dict, old: list[dict], fresh: list, stale: set[int],
          present: set[int]) -> None:
    """The manifest after a load: the old segments without their stale and dropped days (a segment left
    with none goes), the fresh days as one segment when nothing old is left (a build) or one each, and
    everything as one past MAX_SEGMENTS."""
    cdir.mkdir(parents=True, exist_ok=True)
    segs = []
    for seg in old:
        days = [p for p in seg.get("days", []) if p["check"]["day"] in present and p["check"]["day"] not in stale]
        if days:
            segs.append({**seg, "days": days})
    if not segs and fresh:
        segs = [_write(cdir, fresh)]
    elif len(segs) + len(fresh) > MAX_SEGMENTS:
        parts = list(fresh)
        for seg in segs:
            cols = load_segment(cdir, TABLE, seg, {"rowid", *TABLE.numeric, *TABLE.text})
            parts += [(_Day(**p["check"]), {n: a[p["start"]:p["stop"]] for n, a in cols.items()}, seg["dicts"])
                      for p in seg["days"]]
        segs = [_write(cdir, sorted(parts, key=lambda p: p[0].day))]
    else:
        segs += [_write(cdir, [f]) for f in fresh]
    previous = {s.get("dir") for s in entry["segments"] if isinstance(s, dict)} if entry else set()
    write_manifest(cdir, "turns", {"key": key, "segments": segs}, previous)


def load_columns(conn: psycopg.Connection, want_num: tuple[str, ...], want_txt: tuple[str, ...],
                 since: float | None = None, until: float | None = None) -> Columns | None:
    """Every turn of the days ``[since, until)`` touches (all days when None), with these columns, in
    ``(t_wall, seq)`` order, from the cache brought up to date; None when it cannot serve them (read
    PostgreSQL instead; ``last_status`` says why). The window's own filter is the caller's."""
    global last_status
    last_status = "unusable"
    if not set(want_num) <= set(TABLE.numeric) or not set(want_txt) <= set(TABLE.text):
        return None
    names = {"rowid", *want_num, *want_txt}
    try:
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            key, days = _state(conn)
            lo = -np.inf if since is None else since // DAY_S
            hi = np.inf if until is None else until // DAY_S
            wanted = [d for d in days if lo <= d.day <= hi]

            def whole(day: int) -> bool:
                return (since is None or since <= day * DAY_S) and (until is None or until >= (day + 1) * DAY_S)

            segs, loaded, last_status = _segments(conn, _cache_dir(key), key, days, wanted, names, whole)
    except _Narrow as exc:
        last_status = f"narrow: {exc}"
        return None
    except (Invalid, psycopg.Error) as exc:
        last_status = f"unusable: {type(exc).__name__}: {exc}"
        log.debug("column cache of PostgreSQL unusable: %s", exc)
        return None
    if not loaded:
        arrays = {n: np.empty(0, TABLE.dtype(n)) for n in names}
        dicts = {n: [] for n in want_txt}
    else:
        arrays, dicts = merge(TABLE.text, segs, loaded)
    return Columns(rowid=arrays["rowid"], num={n: arrays[n] for n in want_num},
                   codes={n: coded(arrays[n], dicts[n]) for n in want_txt})
