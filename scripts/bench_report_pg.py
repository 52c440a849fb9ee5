"""How long ``specproxy report --db postgresql://...`` takes over a fleet's database (issue 35: 10M turns of
4 proxies in under 10 s, a one-hour window of it in under 1 s).

    python scripts/bench_report_pg.py -n 1000000          # a local PostgreSQL in a temporary directory
    python scripts/bench_report_pg.py -n 10000000 --repeat 1 --keep /tmp/pg10m   # kept: loaded once

Starts a PostgreSQL of Debian's packages the way the tests do (``tests/pgcluster.py``: ``initdb`` and
``pg_ctl`` on 127.0.0.1, fsync off), loads ``n`` synthetic turns of 4 proxies over a week through the
sink's own write path (``PostgresSink.send``: COPY into a staging table, then INSERT into the day
partitions), ``ANALYZE``s, and then times, ``--repeat`` times each:

* the CLI as a user runs it (wall time with the interpreter's start, and its peak RSS):
  ``specproxy report --json`` over the whole database and over one hour of it, each read three ways:
  ``--no-cache`` (PostgreSQL only), a cold column cache (``store/pg_cache.py``; its directory removed
  first, so the whole report builds it, and the hour, holding part of a day not cached, reads
  PostgreSQL) and the warm cache (the one a whole report left);
* in process: ``PgSource.load`` (the SQL or the cache, and the columns) the same three ways, and
  ``build_report`` apart, whole and hour;
* the baseline, in the same run: the report's columns fetched with psycopg into Python lists.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402
import psycopg  # noqa: E402

from benchlib import cpu_model  # noqa: E402
from pgcluster import PgServer, pg_bin  # noqa: E402
from specproxy.analyze.report_data import REPORT_COLUMNS, build_report  # noqa: E402
from specproxy.store.pg_source import PgSource  # noqa: E402
from specproxy.store.sinks import Identity  # noqa: E402
from specproxy.store.sinks.postgres import PostgresSink, migrate  # noqa: E402
from specproxy.store.source import Window  # noqa: E402

T0 = 1_800_000_000.0
SPAN = 7 * 86400.0
BATCH = 50_000
COLUMNS = ("id", "t_wall", "path", "status", "outcome", "streamed", "label", "instance_id", "request_parsed",
           "concurrency", "ttft_s", "decode_s", "total_s", "completion_tokens", "usage_completion_tokens", "chunks",
           "tokens_per_chunk", "decode_tps", "prompt_tokens", "prompt_system_tokens", "prompt_tools_tokens",
           "prompt_history_tokens", "prompt_new_tokens", "proxy_delay_s", "tokenizer", "content_class", "measured",
           "proxy_name")


def batch_rows(rng: np.random.Generator, t: np.ndarray, proxy: str) -> list[tuple]:
    """Plausible turns at times ``t``: two labels and instances, concurrency 1-64, a few errors and aborts,
    a few non-streamed turns, NULLs where a real turn has them."""
    n = len(t)
    conc = np.minimum(rng.geometric(0.15, n), 64)
    ttft = rng.lognormal(-1.0, 0.6, n)
    tokens = rng.integers(20, 900, n)
    tps = rng.normal(80.0, 12.0, n).clip(5) / np.sqrt(conc)
    decode = tokens / tps
    outcome = np.where(rng.random(n) < 0.97, "ok", np.where(rng.random(n) < 0.5, "client_abort", "upstream_error"))
    streamed = rng.random(n) < 0.95
    parts = rng.integers(0, 2000, (n, 4))
    label = np.where(rng.random(n) < 0.5, "a", "b")
    inst = np.where(rng.random(n) < 0.5, "i1", "i2")
    cls = rng.choice(["prose", "code", "tool_call"], n)
    out = []
    for i in range(n):
        s = bool(streamed[i])
        out.append((uuid.uuid4().hex, float(t[i]), "/v1/chat/completions", 200, str(outcome[i]), int(s),
                    str(label[i]), str(inst[i]), 1, int(conc[i]), float(ttft[i]), float(decode[i]) if s else 0.0,
                    float(ttft[i] + decode[i]), int(tokens[i]), int(tokens[i]) + 1, int(tokens[i]) if s else 1,
                    1.0 if s else float(tokens[i]), float(tps[i]) if s else None, int(parts[i].sum()),
                    int(parts[i, 0]), int(parts[i, 1]), int(parts[i, 2]), int(parts[i, 3]), 1e-4,
                    "tiktoken:o200k_base", str(cls[i]), 1, proxy))
    return out


def load(url: str, n: int, proxies: int = 4) -> float:
    """``n`` turns of ``proxies`` proxies through the sink's write path; seconds taken."""
    rng = np.random.default_rng(7)
    start = time.perf_counter()
    per = n // proxies
    for k in range(proxies):
        sink = PostgresSink(url)
        sink.open(Identity(f"edge-{k}", f"store-{k}"))
        t_all = np.sort(rng.uniform(T0, T0 + SPAN, per))
        for lo in range(0, per, BATCH):
            refused = sink.send("turns", COLUMNS, batch_rows(rng, t_all[lo:lo + BATCH], f"edge-{k}"))
            assert not refused, refused[:1]
        sink.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE turns")
    return time.perf_counter() - start


# how the CLI reads the turns: ``--no-cache`` (PostgreSQL only), through the column cache made anew (its
# directory removed first: the first report after a long time), and through the cache the run before made
READS = (("no cache", ("--no-cache",), False), ("cold cache", (), True), ("warm cache", (), False))


def _database(server: PgServer, n: int) -> str:
    """The database of ``n`` loaded turns: the one a kept server holds already, else a new one loaded now."""
    name = f"bench_{n}"
    if server.admin(f"SELECT 1 FROM pg_database WHERE datname = '{name}'"):
        print(f"reusing the {n:,} turns loaded into {server.root} before", flush=True)
        with psycopg.connect(server.url(name), autocommit=True) as conn:
            migrate(conn)  # loaded by an older specproxy: its new schema steps (006_turn_days: the cache's check)
        return name
    server.admin(f"CREATE DATABASE {name}_loading")
    took = load(server.url(f"{name}_loading"), n)
    server.admin(f"ALTER DATABASE {name}_loading RENAME TO {name}")  # only a complete load is reused
    print(f"loaded {n:,} turns of 4 proxies in {took:.1f} s ({n / took:,.0f} turns/s through "
          f"PostgresSink.send)", flush=True)
    return name


def cli(url: str, *extra: str) -> tuple[float, float]:
    start = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "specproxy.app.cli", "report", "--json", "--db", url, *extra],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"report failed: {p.stderr.read().decode()}")
    return wall, usage.ru_maxrss / 1024


def baseline(url: str, window: Window) -> float:
    cols = ", ".join(c for c in REPORT_COLUMNS)
    where = "" if window.since is None else f" WHERE t_wall >= {window.since} AND t_wall < {window.until}"
    start = time.perf_counter()
    with psycopg.connect(url) as conn:
        rows = conn.execute(f"SELECT {cols} FROM turns{where} ORDER BY t_wall, seq").fetchall()
        list(zip(*rows))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=1_000_000, help="turns to load [1,000,000]")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="keep the PostgreSQL server in DIR and reuse its data on the next run with the same -n "
                         "(loading 10M turns takes a while); default: a temporary server, removed")
    ap.add_argument("--load-only", action="store_true", help="load the turns (into --keep's server) and stop")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the baseline fetch into Python lists (10M turns of them need ~10 GB)")
    args = ap.parse_args()
    bindir = pg_bin()
    if bindir is None:
        raise SystemExit("PostgreSQL is not installed (apt-get install postgresql)")
    server = PgServer(bindir, root=args.keep)
    cache = Path(tempfile.mkdtemp(prefix="specproxy-bench-cache-"))
    os.environ["SPECPROXY_CACHE_DIR"] = str(cache)  # this run's PostgreSQL column cache; its children's too
    try:
        url = server.url(_database(server, args.n))
        if args.load_only:
            return
        hour = Window(since=T0 + SPAN / 2, until=T0 + SPAN / 2 + 3600)
        windows = (("whole", Window(), ()),
                   ("one hour", hour, ("--since", str(hour.since), "--until", str(hour.until))))
        # the CLI runs first: a child's peak RSS (wait4) starts from this process's at the fork, so it must
        # be small then (no columns loaded here yet)
        runs: dict[tuple[str, str], dict[str, list]] = {}
        for _ in range(args.repeat):
            for name, window, extra in windows:
                for read, flags, cold in READS:
                    if cold:
                        shutil.rmtree(cache, ignore_errors=True)
                    elif not flags and not cache.exists():  # warm: as a whole report left it (a window
                        cli(url)  # holding part of a day not in the cache reads PostgreSQL: pg_cache.py)
                    w, r = cli(url, *extra, *flags)
                    got = runs.setdefault((name, read), {"wall": [], "rss": [], "load": []})
                    got["wall"].append(w)
                    got["rss"].append(r)
        rows = []
        for name, window, _ in windows:
            builds, bases = [], []
            for _ in range(args.repeat):
                for read, flags, cold in READS:
                    if cold:
                        shutil.rmtree(cache, ignore_errors=True)
                    elif not flags and not cache.exists():
                        cli(url)
                    with PgSource(url, cache=not flags) as store:
                        t = time.perf_counter()
                        data = store.load(window, REPORT_COLUMNS, server=True, context=True)
                        runs[name, read]["load"].append(time.perf_counter() - t)
                    if read == READS[-1][0]:  # the analysis is the same whatever read the columns
                        t = time.perf_counter()
                        build_report(data, source=url)
                        builds.append(time.perf_counter() - t)
                    n = len(data.turns)
                    del data
                bases.append(float("nan") if args.no_baseline else baseline(url, window))
            rows.append((name, n, builds, bases))
        med = statistics.median
        print(f"\n{platform.node()}: {cpu_model()}, {os.cpu_count()} cores; PostgreSQL {bindir.parent.name}; "
              f"medians of {args.repeat}")
        print("| window | turns | read | `report --json` s | peak RSS MiB | `PgSource.load` s |")
        print("|---|---:|---|---:|---:|---:|")
        for name, n, _, _ in rows:
            for read, _, _ in READS:
                got = runs[name, read]
                print(f"| {name} | {n:,} | {read} | {med(got['wall']):.2f} | {med(got['rss']):.0f} | "
                      f"{med(got['load']):.2f} |")
        print()
        for name, n, builds, bases in rows:
            print(f"{name}: build_report {med(builds):.2f} s; baseline fetch (psycopg, Python lists) "
                  f"{med(bases):.2f} s")
    finally:
        server.close()
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
