"""What migration ``006_turn_days``'s triggers cost the shipper: the same batches of turns sent by
``PostgresSink.send`` into two fresh databases of one PostgreSQL (``tests/pgcluster.py``), one with the
triggers and one with them dropped, alternating which goes first; the median seconds per batch of each.

    python scripts/bench_turn_days.py                  # 40 batches of 5,000 turns

The triggers (statement-level, one per INSERT, DELETE, UPDATE statement on ``turns``) count the
statements that change each UTC day in ``turn_days``, what the PostgreSQL column cache checks a day by
(``store/pg_cache.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]

import numpy as np  # noqa: E402
import psycopg  # noqa: E402

from bench_report_pg import COLUMNS, T0, batch_rows  # noqa: E402
from pgcluster import PgServer, pg_bin  # noqa: E402
from specproxy.store.sinks import Identity  # noqa: E402
from specproxy.store.sinks.postgres import PostgresSink  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--rows", type=int, default=5000, help="turns per batch (the shipper's default batch)")
    args = ap.parse_args()
    bindir = pg_bin()
    if bindir is None:
        raise SystemExit("PostgreSQL is not installed (apt-get install postgresql)")
    server = PgServer(bindir)
    sinks: dict[str, PostgresSink] = {}
    try:
        for name in ("with triggers", "without"):
            url = server.url(server.new_database())
            sinks[name] = PostgresSink(url)
            sinks[name].open(Identity("edge-0", "store-0"))  # migrates: 006_turn_days included
            if name == "without":
                with psycopg.connect(url, autocommit=True) as conn:
                    for event in ("insert", "delete", "update"):
                        conn.execute(f"DROP TRIGGER turn_days_{event} ON turns")
        rng = np.random.default_rng(1)
        took: dict[str, list[float]] = {name: [] for name in sinks}
        for b in range(args.batches):
            t = np.sort(rng.uniform(T0 + b * 3000, T0 + (b + 1) * 3000, args.rows))
            rows = batch_rows(rng, t, "edge-0")
            for name in (list(sinks) if b % 2 else list(sinks)[::-1]):
                start = time.perf_counter()
                assert sinks[name].send("turns", COLUMNS, rows) == []
                took[name].append(time.perf_counter() - start)
        for name, times in took.items():
            rest = times[4:]  # the first batches warm the connection and make the partitions
            print(f"{name}: median {statistics.median(rest) * 1000:.1f} ms per batch of {args.rows:,} turns "
                  f"({len(rest)} batches)")
    finally:
        for sink in sinks.values():
            sink.close()
        server.close()


if __name__ == "__main__":
    main()
