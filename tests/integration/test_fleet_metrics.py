"""The shipper's own figures on ``/_specproxy/metrics``, per sink, against a real PostgreSQL
(tests/pgserver.py) that goes down and comes back under a running ``specproxy serve``: rows behind grows
by exactly the turns served meanwhile, seconds behind is the oldest one's age, batches failed counts the
attempts; back up, rows behind returns to 0 and every turn is in PostgreSQL once. Issue 35. Every wait is
for an event (a figure on the page, a row count), bounded.
"""

from __future__ import annotations

import signal
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from faultkit import wait_until
from pgserver import pg_count
from serveproc import LoopThread, ServeProcess, chat
from specproxy.app.fake_upstream import FakeUpstream, Script


def sink_figures(url: str) -> dict[str, dict[str, float]]:
    """Each specproxy_sink_* family's value per sink label."""
    page = urllib.request.urlopen(url + "/_specproxy/metrics", timeout=30).read().decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name.startswith("specproxy_sink_") and not s.name.endswith("_created"):
                out.setdefault(s.name, {})[s.labels["sink"]] = s.value
    return out


def test_rows_behind_grows_while_postgres_is_down_and_returns_to_0(tmp_path, pg_server):
    pgdb = pg_server.new_database()
    sink = pg_server.url(pgdb)
    lt = LoopThread()
    up = FakeUpstream(Script(pieces=["a", "b", "c"]))
    lt.run(up.start())
    proc = ServeProcess(tmp_path, up.url, tmp_path / "s.db", "--sink", sink, "--proxy-name", "edge-1")
    down = False
    try:
        for _ in range(3):
            assert chat(proc.url) == 200
        wait_until(lambda: pg_count(sink) == 3, 60, 0.05, "the first turns shipped")
        wait_until(lambda: sink_figures(proc.url).get("specproxy_sink_rows_shipped_total", {}).get(sink, 0) >= 3,
                   60, 0.1, "the shipped rows counted")
        before = sink_figures(proc.url)
        assert before["specproxy_sink_rows_behind"] == {sink: 0}
        assert before["specproxy_sink_batches_failed_total"] == {sink: 0}
        pg_server.stop("fast")
        down = True
        t_first = time.time()
        for _ in range(5):
            assert chat(proc.url) == 200
        # the outbox grows by exactly the turns served while the sink was down
        wait_until(lambda: sink_figures(proc.url)["specproxy_sink_rows_behind"][sink] == 5, 60, 0.1,
                   "rows behind to count the waiting turns")
        during = sink_figures(proc.url)
        assert during["specproxy_sink_batches_failed_total"][sink] >= 1
        assert 0 < during["specproxy_sink_seconds_behind"][sink] <= time.time() - t_first + 1
        pg_server.start()
        down = False
        wait_until(lambda: sink_figures(proc.url)["specproxy_sink_rows_behind"][sink] == 0, 60, 0.1,
                   "rows behind back to 0")
        after = sink_figures(proc.url)
        assert after["specproxy_sink_seconds_behind"][sink] == 0
        assert after["specproxy_sink_batches_failed_total"][sink] >= during["specproxy_sink_batches_failed_total"][sink]
        assert pg_count(sink) == 8
    finally:
        if down:
            pg_server.start()
        proc.signal(signal.SIGTERM)
        proc.wait(60)
        lt.run(up.close())
        lt.close()
