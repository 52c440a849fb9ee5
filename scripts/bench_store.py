"""How fast specproxy's store writes turns, and that ``Writer.put`` never blocks.

    python scripts/bench_store.py                 # 100k records, 3 rounds
    python scripts/bench_store.py -n 200000 --rounds 5

In one run, on fresh temporary databases (WAL, synchronous=NORMAL, as the proxy opens them):

* ``Writer`` throughput: put N records built with ``specproxy.app.fake_upstream.make_record`` (built beforehand,
  not timed) into a Writer whose queue holds them all, and time from the first ``put`` until
  ``written == N`` (every batch committed). Records/s = N / that time.
* ``put()`` latency while the writer thread is busy writing: every call timed with
  ``perf_counter_ns`` (p50, p99, p99.9, max); the proxy calls ``put`` on its event loop.
* ``put()`` when the queue is full (the default queue size, a producer faster than the disk): the
  call still returns at once (False, counted as dropped).
* Baseline, same run, same rows: raw ``sqlite3`` ``executemany`` of ``record_row(r)`` in transactions of
  the Writer's batch size (1000), and of pre-converted rows in one transaction (the ceiling).

Target (issue 7): the Writer sustains >= 20,000 records/s.
"""

from __future__ import annotations
import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from benchlib import cpu_model  # noqa: E402


import argparse
import datetime as _dt
import os
import platform
import shlex
import statistics
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specproxy.store.db import open_store  # noqa: E402
from specproxy.store.writer import INSERT_TURN, Writer, record_row  # noqa: E402
from specproxy.app.fake_upstream import make_record  # noqa: E402

now_ns = time.perf_counter_ns


def _cpu_model() -> str:
    return cpu_model()


def _pct(xs: list[int], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))] / 1000.0


def bench_writer(records, tmp: Path, batch_size: int) -> dict:
    db = tmp / f"writer-{now_ns()}.db"
    w = Writer(db, queue_size=len(records) + 1, batch_size=batch_size)
    lat = []
    append = lat.append
    put = w.put
    t0 = now_ns()
    for r in records:
        a = now_ns()
        put(r)
        append(now_ns() - a)
    t_put = now_ns()
    deadline = time.monotonic() + 300
    while w.written < len(records) and time.monotonic() < deadline:
        time.sleep(0.0005)
    t1 = now_ns()
    written, dropped = w.written, w.dropped
    w.close()
    n = sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0]
    return {
        "rps": written / ((t1 - t0) / 1e9),
        "put_all_s": (t_put - t0) / 1e9,
        "total_s": (t1 - t0) / 1e9,
        "written": written,
        "in_db": n,
        "dropped": dropped,
        "put_p50_us": _pct(lat, 50),
        "put_p99_us": _pct(lat, 99),
        "put_p999_us": _pct(lat, 99.9),
        "put_max_us": max(lat) / 1000.0,
    }


def bench_full_queue(records, tmp: Path) -> dict:
    """The default queue (10,000) and a producer that never waits: put must still return at once."""
    db = tmp / f"full-{now_ns()}.db"
    w = Writer(db)
    lat = []
    refused = 0
    for r in records:
        a = now_ns()
        ok = w.put(r)
        d = now_ns() - a
        if not ok:
            refused += 1
            lat.append(d)
    w.close()
    return {"refused": refused, "p50_us": _pct(lat, 50) if lat else None, "p99_us": _pct(lat, 99) if lat else None,
            "max_us": max(lat) / 1000.0 if lat else None}


def bench_baseline(records, tmp: Path, batch_size: int) -> dict:
    """Raw sqlite3 on the same schema and pragmas: convert + executemany per batch, one commit each."""
    db = tmp / f"raw-{now_ns()}.db"
    conn = open_store(db)
    t0 = now_ns()
    for i in range(0, len(records), batch_size):
        rows = [record_row(r) for r in records[i : i + batch_size]]
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(INSERT_TURN, rows)
        conn.execute("COMMIT")
    t1 = now_ns()
    conn.close()
    db2 = tmp / f"raw1-{now_ns()}.db"
    conn = open_store(db2)
    rows = [record_row(r) for r in records]
    t2 = now_ns()
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(INSERT_TURN, rows)
    conn.execute("COMMIT")
    t3 = now_ns()
    conn.close()
    return {"batched_rps": len(records) / ((t1 - t0) / 1e9), "one_tx_rps": len(records) / ((t3 - t2) / 1e9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=100_000, help="records per round [100000]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=1000, help="the Writer's batch size [1000, its default]")
    args = ap.parse_args()
    sys.setswitchinterval(0.001)  # as specproxy's Service does: the loop gets the GIL back within 1 ms
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, os.getcwd()), *sys.argv[1:]])
    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    t = time.perf_counter()
    records = [make_record(seed=i) for i in range(args.n)]
    build_s = time.perf_counter() - t
    print(f"built {args.n} records with make_record in {build_s:.1f} s ({args.n / build_s:,.0f}/s; not timed below)",
          file=sys.stderr)
    runs = []
    for rnd in range(args.rounds):
        # rotate the order so neither side always gets the warm page cache
        if rnd % 2 == 0:
            wr = bench_writer(records, tmp, args.batch_size)
            base = bench_baseline(records, tmp, args.batch_size)
        else:
            base = bench_baseline(records, tmp, args.batch_size)
            wr = bench_writer(records, tmp, args.batch_size)
        runs.append((wr, base))
        print(f"round {rnd + 1}: Writer {wr['rps']:,.0f} rec/s (put loop {wr['put_all_s']:.2f} s, all committed "
              f"{wr['total_s']:.2f} s; {wr['in_db']} rows), raw batched {base['batched_rps']:,.0f} rec/s, "
              f"raw one tx {base['one_tx_rps']:,.0f} rec/s", file=sys.stderr)
        for f in tmp.iterdir():
            f.unlink()
    full = bench_full_queue(records[: min(len(records), 100_000)], tmp)

    def stat(values, spec="{:,.0f}"):
        m = statistics.median(values)
        return f"{spec.format(m)} ({spec.format(min(values))}–{spec.format(max(values))})"

    w_rps = [w["rps"] for w, _ in runs]
    b_rps = [b["batched_rps"] for _, b in runs]
    c_rps = [b["one_tx_rps"] for _, b in runs]
    ratio_b = [w["rps"] / b["batched_rps"] for w, b in runs]
    ratio_c = [w["rps"] / b["one_tx_rps"] for w, b in runs]
    print()
    print(f"### specproxy store: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}, nproc {os.cpu_count()}, "
          f"{_cpu_model()}, SQLite {sqlite3.sqlite_version}, Python {platform.python_version()}")
    print()
    print(f"`{cmd}`")
    print()
    print(f"{args.n:,} records (make_record) per round, {args.rounds} rounds, fresh WAL databases in {tempfile.gettempdir()}; "
          f"median (min–max).")
    print()
    print("| what | records/s | Writer ÷ it |")
    print("|---|---:|---:|")
    print(f"| `Writer` (queue → thread → executemany, batch {args.batch_size}, one transaction each): first put to "
          f"all committed | {stat(w_rps)} | 1 |")
    print(f"| raw sqlite3: `record_row` + executemany, batch {args.batch_size}, one transaction each | {stat(b_rps)} | "
          f"{stat(ratio_b, '{:.2f}')} |")
    print(f"| raw sqlite3: executemany of pre-converted rows, one transaction (ceiling) | {stat(c_rps)} | "
          f"{stat(ratio_c, '{:.2f}')} |")
    print()
    print("| `put()` latency (µs) | p50 | p99 | p99.9 | max |")
    print("|---|---:|---:|---:|---:|")
    print(f"| while the writer thread commits (median over rounds) | {statistics.median(w['put_p50_us'] for w, _ in runs):.1f} "
          f"| {statistics.median(w['put_p99_us'] for w, _ in runs):.1f} | {statistics.median(w['put_p999_us'] for w, _ in runs):.1f} "
          f"| {max(w['put_max_us'] for w, _ in runs):.0f} (worst round) |")
    if full["refused"]:
        print(f"| queue full (default 10,000; {full['refused']:,} puts refused and counted) | {full['p50_us']:.1f} "
              f"| {full['p99_us']:.1f} | - | {full['max_us']:.0f} |")
    print()
    lost = [w["written"] - w["in_db"] for w, _ in runs] + [w["dropped"] for w, _ in runs]
    verdict = "met" if statistics.median(w_rps) >= 20_000 else "**not met**"
    print(f"Target: Writer >= 20,000 records/s: {stat(w_rps)} -> {verdict}. Records lost in the throughput rounds: "
          f"{sum(lost)}. put() max includes any GIL hand-off to the writer thread (sys.getswitchinterval() = "
          f"{sys.getswitchinterval() * 1e3:.0f} ms, as specproxy serve sets it).")


if __name__ == "__main__":
    main()
