"""``serve --otlp-endpoint``: the per-turn figures pushed over OTLP/HTTP protobuf to a receiver in the test
(aiohttp on 127.0.0.1) that decodes each ExportMetricsServiceRequest with opentelemetry-proto, and checks
the GenAI semantic-convention names, the attributes and the values against the turns the database holds:
counts exactly, token sums exactly, seconds to the float rounding of adding in another order. An endpoint
that takes nothing is said in one line, counted, and never holds forwarding up. Issue 35. Every wait is
for an event (an export holding the turns, a count on the page), bounded."""

from __future__ import annotations

import signal
import sqlite3
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from faultkit import wait_until
from serveproc import LoopThread, ServeProcess
from specproxy.app.fake_upstream import FakeUpstream, Script

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class Receiver:
    """An OTLP/HTTP metrics endpoint: keeps every request it decoded."""

    def __init__(self, lt: LoopThread) -> None:
        self.lt = lt
        self.requests: list[ExportMetricsServiceRequest] = []
        self.lock = threading.Lock()
        app = web.Application()
        app.router.add_post("/v1/metrics", self.take)
        self.runner = web.AppRunner(app)
        lt.run(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        lt.run(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/metrics"

    async def take(self, request: web.Request) -> web.Response:
        assert request.headers["Content-Type"] == "application/x-protobuf"
        msg = ExportMetricsServiceRequest()
        msg.ParseFromString(await request.read())
        with self.lock:
            self.requests.append(msg)
        return web.Response(body=b"", content_type="application/x-protobuf")

    def latest(self) -> dict[str, list]:
        """The newest export's data points by metric name (cumulative: it holds every turn so far)."""
        with self.lock:
            reqs = [r for r in self.requests if r.resource_metrics]
        if not reqs:
            return {}
        out: dict[str, list] = {}
        for rm in reqs[-1].resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    out[m.name] = [(m.unit, kind, p) for p in getattr(m, kind).data_points]
        return out

    def resource(self) -> dict[str, str]:
        with self.lock:
            rm = next(r for r in self.requests if r.resource_metrics).resource_metrics[0]
        return {a.key: a.value.string_value for a in rm.resource.attributes}

    def close(self) -> None:
        self.lt.run(self.runner.cleanup())


def attrs(point) -> dict[str, str]:
    return {a.key: a.value.string_value for a in point.attributes}


def post(url: str, api: str, stream: bool) -> None:
    import json

    body = ({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi there"}]} if api == "chat"
            else {"model": "m", "stream": stream, "prompt": "once upon a time"})
    req = urllib.request.Request(url + PATHS[api], json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        assert resp.status == 200


@pytest.fixture
def lt():
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def upstream(lt):
    up = FakeUpstream(Script(pieces=["a", " b", " c", " d", " e"], interval_s=0.002))
    lt.run(up.start())
    yield up
    lt.run(up.close())


def turns(db) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT api, streamed, prompt_tokens, completion_tokens, total_s, ttft_s, decode_tps, "
                            "outcome, model FROM turns").fetchall()


def test_the_turns_figures_arrive_under_the_genai_names(tmp_path, lt, upstream):
    receiver = Receiver(lt)
    db = tmp_path / "s.db"
    proc = ServeProcess(tmp_path, upstream.url, db, "--otlp-endpoint", receiver.url, "--otlp-interval", "0.3",
                        "--proxy-name", "edge-7", "--tokenizer", "tiktoken:cl100k_base")
    try:
        sent = [("chat", True)] * 5 + [("completions", True)] * 3 + [("chat", False)] * 2
        for api, stream in sent:
            post(proc.url, api, stream)
        wait_until(lambda: len(turns(db)) == len(sent), 30, 0.02, "the turns in the database")
        rows = turns(db)

        def usage_count() -> int:
            return sum(p.count for _, _, p in receiver.latest().get("gen_ai.client.token.usage", [])
                       if attrs(p)["gen_ai.token.type"] == "output")

        wait_until(lambda: usage_count() == len(sent), 30, 0.05, "an export holding every turn")
        got = receiver.latest()
    finally:
        proc.signal(signal.SIGTERM)
        proc.wait(60)
        receiver.close()
    assert {r[7] for r in rows} == {"ok"} and all(r[3] for r in rows)

    def by(name: str, **want) -> list:
        return [p for _, _, p in got[name] if all(attrs(p).get(k) == v for k, v in want.items())]

    for name, unit in (("gen_ai.client.operation.duration", "s"), ("gen_ai.client.token.usage", "{token}"),
                       ("gen_ai.server.request.duration", "s"), ("gen_ai.server.time_to_first_token", "s"),
                       ("gen_ai.server.time_per_output_token", "s"),
                       ("gen_ai.client.operation.time_to_first_chunk", "s"),
                       ("gen_ai.client.operation.time_per_output_chunk", "s"), ("specproxy.decode.speed", "{token}/s")):
        assert {(u, k) for u, k, _ in got[name]} == {(unit, "histogram")}, name
    for api, op in (("chat", "chat"), ("completions", "text_completion")):
        mine = [r for r in rows if r[0] == api]
        streamed = [r for r in mine if r[1]]
        for token_type, col in (("input", 2), ("output", 3)):
            (p,) = by("gen_ai.client.token.usage", **{"specproxy.api": api, "gen_ai.token.type": token_type})
            assert attrs(p) == {"gen_ai.operation.name": op, "gen_ai.request.model": "m",
                                "gen_ai.provider.name": "openai", "specproxy.api": api, "specproxy.outcome": "ok",
                                "gen_ai.token.type": token_type}
            assert (p.count, p.sum) == (len(mine), sum(r[col] for r in mine))  # exactly
        for name in ("gen_ai.client.operation.duration", "gen_ai.server.request.duration"):
            (p,) = by(name, **{"specproxy.api": api})
            assert p.count == len(mine) and p.sum == pytest.approx(sum(r[4] for r in mine), rel=1e-9)
            assert sum(p.bucket_counts) == p.count and len(p.explicit_bounds) == len(p.bucket_counts) - 1
        (p,) = by("gen_ai.server.time_to_first_token", **{"specproxy.api": api})
        assert p.count == len(streamed) and p.sum == pytest.approx(sum(r[5] for r in streamed), rel=1e-9)
        (p,) = by("gen_ai.server.time_per_output_token", **{"specproxy.api": api})
        assert p.count == len(streamed) and p.sum == pytest.approx(sum(1 / r[6] for r in streamed), rel=1e-9)
        (p,) = by("gen_ai.client.operation.time_to_first_chunk", **{"specproxy.api": api})
        assert p.count == len(streamed)
        (p,) = by("specproxy.decode.speed", **{"specproxy.api": api})
        assert p.count == len(streamed) and p.sum == pytest.approx(sum(r[6] for r in streamed), rel=1e-9)
        (p,) = by("gen_ai.client.operation.time_per_output_chunk", **{"specproxy.api": api})
        assert p.count > len(streamed)  # one per chunk after each turn's first
    assert "error.type" not in {k for _, _, p in got["gen_ai.client.operation.duration"] for k in attrs(p)}
    assert receiver.resource()["service.instance.id"] == "edge-7"
    assert "specproxy.sink.rows_behind" not in got  # no sink: no figures that would read as keeping up



def test_an_endpoint_that_takes_nothing_is_one_line_and_counted(tmp_path, upstream, refused):
    url = f"http://127.0.0.1:{refused}/v1/metrics"
    db = tmp_path / "s.db"
    proc = ServeProcess(tmp_path, upstream.url, db, "--otlp-endpoint", url, "--otlp-interval", "0.2")
    try:
        for _ in range(3):
            post(proc.url, "chat", True)  # forwarding goes on
        wait_until(lambda: "does not take metrics" in proc.stderr(), 30, 0.05, "the line at start")

        def failed() -> float:
            page = urllib.request.urlopen(proc.url + "/_specproxy/metrics", timeout=30).read().decode()
            return {s.name: s.value for f in text_string_to_metric_families(page)
                    for s in f.samples}.get("specproxy_otlp_exports_failed_total", 0)

        wait_until(lambda: failed() >= 3, 30, 0.1, "the failed exports counted")
        post(proc.url, "chat", True)
        wait_until(lambda: len(turns(db)) == 4, 30, 0.02, "the turns recorded")
    finally:
        proc.signal(signal.SIGTERM)
        proc.wait(60)
    lines = [ln for ln in proc.stderr().splitlines() if url in ln]
    assert len(lines) == 1 and "cannot connect" in lines[0], lines
    assert "Traceback" not in proc.stderr()


def test_a_malformed_endpoint_is_refused_in_one_line(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "specproxy.app.cli", "serve", "--upstream", "http://127.0.0.1:9",
                          "--db", str(tmp_path / "x.db"), "--otlp-endpoint", "collector:4318"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().count("\n") == 0 and "otlp_endpoint" in out.stderr, out.stderr


def test_a_turn_that_did_not_end_ok_carries_its_outcome_as_error_type(lt):
    """``error.type`` is the outcome of a turn that did not end ``ok`` (the conventions' attribute for a
    failed operation), absent on one that did; a non-streamed turn has no stream figures. The exporter
    reads what ``OwnMetrics`` holds (the Prometheus page's figures), at ``close`` here."""
    from specproxy.record import Record, new_turn_id
    from specproxy.serve.otlp import Otlp
    from specproxy.serve.own_metrics import OwnMetrics

    receiver = Receiver(lt)
    metrics = OwnMetrics()
    otlp = Otlp(receiver.url, 3600.0, "edge-x", "0.0", lambda: metrics)
    otlp.start()
    try:
        for outcome, streamed in (("ok", True), ("upstream_error", False), ("client_cancelled", True)):
            metrics.record(Record(id=new_turn_id(), t_wall=1.7e9, method="POST", path="/v1/messages", status=200,
                                  outcome=outcome, streamed=streamed, model="claude-x", api="messages",
                                  prompt_tokens=5, completion_tokens=7, total_s=1.5,
                                  ttft_s=0.25 if streamed else None, decode_tps=40.0 if streamed else None,
                                  request_parsed=True, measured=True))
    finally:
        otlp.close()  # the last export
        receiver.close()
    assert otlp.exports == 1 and otlp.exports_failed == 0
    got = receiver.latest()
    by_outcome = {attrs(p)["specproxy.outcome"]: attrs(p) for _, _, p in got["gen_ai.client.operation.duration"]}
    assert set(by_outcome) == {"ok", "upstream_error", "client_cancelled"}
    assert "error.type" not in by_outcome["ok"]
    assert by_outcome["upstream_error"]["error.type"] == "upstream_error"
    assert by_outcome["client_cancelled"]["error.type"] == "client_cancelled"
    assert {a["gen_ai.provider.name"] for a in by_outcome.values()} == {"anthropic"}
    ttft = {attrs(p)["specproxy.outcome"]: p.count for _, _, p in got["gen_ai.server.time_to_first_token"]}
    assert ttft == {"ok": 1, "client_cancelled": 1}  # the non-streamed turn has none


def test_the_exporting_thread_carries_its_name_to_the_os(lt):
    """Its CPU is read by its OS thread name (``top -H``; ``scripts/bench_overhead.py --with-otlp`` splits
    the proxy's CPU by thread), which Python before 3.14 leaves as the process's."""
    from specproxy.serve.otlp import Otlp

    receiver = Receiver(lt)
    otlp = Otlp(receiver.url, 3600.0, "edge-x", "0.0", lambda: None)
    otlp.start()
    try:
        comm = Path(f"/proc/self/task/{otlp._thread.native_id}/comm")
        wait_until(lambda: comm.read_text().strip() == "specproxy-otlp", timeout=10, what="the thread's OS name")
    finally:
        otlp.close()
        receiver.close()


def test_without_the_otlp_extra_the_endpoint_is_one_clear_error(monkeypatch):
    from specproxy.errors import ConfigError
    from specproxy.serve.otlp import Otlp

    # as if the exporter were not installed
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.metric_exporter", None)
    with pytest.raises(ConfigError, match=r"pip install 'specproxy\[otlp\]'"):
        Otlp("http://127.0.0.1:9/v1/metrics", 1.0, "p", "v", lambda: None)


def test_in_process_nothing_blocks_the_event_loop(make_stack, tiktoken_tok, lt):
    """The in-process stack under blockbuster (``make_stack``): a blocking call of specproxy's on the event
    loop fails the test. Recording happens in the measuring thread and exporting in the SDK's."""
    import aiohttp

    receiver = Receiver(lt)
    try:
        stack = make_stack(tiktoken_tok, scrape_interval_s=0, otlp_endpoint=receiver.url, otlp_interval_s=0.2)

        async def one() -> int:
            async with aiohttp.ClientSession() as s:
                async with s.post(stack.url + PATHS["chat"], json={"model": "m", "stream": True, "messages": [
                        {"role": "user", "content": "hi"}]}) as r:
                    await r.read()
                    return r.status

        for _ in range(4):
            assert stack.run(one()) == 200
        stack.settle()

        def outputs() -> int:
            return sum(p.count for _, _, p in receiver.latest().get("gen_ai.client.token.usage", [])
                       if attrs(p)["gen_ai.token.type"] == "output")

        wait_until(lambda: outputs() == 4, 30, 0.05, "an export holding the four turns")
    finally:
        receiver.close()


def test_the_shippers_figures_go_per_sink(lt):
    """With sinks, their figures go as gauges (rows and seconds behind) and cumulative sums (rows shipped,
    batches failed, rows set aside) per ``specproxy.sink``, the values ``Counters.read_sinks`` gives."""
    from specproxy.serve.otlp import Otlp

    figures = {"postgresql://fleet@db-a/fleet": {"sink_rows_behind": 12, "sink_seconds_behind": 3.5,
                                                 "sink_rows_shipped": 900, "sink_batches_failed": 2,
                                                 "sink_rows_set_aside": 1},
               "postgresql://fleet@db-b/fleet": {"sink_rows_behind": 0, "sink_seconds_behind": 0.0,
                                                 "sink_rows_shipped": 912, "sink_batches_failed": 0,
                                                 "sink_rows_set_aside": 0}}
    receiver = Receiver(lt)
    otlp = Otlp(receiver.url, 3600.0, "edge-x", "0.0", lambda: None, lambda: figures)
    try:
        assert otlp.export()
    finally:
        otlp.close()
        receiver.close()
    got = receiver.latest()
    for key, name, kind in (("sink_rows_behind", "specproxy.sink.rows_behind", "gauge"),
                            ("sink_seconds_behind", "specproxy.sink.seconds_behind", "gauge"),
                            ("sink_rows_shipped", "specproxy.sink.rows_shipped", "sum"),
                            ("sink_batches_failed", "specproxy.sink.batches_failed", "sum"),
                            ("sink_rows_set_aside", "specproxy.sink.rows_set_aside", "sum")):
        assert {k for _, k, _ in got[name]} == {kind}, name
        values = {attrs(p)["specproxy.sink"]: (p.as_double if p.HasField("as_double") else p.as_int)
                  for _, _, p in got[name]}
        assert values == {sink: f[key] for sink, f in figures.items()}, name
