"""How fast the shipper sends a local database's turns into PostgreSQL, and its CPU per turn.

    python scripts/bench_ship.py                  # 100k turns, 3 rounds, a PostgreSQL of its own
    python scripts/bench_ship.py -n 200000 --rounds 5
    python scripts/bench_ship.py --proxies 4      # lag: 4 proxies writing and shipping at once, 20 s

In one run: N turns (500 kinds from ``make_record``, each under many ids, over the last hour) written to a fresh SQLite file by
the Writer (not timed), then shipped by ``store/shipper.py`` to a fresh database of a PostgreSQL server
this script starts on 127.0.0.1 (Debian's binaries, as the test suite does: ``tests/pgcluster.py``), and
timed from ``start`` until ``caught_up``. Reports turns/s and the shipper thread's CPU per turn (its
thread's CPU time, read from ``/proc``), beside the baseline of the same run: a bare COPY of the same
rows into an unindexed, unpartitioned table of the same columns (what PostgreSQL takes at most).

With ``--proxies P``: P processes, each a proxy's Writer and Shipper (its own SQLite file and
``proxy_name``), write turns for ``--seconds`` at the rate of ``--streams`` concurrent streams of one turn
per ``--turn-s`` each (64 streams of 0.1 s turns: 640 turns/s a proxy, far more than 64 real LLM streams
give) while shipping into one PostgreSQL. Each turn's lag is the time from its hand-off to the Writer (its
t_wall) until the transaction holding it commits in PostgreSQL: an upper bound of the time from its
commit to SQLite (the Writer commits at most ``COMMIT_GAP_S`` later). Reports lag p50/p99/max over every
turn and each shipper thread's CPU per turn.

Targets (issue 35): at least 20,000 turns/s into a local PostgreSQL; four proxies under 64 concurrent
streams each keep the lag p99 under 2 s.
"""

from __future__ import annotations

import argparse
import multiprocessing
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
from pgcluster import PgServer, pg_bin  # noqa: E402
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


class _TimedSink(PostgresSink):
    """The PostgreSQL sink, noting when each shipped turn's transaction committed (for the lag)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.lags: list[float] = []
        self._t_wall = FIELD_NAMES.index("t_wall")

    def send(self, table, columns, rows):
        refused = super().send(table, columns, rows)
        done = time.time()
        if table == "turns":
            self.lags.extend(done - row[self._t_wall] for row in rows)
        return refused


def one_proxy(url: str, name: str, db: Path, rate: float, seconds: float, out) -> None:
    """A proxy's writer and shipper: turns at ``rate`` a second for ``seconds``, then until shipped."""
    w = Writer(db)
    sink = _TimedSink(url)
    shipper = Shipper(db, sink, name)
    shipper.start()
    t0, written = time.monotonic(), 0
    while (elapsed := time.monotonic() - t0) < seconds:
        for _ in range(int(elapsed * rate) - written):  # the turns that ended since the last look
            w.put(replace(KINDS[written % len(KINDS)], id=new_turn_id(), t_wall=time.time()))
            written += 1
        time.sleep(0.005)
    w.close(60)
    deadline = time.monotonic() + 120
    while shipper.rows_shipped < written and time.monotonic() < deadline:
        shipper.caught_up.wait(1)
        shipper.caught_up.clear()
    cpu = thread_cpu_s(shipper._thread.native_id)
    shipper.close()
    out.put((name, written, shipper.rows_shipped, cpu, sink.lags, shipper.last_error))


def many(pg: PgServer, args: argparse.Namespace, tmp: Path) -> None:
    url = pg.url(pg.new_database())
    rate = args.streams / args.turn_s
    out = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=one_proxy, args=(url, f"proxy{i}", tmp / f"p{i}.db", rate,
                                                             args.seconds, out)) for i in range(args.proxies)]
    for p in procs:
        p.start()
    results = [out.get(timeout=args.seconds + 300) for _ in procs]
    for p in procs:
        p.join(30)
    lags = sorted(lag for r in results for lag in r[4])
    written, shipped, cpu = (sum(r[i] for r in results) for i in (1, 2, 3))
    (held,) = pg.admin("SELECT count(*) FROM turns", db=url.rsplit("/", 1)[1])[0]
    print(f"bench_ship --proxies {args.proxies}: {args.streams} streams of {args.turn_s} s turns each "
          f"({rate:.0f} turns/s a proxy) for {args.seconds} s; {cpu_model()}; PostgreSQL {pg_bin().parent.name}")
    print(f"  turns       {written} written, {shipped} shipped, {held} held in PostgreSQL"
          + "".join(f"; {r[0]}: {r[5]}" for r in results if r[5]))
    if lags:
        q = lambda f: lags[min(len(lags) - 1, int(f * len(lags)))]  # noqa: E731
        print(f"  lag         p50 {q(0.5):.3f} s   p99 {q(0.99):.3f} s   max {lags[-1]:.3f} s  target p99 < 2 s")
    print(f"  shipper CPU {cpu / max(shipped, 1) * 1e6:10.1f} µs per turn (its threads, all proxies)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=100_000, help="turns per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--proxies", type=int, default=0, help="P proxies writing and shipping at once: the lag")
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams a proxy (with --proxies)")
    ap.add_argument("--turn-s", type=float, default=0.1, help="seconds a stream takes per turn (with --proxies)")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long each proxy writes (with --proxies)")
    args = ap.parse_args()
    if pg_bin() is None:
        raise SystemExit("PostgreSQL is not installed (apt-get install postgresql)")
    pg = PgServer(pg_bin())
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ship-") as tmp:
            if args.proxies:
                many(pg, args, Path(tmp))
                return
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
