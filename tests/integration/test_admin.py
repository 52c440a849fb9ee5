"""The reserved prefix /_specproxy/: answered by the proxy on both fronts, never forwarded; its metrics
parse with prometheus_client's own parser and count what the database holds; a token guards it."""

from __future__ import annotations

import socket
import sqlite3

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specproxy.app.fake_upstream import Script, pieces_of
from specproxy.serve.admin import allowed

pytestmark = pytest.mark.usefixtures("each_front")  # the lane and aiohttp's server alone (conftest.py)

TOKEN = "a-token-for-the-tests-0123"


def _raw(url: str, request: bytes) -> bytes:
    """One request on a fresh connection, the whole response until the proxy closes or it is complete."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        out = b""
        while True:
            data = s.recv(65536)
            if not data:
                return out
            out += data
            head, sep, body = out.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    return out


def _get(url: str, path: str, headers: str = "") -> tuple[int, bytes]:
    resp = _raw(url, f"GET {path} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n".encode())
    head, _, body = resp.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def _chat(stack, tok, n: int, model: str = "m") -> None:
    stack.upstream.script = Script(pieces=pieces_of("One two three four five six.", tok), interval_s=0.001)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-test-not-a-secret", max_retries=0, timeout=30)
    for i in range(n):
        stream = client.chat.completions.create(model=model, stream=True, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Count {i}."}])
        for _ in stream:
            pass


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_metrics_parse_and_count_what_the_database_holds(make_stack, tiktoken_tok):
    # no scrapes: a scrape after a turn's end may land after the writer is closed below, and count as dropped
    stack = make_stack(tiktoken_tok, scrape_interval_s=0)
    _chat(stack, tiktoken_tok, 3)
    stack.settle()
    stack.run(stack.service.proxy.drain_measurements())
    stack.service.writer.close()  # flushes every queued record to the file
    with sqlite3.connect(stack.cfg.db) as conn:
        rows = conn.execute("SELECT outcome, count(*), sum(completion_tokens), sum(chunks) FROM turns "
                            "GROUP BY outcome").fetchall()
    status, body = _get(stack.url, "/_specproxy/metrics")
    assert status == 200
    s = _samples(body.decode())
    turns = {x.labels["outcome"]: x.value for x in s["specproxy_turns_total"]}
    assert turns == {o: n for o, n, _, _ in rows} == {"ok": 3}
    labels = s["specproxy_turns_total"][0].labels
    assert set(labels) == {"gen_ai_request_model", "gen_ai_operation_name", "api", "outcome"}
    assert labels["gen_ai_request_model"] == "m" and labels["gen_ai_operation_name"] == "chat"
    assert labels["api"] == "chat"
    assert sum(x.value for x in s["specproxy_delivered_tokens_total"]) == rows[0][2]
    assert s["gen_ai_client_operation_duration_seconds_count"][0].value == 3
    assert s["gen_ai_client_operation_time_to_first_chunk_seconds_count"][0].value == 3
    # per chunk: one observation per chunk after a turn's first, as the convention says; a chunk is an
    # event with data: each turn's text chunks and its role chunk, finish chunk and [DONE]
    assert s["gen_ai_client_operation_time_per_output_chunk_seconds_count"][0].value == rows[0][3] + 3 * 3 - 3
    assert s["specproxy_time_per_output_token_seconds_count"][0].value == 3  # per turn, under its own name
    usage = {x.labels["gen_ai_token_type"]: x.value for x in s["gen_ai_client_token_usage_sum"]}
    assert usage["output"] == rows[0][2] and usage["input"] > 0
    parts = {x.labels["part"] for x in s["specproxy_prompt_part_tokens_count"]}
    assert parts == {"system", "tools", "history", "new"}
    assert s["specproxy_requests_in_flight"][0].value == 0
    assert s["specproxy_dropped_records_store_total"][0].value == 0
    assert "Be brief" not in body.decode() and "sk-test" not in body.decode()  # never text, never keys


# paths that are, or mean to some server, something under the prefix, but no route: answered 404 by the
# proxy, on both fronts (the lane declines them, aiohttp's handler answers)
NOT_ROUTES = (
    "/_specproxy/v1/chat/completions", "/_specproxy/nothing", "/%5Fspecproxy/v1/chat/completions",
    "/v1/../_specproxy/v1/chat/completions", "//_specproxy/metrics", "//_specproxy/", "///_specproxy/metrics",
    "/_specproxy/./metrics", "/_specproxy//metrics", "/%2F_specproxy/metrics", "/%2f_specproxy/metrics",
    "/_specproxy/%2e%2e/v1/models", "/_specproxy/%2E%2E/v1/models", "/_specproxy/../v1/models",
    "/v1/%2e%2e/_specproxy/metrics", "/v1/.%2E/_specproxy/metrics", "/_specproxy/%2e/metrics",
    "/_specproxy/metrics/", "/_specproxy%2Fmetrics", "/_specproxy/events/../metrics",
    "/_specproxy;x/metrics", "/_specproxy;/metrics", "/v1/..;/_specproxy/metrics", "/_specproxy%3Bx/metrics",
)


def test_the_reserved_prefix_never_reaches_the_upstream(make_stack, tiktoken_tok):
    stack = make_stack(tiktoken_tok, scrape_interval_s=0)  # no polls: every request the fake gets is a leak
    before = len(stack.upstream.received)
    for path in NOT_ROUTES:
        status, body = _get(stack.url, path)
        assert status == 404 and b"nothing at that path" in body, (path, status, body)
    for path in ("/_specproxy", "/_specproxy/", "/_specproxy/events"):  # routes, and no page in this process
        status, body = _get(stack.url, path)
        assert status == 404 and b"no live page" in body, (path, status, body)
    for path in ("/_specproxy/metrics", "/_specproxy/metrics?x=1"):
        assert _get(stack.url, path)[0] == 200, path
    for path in ("/_specproxy/v1/chat/completions", "//_specproxy/metrics", "/%2F_specproxy/metrics"):
        post = _raw(stack.url, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               f"Content-Length: 2\r\nConnection: close\r\n\r\n{{}}".encode())
        assert post.startswith(b"HTTP/1.1 405"), (path, post[:200])
    assert stack.upstream.received[before:] == []  # not one of them reached the upstream, on any route
    _chat(stack, tiktoken_tok, 1)  # and the proxy still forwards everything else
    assert len(stack.upstream.sent) == 1
    for path in ("/_specproxyx/v1/models", "/v1/models/_specproxy", "/v1/_specproxy/metrics"):  # not the prefix
        before = len(stack.upstream.received)
        _get(stack.url, path)
        assert stack.upstream.received[before:] == [("GET", path)], path


def test_a_configured_token_is_needed(make_stack, tiktoken_tok):
    stack = make_stack(tiktoken_tok, admin_token=TOKEN)
    assert _get(stack.url, "/_specproxy/metrics")[0] == 401
    assert _get(stack.url, "/_specproxy/metrics", "Authorization: Bearer wrong-token-wrong-token\r\n")[0] == 401
    assert _get(stack.url, "/_specproxy/metrics", f"Authorization: Bearer {TOKEN}\r\n")[0] == 200
    assert _get(stack.url, f"/_specproxy/metrics?token={TOKEN}")[0] == 200
    assert stack.upstream.sent == []


def test_a_token_that_is_not_utf8_is_refused_not_an_error(make_stack, tiktoken_tok, caplog):
    """Header bytes that are not UTF-8 reach the check as surrogates: a 401 like any wrong token, not a
    500 with an ERROR line."""
    stack = make_stack(tiktoken_tok, admin_token=TOKEN)
    request = b"GET /_specproxy/metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3(" \
              b"\r\nConnection: close\r\n\r\n"
    with caplog.at_level("WARNING"):
        assert int(_raw(stack.url, request).split(b" ")[1]) == 401
    assert [r for r in caplog.records if r.levelname == "ERROR"] == []
    assert not allowed("0.0.0.0", "192.168.1.9", TOKEN, "\udcff\udcfe")


def test_who_may_read_without_a_token():
    # loopback clients of a loopback proxy only; any other client, or a proxy listening beyond loopback: 401
    assert allowed("127.0.0.1", "127.0.0.1", None, None)
    assert allowed("localhost", "::1", None, None)
    assert allowed("::1", "::ffff:127.0.0.1", None, None)
    assert not allowed("127.0.0.1", "10.1.2.3", None, None)
    assert not allowed("0.0.0.0", "127.0.0.1", None, None)
    assert not allowed("", "127.0.0.1", None, None)  # every address
    assert not allowed("0.0.0.0", "192.168.1.9", None, None)
    assert not allowed("0.0.0.0", "192.168.1.9", TOKEN, None)
    assert not allowed("0.0.0.0", "192.168.1.9", TOKEN, TOKEN + "x")
    assert allowed("0.0.0.0", "192.168.1.9", TOKEN, TOKEN)
    assert not allowed("127.0.0.1", "127.0.0.1", TOKEN, None)  # a configured token is needed by everyone


def test_a_costly_picture_spaces_out_the_next_one(monkeypatch):
    """The page's drawing waits after a picture in proportion to what it cost, so under heavy traffic it
    stays within RENDER_SHARE of a core: drive Admin's own rendering with a picture of known CPU cost."""
    import asyncio

    from specproxy.config import Config
    from specproxy.serve import admin

    clock = [1000.0]
    slept: list[float] = []

    async def sleep(s: float) -> None:  # the waiting the rule asks for, taken on a clock the test moves
        slept.append(s)
        clock[0] += s

    class Pages:
        drawn = 0

        def fragment(self) -> str:
            self.drawn += 1
            return f"picture {self.drawn}"

    monkeypatch.setattr(admin.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(admin.asyncio, "sleep", sleep)
    monkeypatch.setattr(admin, "_timed", lambda f: (f(), 0.05))  # each picture costs 50 ms of CPU
    version = [0]
    page = admin.Admin(Config(), None, lambda: version[0], Pages())  # type: ignore[arg-type]

    async def two_pictures():
        first = await page._picture_for(version[0])
        version[0] += 1  # the store committed something: a new picture is due
        second = await page._picture_for(version[0])
        return first, second

    first, second = asyncio.run(two_pictures())
    assert first[1] == "picture 1" and second[1] == "picture 2"
    assert slept == [pytest.approx(0.05 / admin.RENDER_SHARE)]  # 10 s between two 50 ms pictures
    assert 0.05 / slept[0] <= admin.RENDER_SHARE + 1e-9


def test_drawing_the_page_never_takes_more_than_its_share_of_a_core():
    """Under heavy traffic the page's 15-minute window holds many turns; a picture that takes longer to
    draw spaces the next one out, so drawing stays at most RENDER_SHARE of one core."""
    from specproxy.serve.admin import MIN_RENDER_S, RENDER_SHARE, render_gap

    assert render_gap(0.0) == render_gap(MIN_RENDER_S * RENDER_SHARE / 2) == MIN_RENDER_S
    for cost in (0.02, 0.1, 0.5):
        assert cost / render_gap(cost) <= RENDER_SHARE + 1e-12


def test_formatting_the_metrics_never_takes_more_than_its_share_of_a_core(monkeypatch):
    """Scraped every second with many series, formatting the page would cost the proxy CPU: a scrape
    sooner than the last formatting's cost / FORMAT_SHARE gets that page again; a later one, a fresh one."""
    import asyncio

    from specproxy.config import Config
    from specproxy.serve import admin

    class Counting:
        formatted = 0

        def exposition(self) -> bytes:
            self.formatted += 1
            return f"page {self.formatted}\n".encode()

    clock = [100.0]
    monkeypatch.setattr(admin.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(admin, "_timed", lambda f: (f(), 0.01))  # each formatting costs 10 ms of CPU
    metrics = Counting()
    page = admin.Admin(Config(), metrics, lambda: 0)  # type: ignore[arg-type]
    gap = admin.format_gap(0.01)
    assert gap == 0.01 / admin.FORMAT_SHARE

    async def scrapes():
        seen = [await page._metrics_text()]
        clock[0] += gap * 0.9
        seen.append(await page._metrics_text())  # too soon: the same page, not formatted again
        clock[0] += gap * 0.2
        seen.append(await page._metrics_text())  # the share allows another
        return seen

    assert asyncio.run(scrapes()) == [b"page 1\n", b"page 1\n", b"page 2\n"]
    assert metrics.formatted == 2

    # however costly the formatting (many models' series), a page is never more than MAX_REUSE_S old
    monkeypatch.setattr(admin, "_timed", lambda f: (f(), 1.3))
    assert admin.format_gap(1.3) == admin.MAX_REUSE_S

    async def costly():
        seen = [await page._metrics_text()]
        clock[0] += admin.MAX_REUSE_S * 0.9
        seen.append(await page._metrics_text())
        clock[0] += admin.MAX_REUSE_S * 0.2
        seen.append(await page._metrics_text())
        return seen

    clock[0] += 100
    assert asyncio.run(costly()) == [b"page 3\n", b"page 3\n", b"page 4\n"]


def test_the_start_up_line_says_when_the_pages_are_closed():
    """Listening beyond loopback without a token, the pages answer 401 to everyone: serve's start-up line
    must not offer their address as if they were open."""
    from specproxy.app.serve_cli import pages_line
    from specproxy.config import Config

    url = "http://h:8080"
    assert pages_line(Config(), url) == f"live page {url}/_specproxy/, Prometheus {url}/_specproxy/metrics"
    assert pages_line(Config(admin_token=TOKEN), url).endswith("(admin_token needed)")
    closed = pages_line(Config(host="0.0.0.0"), url)
    assert "/_specproxy/" not in closed and "set admin_token" in closed
    assert pages_line(Config(host="0.0.0.0", admin_token=TOKEN), url).endswith("(admin_token needed)")
