"""The upstream as users give it and as it behaves: a base URL with or without ``/v1``, clients whose base
URL has no ``/v1``, and an upstream that does not answer (said at start-up, scrape failures logged and
reported)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time

import aiohttp
import pytest
from yarl import URL

from specproxy.store.sqlite_source import SQLiteSource
from specproxy.config import load_config, server_root
from specproxy.store.dataset import load_turns
from specproxy.analyze.report_data import build_report
from specproxy.analyze.report import render_text
from specproxy.observe.scrape import FAIL_LOG_EVERY_S, _worth_a_line
from specproxy.app.fake_upstream import Script
from specproxy.wire.pool import UpstreamPool
from waits import wait_for


async def post(url: str, path: str, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as c:
        async with c.post(url + path, json=body) as r:
            return r.status, await r.read()


def report_of(stack):
    stack.settle()
    stack.run(stack.service.stop())  # drains the measurements and the writer's queue
    conn = sqlite3.connect(stack.cfg.db)
    return build_report(SQLiteSource(conn).load(server=True, context=True), source="test"), conn


CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


# --- a base URL with or without /v1 ---------------------------------------------------------------------

@pytest.mark.parametrize(("given", "root"), [
    ("http://h:8000/v1", "http://h:8000"),
    ("http://h:8000/v1/", "http://h:8000"),
    ("http://h:8000", "http://h:8000"),
    ("http://h/llm/v1", "http://h/llm"),
    ("http://h/llm", "http://h/llm"),
    ("http://h/v1x", "http://h/v1x"),  # only a whole /v1 segment is the API's, not a prefix
])
def test_a_trailing_v1_is_the_apis_not_a_prefix(given, root):
    assert str(server_root(URL(given))).rstrip("/") == root
    cfg = load_config(env={}, overrides={"upstream": given})
    assert cfg.forwards_to("/v1/chat/completions") == root + "/v1/chat/completions"
    assert cfg.forwards_to("/chat/completions") == root + "/chat/completions"


@pytest.mark.usefixtures("each_front")
@pytest.mark.parametrize(("base", "arrives"), [
    ("/v1", "/v1/chat/completions"),
    ("/v1/", "/v1/chat/completions"),
    ("/llm/v1", "/llm/v1/chat/completions"),
    ("/llm", "/llm/v1/chat/completions"),
])
def test_an_upstream_given_with_v1_gets_no_doubled_prefix(make_stack, tiktoken_tok, base, arrives):
    """What the upstream receives, and the scraper's /metrics at the server's root (where llama-server and
    vLLM serve it), for a base URL copied from a server's docs."""
    stack = make_stack(tiktoken_tok, upstream_path=base, scrape_interval_s=0.05)
    stack.upstream.script = Script(pieces=["a", " b"])
    assert stack.run(post(stack.url, "/v1/chat/completions", CHAT))[0] == 200
    assert stack.upstream.sent[-1].path == arrives
    stack.settle()
    (rec,) = stack.records
    assert rec.outcome == "ok" and rec.path == "/v1/chat/completions" and rec.completion_tokens == 2
    if not base.startswith("/llm"):  # the fake upstream serves /metrics at its root only
        watch = stack.service.watch
        assert watch.scraper.url == stack.upstream.url + "/metrics"
        assert wait_for(lambda: watch.instance_id is not None)
        assert watch.scraper.disabled_reason is None


CLIMBING = ["/../admin", "/v1/../../admin", "/%2e%2e/admin", "/.%2E/admin", "/%2E./admin", "/v1/..%2f..%2fadmin",
            "/v1/%2e%2e%2F%2e%2e%2Fadmin", "/..;/admin", "/v1/..;x/..;/admin", "/%252e%252e/admin",
            "/v1/..%5c..%5cadmin", "/..", "/v1/..",
            # overlong UTF-8 "." and "/", which decoders that do not check read as the character
            "/%c0%ae%c0%ae/admin", "/v1/.%c0%ae%c0%afadmin", "/%e0%80%ae%e0%80%ae/admin", "/%f0%80%80%ae./admin",
            "/%25c0%25ae%25c0%25ae/admin"]


@pytest.mark.usefixtures("each_front")
@pytest.mark.parametrize("target", CLIMBING)
def test_a_client_path_never_leaves_the_upstreams_base_path(make_stack, target):
    """``--upstream http://host/llm``: a client path with a ``..`` segment, written as it is or escaped, is
    refused (400) and never forwarded: ``/llm/../admin`` would reach ``/admin`` on a server that resolves
    it. Sent from a raw socket, so that no client library resolves the path first."""
    from faultkit import ScriptedUpstream, request_once

    async def ok(_req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        return True

    upstream = ScriptedUpstream(ok)
    stack = make_stack(raw_script=upstream.serve, upstream_path="/llm", scrape_interval_s=0)
    resp = stack.run(request_once(stack.service.port, f"GET {target} HTTP/1.1\r\nHost: p\r\n\r\n".encode()))
    assert resp.status == 400 and b"'..' segment" in resp.body, (target, resp)
    assert upstream.requests == []
    assert stack.service.counters.rejected_bad == 1
    # a path without one goes under the base as ever
    resp = stack.run(request_once(stack.service.port, b"GET /v1/models HTTP/1.1\r\nHost: p\r\n\r\n"))
    assert (resp.status, resp.body) == (200, b"ok")
    assert [r.line for r in upstream.requests] == [b"GET /llm/v1/models HTTP/1.1"]


# --- clients whose base URL has no /v1 --------------------------------------------------------------------

@pytest.mark.usefixtures("each_front")
def test_paths_without_v1_are_measured_like_their_v1_twins(make_stack, tiktoken_tok):
    stack = make_stack(tiktoken_tok)
    stack.upstream.script = Script(pieces=["one", " two", " three"])
    assert stack.run(post(stack.url, "/chat/completions", CHAT))[0] == 200
    status, body = stack.run(post(stack.url, "/completions", {"model": "m", "prompt": "count"}))
    assert status == 200 and b"one two three" in body
    assert [s.path for s in stack.upstream.sent] == ["/chat/completions", "/completions"]
    stack.settle()
    recs = sorted(stack.records, key=lambda r: r.t_request)
    assert [r.path for r in recs] == ["/chat/completions", "/completions"]  # what the client sent
    assert [r.outcome for r in recs] == ["ok", "ok"]
    assert [r.streamed for r in recs] == [True, False]
    assert [r.completion_tokens for r in recs] == [3, 3]
    assert recs[1].prompt_new_tokens == tiktoken_tok.count("count")


# --- an upstream that does not answer ---------------------------------------------------------------------

def messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in list(caplog.records) if text in r.getMessage()]


def test_start_up_says_when_the_upstream_is_not_answering(make_stack, refused, caplog):
    caplog.set_level(logging.INFO, logger="specproxy")
    dead = f"http://127.0.0.1:{refused}/v1"
    stack = make_stack(upstream=dead)
    (line,) = messages(caplog, "is not answering")
    assert line.startswith(f"upstream {dead} is not answering (") and "refused" in line
    assert line.endswith("): serving anyway; requests will get 502 until it does")
    assert stack.run(post(stack.url, "/v1/chat/completions", CHAT))[0] == 502  # and it serves


def test_start_up_is_quiet_about_an_upstream_that_answers(make_stack, caplog):
    caplog.set_level(logging.INFO, logger="specproxy")
    make_stack()
    assert messages(caplog, "is not answering") == []


async def test_the_start_up_check_waits_no_longer_than_its_timeout(monkeypatch):
    """A connect that never completes (a firewall dropping packets) is a timeout after the check's own
    bound, not after connect_timeout_s: start-up is never held for long."""
    pool = UpstreamPool(URL("http://127.0.0.1:9"), connect_timeout_s=10.0, idle_timeout_s=1.0)

    async def hang(*_args, **_kwargs):
        await asyncio.Event().wait()

    monkeypatch.setattr(pool.loop, "create_connection", hang)
    t0 = time.monotonic()
    why = await pool.probe(0.05)
    assert time.monotonic() - t0 < 8  # its own bound, not connect_timeout_s's 10 s
    assert why is not None and why.timeout and str(why) == "no connection within 0.05 s"


# --- scrape failures: logged with a back-off -------------------------------------------------------------

def test_failed_scrapes_are_logged_with_a_back_off(make_stack, refused, caplog):
    """Nothing answers: the 1st, 2nd, 4th, 8th... failure in a row is logged, with its reason, not every one."""
    caplog.set_level(logging.INFO, logger="specproxy")
    stack = make_stack(upstream=f"http://127.0.0.1:{refused}", scrape_interval_s=0.02)
    watch = stack.service.watch
    assert wait_for(lambda: watch.failures >= 9)
    stack.run(stack.service.stop())  # no more scrapes
    lines = messages(caplog, "failed (")
    assert [int(line.split("failed (")[1].split(" ")[0]) for line in lines] == [
        n for n in (1, 2, 4, 8, 16, 32, 64) if n <= watch.failures]
    assert all(line.startswith(f"scrape of http://127.0.0.1:{refused}/metrics failed (") for line in lines)
    assert all("Connect" in line for line in lines)


def test_a_run_of_scrape_failures_ends_with_a_recovery_line(make_stack, caplog):
    caplog.set_level(logging.INFO, logger="specproxy")
    stack = make_stack(scrape_interval_s=0.02)
    watch = stack.service.watch
    assert wait_for(lambda: watch.instance_id is not None)
    stack.upstream.metrics_status = 500
    assert wait_for(lambda: watch.failures >= 3)
    stack.upstream.metrics_status = 200
    assert wait_for(lambda: messages(caplog, "recovered after"))
    (line,) = messages(caplog, "recovered after")
    n = int(line.split("recovered after ")[1].split(" ")[0])
    assert n >= 3 and line.endswith(f"failure{'s' if n != 1 else ''} in a row")
    assert messages(caplog, "failed (1 in a row): ScrapeError: HTTP 500")


def test_the_back_off_logs_powers_of_two_then_at_least_every_few_minutes():
    logged = [n for n in range(1, 100) if _worth_a_line(n, since_last_line_s=1.0)]
    assert logged == [1, 2, 4, 8, 16, 32, 64]
    assert _worth_a_line(65, since_last_line_s=FAIL_LOG_EVERY_S)
    assert not _worth_a_line(65, since_last_line_s=FAIL_LOG_EVERY_S - 1)


# --- scrape failures: in the report ----------------------------------------------------------------------

def test_a_report_whose_scrapes_all_failed_says_how_many_and_why(make_stack, refused):
    """Every turn 502 and every scrape failed: the report says "0 scrapes, N failed (last error: ...)", not
    "none recorded". N counts the failed attempts around the turns (from the last one before the first turn
    to the first one after the last), so that the report says the same whenever it runs: not every failure
    of the proxy's life."""
    stack = make_stack(upstream=f"http://127.0.0.1:{refused}", scrape_interval_s=0.02)
    watch = stack.service.watch
    assert stack.run(post(stack.url, "/v1/chat/completions", CHAT))[0] == 502
    assert wait_for(lambda: watch.failures >= 5)
    r, conn = report_of(stack)  # stops the service: no more scrapes
    s = r["server"]
    assert s["scrapes"] == 0 and 1 <= s["scrape_failures"] <= watch.failures and "Connect" in s["last_scrape_error"]
    text = render_text(r)
    assert f"Server's own counters: 0 scrapes, {s['scrape_failures']} failed (last error: {s['last_scrape_error']})" in text
    again = build_report(SQLiteSource(conn).load(server=True, context=True), source="test")  # later: the same count
    assert again["server"]["scrape_failures"] == s["scrape_failures"]
    assert "none recorded" not in text
