"""A real Prometheus (tests/promserver.py) scraping two ``specproxy serve`` processes in front of one fake
upstream: after traffic through both, ``histogram_quantile(0.5, sum by (le) (...))`` over both proxies'
per-stream decode speed histograms lands in the very bucket that holds the median ``specproxy report``
computes over the same turns (``report --db postgresql://``: the fleet's database both proxies ship to),
i.e. within the histogram's
resolution. With an odd number of turns this is exact, not a matter of chance: PromQL's rank 0.5 * n
falls in the bucket of the middle turn, and it interpolates inside that bucket. Issue 35. Every wait is
for an event (both targets up, a scrape that holds every turn, every turn shipped), bounded.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from bisect import bisect_left

from faultkit import wait_until
from pgserver import pg_count
from promserver import Prometheus
from serveproc import ROOT, LoopThread, ServeProcess, chat
from specproxy.app.fake_upstream import FakeUpstream, Script
from specproxy.serve.own_metrics import SPEED_TPS

# seconds between chunks, one per turn, cycled: decode speeds spread over several buckets
GAPS_S = (0.002, 0.004, 0.007, 0.012, 0.02, 0.035)
TURNS = 15  # odd: the median is one turn's speed


def turn_count(db) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM turns").fetchone()[0]


def test_promql_median_over_two_proxies_is_in_the_bucket_of_the_reports(tmp_path, pg_server):
    lt = LoopThread()
    up = FakeUpstream(Script(pieces=[" a"] * 12))
    lt.run(up.start())
    dbs = [tmp_path / "a.db", tmp_path / "b.db"]
    url = pg_server.url(pg_server.new_database())  # the fleet's database: both proxies ship to it
    procs = [ServeProcess(tmp_path, up.url, db, "--tokenizer", "tiktoken:cl100k_base", "--proxy-name", f"edge-{i}",
                          "--sink", url, name=f"serve{i}") for i, db in enumerate(dbs)]
    prom = None
    try:
        prom = Prometheus([f"127.0.0.1:{p.port}" for p in procs])
        wait_until(lambda: prom.targets_up() == 2, 60, 0.2, "both proxies up in Prometheus")
        for i in range(TURNS):
            up.script = Script(pieces=[" a"] * 12, interval_s=GAPS_S[i % len(GAPS_S)])
            assert chat(procs[i % 2].url) == 200  # 8 turns through one proxy, 7 through the other
        wait_until(lambda: sum(map(turn_count, dbs)) == TURNS, 30, 0.02, "every turn recorded")
        wait_until(lambda: pg_count(url) == TURNS, 120, 0.05, "both shippers to ship every turn")
        count = "sum(specproxy_decode_speed_tokens_per_second_count)"
        wait_until(lambda: prom.value(count) == TURNS, 60, 0.2, "a scrape of both proxies holding every turn")
        by_proxy = {r["metric"]["instance"]: float(r["value"][1]) for r in
                    prom.query("sum by (instance) (specproxy_decode_speed_tokens_per_second_count)")}
        median = prom.value("histogram_quantile(0.5, sum by (le) (specproxy_decode_speed_tokens_per_second_bucket))")
    finally:
        if prom is not None:
            prom.close()
        for p in procs:
            p.signal(signal.SIGTERM)
            p.wait(60)
        lt.run(up.close())
        lt.close()
    assert sorted(by_proxy.values()) == [7, 8]  # both proxies' series, summed by the query
    report = json.loads(subprocess.run([sys.executable, "-m", "specproxy.app.cli", "report", "--db", url, "--json"], capture_output=True, text=True,
                                       timeout=120, cwd=ROOT, check=True).stdout)
    reference = report["user"]["decode_tps"]
    assert reference["n"] == TURNS  # the same turns on both sides
    i = bisect_left(SPEED_TPS, reference["median"])  # its bucket: (SPEED_TPS[i-1], SPEED_TPS[i]]
    assert 0 < i < len(SPEED_TPS), reference  # a finite bucket (else the quantile is a bound, not a value)
    low, high = SPEED_TPS[i - 1], SPEED_TPS[i]
    print(f"PromQL median {median:.2f}, report median {reference['median']:.2f}, bucket ({low}, {high}]")
    assert low <= median <= high, (median, reference["median"], (low, high))
