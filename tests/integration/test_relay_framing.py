"""How the relay frames a response for the client, end to end through a real proxy (raw sockets both
sides, because an HTTP library would normalise exactly what these tests look at).

The relay passes the upstream's chunk framing through to an HTTP/1.1 client and unframes it for an
HTTP/1.0 one; it skips interim 1xx responses; it never forwards Content-Length beside chunked; bytes an
upstream sends past the end of its response reach no client and the connection is not reused; a HEAD
answer has no body even when it announces a length.
"""

from __future__ import annotations

import asyncio

import pytest

from faultkit import KeptClient, ScriptedUpstream, await_until, chunk, db_records, exchange, kernel_queued, parse_response

pytestmark = pytest.mark.usefixtures("each_relay")  # the relay thread and the Python relay (Config relay)

CHAT = "/v1/chat/completions"
BODY = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
EVENTS = [b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n',
          b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n', b"data: [DONE]\n\n"]


def _request(version: bytes = b"HTTP/1.1", method: bytes = b"POST", extra: bytes = b"") -> bytes:
    return (b"%s %s %s\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (method, CHAT.encode(), version, len(BODY), extra, BODY))


def _assert_relayed_by(stack, relay: str, bodies: int) -> None:
    """The relay the test is parametrised for carried the chunked bodies: the thread took each of the
    ``bodies`` (each came after its head had reached the client), or, with the Python relay, none."""
    turns = stack.service.proxy._pool.thread_turns
    assert turns == (bodies if relay == "thread" else 0), (relay, turns)


def _sse(extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n" + extra + b"\r\n"


def _stack(make_stack, tok, respond):
    upstream = ScriptedUpstream(respond)
    return make_stack(tok, raw_script=upstream.serve, scrape_interval_s=0), upstream


class AfterHead:
    """A chunked answer whose body goes out once the client has the head (``seen[i]``, set by the client
    for request ``i``): the body then comes in a read of its own, which the relay thread takes."""

    def __init__(self, head: bytes | None = None, body: bytes | None = None) -> None:
        self.head = _sse() if head is None else head
        self.body = b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n" if body is None else body
        self.seen = [asyncio.Event() for _ in range(8)]

    async def respond(self, _req, writer, i):
        writer.write(self.head)
        await writer.drain()
        await asyncio.wait_for(self.seen[i].wait(), 10)
        writer.write(self.body)
        await writer.drain()
        return True


def test_http11_client_gets_the_upstreams_framing_verbatim(make_stack, tiktoken_tok, each_relay):
    answer = AfterHead()
    stack, _ = _stack(make_stack, tiktoken_tok, answer.respond)
    raw, _ = stack.run(exchange(stack.service.port, _request(extra=b"Connection: close\r\n"), timeout=5,
                                head_seen=answer.seen[0]))
    assert raw.endswith(b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n")
    resp, _ = parse_response(raw)
    assert resp.status == 200 and resp.complete and resp.body == b"".join(EVENTS)
    _assert_relayed_by(stack, each_relay, 1)


@pytest.mark.usefixtures("each_front")
def test_well_formed_extensions_and_trailers_pass_verbatim(make_stack, tiktoken_tok, each_relay):
    """Strict is not lenient the other way: RFC 9112 extensions (a token value, a quoted-string with an
    escaped quote) and trailer fields (an empty value, a tab and an obs-text byte) reach the client as sent."""
    first, second, done = (chunk(e) for e in EVENTS)
    framed = (first.replace(b"\r\n", b' ; a=1;q = "x\\"y"\r\n', 1) + second + done
              + b"0;end\r\nX-Checksum: abc\r\nEmpty:\r\nV: a\tb \xff\r\n\r\n")
    answer = AfterHead(body=framed)
    stack, _ = _stack(make_stack, tiktoken_tok, answer.respond)
    raw, _ = stack.run(exchange(stack.service.port, _request(extra=b"Connection: close\r\n"), timeout=5,
                                head_seen=answer.seen[0]))
    assert raw.partition(b"\r\n\r\n")[2] == framed
    (rec,) = db_records(stack, 1)
    assert rec["outcome"] == "ok" and rec["chunks"] == 2 and rec["saw_done"] == 1
    _assert_relayed_by(stack, each_relay, 1)


def test_http10_client_gets_the_body_unframed_then_a_close(make_stack, tiktoken_tok):
    answer = AfterHead()
    stack, _ = _stack(make_stack, tiktoken_tok, answer.respond)
    raw, closed = stack.run(exchange(stack.service.port, _request(b"HTTP/1.0"), timeout=5, head_seen=answer.seen[0]))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert closed and head.startswith(b"HTTP/1.0 200")
    assert b"transfer-encoding" not in head.lower() and body == b"".join(EVENTS)
    (rec,) = db_records(stack, 1)
    assert rec["outcome"] == "ok" and rec["chunks"] == 2 and rec["saw_done"] == 1
    _assert_relayed_by(stack, "python", 0)  # unframed on the loop, whichever relay is configured


def test_interim_responses_are_skipped(make_stack, tiktoken_tok, each_relay):
    answer = AfterHead(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n"
                       + _sse())
    stack, _ = _stack(make_stack, tiktoken_tok, answer.respond)
    raw, _ = stack.run(exchange(stack.service.port, _request(extra=b"Connection: close\r\n"), timeout=5,
                                head_seen=answer.seen[0]))
    assert raw.startswith(b"HTTP/1.1 200") and b"103" not in raw.split(b"\r\n\r\n", 1)[0]
    resp, _ = parse_response(raw)
    assert resp.complete and resp.body == b"".join(EVENTS)
    _assert_relayed_by(stack, each_relay, 1)


@pytest.mark.usefixtures("each_front")
def test_content_length_beside_chunked_is_not_forwarded(make_stack, tiktoken_tok, each_relay):
    answer = AfterHead(_sse(b"Content-Length: 3\r\n"))
    stack, _ = _stack(make_stack, tiktoken_tok, answer.respond)
    raw, _ = stack.run(exchange(stack.service.port, _request(extra=b"Connection: close\r\n"), timeout=5,
                                head_seen=answer.seen[0]))
    resp, _ = parse_response(raw)
    assert resp.header("Content-Length") is None and resp.header("Transfer-Encoding") == "chunked"
    assert resp.complete and resp.body == b"".join(EVENTS)
    _assert_relayed_by(stack, each_relay, 1)


def test_bytes_past_the_end_of_a_response_reach_nobody(make_stack, tiktoken_tok, each_relay):
    """An upstream that writes a stray response right after the end of the one asked for, in the same
    write as the chunked body's end (the body comes once the client has the head: the relay thread takes
    it): the client gets exactly its answer, and its next request, on the same client connection, goes to
    a new upstream connection rather than reading the stray bytes."""
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray"
    heads_seen = [asyncio.Event(), asyncio.Event()]

    async def respond(req, writer, i):
        writer.write(_sse())
        await writer.drain()
        await asyncio.wait_for(heads_seen[i].wait(), 10)
        writer.write(b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n" + (stray if i == 0 else b""))
        await writer.drain()
        return True

    stack, upstream = _stack(make_stack, tiktoken_tok, respond)

    async def go():
        async with KeptClient(stack.service.port) as client:
            return [await client.ask(_request(), head_seen=heads_seen[i]) for i in range(2)]

    for resp in stack.run(go()):
        assert resp.complete and resp.body == b"".join(EVENTS) and b"stray" not in resp.raw
    assert upstream.connections == 2 and len(upstream.requests) == 2
    _assert_relayed_by(stack, each_relay, 2)


@pytest.mark.usefixtures("each_front")
def test_kept_alive_upstream_connections_are_reused_by_their_client(make_stack, tiktoken_tok, each_relay):
    """Five requests on one keep-alive client connection: one upstream connection carries them all."""
    answer = AfterHead()
    stack, upstream = _stack(make_stack, tiktoken_tok, answer.respond)

    async def go():
        async with KeptClient(stack.service.port) as client:
            return [await client.ask(_request(), head_seen=answer.seen[i]) for i in range(5)]

    for resp in stack.run(go()):
        assert resp.complete and resp.body == b"".join(EVENTS)
    assert upstream.connections == 1 and len(upstream.requests) == 5
    _assert_relayed_by(stack, each_relay, 5)


def test_head_gets_no_body_even_with_a_length(make_stack, tiktoken_tok):
    async def respond(req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1234\r\n\r\n")
        if req.line.startswith(b"GET"):
            writer.write(b"x" * 1234)
        await writer.drain()
        return True

    stack, upstream = _stack(make_stack, tiktoken_tok, respond)
    req = b"HEAD /v1/models HTTP/1.1\r\nHost: proxy\r\n\r\n" + b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n"
    raw, closed = stack.run(exchange(stack.service.port, req, timeout=5))
    first, rest = parse_response(raw, head_request=True)
    assert first.status == 200 and first.header("Content-Length") == "1234" and first.body == b""
    second, rest = parse_response(rest)  # the next response follows at once: no body was waited for
    assert second.complete and second.body == b"x" * 1234 and rest == b"" and closed
    assert [r.line.split(b" ")[0] for r in upstream.requests] == [b"HEAD", b"GET"]


# Malformed chunked framing, each shape a lenient relay passed on: the head is out first and the body
# comes in later reads (so the relay thread, not the loop, takes it when it is the relay picked), each
# piece once the proxy has read the one before from the kernel (its own read). Through each relay and
# each front, and unframed for an HTTP/1.0 client (the Python relay's DECHUNK path, whatever the relay).
# Each with the words the record's error must hold.
MALFORMED_BODIES = {
    "bare LF size lines": ([b"5\nhello\r\n0\n\n"], "CRLF"),
    "LF alone after the data": ([b"5\r\nhello\n10\r\n\r\n"], "CRLF"),
    "LF alone after the data, in the next read": ([b"5\r\nhello", b"\n10\r\n\r\n"], "CRLF"),
    "no CRLF after the data, in the next read": ([b"5\r\nhello", b"XY0\r\n\r\n"], "CRLF"),
    "a control byte in an extension, a NUL trailer, a colon-less one":
        ([b"5;\x01x\r\nhello\r\n0\r\nX-A: a\x00b\r\nnocolon\r\n\r\n"], "chunk extension"),
    "a NUL in a trailer value": ([b"5\r\nhello\r\n", b"0\r\nX-A: a\x00b\r\n\r\n"], "trailer field"),
    "a trailer line with no colon": ([b"5\r\nhello\r\n", b"0\r\nnocolon\r\n\r\n"], "trailer field"),
}


@pytest.mark.usefixtures("each_front")
@pytest.mark.parametrize("version", ["1.1", "1.0"])
@pytest.mark.parametrize("pieces,why", list(MALFORMED_BODIES.values()), ids=list(MALFORMED_BODIES))
def test_malformed_chunked_framing_closes_both_sides_and_fails_the_turn(make_stack, tiktoken_tok, each_relay,
                                                                          pieces, why, version):
    """Nothing ambiguous reaches the client: no complete body, its connection closed (not kept for another
    request); the upstream's connection closed too; the turn recorded as truncated with the reason."""
    head_seen = asyncio.Event()

    async def respond(_req, writer, _i):
        writer.write(_sse())
        await writer.drain()
        await asyncio.wait_for(head_seen.wait(), 10)
        port = {writer.get_extra_info("sockname")[1]}
        for piece in pieces:
            await await_until(lambda: kernel_queued(port) == 0, 5, what="the proxy read what came before")
            writer.write(piece)
            await writer.drain()
        return True  # keep: whether the connection is dropped is the proxy's to decide

    stack, upstream = _stack(make_stack, tiktoken_tok, respond)
    raw, closed = stack.run(exchange(stack.service.port, _request(b"HTTP/" + version.encode()), timeout=5,
                                     head_seen=head_seen))
    assert closed, "the client's connection was kept open after malformed framing"
    head, _, body = raw.partition(b"\r\n\r\n")
    if version == "1.1":
        resp, _ = parse_response(raw)
        assert resp.status == 200 and not resp.complete and b"0\r\n\r\n" not in body
    else:  # unframed: the client sees the end by the close alone, so nothing past the valid payload may come
        assert head.startswith(b"HTTP/1.0 200") and b"transfer-encoding" not in head.lower()
        assert body in (b"", b"hello") and b"0\r\n" not in body
    (rec,) = db_records(stack, 1)
    assert rec["outcome"] == "upstream_truncated"
    assert "malformed chunked framing from the upstream" in rec["error"] and why in rec["error"]
    stack.settle()
    assert upstream.peer_closed_at, "the upstream's connection was kept after malformed framing"
    _assert_relayed_by(stack, each_relay if version == "1.1" else "python", 1)  # HTTP/1.0: unframed on the loop
