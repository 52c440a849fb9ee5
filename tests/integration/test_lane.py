"""The lane (``specproxy/serve/lane.py``): the common request served without aiohttp's server.

Two kinds of test. What the lane takes, it must read exactly as aiohttp's parser would and ``refusals.refuse``
must let through: a differential test against aiohttp's C parser and its Python one, over generated
heads, well-formed and not. And, through a real proxy on 127.0.0.1 and a scripted upstream, what the
lane does on the wire: it serves common requests itself, hands a connection to aiohttp at the first
request it declines (that request and every later one still answered, in order, with exact bodies),
serves pipelined requests in order, waits for a body that comes in pieces, answers a stalled body with
408, closes an idle connection at the keep-alive timeout, and lets go of its connections on stop.
The rest of the proxy's wire behaviour runs through both fronts (``each_front`` in conftest.py).
"""

from __future__ import annotations

import asyncio
import types
from unittest import mock

import aiohttp.http_parser
import aiohttp.web_protocol
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from budget import examples
from faultkit import ScriptedUpstream, await_until, chunk, exchange, parse_response, post_head
from specproxy.serve.lane import read_head
from specproxy.serve.headers import LABEL_HEADER
from specproxy.serve.refusals import refuse

CHAT = "/v1/chat/completions"
BODY = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
MAX_BODY = 1 << 20


# --- what the lane takes, aiohttp reads the same ----------------------------------------------------------

_TOKEN = st.text(alphabet="!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                 min_size=1, max_size=12).map(str.encode)
_NAMES = st.one_of(
    _TOKEN,
    st.sampled_from([b"Host", b"host", b"Content-Length", b"content-length", b"Transfer-Encoding", b"Expect",
                     b"Upgrade", b"Connection", b"Content-Type", b"User-Agent", b"Authorization",
                     LABEL_HEADER.encode(), b"Content-Encoding", b"X-A", b"Server", b"ETag", b"Max-Forwards"]),
    st.sampled_from([b"X A", b"", b"X\x00A", b"X:A", b"X\tA", b"\xe9t\xe9", b" X"]),
)
_VALUES = st.one_of(
    st.binary(max_size=20),
    st.text(alphabet=" \tabcXYZ019,;=-\x7f\xe9", max_size=20).map(lambda s: s.encode("latin-1")),
    st.sampled_from([b"close", b"keep-alive", b"Keep-Alive, close", b"upgrade", b"chunked", b"gzip",
                     b"100-continue", b"0", b"5", b"+5", b"-1", b"5, 5", b" 5 ", b"05", b"9" * 20,
                     b"X-A", b"x-a, close", b"caf\xe9", b"\t", b""]),
)
_TARGETS = st.one_of(
    st.sampled_from([b"/v1/chat/completions", b"/", b"/v1/models?x=1&y=2", b"//evil/x", b"/a/../b",
                     b"/a/./b", b"/%2F", b"*", b"http://h/x", b"/a#f", b"/a b", b"/a?", b"/?", b"/a;b=c",
                     b"/~u/@x:y", b"/a?b=/c", b"/.hidden", b"/a/..", b"/\xe9", b"/v1/completions"]),
    st.text(alphabet="/abc.%?=&#~@:;+!$'()*,-_", min_size=1, max_size=16).map(lambda s: b"/" + s.encode()),
)


@st.composite
def _requests(draw) -> bytes:
    method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS", b"HEAD",
                                   b"CONNECT", b"TRACE", b"get", b"PRI", b"POSTX"]))
    target = draw(_TARGETS)
    version = draw(st.sampled_from([b"HTTP/1.1"] * 6 + [b"HTTP/1.0", b"HTTP/1.1x", b"HTTP/2.0", b"http/1.1"]))
    eol = draw(st.sampled_from([b"\r\n"] * 12 + [b"\n"]))
    fields = draw(st.lists(st.tuples(_NAMES, st.sampled_from([b": ", b":", b":\t", b" : ", b": \t"]), _VALUES),
                           max_size=8))
    if fields:  # a header again, sometimes: which one of several counts must be what aiohttp takes
        fields += draw(st.lists(st.sampled_from(fields), max_size=2))
    body = draw(st.binary(max_size=40))
    if draw(st.booleans()):  # usually a right Content-Length
        fields.append((b"Content-Length", b": ", str(len(body)).encode()))
    head = method + b" " + target + b" " + version + eol
    for name, sep, value in draw(st.permutations(fields)):
        head += name + sep + value + eol
    return head + eol + body


def _aiohttp_reads(raw: bytes, parser_cls):
    """What aiohttp's server would take from ``raw``: its first message and payload, or an exception."""
    proto = mock.Mock()
    parser = parser_cls(proto, asyncio.new_event_loop(), 2**16, max_line_size=8190, max_field_size=16384,
                        max_headers=128, auto_decompress=False)
    messages, _upgraded, _tail = parser.feed_data(raw)
    return messages


@pytest.mark.parametrize("parser_cls", [aiohttp.web_protocol.HttpRequestParser, aiohttp.http_parser.HttpRequestParserPy],
                         ids=["installed", "py"])
@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(raw=_requests())
@example(raw=b"GET /v1/chat/completions HTTP/1.1\r\n0: \r\n0: \r\n0: \r\nHost: \r\n\r\n\x00")  # a bad next message
def test_what_the_lane_takes_aiohttp_reads_the_same_and_would_forward(parser_cls, raw):
    end = raw.find(b"\r\n\r\n")
    taken = read_head(raw, end, MAX_BODY) if end >= 0 else None
    if taken is None:
        return  # declined: aiohttp's server gets the request, as before the lane
    req, start, need = taken
    # the first message as the lane framed it: bytes past it are the next request, read (or declined) on
    # its own. Fed together, aiohttp's C parser refuses the whole read for a bad next message (found by
    # this test: a valid GET, then b"\x00" in the same read), so its server would answer 400 to both
    # where the lane forwards the first; over separate reads aiohttp too would forward it. A framing
    # difference still shows: aiohttp then sees no whole message here, or another payload.
    messages = _aiohttp_reads(raw[:need], parser_cls)  # raises if aiohttp refuses it: the lane must not take it
    assert messages, "aiohttp's parser did not see a whole request where the lane did"
    msg, payload = messages[0]
    assert msg.method == req.method
    assert msg.version == aiohttp.HttpVersion11 and req.http11
    assert list(msg.raw_headers) == list(req.raw_headers)  # the header bytes forwarded are the same
    assert msg.url.path == req.path and msg.url.raw_path_qs.encode() in (req.target, req.target.rstrip(b"?"))
    assert (not msg.should_close) == req.keep_alive
    assert payload.is_eof() and payload.read_nowait(-1) == raw[start:need]
    assert msg.headers.get(LABEL_HEADER) == req.label
    assert msg.headers.get("Content-Encoding", "") == req.content_encoding
    assert not msg.upgrade and not msg.chunked
    shim = types.SimpleNamespace(method=msg.method, version=msg.version, headers=msg.headers,
                                 raw_headers=msg.raw_headers)
    assert refuse(shim) is None  # nothing the proxy's own checks would refuse


def test_the_lane_takes_what_clients_send():
    """The differential test passes trivially if the lane declines everything: these it must take."""
    sdk = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept-Encoding: gzip, deflate\r\n"
           b"Connection: keep-alive\r\nAccept: application/json\r\nContent-Type: application/json\r\n"
           b"User-Agent: OpenAI/Python 1.40.0\r\nX-Stainless-Lang: python\r\nAuthorization: Bearer sk-x\r\n"
           b"X-Specproxy-Label: base\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
    for raw in (sdk, b"GET /v1/models HTTP/1.1\r\nHost: p\r\n\r\n", post_head(CHAT, BODY),
                b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: p\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"):
        taken = read_head(raw, raw.find(b"\r\n\r\n"), MAX_BODY)
        assert taken is not None, raw[:60]
    req, start, need = read_head(sdk, sdk.find(b"\r\n\r\n"), MAX_BODY)
    assert (req.method, req.path, req.label, req.keep_alive, sdk[start:need]) == ("POST", CHAT, "base", True, BODY)
    assert read_head(sdk, sdk.find(b"\r\n\r\n"), len(BODY) - 1) is None  # over max_body_bytes: aiohttp's 413


# --- on the wire ----------------------------------------------------------------------------------------


def _sse(events: int = 3) -> bytes:
    body = b"".join(chunk(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n') for _ in range(events))
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + body + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


async def _ok(req, writer, _i):
    writer.write(_sse())
    await writer.drain()
    return True


def _counts(stack) -> tuple[int, int]:
    """Requests the lane forwarded, connections it handed to aiohttp (the state line's two counts)."""
    lanes = stack.service.lanes
    return lanes.requests, lanes.handed_over


async def _read_responses(reader: asyncio.StreamReader, n: int, timeout: float = 10) -> list:
    out, pending = [], b""
    while len(out) < n:
        if b"\r\n\r\n" in pending:
            resp, rest = parse_response(pending)
            if resp.complete and (resp.header("Content-Length") or resp.header("Transfer-Encoding")):
                out.append(resp)
                pending = rest
                continue
        data = await asyncio.wait_for(reader.read(65536), timeout)
        assert data, f"the proxy closed the connection after {len(out)} responses"
        pending += data
    return out


def test_common_requests_are_served_by_the_lane(make_stack, tiktoken_tok):
    upstream = ScriptedUpstream(_ok)
    stack = make_stack(tiktoken_tok, raw_script=upstream.serve, scrape_interval_s=0)

    async def go():
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        for _ in range(5):
            writer.write(post_head(CHAT, BODY))
            [resp] = await _read_responses(reader, 1)
            assert resp.status == 200 and resp.body.endswith(b"data: [DONE]\n\n")
        writer.close()

    stack.run(go())
    stack.settle()
    assert _counts(stack) == (5, 0)
    assert [r.body for r in upstream.requests] == [BODY] * 5
    expected = ("ok", tiktoken_tok.count("xxx"), 3)  # three chunks of "x": the tokenizer counts the text
    assert [(r.outcome, r.completion_tokens, r.chunks) for r in stack.records] == [expected] * 5


def test_the_head_deadline_steps_aside_once_the_first_head_is_in(make_stack):
    """Until the first request's head is whole, the connection's reads go through the head deadline
    (``service._HeadDeadline``); from then on the transport hands them to the lane itself."""
    upstream = ScriptedUpstream(_ok)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)

    async def go():
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        raw = post_head(CHAT, BODY)
        cut = raw.index(b"\r\n\r\n")
        writer.write(raw[:cut])  # the head, but for its blank line
        [lane] = await await_until(lambda: list(stack.service.lanes.open), 30, what="the connection's lane")
        before = type(lane.transport.get_protocol()).__name__
        writer.write(raw[cut:])
        [first] = await _read_responses(reader, 1)
        after = lane.transport.get_protocol()
        writer.write(raw)
        [second] = await _read_responses(reader, 1)
        writer.close()
        return before, after is lane, first.status, second.status

    assert stack.run(go()) == ("_HeadDeadline", True, 200, 200)


def test_a_declined_request_hands_the_connection_to_aiohttp_in_order(make_stack):
    """Common, then a chunked request body (the lane declines it), then common again, pipelined on one
    connection: three answers in order, three exact bodies upstream; aiohttp has the connection from
    the second request on."""
    upstream = ScriptedUpstream(_ok)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    second = b'{"model": "m", "messages": []}'
    chunked = (f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(second), second))

    async def go():
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        writer.write(post_head(CHAT, BODY) + chunked + post_head(CHAT, BODY + b" "))
        got = await _read_responses(reader, 3)
        writer.close()
        return got

    got = stack.run(go())
    assert [r.status for r in got] == [200, 200, 200]
    assert [r.body for r in upstream.requests] == [BODY, second, BODY + b" "]
    assert upstream.requests[1].header("Content-Length") == str(len(second))  # de-chunked, re-framed
    assert _counts(stack) == (1, 1)


def test_pipelined_requests_and_a_body_in_pieces(make_stack):
    upstream = ScriptedUpstream(_ok)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    bodies = [BODY + b" " * i for i in range(4)]

    async def go():
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        writer.write(b"".join(post_head(CHAT, b) for b in bodies[:3]))  # three in one write
        first = await _read_responses(reader, 3)
        last = post_head(CHAT, bodies[3])
        cut = last.index(b"\r\n\r\n") + 4
        for piece in (last[:20], last[20:cut], last[cut : cut + 5], last[cut + 5 :]):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.02)  # separate reads on the proxy's side (the test's pacing)
        second = await _read_responses(reader, 1)
        writer.close()
        return first + second

    got = stack.run(go())
    assert [r.status for r in got] == [200] * 4
    assert [r.body for r in upstream.requests] == bodies
    assert _counts(stack) == (4, 0)


def test_a_stalled_body_gets_408_and_nothing_is_forwarded(make_stack):
    upstream = ScriptedUpstream(_ok)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0, header_timeout_s=0.4)
    raw = post_head(CHAT, BODY)

    async def go():
        t0 = asyncio.get_running_loop().time()
        got, closed = await exchange(stack.service.port, raw[:-10], timeout=30)
        return got, closed, asyncio.get_running_loop().time() - t0

    got, closed, took = stack.run(go())
    resp, _ = parse_response(got)
    assert (resp.status, closed) == (408, True) and b"request_timeout" in resp.body
    assert 0.35 < took < 20  # the 0.4 s deadline, not the exchange's 30 s give-up (nor never)
    assert upstream.requests == [] and stack.service.counters.rejected_bad == 1


def test_an_idle_connection_closes_at_the_keepalive_timeout(make_stack):
    upstream = ScriptedUpstream(_ok)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0, header_timeout_s=0.4)

    async def go():
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        writer.write(post_head(CHAT, BODY))
        await _read_responses(reader, 1)
        t0 = loop.time()
        eof = await asyncio.wait_for(reader.read(), 5)  # nothing more is sent: the proxy must hang up
        writer.close()
        return eof, loop.time() - t0

    eof, idle = stack.run(go())
    assert eof == b"" and 0.3 < idle < 3
    assert _counts(stack) == (1, 0)


def test_stop_lets_an_exchange_finish_and_closes_idle_connections(make_stack):
    release = asyncio.Event()

    async def slow(req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await release.wait()
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        return True

    upstream = ScriptedUpstream(slow)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    service = stack.service

    async def go():
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", service.port)
        busy_r, busy_w = await asyncio.open_connection("127.0.0.1", service.port)
        busy_w.write(post_head(CHAT, BODY))
        await busy_r.readuntil(b"\r\n\r\n")  # the head: the exchange is under way
        await await_until(lambda: len(service.lanes.open) == 2, 5, what="both connections to be open")
        stopping = asyncio.ensure_future(service.stop())
        assert await asyncio.wait_for(idle_r.read(), 5) == b""  # the idle one closes at once
        assert not stopping.done()  # the busy one holds the stop until its exchange is over
        release.set()
        rest = await asyncio.wait_for(busy_r.read(), 5)  # its body to the end, then the close
        await asyncio.wait_for(stopping, 10)
        idle_w.close()
        busy_w.close()
        return rest

    rest = stack.run(go())
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert service.open_connections() == 0


def test_a_large_request_pipelined_behind_a_slow_exchange_waits_and_is_forwarded_whole(make_stack):
    """The lane stops reading while more than ``PIPELINED_BYTES`` wait behind the exchange in progress, and
    reads on when it is over: the second request (2 MiB of body) arrives whole and in order."""
    release = asyncio.Event()

    async def first_slow(req, writer, i):
        if i == 0:
            await release.wait()
        writer.write(_sse())
        await writer.drain()
        return True

    upstream = ScriptedUpstream(first_slow)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * (2 << 20) + b'"}]}'

    async def go():
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        writer.write(post_head(CHAT, BODY) + post_head(CHAT, big))
        lanes = stack.service.lanes
        lane = next(iter(lanes.open))
        await await_until(lambda: lane._reading_paused, 10, what="the lane to stop reading")
        release.set()
        got = await _read_responses(reader, 2, timeout=30)
        writer.close()
        return got

    got = stack.run(go())
    assert [r.status for r in got] == [200, 200]
    assert [r.body for r in upstream.requests] == [BODY, big]
    assert _counts(stack) == (2, 0)
