"""The files of a columnar cache: immutable segments of ``.npy`` columns and the manifest that names them.

Why a module of its own: two caches keep the same files and differ only in what keys them and how new
rows are found. The SQLite cache (``column_cache.py``: beside the file, checked by the database's edit
counter, extended by rowid) and the PostgreSQL cache (``pg_cache.py``: day partitions as ranges of segments,
checked per partition) both write and read segments, merge them and replace the manifest here, so a
segment is the same thing, read the same way, in both.

The layout: a cache directory holds ``manifest.json`` (``{"format", "tables": {name: {"key", "segments":
[...]}}}``; what a segment entry holds beyond ``dir``, ``rows``, ``files`` and ``dicts`` is the cache's
own) and one ``seg-*/`` directory per segment, with one ``.npy`` per column of one table: ``rowid``
int64 (the store's insertion key: SQLite's rowid, PostgreSQL's ``seq``), numeric columns float64 (NULL is
NaN), text columns int32 codes (NULL is -1) into the segment's dictionary of values in the manifest.

Why no checksum, and why it is never torn: segments are written to a ``tmp-*`` directory, renamed into
place and never written again, and the manifest is replaced atomically after them, so a file the
manifest refers to is whole; a crashed writer leaves at most an unreferenced directory, cleaned up later.
A truncated or extended file fails the size check, a rewritten header the header check (``load``). A
byte changed in place inside a file is not seen: the cache trusts its own files as a database trusts its
pages.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specproxy.store.pages import map_column

__all__ = ["FORMAT", "Invalid", "Table", "coded", "load_segment", "merge", "read_manifest", "write_manifest",
           "write_merged", "write_segment"]

FORMAT = 2


class Invalid(Exception):
    """The cache cannot vouch for these rows: rebuild them (or read the database)."""


@dataclass(frozen=True)
class Table:
    """One cached table: ``rowid`` (int64), ``numeric`` columns (float64, NULL as NaN) and ``text`` columns
    (int32 codes into a dictionary per segment, -1 for NULL)."""

    name: str
    numeric: tuple[str, ...]
    text: tuple[str, ...]

    def dtype(self, column: str) -> np.dtype:
        return np.dtype(np.int64 if column == "rowid" else np.int32 if column in self.text else np.float64)


def _save(path: Path, arr: np.ndarray) -> int:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def _load(path: Path, size: int, rows: int, dtype: np.dtype) -> np.ndarray:
    """One column file mapped read-only (no copy), its size and header checked against the manifest and
    the segment's row count."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != size:
            raise Invalid(f"{path.name}: size changed")
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, got = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, got = np.lib.format.read_array_header_2_0(f)
        offset = f.tell()
        if shape != (rows,) or got != dtype or offset + rows * dtype.itemsize != size:
            raise Invalid(f"{path.name}: shape")
        if not rows:
            return np.empty(0, dtype)
        return map_column(f, rows, dtype, offset)


def read_manifest(cdir: Path) -> dict[str, dict]:
    """The manifest's entry per table ({} when there is none, or one of another format)."""
    try:
        with open(cdir / "manifest.json", "rb") as f:
            m = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("tables"), dict):
        return {}
    return {name: t for name, t in m["tables"].items()
            if isinstance(t, dict) and isinstance(t.get("segments"), list)}


def write_segment(cdir: Path, arrays: dict[str, np.ndarray], dicts: dict) -> dict:
    """``arrays`` (``rowid`` among them) as a new segment directory; its manifest entry."""
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


def load_segment(cdir: Path, table: Table, seg: dict, names: set[str]) -> dict[str, np.ndarray]:
    """The ``names`` columns of one segment, mapped read-only and checked (``Invalid`` when they do not
    match the manifest)."""
    d = cdir / seg["dir"]
    if not seg["dir"].startswith("seg-") or "/" in seg["dir"]:
        raise Invalid("segment name")
    return {name: _load(d / f"{name}.npy", seg["files"][name], seg["rows"], table.dtype(name)) for name in names}


def merge(text: tuple[str, ...], segs: list[dict],
          loaded: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], dict]:
    """Segments (all their files loaded) as one: arrays concatenated, text codes onto one dictionary."""
    if len(loaded) == 1:  # one segment: its arrays and dictionaries as they are
        return dict(loaded[0]), {n: list(segs[0]["dicts"][n]) for n in loaded[0] if n in text}
    out: dict[str, np.ndarray] = {}
    dicts: dict[str, list] = {}
    for name in loaded[0]:
        out[name], values = _merge_column(name, text, segs, loaded)
        if values is not None:
            dicts[name] = values
    return out, dicts


def _merge_column(name: str, text: tuple[str, ...], segs: list[dict],
                  loaded: list[dict[str, np.ndarray]]) -> tuple[np.ndarray, list | None]:
    """One column of several segments as one: concatenated; a text column's codes onto one dictionary
    (its values in order of first appearance across the segments), returned beside it."""
    if name not in text:
        return np.concatenate([a[name] for a in loaded]), None
    merged: dict = {}
    parts = []
    for seg, a in zip(segs, loaded):
        remap = np.array([merged.setdefault(v, len(merged)) for v in seg["dicts"][name]], dtype=np.int32)
        codes = a[name]
        parts.append(np.where(codes < 0, -1, remap[np.maximum(codes, 0)] if len(remap) else -1).astype(np.int32))
    return np.concatenate(parts), list(merged)


def write_merged(cdir: Path, table: Table, segs: list[dict]) -> dict:
    """``segs`` (in rowid order) as one new segment directory, written a column at a time, so that a
    month's cold build holds one column in memory rather than the table; its manifest entry."""
    tmp = cdir / f"tmp-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.mkdir()
    files: dict[str, int] = {}
    dicts: dict[str, list] = {}
    try:
        for name in segs[0]["files"]:
            loaded = [load_segment(cdir, table, seg, {name}) for seg in segs]
            column, values = _merge_column(name, table.text, segs, loaded)
            files[name] = _save(tmp / f"{name}.npy", column)
            if values is not None:
                dicts[name] = values
            del loaded, column  # the mapped parts and the merged copy: one column at a time
        final = cdir / f"seg-{uuid.uuid4().hex}"
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tops = [seg["max_rowid"] for seg in segs if seg["max_rowid"] is not None]
    return {"dir": final.name, "rows": sum(seg["rows"] for seg in segs), "max_rowid": max(tops) if tops else None,
            "files": files, "dicts": dicts}


def coded(codes: np.ndarray, values: list) -> tuple[np.ndarray, list]:
    """A text column's codes and values, once every code is -1 (NULL) or an index of ``values``."""
    if len(codes) and (codes.min() < -1 or codes.max() >= len(values)):
        raise Invalid("text code out of range")
    return codes, values


def write_manifest(cdir: Path, name: str, entry: dict, previous: set) -> None:
    """Replace the manifest's entry for table ``name`` (the other tables' as the manifest holds them now),
    atomically, then remove the segments no entry refers to any more (``previous``: the ones the old
    entry referred to, removed at once; others only when they are not new: another process may be
    about to refer to them)."""
    tables = {**read_manifest(cdir), name: entry}
    tmp = cdir / f"tmp-manifest-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.write_text(json.dumps({"format": FORMAT, "tables": tables}))
    os.replace(tmp, cdir / "manifest.json")
    keep = {s.get("dir") for t in tables.values() for s in t["segments"] if isinstance(s, dict)}
    _clean(cdir, keep, previous)


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
