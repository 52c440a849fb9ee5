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
from typing import Any, Mapping, Sequence

import numpy as np

from specproxy.store.pages import map_column

__all__ = ["FORMAT", "Invalid", "SegmentWriter", "Table", "coded", "load_segment", "merge", "read_manifest", "write_manifest",
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


def _header(dtype: np.dtype, rows: int) -> bytes:
    """The ``.npy`` header of a column of ``rows`` values: the same length for every ``rows`` (numpy pads
    the shape for growth), so a file's header can be rewritten once its rows are counted."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                              "shape": (rows,)})
    return buf.getvalue()


class SegmentWriter:
    """A new segment written a part at a time, parts in rowid order: each column's file grows by each
    part's values as they come (a text column's codes moved onto one dictionary of its values in order of
    first appearance across the parts, as ``merge`` does), its header written last with the rows counted.

    Why: a month's cold build arrives in rowid ranges; written as a segment each and then merged, every
    byte was written twice and copied three times more (the merge's concatenation, ``np.save`` into a
    buffer, the buffer's copy); here each byte is written once, straight from the reader's arrays."""

    def __init__(self, cdir: Path, table: Table, names: list[str] | tuple[str, ...]):
        self._cdir, self._table, self._names = cdir, table, tuple(names)
        self._tmp = cdir / f"tmp-{os.getpid()}-{uuid.uuid4().hex}"
        self._tmp.mkdir()
        self._files: dict[str, Any] = {}
        self._dicts: dict[str, dict] = {n: {} for n in self._names if n in table.text}
        self._rows = 0
        self._max_rowid: int | None = None
        try:
            for name in self._names:
                f = self._files[name] = open(self._tmp / f"{name}.npy", "wb")
                f.write(_header(table.dtype(name), 0))
        except BaseException:
            self.abort()
            raise

    def add(self, arrays: Mapping[str, np.ndarray], dicts: Mapping[str, Sequence]) -> None:
        """One part's columns (every name, the same length) and its text columns' dictionaries."""
        for name in self._names:
            arr = np.ascontiguousarray(arrays[name], dtype=self._table.dtype(name))
            if name in self._dicts:
                arr = _onto(arr, dicts[name], self._dicts[name])
            self._files[name].write(memoryview(arr).cast("B"))
        rowid = arrays["rowid"]
        self._rows += len(rowid)
        if len(rowid):
            self._max_rowid = int(rowid[-1])

    def close(self) -> dict:
        """The headers written, the directory renamed into place: the segment's manifest entry."""
        files: dict[str, int] = {}
        try:
            for name, f in self._files.items():
                files[name] = f.tell()
                f.seek(0)
                f.write(_header(self._table.dtype(name), self._rows))
                f.close()
            final = self._cdir / f"seg-{uuid.uuid4().hex}"
            self._tmp.rename(final)
        except BaseException:
            self.abort()
            raise
        return {"dir": final.name, "rows": self._rows, "max_rowid": self._max_rowid, "files": files,
                "dicts": {n: list(d) for n, d in self._dicts.items()}}

    def abort(self) -> None:
        """Nothing kept: the files closed, the directory removed."""
        for f in self._files.values():
            f.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


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


def write_segment(cdir: Path, table: Table, arrays: dict[str, np.ndarray], dicts: dict) -> dict:
    """``arrays`` (``rowid`` among them) as a new segment directory; its manifest entry."""
    writer = SegmentWriter(cdir, table, list(arrays))
    writer.add(arrays, dicts)
    return writer.close()


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
    parts = [_onto(a[name], seg["dicts"][name], merged) for seg, a in zip(segs, loaded)]
    return np.concatenate(parts), list(merged)


def _onto(codes: np.ndarray, values: Sequence, merged: dict) -> np.ndarray:
    """A part's text codes (into its ``values``) as codes into ``merged`` (value -> code), which gains the
    part's new values in their order: one dictionary in order of first appearance across the parts."""
    remap = np.array([merged.setdefault(v, len(merged)) for v in values], dtype=np.int32)
    if np.array_equal(remap, np.arange(len(remap), dtype=np.int32)):
        return codes  # the part's dictionary starts the merged one: its codes as they are
    return np.where(codes < 0, -1, remap[np.maximum(codes, 0)] if len(remap) else -1).astype(np.int32)


def write_merged(cdir: Path, table: Table, segs: list[dict]) -> dict:
    """``segs`` (in rowid order) as one new segment directory, a segment's mapped files at a time (a
    month's cache is never in memory whole); its manifest entry."""
    names = list(segs[0]["files"])
    writer = SegmentWriter(cdir, table, names)
    try:
        for seg in segs:
            writer.add(load_segment(cdir, table, seg, set(names)), seg["dicts"])
    except BaseException:
        writer.abort()
        raise
    return writer.close()


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
