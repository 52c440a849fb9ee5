"""The upstream half of the relay, piece by piece: response heads, and finding where a chunked body ends.

The relay forwards chunked framing verbatim and must know, read by read, whether the body has ended (to
reuse the connection and end the turn) without copying payload; a mistake either cuts a stream or hangs
it. So: random bodies, random chunk sizes, extensions and trailers, split at random read boundaries.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from readsplit import split
from specproxy.wire.upstream import CHUNKED, CLOSE, LENGTH, NO_BODY, ChunkedEnd, FramingError, UpstreamError, parse_head


def _frame(payloads: list[bytes], ext: bool, trailers: list[bytes], upper: bool) -> bytes:
    out = []
    for p in payloads:
        size = b"%x" % len(p)
        if upper:
            size = size.upper()
        out.append(size + (b";name=val" if ext else b"") + b"\r\n" + p + b"\r\n")
    out.append(b"0" + (b";last" if ext else b"") + b"\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n")
    return b"".join(out)


framed = st.builds(
    lambda payloads, ext, trailers, upper: (payloads, _frame(payloads, ext, trailers, upper)),
    st.lists(st.binary(min_size=1, max_size=300), max_size=12),
    st.booleans(),
    st.lists(st.sampled_from([b"X-Trailer: 1", b"Checksum: abc"]), max_size=2),
    st.booleans(),
)


@settings(max_examples=examples(200), deadline=None)
@given(framed, st.lists(st.integers(min_value=0, max_value=10_000), max_size=20), st.binary(max_size=20))
def test_chunked_end_is_found_exactly_whatever_the_reads(case, cuts, after):
    payloads, body = case
    reads = split(body + after, cuts)
    tracker = ChunkedEnd(collect=True)
    consumed = 0
    end_at = None
    for data in reads:
        end = tracker.feed(data)
        if end >= 0:
            end_at = consumed + end
            break
        consumed += len(data)
    assert end_at == len(body)
    assert b"".join(tracker.payload) == b"".join(payloads)


@settings(max_examples=200, deadline=None)
@given(framed, st.lists(st.integers(min_value=0, max_value=10_000), max_size=20))
def test_a_truncated_chunked_body_never_ends(case, cuts):
    _, body = case
    cut = body[: len(body) - 1 - (cuts[0] % len(body) if cuts else 0)]
    tracker = ChunkedEnd()
    assert all(tracker.feed(data) < 0 for data in split(cut, cuts))


@pytest.mark.parametrize("bad", [b"zz\r\n", b"0x10\r\n", b"+5\r\n", b"-1\r\n", b" \r\n", b"5\r\nhello!!", b"1_0\r\n"])
def test_malformed_chunk_sizes_are_refused(bad):
    with pytest.raises(FramingError):
        ChunkedEnd().feed(bad + b"\r\n" * 3 + b"x" * 20)


def test_an_endless_size_line_is_refused():
    tracker = ChunkedEnd()
    with pytest.raises(FramingError):
        for _ in range(100):
            tracker.feed(b"0" * 100)


@pytest.mark.parametrize(
    ("head", "method", "framing", "length", "keep"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", "POST", CHUNKED, -1, True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 12", "POST", LENGTH, 12, True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked", "POST", CHUNKED, -1, True),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked", "POST", CHUNKED, -1, True),
        (b"HTTP/1.1 200 OK", "POST", CLOSE, -1, False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 12", "HEAD", NO_BODY, -1, True),
        (b"HTTP/1.1 204 No Content", "POST", NO_BODY, -1, True),
        (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9", "GET", NO_BODY, -1, True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1", "GET", LENGTH, 1, False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 1", "GET", LENGTH, 1, False),
    ],
)
def test_response_framing_follows_rfc_9112(head, method, framing, length, keep):
    parsed = parse_head(head + b"\r\n\r\n", method)
    assert (parsed.framing, parsed.length, parsed.keep_alive) == (framing, length, keep)


def test_header_bytes_are_kept_as_they_came():
    parsed = parse_head(b"HTTP/1.1 200 Fine\r\nX-Name: caf\xe9 \xff\r\nSet-Cookie: a\r\nSet-Cookie: b\r\n\r\n", "GET")
    assert parsed.headers == [(b"X-Name", b"caf\xe9 \xff"), (b"Set-Cookie", b"a"), (b"Set-Cookie", b"b")]
    assert parsed.reason == b"Fine" and parsed.status == 200


def test_the_content_type_and_encoding_measuring_reads_are_the_first_of_each():
    parsed = parse_head(b"HTTP/1.1 200 OK\r\ncontent-TYPE: text/event-stream; charset=\xe9\r\nContent-Type: a/b\r\n"
                        b"Content-Encoding: gzip \r\nContent-Length: 0\r\n\r\n", "POST")
    assert (parsed.content_type, parsed.content_encoding) == ("text/event-stream; charset=\xe9", "gzip")
    bare = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", "POST")
    assert (bare.content_type, bare.content_encoding) == ("", "")


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/2 200 OK",
        b"HTTP/1.1 20 OK",
        b"garbage",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1e3",
        b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded",
        b"HTTP/1.1 200 OK\r\nBad Name: 1",
        b"HTTP/1.1 200 OK\r\nno colon",
        b"HTTP/1.1 200 OK\r\nContent-Length: 12, 12",  # llhttp refuses even a repeated equal value
        b"HTTP/1.1 200 OK\nContent-Length: 3\n",  # bare LF line ends
        b"HTTP/1.1 200 OK\rX-Injected: 1",  # bare CR in the status line
        b"HTTP/1.1 200 OK\r\nX-A: a\rX-Injected: 1",  # bare CR in a field value
        b"HTTP/1.1 200 OK\r\nX-A: a\x00b",  # NUL in a field value
        b"HTTP/1.1 200 O\x00K",  # NUL in the reason phrase (llhttp lets it through; we do not)
        b"HTTP/1.1 200 O\x01K",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip",  # only chunked is relayed: the client could not be told
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity",
    ],
)
def test_malformed_heads_are_refused(head):
    with pytest.raises(UpstreamError):
        parse_head(head + b"\r\n\r\n", "GET")


# --- a handler abandoning its exchange --------------------------------------------------------------------


class _Client:
    """A stand-in for the client's transport: takes what the relay writes."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name, default=None):
        return default


def test_abandoning_an_exchange_that_is_over_leaves_the_connections_next_one_alone():
    """A handler cancelled just after its exchange ended (its connection already back in the pool and
    sent the next request) must not fail that next exchange: the soak's 502s "client disconnected"."""
    import asyncio

    from yarl import URL

    from specproxy.wire.exchange import Exchange
    from specproxy.wire.pool import UpstreamPool
    from specproxy.wire.upstream import PASS

    async def main():
        requests = asyncio.Queue()

        async def serve(reader, writer):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await requests.put(head)
                if requests.qsize() == 1 and head.startswith(b"POST /first"):
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
                    await writer.drain()
                # the second request gets no answer: its exchange waits for a head

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(URL(f"http://127.0.0.1:{port}"), connect_timeout_s=5, idle_timeout_s=30)
        try:
            client = _Client()  # one client connection: its next request reuses the upstream connection
            first = Exchange(pool, None)
            await asyncio.wait_for(first.send("POST", b"POST /first HTTP/1.1\r\nHost: x\r\n\r\n", client), 5)
            conn = first.conn
            first.attach(client, PASS)  # the whole body came with the head: over at once
            assert first.outcome == "ok" and conn in pool.idle
            following = Exchange(pool, None)
            second = asyncio.ensure_future(following.send("POST", b"POST /second HTTP/1.1\r\nHost: x\r\n\r\n", client))
            await asyncio.wait_for(requests.get(), 5)
            await asyncio.wait_for(requests.get(), 5)  # the second request reached the upstream
            assert conn in pool.active and following.conn is conn and conn.exchanges == 2
            first.abandon("client_abort", "client disconnected")  # the first handler, cancelled late
            await asyncio.sleep(0)
            assert not second.done(), "the next exchange was failed by a handler that was already done"
            following.abandon("client_abort", "client disconnected")  # its own handler: it ends
            with pytest.raises(UpstreamError, match="client disconnected"):
                await asyncio.wait_for(second, 5)
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
