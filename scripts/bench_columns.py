"""Which columnar store a report reads its turns from: the column cache (store/column_cache.py) against
Parquet through pyarrow and DuckDB's own file, in one run over the same database (issue 36).

    python scripts/bench_columns.py --db /work/bench-data/1m.db      # a database bench_report.py made
    python scripts/bench_columns.py --db /work/bench-data/1m.db --only cache,parquet

For each store, in its own process (so that its peak RSS is its own, read by ``wait4``):

* cold: the cached columns (``column_cache``'s: every numeric one, the few-valued text ones) read from SQLite (the same reader for every store: the column
  cache's own build, which is what any store must start from; DuckDB's SQLite scanner is an extension
  fetched at run time, not in the wheel, so it cannot be used offline), then written in the store's
  format; for the column cache, ``load_columns`` with its directory removed;
* warm: the report's columns loaded back as the numpy arrays the analysis reads (numbers float64, text
  as object arrays), for the cache through ``load_columns``, its checks against SQLite included (any
  derived store needs them: the other two are timed without, so the cache is the one at a
  disadvantage: ``cache-format`` is the cache's files alone, its checks skipped); the library's import
  apart;
* the store's size on disk.

pyarrow and duckdb are not dependencies of specproxy: install them beside it to run this.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402

from specproxy.analyze.report_data import REPORT_COLUMNS  # noqa: E402
from specproxy.store import column_cache  # noqa: E402
from specproxy.store.dataset import NUMERIC, TEXT  # noqa: E402

WANT_NUM = tuple(c for c in NUMERIC if c in REPORT_COLUMNS or c in ("t_wall", "measured"))
WANT_TXT = tuple(c for c in TEXT if c in REPORT_COLUMNS)
STORES = ("cache", "cache-format", "parquet", "duckdb")


# what every store holds: the column cache's columns (every numeric one and the few-valued text ones)
ALL_NUM, ALL_TXT = NUMERIC, column_cache.CACHED_TEXT


def read_sqlite(db: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The columns every store is built from, as the cache's build reads them (rowid order)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    names = ("rowid", *ALL_NUM, *ALL_TXT)
    cur = conn.execute(f"SELECT {', '.join(names)} FROM turns ORDER BY rowid")
    num: dict[str, list] = {c: [] for c in ("rowid", *ALL_NUM)}
    txt: dict[str, list] = {c: [] for c in ALL_TXT}
    while rows := cur.fetchmany(50_000):
        cols = list(zip(*rows))
        num["rowid"].append(np.array(cols[0], dtype=np.int64))
        for i, c in enumerate(ALL_NUM):
            num[c].append(np.array(cols[1 + i], dtype=float))
        for i, c in enumerate(ALL_TXT):
            txt[c].append(np.array(cols[1 + len(ALL_NUM) + i], dtype=object))
    conn.close()
    return ({c: np.concatenate(v) for c, v in num.items()}, {c: np.concatenate(v) for c, v in txt.items()})


def arrow_table(num, txt):
    import pyarrow as pa

    cols = {c: pa.array(v) for c, v in num.items()}
    cols.update({c: pa.array(v, type=pa.string()).dictionary_encode() for c, v in txt.items()})
    return pa.table(cols)


def store_path(db: Path, store: str) -> Path:
    return {"cache": column_cache.cache_dir(db), "cache-format": column_cache.cache_dir(db), "parquet": Path(str(db) + ".parquet"),
            "duckdb": Path(str(db) + ".duckdb")}[store]


def build(db: Path, store: str) -> dict[str, float]:
    path = store_path(db, store)
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    if store == "cache":
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        assert column_cache.load_columns(conn, NUMERIC, WANT_NUM, WANT_TXT) is not None
        conn.close()
        return {"read": float("nan"), "write": time.perf_counter() - t0}
    num, txt = read_sqlite(db)
    t1 = time.perf_counter()
    if store == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(arrow_table(num, txt), path, compression="zstd")
    else:
        import duckdb

        con = duckdb.connect(str(path))
        con.register("arrow_turns", arrow_table(num, txt))
        con.execute("CREATE TABLE turns AS SELECT * FROM arrow_turns")
        con.close()
    return {"read": t1 - t0, "write": time.perf_counter() - t1}


def load(db: Path, store: str) -> dict[str, float]:
    path = store_path(db, store)
    t0 = time.perf_counter()
    if not store.startswith("cache"):  # the library's import, apart: a CLI run pays it too
        __import__("pyarrow.parquet" if store == "parquet" else "duckdb")
        __import__("pyarrow")
    imported = time.perf_counter() - t0
    t0 = time.perf_counter()
    if store.startswith("cache"):
        if store == "cache-format":  # its files alone, as the others are timed: the checks skipped
            setattr(column_cache, "_check", lambda *a: None)
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        cols = column_cache.load_columns(conn, NUMERIC, WANT_NUM, WANT_TXT)
        conn.close()
        assert column_cache.last_status == "hit", column_cache.last_status
        n = len(cols.rowid)
    else:
        if store == "parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path, columns=["rowid", *WANT_NUM, *WANT_TXT])
        else:
            import duckdb

            con = duckdb.connect(str(path), read_only=True)
            table = con.sql(f"SELECT {', '.join(['rowid', *WANT_NUM, *WANT_TXT])} FROM turns").to_arrow_table()
        num = {c: table.column(c).to_numpy() for c in ("rowid", *WANT_NUM)}
        txt = {}
        for c in WANT_TXT:  # object arrays, as the analysis compares them: decode the dictionary once
            col = table.column(c).combine_chunks()
            if hasattr(col, "dictionary"):
                values = np.array([*col.dictionary.to_pylist(), None], dtype=object)
                codes = col.indices.fill_null(-1).to_numpy(zero_copy_only=False)
                txt[c] = values[codes]
            else:
                txt[c] = np.array(col.to_pylist(), dtype=object)
        n = len(num["rowid"])
    return {"load": time.perf_counter() - t0, "import": imported, "rows": n}


def size_mib(path: Path) -> float:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
    return path.stat().st_size / 2**20 if path.exists() else 0.0


def child(db: Path, store: str, phase: str) -> tuple[dict, float]:
    """One phase in its own process: its figures and its peak RSS (MiB)."""
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen([sys.executable, __file__, "--db", str(db), "--child", f"{store}:{phase}"], stdout=out)
        _, status, usage = os.wait4(p.pid, 0)
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(f"{store} {phase} failed")
        out.seek(0)
        return json.loads(out.read()), usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True, help="a database made by scripts/bench_report.py")
    ap.add_argument("--only", default=",".join(STORES), help=f"stores to measure [{','.join(STORES)}]")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    db = Path(args.db)
    if args.child:
        store, phase = args.child.split(":")
        print(json.dumps(build(db, store) if phase == "build" else load(db, store)))
        return
    stores = [s for s in args.only.split(",") if s]
    n = sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0]
    print(f"{n:,} turns, {len(WANT_NUM)} numeric and {len(WANT_TXT)} text columns (the report's), "
          f"{db.stat().st_size / 2**20:.0f} MiB of SQLite", file=sys.stderr)
    print("| store | cold: SQLite read + write (s) | cold peak RSS MiB | warm load (s) | warm load 2 (s) "
          "| its import (s) | warm peak RSS MiB | on disk MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for store in stores:
        if store == "cache-format":  # the cache's files as "cache" built them
            b, b_rss = {"read": float("nan"), "write": float("nan")}, float("nan")
        else:
            b, b_rss = child(db, store, "build")
        w1, _ = child(db, store, "load")
        w2, w_rss = child(db, store, "load")
        cold = (f"{b['write']:.1f}" if np.isnan(b["read"]) else f"{b['read']:.1f} + {b['write']:.1f}")
        cold = "(as cache)" if store == "cache-format" else cold
        print(f"| {store} | {cold} | {b_rss:.0f} | {w1['load']:.2f} | {w2['load']:.2f} | {w2['import']:.2f} | {w_rss:.0f} | "
              f"{size_mib(store_path(db, store)):.0f} |", flush=True)


if __name__ == "__main__":
    main()
