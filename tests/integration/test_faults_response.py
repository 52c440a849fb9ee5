"""The response side as strict as the request side: no stale response to another client, no ambiguous
framing downstream, no control characters or oversized heads, no underscore header names.

Both peers are raw sockets scripted byte by byte (faultkit, rawpeers), through both fronts (the lane,
aiohttp's server alone) and, where a chunked body is relayed, each body relay that ships (the relay
thread, the Python one).
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from faultkit import (KeptClient, await_until, chunk, kernel_received, post_head, read_request,
                      request_once)
from procmem import memory, reset_peak
from specproxy.wire.pool import UpstreamPool

# each front; each relay for the tests whose bodies the relay thread can take (a chunked one after its
# head), which assert that it took them: a head refused or a Content-Length body never reaches the thread
pytestmark = pytest.mark.usefixtures("each_front")

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
EVIL = b"HTTP/1.1 203 Evil\r\nContent-Length: 4\r\nX-Echo: evil\r\n\r\nEVIL"


# --- 1. a response's late bytes never reach another client ---------------------------------------------


def _thread_turns(stack) -> int:
    return stack.service.proxy._pool.thread_turns


def _assert_the_probe_got_its_own(stack, upstream, b) -> None:
    """The second request got its own answer over a second upstream connection (none of the late bytes),
    and its record is its own: the payload, unframed."""
    assert (b.status, b.body, b.header("X-Echo")) == (200, b"".join(PROBE_EVENTS), None), b.raw
    assert not upstream.probe_on_first_connection and upstream.connections == 2
    stack.settle()
    (rec,) = [r for r in stack.records if r.path == CHAT]
    assert (rec.status, rec.outcome, rec.response_bytes) == (200, "ok", len(b"".join(PROBE_EVENTS)))


def _assert_relayed_by(stack, relay: str, bodies: int) -> None:
    """The relay the test is parametrised for is the one that carried the chunked bodies: the thread took
    each of the ``bodies`` (each came after its head), or, with the Python relay, it took none."""
    assert _thread_turns(stack) == (bodies if relay == "thread" else 0), relay


PROBE_EVENTS = [b'data: {"choices":[{"index":0,"delta":{"content":"pro"}}]}\n\n',
                b'data: {"choices":[{"index":0,"delta":{"content":"be"}}]}\n\n', b"data: [DONE]\n\n"]
PROBE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
PROBE_CHUNKED = b"".join(chunk(e) for e in PROBE_EVENTS) + b"0\r\n\r\n"

# the first client's answer: its head, then its body (if any) once that client has the head
FIRSTS = {
    "head": (b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", b""),
    "204": (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
    "304": (b"HTTP/1.1 304 Not Modified\r\nETag: \"x\"\r\n\r\n", b""),
    "100": (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", b"ok"),
    "length": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", b"ok"),
    "chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"2\r\nok\r\n0\r\n\r\n"),
}


class LateBytes:
    """An upstream whose answer to ``/evil`` is followed, on the same connection, by a whole second
    response (``EVIL``) that it sends only once the next client's request has reached it, on whichever
    connection: the window in which a proxy that reused the connection would relay it to that client.
    The next client's own answer (a chunked stream) goes out after ``EVIL`` was sent, its body once that
    client has the head. Each answer's body comes after its head has reached the client (``a_head`` and
    ``b_head``, set by the clients): the relay thread takes such a chunked body."""

    def __init__(self, first: tuple[bytes, bytes]) -> None:
        self.head, self.body = first
        self.connections = 0
        self.probe_on_first_connection = False
        self.a_head = asyncio.Event()
        self.b_head = asyncio.Event()
        self._probe_arrived = asyncio.Event()
        self._evil_sent = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            req = await read_request(reader)
            if req is None:
                return
            if b"/evil" not in req.line:  # the probe, on a connection of its own
                self._probe_arrived.set()
                await asyncio.wait_for(self._evil_sent.wait(), 10)
                await self._answer_probe(writer)
                return
            writer.write(self.head)
            await writer.drain()
            if self.body:
                await asyncio.wait_for(self.a_head.wait(), 10)
                writer.write(self.body)
                await writer.drain()
            following = asyncio.ensure_future(read_request(reader))
            arrived = asyncio.ensure_future(self._probe_arrived.wait())
            await asyncio.wait({following, arrived}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            arrived.cancel()
            try:
                writer.write(EVIL)  # the late bytes, after the next request is on its way
                await writer.drain()
            except ConnectionError:
                pass  # the proxy had closed this connection: nobody can read them
            self._evil_sent.set()
            if following.done() and following.result() is not None:  # the probe came on this connection
                self.probe_on_first_connection = True
                await self._answer_probe(writer)
            else:
                following.cancel()
                await asyncio.wait({following})
                await reader.read()  # until the proxy closes it
        finally:
            writer.close()

    async def _answer_probe(self, writer: asyncio.StreamWriter) -> None:
        writer.write(PROBE_HEAD)
        await writer.drain()
        try:
            await asyncio.wait_for(self.b_head.wait(), 5)
        except TimeoutError:
            pass  # the client read another answer (EVIL) as its own: let the test see that
        writer.write(PROBE_CHUNKED)
        await writer.drain()


@pytest.mark.parametrize("case", list(FIRSTS))
def test_late_bytes_never_reach_another_client(make_stack, each_relay, case):
    """Client A's answer, then late bytes on its connection once client B's request has reached the
    upstream. After a body-less response (HEAD, 204, 304) or an interim 1xx the connection is not reused
    at all; after a Content-Length or chunked body it is kept for A alone (A's connection stays open
    throughout): either way B, on another connection, gets its own answer and its own record."""
    upstream = LateBytes(FIRSTS[case])
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    port = stack.service.port
    method = "HEAD" if case == "head" else "GET"

    async def go():
        async with KeptClient(port) as client_a, KeptClient(port) as client_b:
            a = await client_a.ask(f"{method} /evil HTTP/1.1\r\nHost: p\r\n\r\n".encode(),
                                   head_request=case == "head", head_seen=upstream.a_head)
            b = await client_b.ask(post_head(CHAT, BODY), head_seen=upstream.b_head)
            return a, b

    a, b = stack.run(go())
    assert a.status == {"head": 200, "204": 204, "304": 304}.get(case, 200)
    assert a.body == (b"" if case in ("head", "204", "304") else b"ok")
    _assert_the_probe_got_its_own(stack, upstream, b)
    _assert_relayed_by(stack, each_relay, 2 if case == "chunked" else 1)  # B's body, and A's when chunked


@pytest.mark.parametrize("case", ["head", "204", "304", "100"])
def test_no_reuse_after_a_bodiless_or_interim_response_even_for_the_same_client(make_stack, each_relay, case):
    """The rule per-client ownership does not cover: one kept-alive client sends ``/evil`` (answered by a
    HEAD's 200, a 204, a 304, or a 100 then a 200), then its next request on the SAME client connection;
    the upstream sends a late whole response on the first connection only once that next request has
    reached it. Reusing the connection for its own client would hand that client the late bytes as its
    answer: it gets its own answer and record instead, over a second upstream connection."""
    upstream = LateBytes(FIRSTS[case])
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    method = "HEAD" if case == "head" else "GET"

    async def go():
        async with KeptClient(stack.service.port) as client:
            a = await client.ask(f"{method} /evil HTTP/1.1\r\nHost: p\r\n\r\n".encode(),
                                 head_request=case == "head", head_seen=upstream.a_head)
            b = await client.ask(post_head(CHAT, BODY), head_seen=upstream.b_head)
            return a, b

    a, b = stack.run(go())
    assert a.status == {"head": 200, "204": 204, "304": 304}.get(case, 200)
    assert a.body == (b"ok" if case == "100" else b"")
    _assert_the_probe_got_its_own(stack, upstream, b)
    _assert_relayed_by(stack, each_relay, 1)  # the second answer's chunked body


@pytest.mark.parametrize("case", ["length", "chunked"])
def test_upstream_reuse_off_gives_every_request_a_new_connection(make_stack, each_relay, case):
    """What per-client ownership leaves open, closed by ``upstream_reuse = "off"`` (a front proxy whose one
    connection carries many users): one kept-alive client sends ``/evil`` (a Content-Length or chunked
    answer, reusable by the rules), then its next request on the same client connection, and the upstream
    sends a late whole response on the first connection once that request has reached it. The first
    upstream connection was closed after its answer: the second request got a new one, its own answer
    and its own record, and no upstream connection is kept idle."""
    upstream = LateBytes(FIRSTS[case])
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0, upstream_reuse="off")

    async def go():
        async with KeptClient(stack.service.port) as client:
            a = await client.ask(b"GET /evil HTTP/1.1\r\nHost: p\r\n\r\n", head_seen=upstream.a_head)
            b = await client.ask(post_head(CHAT, BODY), head_seen=upstream.b_head)
            return a, b

    a, b = stack.run(go())
    assert (a.status, a.body) == (200, b"ok")
    _assert_the_probe_got_its_own(stack, upstream, b)
    _assert_relayed_by(stack, each_relay, 2 if case == "chunked" else 1)
    assert stack.service.proxy.upstream_idle == 0


def test_stray_bytes_on_an_idle_connection_send_the_next_request_elsewhere(make_stack, each_relay):
    """End to end, nothing reached into: one kept-alive client, a Content-Length answer, then the upstream
    writes a whole stray response on that connection, idle in the pool; once the write is done (on
    loopback: in the proxy's socket) and the proxy either holds the bytes unread or has dropped the
    connection for them, the same client sends its next request. It gets its own answer (a chunked stream,
    which the relay thread takes when it is the relay) from a new upstream connection, and its record.
    With the upstream on the proxy's loop, the loop reads such bytes as soon as they are in, before any
    checkout, and drops the connection for them (``UpstreamConn.data_received`` when idle); the checkout's
    peek covers bytes that arrive in the same loop turn as the checkout, which only the white-box test
    below can hold still."""
    stray_now = asyncio.Event()
    stray_sent = asyncio.Event()
    b_head = asyncio.Event()
    ports: set[int] = set()
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        req = await read_request(reader)
        if req is None:
            return
        if b"/a " in req.line:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await asyncio.wait_for(stray_now.wait(), 10)
            ports.add(writer.get_extra_info("peername")[1])
            writer.write(EVIL)
            await writer.drain()
            stray_sent.set()
            following = await read_request(reader)  # a proxy that reused this connection sends it here
            if following is not None:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nreuse")
                await writer.drain()
            await reader.read()
            return
        writer.write(PROBE_HEAD)
        await writer.drain()
        await asyncio.wait_for(b_head.wait(), 10)
        writer.write(PROBE_CHUNKED)
        await writer.drain()
        await reader.read()

    stack = make_stack(raw_script=serve, scrape_interval_s=0)
    pool: UpstreamPool = stack.service.proxy._pool

    async def go():
        async with KeptClient(stack.service.port) as client:
            a = await client.ask(b"GET /a HTTP/1.1\r\nHost: p\r\n\r\n")
            await await_until(lambda: len(pool.idle) == 1, 5, what="the connection idle in the pool")
            stray_now.set()
            await asyncio.wait_for(stray_sent.wait(), 10)
            await await_until(lambda: kernel_received(ports) >= len(EVIL) or not pool.idle, 5,
                              what="the stray bytes in the proxy's socket, or the connection dropped for them")
            b = await client.ask(post_head(CHAT, BODY), head_seen=b_head)
            return a, b

    a, b = stack.run(go())
    assert (a.status, a.body) == (200, b"ok")
    assert (b.status, b.body, b.header("X-Echo")) == (200, b"".join(PROBE_EVENTS), None), b.raw
    assert len(connections) == 2
    stack.settle()
    (rec,) = [r for r in stack.records if r.path == CHAT]
    assert (rec.status, rec.outcome, rec.response_bytes) == (200, "ok", len(b"".join(PROBE_EVENTS)))
    _assert_relayed_by(stack, each_relay, 1)


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_an_idle_connection_with_bytes_waiting_is_not_taken_from_the_pool(make_stack, each_relay, framing):
    """Bytes past a response's end that the loop has not read yet (they came in a later segment, after
    a Content-Length body or a chunked one's ``0\\r\\n\\r\\n``, which the relay thread carries, just
    before the next checkout): the checkout for the same client peeks, finds them, and opens a new
    connection instead."""
    junk_now = asyncio.Event()
    head_seen = asyncio.Event()
    head, body = FIRSTS[framing]

    async def serve(reader, writer):
        req = await read_request(reader)
        if req is None:
            return
        writer.write(head)
        await writer.drain()
        await asyncio.wait_for(head_seen.wait(), 10)
        writer.write(body)
        await writer.drain()
        await asyncio.wait_for(junk_now.wait(), 10)
        writer.write(EVIL)
        await writer.drain()
        await reader.read()  # until the proxy closes it

    stack = make_stack(raw_script=serve, scrape_interval_s=0)
    port = stack.service.port
    pool: UpstreamPool = stack.service.proxy._pool

    async def go():
        async with KeptClient(port) as client:
            a = await client.ask(b"GET /a HTTP/1.1\r\nHost: p\r\n\r\n", head_seen=head_seen)
            assert a.body == b"ok"
            await await_until(lambda: len(pool.idle) == 1, 5, what="the connection back in the pool")
            conn = pool.idle[0]
            assert conn.owner is not None and not conn.owner.is_closing()  # kept for this client
            conn.transport.pause_reading()  # the loop has not got to the bytes yet: the window of the race
            sock = conn.transport.get_extra_info("socket")
            ports = {sock.getsockname()[1]}
            junk_now.set()
            # in the proxy's receive queue, where the peek looks (the server's send queue holding them does
            # not do: under load the kernel may deliver them a while later)
            await await_until(lambda: kernel_received(ports) >= len(EVIL), 5,
                              what="the late bytes in the proxy's socket")
            taken = pool.checkout(conn.owner)
            return taken, conn

    taken, conn = stack.run(go())
    assert taken is None
    assert conn.transport is None or conn.transport.is_closing()
    _assert_relayed_by(stack, each_relay, 1 if framing == "chunked" else 0)


def test_a_client_connection_reuses_its_own_upstream_connection_and_no_other(make_stack, each_relay):
    """Two requests on one keep-alive client connection go over one upstream connection; a second client
    connection gets an upstream connection of its own; and once a client hangs up, the upstream
    connection kept for it is closed (the upstream sees it close)."""
    from faultkit import ScriptedUpstream

    heads_seen = [asyncio.Event() for _ in range(3)]

    async def respond(_req, writer, i):
        writer.write(PROBE_HEAD)
        await writer.drain()
        await asyncio.wait_for(heads_seen[i].wait(), 10)
        writer.write(PROBE_CHUNKED)
        await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)
    port = stack.service.port

    async def go():
        async with KeptClient(port) as one:
            for i in range(2):
                resp = await one.ask(post_head(CHAT, BODY), head_seen=heads_seen[i])
                assert resp.body == b"".join(PROBE_EVENTS)
            first_connections = upstream.connections
            async with KeptClient(port) as two:
                resp = await two.ask(post_head(CHAT, BODY), head_seen=heads_seen[2])
                assert resp.body == b"".join(PROBE_EVENTS)
                assert upstream.connections == first_connections + 1
                assert upstream.peer_closed_at == []  # kept while their clients are connected
        # both clients gone: their upstream connections are closed (well before POOL_IDLE_S, 15 s)
        await await_until(lambda: len(upstream.peer_closed_at) == 2, 5,
                          what="the upstream connections of the gone clients closed")
        return first_connections

    first_connections = stack.run(go())
    assert first_connections == 1 and len(upstream.requests) == 3
    _assert_relayed_by(stack, each_relay, 3)


def test_an_idle_connection_is_closed_once_it_has_been_idle_for_the_pool_s_limit(make_stack, monkeypatch):
    """An upstream connection kept for a client that stays connected is reused while it has been idle less
    than ``POOL_IDLE_S`` (its idle time counts from its latest exchange), and closed by the pool's sweep
    once it has been idle that long: never before, and within a sweep or two after."""
    from faultkit import ScriptedUpstream
    from specproxy.wire import pool as pool_module

    monkeypatch.setattr(pool_module, "POOL_IDLE_S", 2.0)
    monkeypatch.setattr(pool_module, "SWEEP_S", 0.05)

    async def respond(_req, writer, i):
        writer.write(PROBE_HEAD + PROBE_CHUNKED)
        await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)

    async def go():
        loop = asyncio.get_running_loop()
        async with KeptClient(stack.service.port) as client:
            for _ in range(3):  # each 0.5 s after the one before: idle far less than 2 s each time
                t_sent = loop.time()
                assert (await client.ask(post_head(CHAT, BODY))).body == b"".join(PROBE_EVENTS)
                t_answered = loop.time()
                await asyncio.sleep(0.5)
            assert upstream.connections == 1 and upstream.peer_closed_at == []
            await await_until(lambda: upstream.peer_closed_at, 10, what="the idle connection closed")
            return t_sent, t_answered, upstream.peer_closed_at[0]

    t_sent, t_answered, closed = stack.run(go())
    # its last exchange ended between t_sent and t_answered: closed POOL_IDLE_S after that, not before;
    # the upper bound is loose (a loaded machine's timers), never reached by a per-connection 15 s timer
    assert closed - t_sent >= 2.0
    assert closed - t_answered < 7.0
    assert len(upstream.requests) == 3


# --- 2. Content-Length beside Transfer-Encoding --------------------------------------------------------


@pytest.mark.parametrize("coding", [b"gzip", b"gzip, chunked"])
def test_a_transfer_coding_other_than_chunked_gets_502(make_stack, coding):
    """Content-Length beside ``Transfer-Encoding: gzip``, or gzip under chunked: the proxy could relay the
    gzipped bytes only by telling the client that transfer coding (HTTP/1.0 cannot; few clients decode
    it), so, as nginx, it refuses the response: a 502, neither header nor a byte of the body relayed."""
    body = b"hello" if coding == b"gzip" else b"5\r\nhello\r\n0\r\n\r\n"

    async def serve(reader, writer):
        if await read_request(reader) is None:
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: %b\r\n\r\n%b" % (coding, body))
        await writer.drain()
        await reader.read()

    stack = make_stack(raw_script=serve, scrape_interval_s=0)
    resp = stack.run(request_once(stack.service.port, post_head(CHAT, BODY)))
    assert resp.status == 502 and b"hello" not in resp.raw and resp.header("Content-Length") != "5"
    assert b"unsupported Transfer-Encoding" in resp.raw
    stack.settle()
    (rec,) = stack.records
    assert (rec.status, rec.outcome) == (502, "upstream_unreachable")
    assert "unsupported Transfer-Encoding" in rec.error


@pytest.mark.parametrize("framing", [b"Content-Length: 5\r\n", b"Transfer-Encoding: chunked\r\n",
                                     b"Content-Length: 0\r\nTransfer-Encoding: chunked\r\n"])
def test_a_204_reaches_the_client_without_a_length(make_stack, framing):
    """RFC 9110 8.6: a 204 carries no Content-Length (nor Transfer-Encoding); an upstream's is dropped, as
    nginx does, so no client waits for a body that never comes. The other headers pass; the client
    connection stays usable for its next request."""
    async def serve(reader, writer):
        while (req := await read_request(reader)) is not None:
            if b"/second" in req.line:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            else:
                writer.write(b"HTTP/1.1 204 No Content\r\nX-Kept: 1\r\n%b\r\n" % framing)
            await writer.drain()

    stack = make_stack(raw_script=serve, scrape_interval_s=0)

    async def go():
        async with KeptClient(stack.service.port) as client:
            first = await client.ask(b"DELETE /v1/thing HTTP/1.1\r\nHost: p\r\nContent-Length: 0\r\n\r\n")
            second = await client.ask(b"GET /second HTTP/1.1\r\nHost: p\r\n\r\n")
            return first, second

    first, second = stack.run(go())
    assert first.status == 204 and first.header("X-Kept") == "1" and first.body == b""
    assert first.header("Content-Length") is None and first.header("Transfer-Encoding") is None, first.raw
    assert (second.status, second.body) == (200, b"ok")


# --- 5. control characters in the head; 7. one size limit ----------------------------------------------


BAD_HEADS = {
    "cr_in_status_line": b"HTTP/1.1 200 OK\rX-Injected: 1\r\nContent-Length: 2\r\n\r\nok",
    "cr_in_value": b"HTTP/1.1 200 OK\r\nX-A: a\rX-Injected: 1\r\nContent-Length: 2\r\n\r\nok",
    "nul_in_value": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\nok",
    "lf_in_value": b"HTTP/1.1 200 OK\r\nX-A: a\nX-Injected: 1\r\nContent-Length: 2\r\n\r\nok",
    "bare_lf_head": b"HTTP/1.1 200 OK\nX-Injected: 1\nContent-Length: 2\n\nok",
    "nul_in_reason": b"HTTP/1.1 200 O\x00K\r\nContent-Length: 2\r\n\r\nok",
    "over_64k_in_one_read": b"HTTP/1.1 200 OK\r\n" + b"X-Pad: %b\r\n" % (b"p" * 70_000) + b"Content-Length: 2\r\n\r\nok",
    # a bare LF then CRLF as the blank line: neither a strict end nor a bare-LF one; refused at once,
    # not after idle_timeout_s (the default, 600 s, far past this test's deadline)
    "lf_then_crlf_blank_line": b"HTTP/1.1 200 OK\r\nX-Injected: 1\r\nContent-Length: 2\n\r\nok",
    # interim responses without end, or whose heads together pass the one head limit
    "endless_interim": b"HTTP/1.1 100 Continue\r\nX-Injected: 1\r\n\r\n" * 200,
    "interim_heads_over_64k": b"HTTP/1.1 103 Early Hints\r\nLink: %b\r\n\r\n" % (b"x" * 20_000) * 4
                              + b"HTTP/1.1 200 OK\r\nX-Injected: 1\r\nContent-Length: 2\r\n\r\nok",
}


@pytest.mark.parametrize("case", sorted(BAD_HEADS))
def test_a_malformed_or_oversized_response_head_gets_502(make_stack, case):
    async def serve(reader, writer):
        if await read_request(reader) is None:
            return
        writer.write(BAD_HEADS[case])  # one write: loopback delivers it in as few reads as it can
        await writer.drain()
        await reader.read()

    stack = make_stack(raw_script=serve, scrape_interval_s=0)
    resp = stack.run(request_once(stack.service.port, post_head(CHAT, BODY)))
    assert resp.status == 502
    assert resp.header("X-Injected") is None and b"X-Injected" not in resp.raw
    stack.settle()
    (rec,) = stack.records
    assert (rec.status, rec.outcome) == (502, "upstream_unreachable")


def test_a_head_just_under_the_limit_passes(make_stack):
    pad = b"p" * (65536 - 200)

    async def serve(reader, writer):
        if await read_request(reader) is None:
            return
        writer.write(b"HTTP/1.1 200 OK\r\nX-Pad: %b\r\nContent-Length: 2\r\n\r\nok" % pad)
        await writer.drain()

    stack = make_stack(raw_script=serve, scrape_interval_s=0)
    resp = stack.run(request_once(stack.service.port, b"GET /x HTTP/1.1\r\nHost: p\r\n\r\n"))
    assert (resp.status, resp.body, resp.header("X-Pad")) == (200, b"ok", pad.decode())


# --- header names with an underscore ----------------------------------------------------------------------


def test_header_names_with_an_underscore_are_dropped_both_ways(make_stack):
    seen = []

    async def serve(reader, writer):
        req = await read_request(reader)
        if req is None:
            return
        seen.append(req)
        writer.write(b"HTTP/1.1 200 OK\r\nX_Bar: 1\r\nTransfer_Encoding: chunked\r\nX-Ok: 1\r\n"
                     b"Content-Length: 2\r\n\r\nok")
        await writer.drain()

    stack = make_stack(raw_script=serve, scrape_interval_s=0)
    req = post_head(CHAT, BODY, extra="X_Foo: 1\r\nTransfer_Encoding: chunked\r\nX-Kept: 1\r\n")
    resp = stack.run(request_once(stack.service.port, req))
    assert (resp.status, resp.body) == (200, b"ok")
    assert [k for k, _ in resp.headers if "_" in k] == [] and resp.header("X-Ok") == "1"
    (up,) = seen
    assert [k for k, _ in up.headers if "_" in k] == [] and up.header("X-Kept") == "1"
    assert up.body == BODY


# --- 4. response bodies are kept only as far as measuring needs -----------------------------------------


BIG_MB = 80
EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
BIG_CHUNK = b"%x\r\n%b\r\n" % (len(EVENT) * 1000, EVENT * 1000)  # ~57 KB of payload per chunk
BIG_CHUNKS = BIG_MB * 1024 * 1024 // len(BIG_CHUNK)


async def _serve_big(reader, writer):
    """Any request: an SSE stream of ``BIG_MB`` MB, chunked, written a chunk at a time (never whole)."""
    while await read_request(reader) is not None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(BIG_CHUNKS):
            writer.write(BIG_CHUNK)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def _read_and_drop(port: int, request: bytes) -> int:
    """Send ``request``; read the chunked answer to its end, keeping nothing; return the body's size."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    want = BIG_CHUNKS * len(BIG_CHUNK) + 5
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200"), head
        got = 0
        while got < want:
            piece = await asyncio.wait_for(reader.read(1 << 20), 10)
            assert piece, "the proxy closed before the body's end"
            got += len(piece)
        return got
    finally:
        writer.close()


@pytest.mark.parametrize("measured", [False, True])
def test_a_large_response_body_is_not_held_in_memory(make_stack, each_relay, measured):
    """An 80 MB stream through the proxy: unmeasured, nothing of it is kept; measured, only its first
    ``max_measured_bytes`` (1 MiB here), and the record says it was capped. The process's peak resident
    set grows by far less than the body."""
    stack = make_stack(raw_script=_serve_big, scrape_interval_s=0, max_measured_bytes=1 << 20)
    port = stack.service.port
    request = post_head(CHAT, BODY) if measured else b"GET /big HTTP/1.1\r\nHost: p\r\n\r\n"
    stack.run(_read_and_drop(port, b"GET /warm HTTP/1.1\r\nHost: p\r\n\r\n"))  # the first turn's one-off costs
    stack.settle()
    reset_peak()
    before = memory()["VmRSS"]
    got = stack.run(_read_and_drop(port, request))
    stack.settle()
    grew_mb = (memory()["VmHWM"] - before) / (1 << 20)
    assert got == BIG_CHUNKS * len(BIG_CHUNK) + 5
    _assert_relayed_by(stack, each_relay, 2)  # the thread takes each body after its first reads
    assert grew_mb < BIG_MB / 4, f"peak RSS grew {grew_mb:.0f} MB for a {BIG_MB} MB body"
    if measured:
        (rec,) = [r for r in stack.records if r.path == CHAT]
        assert rec.measure_capped and rec.outcome == "ok" and rec.streamed
        assert 0 < rec.response_bytes <= 1 << 20
