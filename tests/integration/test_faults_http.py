"""Never break what it measures: the HTTP edge. Slow clients, headers, keep-alive, body limits,
smuggling and open-proxy tricks, each sent byte by byte on a raw socket.

Issue 6, items 6 (slowloris), 8 (hop-by-hop headers, keep-alive without leaks), 9 (body limit),
10 (smuggling and malformed requests, with aiohttp's C parser and its Python parser) and 16 (open proxy).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import aiohttp.http_parser
import aiohttp.web_protocol
import orjson
import pytest

from faultkit import ScriptedUpstream, await_until, chunk, exchange, fd_count, parse_response, post_head
from specproxy.config import Config
from specproxy.app.fake_upstream import Script

pytestmark = pytest.mark.usefixtures("each_front")  # the lane and aiohttp's server alone (conftest.py)

CHAT = "/v1/chat/completions"
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


# --- 6. slowloris ----------------------------------------------------------------------------------------


async def _trickle(port: int, data: bytes, every: float, limit: int = 400) -> float | None:
    """Send ``data`` one byte every ``every`` s (nothing when it is empty) until the server closes the
    connection; return when it did (seconds after connecting), or None if it never did."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = loop.time()
    try:
        for i in range(limit):
            if i < len(data):
                writer.write(data[i : i + 1])
            try:
                got = await asyncio.wait_for(reader.read(65536), every)
            except asyncio.TimeoutError:
                continue
            if not got:
                return loop.time() - t0
        return None
    except ConnectionError:
        return loop.time() - t0
    finally:
        writer.close()


def test_slowloris_is_cut_at_the_header_timeout_while_others_are_served(make_stack):
    # A header deadline of 3 s: an honest client that had to wait for the slow ones would take seconds, which
    # tells it apart from a busy machine's scheduling delay (the 1.5 s bound below)
    stack = make_stack(header_timeout_s=3.0, scrape_interval_s=0)
    port = stack.service.port

    async def normal(session, delay):
        await asyncio.sleep(delay)  # spread the honest clients over the attack (a schedule, not a wait)
        t0 = time.monotonic()
        async with session.post(stack.url + CHAT, data=BODY) as r:
            await r.read()
            return r.status, time.monotonic() - t0

    async def go():
        head = post_head(CHAT, BODY)
        slow = [_trickle(port, head, 0.05) for _ in range(10)] + [_trickle(port, b"", 0.05) for _ in range(10)]
        async with aiohttp.ClientSession() as s:
            honest = [normal(s, i * 0.03) for i in range(25)]
            results = await asyncio.gather(*slow, *honest)
        return results[:20], results[20:]

    slow, honest = stack.run(go())
    assert all(t is not None and 2.9 < t < 15 for t in slow), slow  # cut at the deadline, not at the 20 s trickle's end
    assert all(status == 200 for status, _ in honest)
    assert max(latency for _, latency in honest) < 1.5, honest
    assert len(stack.upstream.sent) == 25  # not one slow request reached the upstream
    assert stack.service.counters.header_timeouts == 20


def test_slow_second_request_on_a_kept_alive_connection_is_cut(make_stack):
    stack = make_stack(header_timeout_s=0.5, scrape_interval_s=0)

    async def go():
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        writer.write(post_head(CHAT, BODY))
        raw = b""
        while True:
            raw += await asyncio.wait_for(reader.read(65536), 5)
            if b"\r\n\r\n" in raw and parse_response(raw)[0].complete:
                break
        t_response = loop.time()
        nxt = post_head(CHAT, BODY)
        for i in range(200):
            writer.write(nxt[i : i + 1])
            try:
                if not await asyncio.wait_for(reader.read(65536), 0.05):
                    return loop.time() - t_response
            except asyncio.TimeoutError:
                continue
            except ConnectionError:
                return loop.time() - t_response
        return None

    closed_after = stack.run(go())
    assert closed_after is not None and 0.4 < closed_after < 1.5
    assert len(stack.upstream.sent) == 1


def test_header_timeout_never_cuts_a_response_or_a_steady_body(make_stack):
    stack = make_stack(header_timeout_s=0.3, scrape_interval_s=0)
    stack.upstream.script = Script(pieces=["tick"] * 10, interval_s=0.1)  # a 1 s stream, > 3 header timeouts

    async def steady_body():
        for i in range(8):  # a body trickling in 0.1 s apart: each pause is under the timeout
            yield b" " * 10 if i else b'{"stream": true, "messages": []'
            await asyncio.sleep(0.1)
        yield b"}"

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(stack.url + CHAT, data=steady_body()) as r:
                return r.status, await r.read()

    status, body = stack.run(go())
    assert status == 200 and body.count(b'"tick"') == 10 and body.endswith(b"data: [DONE]\n\n")


def test_stalled_body_gets_408_and_never_reaches_the_upstream(make_stack):
    stack = make_stack(header_timeout_s=0.4, scrape_interval_s=0)
    head = f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"

    async def go():
        t0 = time.monotonic()
        raw, closed = await exchange(stack.service.port, head.encode() + b'{"messages": [', timeout=30)
        return raw, closed, time.monotonic() - t0

    raw, closed, elapsed = stack.run(go())
    assert parse_response(raw)[0].status == 408 and closed
    assert 0.35 < elapsed < 20  # the 0.4 s deadline, not the exchange's 30 s give-up (nor never)
    assert stack.upstream.sent == []


# --- 8. headers and keep-alive ---------------------------------------------------------------------------


def test_hop_by_hop_headers_dropped_end_to_end_kept_both_ways(make_stack):
    async def respond(_req, writer, _i):
        body = b'{"ok": true}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: keep-alive, X-Hop-Down\r\nX-Hop-Down: 1\r\nKeep-Alive: timeout=5\r\n"
                     b"Proxy-Authenticate: Basic\r\nTrailer: X-T\r\nUpgrade: h2c\r\n"
                     b"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-Request-Id: rid-9\r\nCache-Control: no-store\r\n"
                     b"X-Multi: one\r\nX-Multi: two\r\nServer: upstream/1.0\r\n\r\n" % len(body) + body)
        await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    extra = ("Connection: keep-alive, X-Hop-Up\r\nX-Hop-Up: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n"
             "Proxy-Authorization: Basic eA==\r\nProxy-Connection: keep-alive\r\nUpgrade: websocket\r\n"
             "Expect: 100-continue\r\nX-Specproxy-Label: arm\r\n"
             "Authorization: Bearer sk-e2e\r\nCookie: c=3\r\nX-Multi: one\r\nX-Multi: two\r\n"
             "Accept: text/event-stream\r\nUser-Agent: raw-client/1\r\nX-Utf8: café ✓\r\n")

    async def go():
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        head = post_head(CHAT, b"", extra).replace(b"Content-Length: 0", b"Content-Length: %d" % len(BODY))
        writer.write(head)
        # Expect: 100-continue: the proxy answers it; the upstream never sees it
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(BODY)
        raw = b""
        while b"\r\n\r\n" not in raw or not parse_response(raw)[0].complete:
            raw += await asyncio.wait_for(reader.read(65536), 5)
        writer.close()
        return interim, parse_response(raw)[0]

    interim, resp = stack.run(go())
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    assert resp.status == 200 and resp.body == b'{"ok": true}'
    names = {k.lower() for k, _ in resp.headers}
    assert not names & {"x-hop-down", "keep-alive", "proxy-authenticate", "trailer", "upgrade"}
    assert resp.header_all("Set-Cookie") == ["a=1", "b=2"] and resp.header_all("X-Multi") == ["one", "two"]
    assert resp.header("X-Request-Id") == "rid-9" and resp.header("Cache-Control") == "no-store"
    assert resp.header("Server") == "upstream/1.0"
    (req,) = upstream.requests
    up_names = {k.lower() for k, _ in req.headers}
    assert not up_names & {"x-hop-up", "keep-alive", "te", "proxy-authorization", "proxy-connection", "upgrade",
                           "expect", "x-specproxy-label"}
    got = dict((k.lower(), v) for k, v in req.headers)
    assert got["authorization"] == "Bearer sk-e2e" and got["cookie"] == "c=3"
    assert [v for k, v in req.headers if k.lower() == "x-multi"] == ["one", "two"]
    assert got["accept"] == "text/event-stream" and got["user-agent"] == "raw-client/1"
    assert req.head.count("X-Utf8: café ✓\r\n".encode()) == 1  # non-ASCII UTF-8 passes as it came
    assert got["host"] == f"127.0.0.1:{stack.raw.port}" and req.body == BODY


def test_request_header_obs_text_passes_unchanged(make_stack):
    """Request header bytes that are not UTF-8 (obs-text) reach the upstream as the client sent them."""
    got = []

    async def respond(req, writer, _i):
        got.append(req.head)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    head = post_head(CHAT, BODY, "Connection: close\r\n").replace(b"Connection: close\r\n",
                                                                 b"Connection: close\r\nX-Obs: caf\xe9 \xff\r\n")
    raw, _ = stack.run(exchange(stack.service.port, head, timeout=5))
    assert raw.startswith(b"HTTP/1.1 200") and len(got) == 1 and b"\r\nX-Obs: caf\xe9 \xff\r\n" in got[0]


def test_response_header_obs_text_passes_unchanged(make_stack):
    """Response header bytes pass as they came, even those that are not UTF-8 (obs-text, RFC 9110 5.5)."""
    async def respond(_req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Obs: caf\xe9\r\n"
                     b"Content-Length: 2\r\n\r\n{}")
        await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    raw, _ = stack.run(exchange(stack.service.port, post_head(CHAT, BODY, "Connection: close\r\n"), timeout=5))
    assert b"X-Obs: caf\xe9\r\n" in raw


@pytest.mark.slow
def test_1000_requests_on_one_connection_leak_nothing(make_stack, tiktoken_tok):
    events = b"".join(chunk(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n') for _ in range(3))

    async def respond(req, writer, _i):
        if req.line.startswith(b"GET"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + events + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)
    stack = make_stack(tiktoken_tok, raw_script=upstream.serve, scrape_interval_s=0)
    service = stack.service

    async def go():
        fds_before, tasks_before = fd_count(), len(asyncio.all_tasks())
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        pending = b""
        for i in range(1000):
            if i % 10 == 9:
                writer.write(b"GET /v1/models HTTP/1.1\r\nHost: p\r\n\r\n")
            else:
                writer.write(post_head(CHAT, b'{"stream": true, "messages": []}'))
            while True:
                if b"\r\n\r\n" in pending:
                    resp, rest = parse_response(pending)
                    if resp.complete and (resp.header("Content-Length") or resp.header("Transfer-Encoding")):
                        pending = rest
                        break
                data = await asyncio.wait_for(reader.read(65536), 5)
                assert data, f"the proxy closed the connection at request {i}"
                pending += data
            assert resp.status == 200
        writer.close()
        await await_until(lambda: not service.open_connections(), 5, what="the proxy to let the connection go")
        return fds_before, tasks_before, fd_count(), len(asyncio.all_tasks())

    fds_before, tasks_before, fds_after, tasks_after = stack.run(go(), timeout=120)
    assert upstream.connections == 1  # every request went over one pooled upstream connection
    assert fds_after - fds_before <= 2  # that pooled connection's two ends, nothing else
    assert tasks_after - tasks_before <= 2  # the scripted upstream serving that connection, and its read
    stack.settle()
    assert len(stack.records) == 900 and all(r.outcome == "ok" for r in stack.records)


# --- 9. body limit ----------------------------------------------------------------------------------------


def test_body_over_the_limit_gets_413_and_the_upstream_is_never_contacted(make_stack):
    assert Config().max_body_bytes >= 16 * 1024 * 1024
    limit = 1 << 20
    stack = make_stack(max_body_bytes=limit, scrape_interval_s=0)

    async def declared():
        # a Content-Length over the limit is refused from the headers alone: no body is sent at all
        head = f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nContent-Length: {2 * limit}\r\n\r\n".encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        writer.write(head)
        raw = await asyncio.wait_for(reader.readuntil(b"}"), 5)
        writer.close()
        return parse_response(raw)[0]

    async def chunked():
        async def body():
            for _ in range(32):
                yield b"x" * 65536

        async with aiohttp.ClientSession() as s:
            async with s.post(stack.url + CHAT, data=body()) as r:
                return r.status, await r.json()

    async def exact():
        async with aiohttp.ClientSession() as s:
            async with s.post(stack.url + CHAT, data=b" " * (limit - len(BODY)) + BODY) as r:
                return r.status

    resp = stack.run(declared())
    assert resp.status == 413 and resp.header("Connection") == "close"
    status, err = stack.run(chunked())
    assert status == 413 and err["error"]["type"] == "body_too_large"
    assert stack.upstream.sent == []
    assert stack.run(exact()) == 200 and len(stack.upstream.sent[0].request_body) == limit


# --- 10. smuggling and malformed requests ---------------------------------------------------------------

P = "POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\n"
MALFORMED = {
    "cl_and_te": P + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "cl_te_pipelined_smuggle": P + "Content-Length: 44\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                               "GET /admin HTTP/1.1\r\nHost: p\r\n\r\n",
    "two_lengths": P + "Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    "two_equal_lengths": P + "Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    "length_list": P + "Content-Length: 5, 5\r\n\r\nhello",
    "length_plus": P + "Content-Length: +5\r\n\r\nhello",
    "length_negative": P + "Content-Length: -1\r\n\r\n",
    "te_twice_in_one": P + "Transfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n",
    "te_two_headers": P + "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te_not_chunked": P + "Transfer-Encoding: gzip\r\n\r\nxxxx",
    "te_obfuscated": P + "Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "te_space_before_colon": P + "Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "te_obs_fold": P + "Transfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n",
    "te_in_http10": "POST /v1/chat/completions HTTP/1.0\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "cr_in_value": P + "X-A: a\rb\r\nContent-Length: 0\r\n\r\n",
    "nul_in_value": P + "X-A: a\x00b\r\nContent-Length: 0\r\n\r\n",
    "nul_in_name": P + "X\x00A: b\r\nContent-Length: 0\r\n\r\n",
    "bare_lf_in_headers": P + "X-A: a\nX-B: b\r\nContent-Length: 0\r\n\r\n",
    "lf_only_request": "POST /v1/chat/completions HTTP/1.1\nHost: p\nContent-Length: 0\n\n",
    "control_char_in_path": "POST /v1/chat\x01/completions HTTP/1.1\r\nHost: p\r\nContent-Length: 0\r\n\r\n",
    "http09": "GET /v1/models\r\n\r\n",
    "bad_version": "POST / HTTP/1.1x\r\nHost: p\r\nContent-Length: 0\r\n\r\n",
    "two_hosts": P + "Host: q\r\nContent-Length: 0\r\n\r\n",
    "bad_chunk_size": P + "Transfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
    "huge_header_line": P + "Authorization: Bearer " + "a" * 20000 + "\r\nContent-Length: 0\r\n\r\n",
    "too_many_headers": P + "".join(f"X-{i}: a\r\n" for i in range(300)) + "Content-Length: 0\r\n\r\n",
    "huge_request_line": "POST /v1/chat/completions?" + "a" * 20000 + " HTTP/1.1\r\nHost: p\r\n\r\n",
    "huge_headers_in_total": P + "".join(f"X-{i}: {'a' * 8000}\r\n" for i in range(100)) + "Content-Length: 0\r\n\r\n",
}
STATUS = {"huge_headers_in_total": 431}


@pytest.fixture(params=["c", "py"])
def parser(request, monkeypatch):
    """aiohttp's C (llhttp) request parser, as installed, and its pure-Python one."""
    if request.param == "py":
        monkeypatch.setattr(aiohttp.web_protocol, "HttpRequestParser", aiohttp.http_parser.HttpRequestParserPy)
    elif aiohttp.web_protocol.HttpRequestParser is aiohttp.http_parser.HttpRequestParserPy:
        pytest.skip("aiohttp's C parser is not installed")
    return request.param


def test_malformed_and_smuggling_requests_are_refused_closed_and_never_forwarded(make_stack, parser):
    stack = make_stack(scrape_interval_s=0)

    async def go():
        out = {}
        for name, raw in MALFORMED.items():
            data, closed = await exchange(stack.service.port, raw.encode("latin-1"), timeout=5)
            out[name] = (parse_response(data)[0].status if b"\r\n\r\n" in data else None, closed)
        return out

    results = stack.run(go(), timeout=120)
    wrong = {name: got for name, got in results.items() if got != (STATUS.get(name, 400), True)}
    assert not wrong, f"{parser} parser: {wrong}"
    assert stack.upstream.sent == []  # nothing, not even the smuggled GET, reached the upstream


# --- 16. open proxy ----------------------------------------------------------------------------------------


def test_requests_cannot_reach_any_host_but_the_upstream(make_stack):
    """Absolute-form URIs, hostile Host / X-Forwarded-Host / Forwarded, a body ``base_url``, CONNECT and
    authority-looking paths: a decoy listener must receive no connection at all."""
    async def nothing(_req, _writer, _i):
        return False

    async def ok(_req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        return True

    decoy = ScriptedUpstream(nothing)
    upstream = ScriptedUpstream(ok)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    stack.run(decoy.start())
    d = f"127.0.0.1:{decoy.port}"
    body = orjson.dumps({"model": "m", "messages": [], "base_url": f"http://{d}/v1", "api_base": f"http://{d}",
                         "url": f"http://{d}/x"})
    cl = f"Content-Length: {len(body)}\r\n"
    attempts = {
        "absolute_get": f"GET http://{d}/v1/models HTTP/1.1\r\nHost: {d}\r\n\r\n",
        "absolute_post": f"POST http://{d}{CHAT} HTTP/1.1\r\nHost: {d}\r\n{cl}\r\n",
        "absolute_userinfo": f"GET http://user@{d}/v1/models HTTP/1.1\r\nHost: {d}\r\n\r\n",
        "host_header": f"POST {CHAT} HTTP/1.1\r\nHost: {d}\r\n{cl}\r\n",
        "forwarded_headers": f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nX-Forwarded-Host: {d}\r\nX-Forwarded-Proto: http\r\n"
                             f"Forwarded: host={d};proto=http\r\nX-Original-URL: http://{d}/\r\n"
                             f"X-Rewrite-URL: http://{d}/\r\n{cl}\r\n",
        "double_slash": f"GET //{d}/v1/models HTTP/1.1\r\nHost: p\r\n\r\n",
        "at_path": f"GET /@{d}/v1/models HTTP/1.1\r\nHost: p\r\n\r\n",
        "encoded_slashes": f"GET /%2F%2F{d}/v1/models HTTP/1.1\r\nHost: p\r\n\r\n",
        "options_star": "OPTIONS * HTTP/1.1\r\nHost: p\r\n\r\n",
        "connect": f"CONNECT {d} HTTP/1.1\r\nHost: {d}\r\n\r\n",
    }

    async def go():
        out = {}
        for name, raw in attempts.items():
            raw = raw.replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n", 1)
            data = raw.encode() + (body if "Content-Length" in raw else b"")
            got, closed = await exchange(stack.service.port, data, timeout=2)
            out[name] = (parse_response(got)[0].status if b"\r\n\r\n" in got else None, closed)
        return out

    results = stack.run(go(), timeout=60)
    assert decoy.connections == 0, results
    assert results["connect"] == (405, True)
    lines = [r.line.decode() for r in upstream.requests]
    assert all(r.header("Host") == f"127.0.0.1:{stack.raw.port}" for r in upstream.requests)
    assert lines.count(f"POST {CHAT} HTTP/1.1") == 3
    assert "GET /v1/models HTTP/1.1" in lines  # an absolute-form target becomes a path on the upstream
    # authority-looking paths stay paths, sent unchanged to the upstream and nowhere else
    for path in (f"//{d}/v1/models", f"/@{d}/v1/models", f"/%2F%2F{d}/v1/models"):
        assert f"GET {path} HTTP/1.1" in lines
    assert [r.body for r in upstream.requests if r.line.startswith(b"POST")] == [body] * 3


def test_an_expectation_other_than_100_continue_gets_417_and_is_not_forwarded(make_stack):
    async def respond(_req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    raw, closed = stack.run(exchange(stack.service.port, post_head(CHAT, BODY, "Expect: 200-ok\r\n"), timeout=5))
    resp, _ = parse_response(raw)
    assert resp.status == 417 and closed
    assert upstream.requests == []


# --- malformed requests: counted, not a log line each ----------------------------------------------------

BAD_HEADS = [b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
             b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
             b"GET / HTTP/1.1\r\nHost: x\r\n\x01Name: v\r\n\r\n",
             b"GARBAGE\r\n\r\n"]


def test_malformed_requests_are_counted_and_said_once_per_interval(make_stack, caplog):
    """Anyone who can connect can send malformed requests: 20 of them get 400 each, are counted in
    ``specproxy_rejected_bad_total``, and make one WARNING line (none at ERROR), not 20. Past the interval
    the next one makes a line again, saying how many came since the last."""
    from specproxy.serve import aiohttp_front

    stack = make_stack(None, scrape_interval_s=0)
    caplog.set_level("DEBUG", logger="specproxy.http")

    async def send(n: int) -> list[bytes]:
        return [(await exchange(stack.service.port, BAD_HEADS[i % len(BAD_HEADS)]))[0][:12] for i in range(n)]

    assert stack.run(send(20)) == [b"HTTP/1.0 400"] * 20
    said = [r for r in caplog.records if r.name == "specproxy.http"]
    assert [r.levelname for r in said] == ["WARNING"], [r.getMessage() for r in said]
    assert "malformed request from 127.0.0.1 answered 400: BadHttpM" in said[0].getMessage()
    assert stack.service.counters.rejected_bad == 20
    assert "specproxy_rejected_bad_total 20.0" in stack.service.metrics.exposition().decode()
    server_log = stack.service._runner.server._kwargs["logger"]
    assert isinstance(server_log, aiohttp_front._ServerLog)
    server_log.next_line_at = 0.0  # as if the interval had passed
    assert stack.run(send(1)) == [b"HTTP/1.0 400"]
    said = [r.getMessage() for r in caplog.records if r.name == "specproxy.http"]
    assert len(said) == 2 and "; 20 since the last such line" in said[1], said
