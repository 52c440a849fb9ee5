"""The reads that came with the response head, handed to the relay thread's turn (``Turn(..., first)``).

The event loop reads the response head, and often the body's first chunk in the same read (a streamed
answer's first token comes with its head). The exchange hands those reads to the turn with the body
(``relay_thread.ThreadRelay.start``), which relays them before it returns, on the caller's thread, as the
thread relays its own reads: what must hold is what holds for the thread's reads (test_relay_thread.py).
The client gets the body up to its end and nothing past it, a malformed read sends nothing of itself,
each read is kept with its read time as given, a turn whose whole body came with the head ends at once
(reported through its sink as any other), a client that cannot take them all blocks the turn until it
reads, and bad arguments are refused before a byte is sent.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
from framing_strategies import chunked_bodies
from hypothesis import given, settings
from hypothesis import strategies as st
from relaykit import (  # noqa: F401 (fixtures)
    Ends, ends, give_back_what_the_turns_kept, recv_until, sink, taken, tcp_ends, wait_done)

from specproxy.frames.chunked import ChunkedEnd, FramingError
from specproxy.wire import relay_thread

relayc = relay_thread._relayc
pytestmark = pytest.mark.skipif(relayc is None, reason="specproxy.wire._relayc is not built")


def reads_of(body: bytes, cuts: list[int]) -> list[bytes]:
    """``body`` cut at ``cuts`` (sorted, deduplicated) into non-empty reads."""
    edges = [0, *sorted({c for c in cuts if 0 < c < len(body)}), len(body)]
    return [body[a:b] for a, b in zip(edges, edges[1:]) if b > a]


@settings(max_examples=300, deadline=None)
@given(body=chunked_bodies(), cuts=st.lists(st.integers(0, 3000), max_size=4), rest_at=st.integers(0, 5))
def test_the_client_gets_what_the_reference_decides_from_the_first_reads_and_the_rest(body, cuts, rest_at):
    """The body cut into reads; the first ``rest_at`` of them came with the head, the others are in the
    upstream's socket before the turn starts (the thread takes them in one read, as the reference is fed
    them). The Python reference, fed the same reads in order, decides: the client gets the
    body up to its end and nothing past it, nothing of a malformed read, and the reads kept are what it got."""
    reads = reads_of(body, cuts)
    first, rest = reads[:rest_at], b"".join(reads[rest_at:])
    ref, want, how = ChunkedEnd(), b"", "more"
    for r in [*first, rest]:
        try:
            end = ref.feed(r)
        except FramingError as exc:
            how = ("framing", str(exc))
            break
        if end >= 0:
            want += r[:end]
            how = "end"
            break
        want += r
    stamps = [(r, 1000.0 + i) for i, r in enumerate(first)]
    sink, e = relayc.Sink(), Ends()
    try:
        if rest:
            e.up_server.sendall(rest)
        turn = e.turn(sink, first=stamps)
        if how == "more":  # the body goes on: what came was sent, the turn waits for more
            assert recv_until(e.cl_client, len(want)) == want
            assert turn.cancel() is True
            assert b"".join(taken(turn)[0]) == want
            return
        assert wait_done(sink) == [turn.id]
        assert turn.outcome == (("end", 0, None) if how == "end" else ("framing", 0, how[1]))
        assert recv_until(e.cl_client, len(want)) == want
        assert b"".join(taken(turn)[0]) == want  # of a malformed read, not a byte
        e.cl_proxy.close()  # ours too: the turn's copy is closed
        e.cl_client.settimeout(5)
        assert e.cl_client.recv(100) == b""  # nothing past the end, nothing of a malformed read
    finally:
        e.close()


def test_the_first_reads_reach_the_client_before_the_turn_returns_with_their_own_read_times(sink, ends):
    turn = ends.turn(sink, first=[(b"5\r\nhello\r\n", 1.5), (b"3\r\nabc\r\n", 2.5)])
    ends.cl_client.setblocking(False)
    assert ends.cl_client.recv(100) == b"5\r\nhello\r\n3\r\nabc\r\n"  # there already: no wait
    t0 = time.perf_counter()
    ends.up_server.sendall(b"2\r\nok\r\n0\r\n\r\n")
    assert wait_done(sink) == [turn.id] and turn.outcome == ("end", 0, None)
    assert recv_until(ends.cl_client, 12) == b"2\r\nok\r\n0\r\n\r\n"
    reads, rtimes, wtimes = taken(turn)
    assert reads == [b"5\r\nhello\r\n", b"3\r\nabc\r\n", b"2\r\nok\r\n0\r\n\r\n"]
    assert rtimes[:2] == [1.5, 2.5] and rtimes[2] >= t0  # a first read's time is the loop's, as given
    assert all(w >= t0 for w in wtimes[2:]) and all(w >= r for r, w in zip(rtimes, wtimes))


def test_a_body_that_came_whole_with_the_head_ends_the_turn_without_the_thread_reading(sink, ends):
    """Its end and bytes past it in the first read: the turn ends before Turn returns (reported through
    the sink), nothing past the end is sent, and the upstream's socket was never read: what waits there
    stays for whoever reads it next."""
    body = b"5\r\nhello\r\n0\r\n\r\n"
    ends.up_server.sendall(b"not the turn's")
    turn = ends.turn(sink, first=[(body + b"HTTP/1.1 200 OK\r\n", 1.0)])
    assert not turn.active and turn.outcome == ("end", 0, None) and turn.past_end
    assert wait_done(sink) == [turn.id]
    assert recv_until(ends.cl_client, len(body)) == body
    ends.cl_proxy.close()
    ends.cl_client.settimeout(5)
    assert ends.cl_client.recv(100) == b""
    ends.up_proxy.setblocking(False)
    assert ends.up_proxy.recv(100) == b"not the turn's"


def test_a_client_gone_before_the_first_reads_ends_the_turn_as_client_gone(sink, ends):
    ends.cl_client.close()
    turn = ends.turn(sink, first=[(b"5\r\nhello\r\n", 1.0)])
    assert wait_done(sink) == [turn.id]
    name, err, _ = turn.outcome
    assert name == "client_gone" and err in (32, 104)  # EPIPE, ECONNRESET


def test_first_reads_the_client_cannot_take_at_once_block_the_turn_until_it_reads(sink, tcp_ends):
    """8 MB came with the head (more than the kernel's buffers to the client hold): the turn holds the rest
    and waits for the client, not the upstream; once the client reads, all of it arrives, then the body's
    end from the upstream."""
    tcp_ends.cl_proxy.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    payload = os.urandom(16384)
    frame = b"%x\r\n%b\r\n" % (len(payload), payload)
    big = frame * 512
    turn = tcp_ends.turn(sink, first=[(big, 1.0)])
    assert turn.blocked and turn.active
    tcp_ends.up_server.sendall(b"0\r\n\r\n")
    assert recv_until(tcp_ends.cl_client, len(big) + 5, timeout=30) == big + b"0\r\n\r\n"
    assert wait_done(sink) == [turn.id] and turn.outcome == ("end", 0, None)
    assert not turn.blocked


@pytest.mark.parametrize("first", [[b"5\r\nhello\r\n"], [(b"5\r\nhello\r\n", "now")], [(b"x",)],
                                   ("not", "a list")])
def test_first_reads_that_are_not_bytes_and_times_are_refused_before_a_byte_is_sent(sink, ends, first):
    with pytest.raises(TypeError):
        relayc.Turn(sink, ends.up_proxy.fileno(), ends.cl_proxy.fileno(), relayc.ChunkedEnd(), 100,
                    [(b"1\r\na\r\n", 1.0), *first] if isinstance(first, list) else first)
    ends.cl_client.setblocking(False)
    with pytest.raises(BlockingIOError):
        ends.cl_client.recv(100)
