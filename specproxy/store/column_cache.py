"""A columnar cache of the ``turns`` table beside the database, checked against it on every load.

Why: a report over a million turns spent ~9 s turning SQLite rows into Python objects and those into
numpy columns; the same columns read back from one ``.npy`` file each take a fraction of a second.
The cache is derived data and must never change a number, so every load checks it against the
database and, whenever it cannot vouch for it, the caller reads SQLite as before.

Where: ``<db>.cache/`` beside the database file (``specproxy.db`` -> ``specproxy.db.cache/``):
``manifest.json`` and immutable segment directories ``seg-*/``, each with one ``.npy`` per column
(text columns as int32 codes into a dictionary kept in the manifest). Deleting the directory is
always safe; ``specproxy report --no-cache`` bypasses it.

Why incremental: specproxy only ever inserts turns (``INSERT OR REPLACE`` of a turn id that exists
deletes that row and inserts a new one with a new rowid; nothing runs ``UPDATE turns``), so the rows
with a rowid above the cached maximum are the new ones: they are read, appended as a new segment,
and segments are merged when there are more than ``MAX_SEGMENTS``.

What keys it, checked on every load inside one read transaction:

* the cache format, the cached column names, the database file's device and inode (a file put in
  its place is another inode), ``PRAGMA schema_version``, the ``turns`` table's SQL and the applied
  migrations (a migration or any schema change rebuilds);
* the cached rows are still exactly there: per label, the count and the sum of rowids of the rows up
  to the cached maximum rowid equal the cache's (a deleted, replaced or relabelled row, or rowids
  renumbered by VACUUM, changes them; served by the label index); a checksum of every ``t_wall`` in
  microseconds equals the cache's (served by the t_wall index); the first, the last and a few random
  cached rows equal their database rows in every column loaded;
* every file's size and CRC-32 equal the manifest's (a torn or corrupted file is a rebuild).

Writes go to a ``tmp-*`` directory renamed into place, then the manifest is replaced atomically: a
crashed writer leaves at most an unreferenced directory, cleaned up later. A directory that cannot
be written (read-only database directory) means no cache, never an error. The one change the checks
do not see for sure is another program's in-place ``UPDATE`` of a column other than ``label`` and
``t_wall`` (seen only if a sampled row is hit): delete the cache directory after such an edit.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import sqlite3
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["CACHED_TEXT", "Columns", "cache_dir", "db_file", "load_columns"]

log = logging.getLogger("specproxy.cache")

FORMAT = 1
# text columns with few distinct values: stored as codes into a dictionary ("id" is not cached)
CACHED_TEXT = ("outcome", "label", "instance_id", "tokenizer", "content_class", "path", "api", "client", "session",
               "prefix_break_part", "turn_diff", "tool_names", "model", "tenant", "proxy_name")
MAX_SEGMENTS = 8
SAMPLED_ROWS = 16
_PRIME = 2147483647  # t_wall checksum: sum of (microseconds since the first turn) mod this prime
_FETCH = 50_000


@dataclass
class Columns:
    """Every turn, in rowid order: ``rowid`` int64, ``num`` float64 arrays, ``codes`` the text columns as
    (int32 codes, values), -1 for NULL: handed over as stored, never decoded to objects here."""

    rowid: np.ndarray
    num: dict[str, np.ndarray]
    codes: dict[str, tuple[np.ndarray, list]]


def cache_dir(db_path: str | Path) -> Path:
    p = Path(db_path)
    return p.with_name(p.name + ".cache")


def db_file(conn: sqlite3.Connection) -> Path | None:
    """The file behind the connection's main database (None for an in-memory or temporary one)."""
    for _, name, path in conn.execute("PRAGMA database_list"):
        if name == "main":
            return Path(path) if path else None
    return None


class _Invalid(Exception):
    """The cache cannot vouch for these rows: rebuild it (or read SQLite)."""


# --- the key --------------------------------------------------------------------------------------


def _key(conn: sqlite3.Connection, db: Path, numeric: tuple[str, ...]) -> dict:
    st = os.stat(db)
    (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'turns'").fetchone() or (None,)
    try:
        migrations = [r[0] for r in conn.execute("SELECT name FROM _migrations ORDER BY name")]
    except sqlite3.OperationalError:
        migrations = None
    return {
        "format": FORMAT,
        "numeric": list(numeric),
        "text": list(CACHED_TEXT),
        "dev": st.st_dev,
        "ino": st.st_ino,
        "schema_version": conn.execute("PRAGMA schema_version").fetchone()[0],
        "turns_sql": sql,
        "migrations": migrations,
    }


# --- files ------------------------------------------------------------------------------------------


def _save(path: Path, arr: np.ndarray) -> list[int]:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
    return [len(data), zlib.crc32(data)]


def _load(path: Path, size_crc: list[int], rows: int) -> np.ndarray:
    """One column file, checked against the manifest's size and CRC-32 and the segment's row count."""
    size, crc = size_crc
    buf = bytearray(size)
    with open(path, "rb") as f:
        if f.readinto(buf) != size or f.read(1):
            raise _Invalid(f"{path.name}: size changed")
    if zlib.crc32(buf) != crc:
        raise _Invalid(f"{path.name}: checksum")
    fp = io.BytesIO(buf)
    version = np.lib.format.read_magic(fp)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(fp)
    else:
        shape, _, dtype = np.lib.format.read_array_header_2_0(fp)
    if shape != (rows,) or dtype.hasobject or size - fp.tell() != rows * dtype.itemsize:
        raise _Invalid(f"{path.name}: shape")
    return np.frombuffer(buf, dtype=dtype, count=rows, offset=fp.tell())


def _read_manifest(cdir: Path) -> dict | None:
    try:
        with open(cdir / "manifest.json", "rb") as f:
            m = json.loads(f.read())
        return m if isinstance(m, dict) and isinstance(m.get("segments"), list) else None
    except (OSError, ValueError):
        return None


# --- reading rows from SQLite -------------------------------------------------------------------------


def _fetch(conn: sqlite3.Connection, numeric: tuple[str, ...], after: int) -> tuple[dict[str, np.ndarray], dict]:
    """Rows with rowid > ``after``, rowid order: arrays (rowid, numeric, text codes) and dictionaries."""
    cols = ("rowid", *numeric, *CACHED_TEXT)
    cur = conn.execute(f"SELECT {', '.join(cols)} FROM turns WHERE rowid > ? ORDER BY rowid", (after,))
    parts: dict[str, list[np.ndarray]] = {c: [] for c in cols}
    lookup: dict[str, dict] = {c: {} for c in CACHED_TEXT}
    n_num = 1 + len(numeric)
    while True:
        rows = cur.fetchmany(_FETCH)
        if not rows:
            break
        columns = list(zip(*rows))
        parts["rowid"].append(np.array(columns[0], dtype=np.int64))
        for i, name in enumerate(numeric):
            parts[name].append(np.array(columns[1 + i], dtype=float))  # NULL (None) becomes NaN
        for i, name in enumerate(CACHED_TEXT):
            d = lookup[name]
            codes = [-1 if v is None else d.setdefault(v, len(d)) for v in columns[n_num + i]]
            parts[name].append(np.array(codes, dtype=np.int32))
    arrays = {c: (np.concatenate(v) if v else np.empty(0, np.int64 if c == "rowid" else np.int32 if c in CACHED_TEXT
                                                      else float)) for c, v in parts.items()}
    return arrays, {c: list(d) for c, d in lookup.items()}


# --- segments ---------------------------------------------------------------------------------------


def _write_segment(cdir: Path, arrays: dict[str, np.ndarray], dicts: dict) -> dict:
    tmp = cdir / f"tmp-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        files = {name: _save(tmp / f"{name}.npy", arr) for name, arr in arrays.items()}
        final = cdir / f"seg-{uuid.uuid4().hex}"
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    rowid = arrays["rowid"]
    return {"dir": final.name, "rows": len(rowid), "max_rowid": int(rowid[-1]) if len(rowid) else None,
            "files": files, "dicts": dicts}


def _load_segment(cdir: Path, seg: dict, names: set[str]) -> dict[str, np.ndarray]:
    d = cdir / seg["dir"]
    if not seg["dir"].startswith("seg-") or "/" in seg["dir"]:
        raise _Invalid("segment name")
    return {name: _load(d / f"{name}.npy", seg["files"][name], seg["rows"]) for name in names}


def _merge(segs: list[dict], loaded: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], dict]:
    """Segments (all their files loaded) as one: arrays concatenated, text codes onto one dictionary."""
    if len(loaded) == 1:  # one segment: its arrays and dictionaries as they are
        return dict(loaded[0]), {n: list(segs[0]["dicts"][n]) for n in loaded[0] if n in CACHED_TEXT}
    out: dict[str, np.ndarray] = {}
    dicts: dict[str, list] = {}
    for name in loaded[0]:
        if name not in CACHED_TEXT:
            out[name] = np.concatenate([a[name] for a in loaded])
            continue
        merged: dict = {}
        parts = []
        for seg, a in zip(segs, loaded):
            remap = np.array([merged.setdefault(v, len(merged)) for v in seg["dicts"][name]], dtype=np.int32)
            codes = a[name]
            parts.append(np.where(codes < 0, -1, remap[np.maximum(codes, 0)] if len(remap) else -1).astype(np.int32))
        out[name] = np.concatenate(parts)
        dicts[name] = list(merged)
    return out, dicts


def _coded(codes: np.ndarray, values: list) -> tuple[np.ndarray, list]:
    """A text column's codes and values, once every code is -1 (NULL) or an index of ``values``."""
    if len(codes) and (codes.min() < -1 or codes.max() >= len(values)):
        raise _Invalid("text code out of range")
    return codes, values


# --- the checks ----------------------------------------------------------------------------------


def _same(sql_value, cached: float) -> bool:
    if sql_value is None:
        return bool(np.isnan(cached))
    return float(sql_value) == float(cached)


def _check(conn: sqlite3.Connection, arrays: dict[str, np.ndarray], dicts: dict, max_rowid: int) -> None:
    """Raise _Invalid unless the database still holds exactly the cached rows up to ``max_rowid``."""
    rowid, t_wall = arrays["rowid"], arrays["t_wall"]
    if len(rowid) > 1 and not np.all(np.diff(rowid) > 0):
        raise _Invalid("rowids not ascending")
    # per label: count and sum of rowids (the label index covers this query)
    sql = {lab: (n, s) for lab, n, s in conn.execute(
        "SELECT label, count(*), sum(rowid) FROM turns WHERE rowid <= ? GROUP BY label", (max_rowid,))}
    codes, values = arrays["label"], dicts["label"]
    if len(codes) and (codes.min() < -1 or codes.max() >= len(values)):
        raise _Invalid("label code out of range")
    mine = {}
    for code in (np.flatnonzero(np.bincount(codes + 1, minlength=1)) - 1).tolist():
        mask = codes == code
        mine[None if code < 0 else values[code]] = (int(mask.sum()), int(rowid[mask].sum()))
    if sql != mine:
        raise _Invalid("rows or labels changed")
    # t_wall: count of non-NULL values and a checksum of them in microseconds (the t_wall index covers this)
    known = ~np.isnan(t_wall)
    base = float(t_wall[known].min()) if known.any() else 0.0
    n_sql, sum_sql = conn.execute(
        "SELECT count(t_wall), sum(CAST((t_wall - ?) * 1000000 AS INTEGER) % ?) FROM turns WHERE rowid <= ?",
        (base, _PRIME, max_rowid)).fetchone()
    micros = ((t_wall[known] - base) * 1000000).astype(np.int64)
    if n_sql != int(known.sum()) or (sum_sql or 0) != int(np.fmod(micros, _PRIME).sum()):
        raise _Invalid("t_wall changed")
    # the first, the last and a few random rows, in every loaded column
    if not len(rowid):
        return
    rng = np.random.default_rng()
    pos = np.unique(np.concatenate([[0, len(rowid) - 1], rng.integers(0, len(rowid), SAMPLED_ROWS)]))
    names = [n for n in arrays if n != "rowid"]
    got = conn.execute(
        f"SELECT rowid, {', '.join(names)} FROM turns WHERE rowid IN ({', '.join('?' * len(pos))})",
        [int(rowid[p]) for p in pos]).fetchall()
    if len(got) != len(pos):
        raise _Invalid("a sampled row is missing")
    at = {int(rowid[p]): int(p) for p in pos}
    for r in got:
        p = at[r[0]]
        for i, name in enumerate(names):
            if name in CACHED_TEXT:
                code = int(arrays[name][p])
                if r[1 + i] != (None if code < 0 else dicts[name][code]):
                    raise _Invalid(f"a sampled row differs in {name}")
            elif not _same(r[1 + i], arrays[name][p]):
                raise _Invalid(f"a sampled row differs in {name}")


# --- loading ----------------------------------------------------------------------------------------

last_status = "off"  # what the last load_columns did: hit, append, build, unusable (for tests and benchmarks)


def load_columns(conn: sqlite3.Connection, numeric: tuple[str, ...], want_num: tuple[str, ...],
                 want_txt: tuple[str, ...]) -> Columns | None:
    """Every turn with these columns, in rowid order, from the cache brought up to date (and saved when
    the cache directory can be written); None when the cache cannot serve them (read SQLite instead).

    ``numeric`` is every numeric column the cache holds (one cache serves every caller); ``want_*``
    are the columns to return, besides ``rowid``.
    """
    global last_status
    last_status = "unusable"
    if not set(want_num) <= set(numeric) or not set(want_txt) <= set(CACHED_TEXT):
        return None
    try:
        db = db_file(conn)
    except sqlite3.Error:
        return None
    if db is None or not db.is_file():
        return None
    own = not conn.in_transaction
    try:
        if own:
            conn.execute("BEGIN")  # one snapshot for the checks and the new rows
        cols, last_status = _load_columns(conn, db, cache_dir(db), tuple(numeric), want_num, want_txt)
        return cols
    except Exception as exc:  # not a specproxy database, a column missing, odd values: the SQL path says why
        log.debug("column cache unusable: %s", exc)
        last_status = f"unusable: {type(exc).__name__}: {exc}"
        return None
    finally:
        if own and conn.in_transaction:
            conn.execute("COMMIT")


def _load_columns(conn, db, cdir, numeric, want_num, want_txt) -> tuple[Columns, str]:
    key = _key(conn, db, numeric)
    names = ["rowid", "t_wall", "label", *[n for n in want_num if n != "t_wall"], *[t for t in want_txt if t != "label"]]
    m = _read_manifest(cdir)
    segs: list[dict] = []
    old: dict[str, np.ndarray] | None = None
    old_dicts: dict = {}
    max_rowid = None
    if m is not None and m.get("key") == key:
        try:
            segs = m["segments"]
            loaded = [_load_segment(cdir, s, set(names)) for s in segs]
            if segs:
                old, old_dicts = _merge(segs, loaded)
                max_rowid = max(s["max_rowid"] for s in segs)
                _check(conn, old, old_dicts, max_rowid)
        except (_Invalid, OSError, KeyError, IndexError, ValueError, TypeError) as exc:
            log.info("column cache of %s rebuilt: %s", db, exc)
            segs, old, old_dicts, max_rowid = [], None, {}, None
    new, new_dicts = _fetch(conn, numeric, max_rowid if max_rowid is not None else -(2**63))
    status = "hit" if segs else "build"
    if len(new["rowid"]):
        status = "append" if segs else "build"
        try:
            previous = {s.get("dir") for s in m["segments"] if isinstance(s, dict)} if m is not None else set()
            _persist(cdir, key, segs, new, new_dicts, previous)
        except OSError as exc:  # read-only directory, disk full: no cache, no error
            log.debug("column cache of %s not written: %s", db, exc)
            status += " (not saved)"
        part = {n: new[n] for n in names}
        if old is None:
            old, old_dicts = _merge([{"dicts": new_dicts}], [part])
        else:
            old, old_dicts = _merge([{"dicts": old_dicts}, {"dicts": new_dicts}], [old, part])
    elif old is None:  # no turns at all
        old, old_dicts = _merge([{"dicts": new_dicts}], [{n: new[n] for n in names}])
    cols = Columns(rowid=old["rowid"], num={n: old[n] for n in names[1:] if n not in CACHED_TEXT},
                   codes={n: _coded(old[n], old_dicts[n]) for n in names[1:] if n in CACHED_TEXT})
    return cols, status


def _persist(cdir: Path, key: dict, segs: list[dict], new: dict[str, np.ndarray], new_dicts: dict,
             previous: set) -> None:
    """Write the new rows as a segment (or, past MAX_SEGMENTS, everything as one) and the manifest."""
    cdir.mkdir(exist_ok=True)
    if len(segs) + 1 > MAX_SEGMENTS:
        everything = [_load_segment(cdir, s, set(new)) for s in segs]
        merged, dicts = _merge([*segs, {"dicts": new_dicts}], [*everything, new])
        segs = [_write_segment(cdir, merged, dicts)]
    else:
        segs = [*segs, _write_segment(cdir, new, new_dicts)]
    tmp = cdir / f"tmp-manifest-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.write_text(json.dumps({"key": key, "segments": segs}))
    os.replace(tmp, cdir / "manifest.json")
    _clean(cdir, {s["dir"] for s in segs}, previous)


def _clean(cdir: Path, keep: set[str], previous: set) -> None:
    """Remove the segments the manifest no longer refers to, other unreferenced segments unless they
    are very new (another process may be about to refer to them), and what crashed writers left."""
    now = time.time()
    for p in cdir.iterdir():
        try:
            age = now - p.stat().st_mtime
            if p.name.startswith("seg-") and p.name not in keep and (p.name in previous or age > 10):
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith("tmp-") and age > 3600:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
        except OSError:
            pass
