"""``bench_overhead.py --with-sink``: the PostgreSQL a specproxy ships to, and what the benchmark reads of
that shipping (issue 35: with a sink and OTLP on, the overhead targets hold; the shipper's CPU per turn
is reported).

The server is the test suite's (``tests/pgcluster.py``: Debian's binaries, ``initdb`` and ``pg_ctl`` in a
temporary directory on 127.0.0.1), started after the orchestrator pinned itself to the load side's
CPUs, so that PostgreSQL runs there as a remote database would run elsewhere: its CPU is counted with
the load side's, never the proxy's. Each specproxy started with a sink gets a database of its own: two
proxies of one host name in one database would be two proxies of the same ``proxy_name``, which the
sink refuses, and a count per database is a count per proxy.

What is read, all from outside the proxy: the shipper thread's CPU by its OS name (``specproxy-ship``,
``/proc/PID/task/*/schedstat``), its rows and seconds behind from the state line (the same figures as
``/_specproxy/metrics``' ``specproxy_sink_*``), and at the end the turns in PostgreSQL against the turns
in the proxy's own SQLite file.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path

from overhead_procs import children, listdir
from overhead_tables import SHIPPER_THREAD

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # pgcluster: the server the fleet's tests start

from pgcluster import PgServer, pg_bin  # noqa: E402

SHIPPER_FIGURES = ("sink_rows_behind", "sink_seconds_behind", "sink_rows_shipped", "sink_batches_failed",
                   "sink_rows_set_aside")  # the state line's keys (serve/counters.py SINK_COUNTS)


class SinkSide:
    """A local PostgreSQL for the run; ``new_url`` a fresh database per proxy; ``close`` at the end."""

    def __init__(self) -> None:
        bindir = pg_bin()
        if bindir is None:
            raise SystemExit("--with-sink needs PostgreSQL's binaries (apt-get install postgresql)")
        self.server = PgServer(bindir)

    def new_url(self) -> str:
        return self.server.url(self.server.new_database())

    def pids(self) -> list[int]:
        """The postmaster and its children now (backends, the autovacuum launcher and its workers)."""
        pid = self.server.pid
        return [pid, *children(pid)]

    def close(self) -> None:
        self.server.close()


def shipper_sample(state: dict[str, float] | None) -> dict[str, float] | None:
    """The shipper's figures of one state line (``specproxy_state``), or None without them."""
    if not state or "sink_rows_behind" not in state:
        return None
    return {k: state[k] for k in SHIPPER_FIGURES if k in state}


def thread_on_cpu_s(pid: int, name: str = SHIPPER_THREAD) -> float:
    """On-CPU seconds (schedstat) of the threads of ``pid`` whose OS name is ``name``, 0 when none."""
    total = 0
    for tid in listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() != name[:15]:
                    continue
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def _counts(db: Path, url: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(turns, ok turns) in the proxy's SQLite file, and in its PostgreSQL database."""
    import psycopg

    query = "SELECT count(*), count(*) FILTER (WHERE outcome = 'ok') FROM turns"
    lite = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        local = lite.execute(query).fetchone()
    finally:
        lite.close()
    with psycopg.connect(url, connect_timeout=10) as conn:
        remote = conn.execute(query).fetchone()
    return (int(local[0]), int(local[1] or 0)), (int(remote[0]), int(remote[1] or 0))


def delivered(db: Path, url: str, timeout_s: float = 60.0, poll_s: float = 0.2) -> dict:
    """Once the load has stopped: wait (at most ``timeout_s``) until PostgreSQL holds as many turns as the
    proxy's file and neither count moved since the last look (the last turns may still be in the
    measuring thread or the writer's queue); then both counts and the wait. A count that never matches is
    returned as it stands: the caller prints the difference."""
    t0 = time.monotonic()
    last = None
    while True:
        now = _counts(db, url)
        if now == last and now[0][0] == now[1][0]:
            break
        if time.monotonic() - t0 >= timeout_s:
            break
        last = now
        time.sleep(poll_s)  # a poll interval: the shipper offers no event to wait on from outside
    (recorded, recorded_ok), (in_pg, in_pg_ok) = now
    return {"recorded": recorded, "recorded_ok": recorded_ok, "in_pg": in_pg, "in_pg_ok": in_pg_ok,
            "waited_s": time.monotonic() - t0}
