"""How fast the shipper sends a local database's turns into PostgreSQL, and its CPU per turn.

    python scripts/bench_ship.py                  # 100k turns, 3 rounds, a PostgreSQL of its own
    python scripts/bench_ship.py -n 200000 --rounds 5

In one run: N turns (500 kinds from ``make_record``, each under many ids, over the last hour) written to a fresh SQLite file by
the Writer (not timed), then shipped by ``store/shipper.py`` to a fresh database of a PostgreSQL server
this script starts on 127.0.0.1 (Debian's binaries, as the test suite does: ``tests/pgserver.py``), and
timed from ``start`` until ``caught_up``. Reports turns/s and the shipper thread's CPU per turn (its
thread's CPU time, read from ``/proc``), beside the baseline of the same run: a bare COPY of the same
rows into an unindexed, unpartitioned table of the same columns (what PostgreSQL takes at most).

Target (issue 35): at least 20,000 turns/s into a local PostgreSQL.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]

import psycopg  # noqa: E402

from benchlib import cpu_model  # noqa: E402
from pgserver import PgServer, pg_bin  # noqa: E402
from specproxy.app.fake_upstream import make_record  # noqa: E402
from specproxy.record import FIELD_NAMES, new_turn_id  # noqa: E402
from specproxy.store.shipper import Shipper  # noqa: E402
from specproxy.store.sinks.postgres import PostgresSink  # noqa: E402
from specproxy.store.writer import Writer  # noqa: E402


KINDS = [make_record(seed=i) for i in range(500)]  # turns of varied figures, each shipped under many ids


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) of one thread of this process."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(pg: PgServer, n: int, tmp: Path) -> tuple[float, float, float]:
    """(turns/s shipped, shipper CPU µs per turn, bare COPY rows/s)."""
    db = tmp / f"r{time.monotonic_ns()}.db"
    w = Writer(db, queue_size=n + 10)
    now = time.time()
    records = [replace(KINDS[i % len(KINDS)], id=new_turn_id(), t_wall=now - 3600 + i * 3600 / n) for i in range(n)]
    for r in records:
        w.put(r)
    w.close(600)
    name = pg.new_database()
    shipper = Shipper(db, PostgresSink(pg.url(name)), "bench", idle_s=0.01)
    t0 = time.perf_counter()
    shipper.start()
    if not shipper.caught_up.wait(600):
        raise SystemExit(f"the shipper did not catch up: {shipper.last_error}")
    elapsed = time.perf_counter() - t0
    cpu = thread_cpu_s(shipper._thread.native_id)
    shipper.close()
    assert shipper.rows_shipped == n, (shipper.rows_shipped, shipper.last_error)
    # the baseline: the same rows by one bare COPY into a plain table of the same columns
    rows = [tuple(int(v) if isinstance(v, bool) else v for v in map(r.__getattribute__, FIELD_NAMES))
            for r in records]  # as SQLite gives them back (booleans 0/1)
    with psycopg.connect(pg.url(name), autocommit=True) as conn:
        conn.execute("CREATE TABLE bare AS SELECT " + ", ".join(FIELD_NAMES) + " FROM turns WITH NO DATA")
        b0 = time.perf_counter()
        with conn.cursor() as cur, cur.copy("COPY bare (" + ", ".join(FIELD_NAMES) + ") FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        bare = n / (time.perf_counter() - b0)
    return n / elapsed, cpu / n * 1e6, bare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=100_000, help="turns per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if pg_bin() is None:
        raise SystemExit("PostgreSQL is not installed (apt-get install postgresql)")
    pg = PgServer(pg_bin())
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ship-") as tmp:
            results = [one_round(pg, args.n, Path(tmp)) for _ in range(args.rounds)]
    finally:
        pg.close()
    rates, cpus, bares = zip(*results)
    print(f"bench_ship: {args.n} turns x {args.rounds} rounds; {cpu_model()}; PostgreSQL {pg_bin().parent.name}")
    print(f"  shipper     {statistics.median(rates):10.0f} turns/s (median; rounds: "
          f"{', '.join(f'{r:.0f}' for r in rates)})  target >= 20000")
    print(f"  shipper CPU {statistics.median(cpus):10.1f} µs per turn (its thread)")
    print(f"  bare COPY   {statistics.median(bares):10.0f} rows/s (same rows, no index, no conflict check): "
          f"shipper/bare = {statistics.median(rates) / statistics.median(bares):.2f}")


if __name__ == "__main__":
    main()
