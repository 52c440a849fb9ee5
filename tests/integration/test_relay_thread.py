"""The relay thread (``specproxy/wire/_pump.c``: ``_relayc.Turn`` and ``_relayc.Sink``), on real sockets.

What must hold: the client gets exactly the body's bytes up to its end (never past it), whatever framing
state the turn starts from and however the upstream's writes are split; each read is kept with two
``perf_counter`` stamps; each way a body can end (its end, bad framing, the upstream's EOF or reset, the
client gone) is reported once, through the sink's descriptor; a client that does not read stops the
thread from reading the upstream; after ``cancel()`` the thread holds no descriptor of the turn's sockets;
nothing leaks over thousands of turns; a forked child starts its own thread. The thread inside a running
proxy is tested in test_relay_thread_in_proxy.py; end to end, every suite runs with the thread (the
default relay), and test_relay_framing.py runs with it and with the Python relay (``each_relay``).
"""

from __future__ import annotations

import os
import resource
import select
import socket
import struct
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from framing_strategies import chunked_bodies
from relaykit import (  # noqa: F401 (fixtures)
    Ends, ends, give_back_what_the_turns_kept, recv_until, sink, taken, tcp_ends, wait_done)

from specproxy.frames.chunked import ChunkedEnd, FramingError
from specproxy.wire import memory, relay_thread

relayc = relay_thread._relayc
pytestmark = pytest.mark.skipif(relayc is None, reason="specproxy.wire._relayc is not built")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_on(sock: socket.socket) -> int:
    """How many of this process's descriptors refer to ``sock``'s socket (ours and any dup of it)."""
    target = os.readlink(f"/proc/self/fd/{sock.fileno()}")
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:  # closed meanwhile (another thread's descriptor)
            pass
    return n


def reference(prefix: bytes, rest: bytes) -> tuple[str, int | str]:
    """chunked.ChunkedEnd (the Python reference) fed the same two reads: ("end", index in rest),
    ("framing", message) or ("more", 0)."""
    ref = ChunkedEnd()
    try:
        assert ref.feed(prefix) < 0
        end = ref.feed(rest)
    except FramingError as exc:
        return "framing", str(exc)
    return ("end", end) if end >= 0 else ("more", 0)


# --- what reaches the client ----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(body=chunked_bodies(), cut=st.integers(0, 10_000))
def test_the_client_gets_the_body_up_to_its_end_from_any_framing_state(body, cut):
    """The thread goes on from the state the loop's ChunkedEnd reached on the reads before it (parked
    reads), sends what it reads up to the body's end and nothing past it: the reference, fed the same
    reads, decides. (The rest is in the socket before the turn starts: one read, as the reference.)"""
    cut = min(cut, len(body))
    prefix, rest = body[:cut], body[cut:]
    framing = relayc.ChunkedEnd()
    try:
        if framing.feed(prefix) >= 0:
            return  # the body ended within the parked reads: no turn to hand over
    except FramingError:
        return  # the loop would have ended the turn before handing it over
    sink = relayc.Sink()
    ends = Ends()
    try:
        ends.up_server.sendall(rest)
        turn = ends.turn(sink, framing)
        how, where = reference(prefix, rest)
        if how == "end":
            assert wait_done(sink) == [turn.id]
            assert turn.outcome == ("end", 0, None)
            want = rest[:where]
            assert recv_until(ends.cl_client, len(want)) == want
            assert turn.past_end == (where < len(rest))
            reads, _, _ = taken(turn)
            assert b"".join(reads) == want
        elif how == "framing":
            assert wait_done(sink) == [turn.id]
            assert turn.outcome == ("framing", 0, where)
            assert taken(turn) == ([], [], [])  # nothing of the bad read
        else:  # the body goes on: the thread sends what came and waits for more
            assert recv_until(ends.cl_client, len(rest)) == rest
            assert turn.active
            reads, _, _ = taken(turn)  # the read is kept before the thread lets go of the turn's lock
            assert b"".join(reads) == rest
            assert turn.cancel() is True
            assert turn.outcome == ("none", 0, None)
    finally:
        ends.close()


def test_a_body_split_into_many_writes_arrives_whole_with_a_stamp_per_read(sink, ends):
    events = [b"data: {\"n\": %d}\n\n" % i for i in range(200)]
    body = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    t0 = time.perf_counter()
    turn = ends.turn(sink)
    received = bytearray()
    for i in range(0, len(body), 37):  # the client reads as the upstream writes
        ends.up_server.sendall(body[i : i + 37])
        ready, _, _ = select.select([ends.cl_client], [], [], 0)
        if ready:
            received += ends.cl_client.recv(65536)
    assert wait_done(sink) == [turn.id]
    t1 = time.perf_counter()
    received += recv_until(ends.cl_client, len(body) - len(received))
    assert bytes(received) == body and turn.outcome == ("end", 0, None) and not turn.past_end
    reads, rtimes, wtimes = taken(turn)
    assert b"".join(reads) == body and all(reads)
    assert len(reads) == len(rtimes) == len(wtimes)
    assert all(t0 <= r <= w <= t1 for r, w in zip(rtimes, wtimes))  # the same clock as perf_counter
    assert rtimes == sorted(rtimes)
    assert taken(turn) == ([], [], [])  # take() hands each read over once


def test_bytes_past_the_end_are_not_sent(sink, ends):
    body = b"5\r\nhello\r\n0\r\n\r\n"
    turn = ends.turn(sink)
    ends.up_server.sendall(body + b"HTTP/1.1 200 OK\r\n")  # one write: the same read as the end
    assert wait_done(sink) == [turn.id]
    assert turn.outcome == ("end", 0, None) and turn.past_end
    assert recv_until(ends.cl_client, len(body)) == body
    ends.cl_proxy.close()  # our copy too: the thread's was closed when the turn ended
    ends.cl_client.settimeout(5)
    assert ends.cl_client.recv(100) == b""  # nothing followed the body


@pytest.mark.parametrize("keep", [0, 50_000])
@pytest.mark.parametrize("client", ["reading", "stalled"])
def test_a_turn_keeps_only_its_first_reads_within_its_allowance_and_relays_all(sink, tcp_ends, keep, client):
    """A turn keeps the reads that fit in ``keep`` bytes, in order from the first, and none after the
    first that does not (``capped``); every byte still reaches the client, also when it does not read
    for a while (the bytes it has not taken are held, then their room reused)."""
    tcp_ends.cl_proxy.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    payload = os.urandom(16384)
    frame = b"%x\r\n%b\r\n" % (len(payload), payload)
    want = frame * 400 + b"0\r\n\r\n"  # 6.5 MB
    turn = relayc.Turn(sink, tcp_ends.up_proxy.fileno(), tcp_ends.cl_proxy.fileno(), relayc.ChunkedEnd(), keep)
    writer = threading.Thread(target=tcp_ends.up_server.sendall, args=(want,), daemon=True)
    writer.start()
    if client == "stalled":  # the thread blocks on the client before the client reads anything
        start = time.monotonic()
        while not turn.blocked:
            assert time.monotonic() - start < 10, "the thread never waited for the client"
            time.sleep(0.01)
    assert recv_until(tcp_ends.cl_client, len(want), timeout=30) == want
    assert wait_done(sink) == [turn.id] and turn.outcome == ("end", 0, None)
    writer.join(5)
    reads, rtimes, wtimes = taken(turn)
    kept = b"".join(reads)
    assert turn.capped and len(kept) <= keep and want.startswith(kept)
    assert len(reads) == len(rtimes) == len(wtimes)
    if keep:
        assert len(kept) > keep - 65536  # the first read that did not fit is within one read of the cap


# --- how a turn ends ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["ends", "tcp_ends"])
def test_the_upstream_closing_mid_body_is_reported_as_eof(sink, pair, request):
    """The bytes and the EOF behind them are in the socket before the thread's first read: the thread
    watches the socket edge-triggered, so it must read on past the short read to the EOF."""
    ends = request.getfixturevalue(pair)
    ends.up_server.sendall(b"5\r\nhello\r\n")
    ends.up_server.shutdown(socket.SHUT_WR)
    poll = select.poll()
    poll.register(ends.up_proxy, select.POLLRDHUP)
    assert poll.poll(10_000), "the EOF never reached the proxy's socket"  # bytes and EOF both queued now
    turn = ends.turn(sink)
    assert wait_done(sink) == [turn.id]
    assert turn.outcome == ("upstream_eof", 0, None)
    assert relay_thread.ended_reason(turn.outcome) == (
        "truncated", "body incomplete: the upstream closed the connection")
    assert recv_until(ends.cl_client, 10) == b"5\r\nhello\r\n"


def test_an_upstream_reset_is_reported_with_its_errno(sink, tcp_ends):
    turn = tcp_ends.turn(sink)
    tcp_ends.up_server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    tcp_ends.up_server.sendall(b"5\r\nhello\r\n")
    assert recv_until(tcp_ends.cl_client, 10) == b"5\r\nhello\r\n"
    tcp_ends.up_server.close()  # linger 0: a reset
    assert wait_done(sink) == [turn.id]
    name, err, _ = turn.outcome
    assert name == "upstream_error" and err == 104  # ECONNRESET
    assert relay_thread.ended_reason(turn.outcome) == (
        "truncated", "body incomplete: ConnectionResetError: connection lost")


def test_a_client_gone_is_reported(sink, ends):
    turn = ends.turn(sink)
    ends.cl_client.close()
    ends.up_server.sendall(b"5\r\nhello\r\n")
    assert wait_done(sink) == [turn.id]
    name, err, _ = turn.outcome
    assert name == "client_gone" and err in (32, 104)  # EPIPE, ECONNRESET
    assert relay_thread.ended_reason(turn.outcome) == ("client_gone", "client disconnected")


def test_malformed_framing_sends_nothing_of_the_bad_read(sink, ends):
    turn = ends.turn(sink)
    ends.up_server.sendall(b"5\r\nhello\r\nzz\r\n")
    assert wait_done(sink) == [turn.id]
    assert turn.outcome == ("framing", 0, "malformed chunk size")
    assert relay_thread.ended_reason(turn.outcome)[1] == (
        "malformed chunked framing from the upstream (malformed chunk size)")
    assert taken(turn) == ([], [], [])
    ends.cl_proxy.close()
    ends.cl_client.settimeout(5)
    assert ends.cl_client.recv(100) == b""


def test_cancel_lets_go_of_both_sockets_at_once(sink, ends):
    assert fds_on(ends.up_proxy) == fds_on(ends.cl_proxy) == 1
    turn = ends.turn(sink)
    assert fds_on(ends.up_proxy) == fds_on(ends.cl_proxy) == 2  # the thread's own copies
    ends.up_server.sendall(b"5\r\nhello\r\n")
    assert recv_until(ends.cl_client, 10) == b"5\r\nhello\r\n"
    assert turn.cancel() is True
    # closed on return: the thread cannot write to the client any more
    assert fds_on(ends.up_proxy) == fds_on(ends.cl_proxy) == 1
    assert turn.cancel() is False and not turn.active
    assert turn.outcome == ("none", 0, None)
    reads, _, _ = taken(turn)
    assert reads == [b"5\r\nhello\r\n"]


def test_a_client_that_does_not_read_stops_the_thread_reading_the_upstream(sink, tcp_ends):
    """The thread keeps at most one read it could not send; the upstream's writes stall in the kernel's
    buffers; once the client reads, everything arrives, identical."""
    tcp_ends.cl_proxy.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    payload = os.urandom(16384)
    frame = b"%x\r\n%b\r\n" % (len(payload), payload)
    total_frames = 2000  # 32 MiB: far more than the kernel's buffers hold
    turn = tcp_ends.turn(sink)
    written = [0]
    done = threading.Event()

    def upstream_writes():
        try:
            for _ in range(total_frames):
                tcp_ends.up_server.sendall(frame)
                written[0] += 1
            tcp_ends.up_server.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        done.set()

    writer = threading.Thread(target=upstream_writes, daemon=True)
    writer.start()
    last, since, start = -1, time.monotonic(), time.monotonic()
    while time.monotonic() - since < 0.5:  # until the upstream's writes make no progress for 0.5 s
        if written[0] != last:
            last, since = written[0], time.monotonic()
        assert time.monotonic() - start < 20, "the upstream never stalled"
        time.sleep(0.02)
    assert written[0] < total_frames // 2
    assert turn.blocked and turn.active
    stalled_at = written[0]
    want = frame * total_frames + b"0\r\n\r\n"
    got = recv_until(tcp_ends.cl_client, len(want), timeout=30)
    assert got == want
    assert wait_done(sink) == [turn.id] and turn.outcome == ("end", 0, None)
    assert done.wait(5) and stalled_at < total_frames
    assert not turn.blocked


def test_each_sink_gets_its_own_turns():
    sinks = [relayc.Sink(), relayc.Sink()]
    ends = [Ends(), Ends()]
    turns = [e.turn(k) for e, k in zip(ends, sinks)]
    for e in ends:
        e.up_server.sendall(b"0\r\n\r\n")
    for k, t in zip(sinks, turns):
        assert wait_done(k) == [t.id]
    assert sinks[0].done() == [] and sinks[1].done() == []
    for e in ends:
        e.close()


def test_bad_arguments_are_refused():
    sink = relayc.Sink()
    with pytest.raises(TypeError):
        relayc.Turn(sink, 0, 1, ChunkedEnd())  # the Python class: its state is not the thread's
    with pytest.raises(TypeError):
        relayc.Turn(object(), 0, 1, relayc.ChunkedEnd())
    with pytest.raises(OSError):
        relayc.Turn(sink, 10_000_000, 10_000_001, relayc.ChunkedEnd())  # no such descriptors


def test_thousands_of_turns_leak_neither_descriptors_nor_memory():
    body = b"%x\r\n%b\r\n0\r\n\r\n" % (60000, b"x" * 60000)

    def batch(n: int) -> None:
        sink = relayc.Sink()
        for _ in range(n):
            ends = Ends()
            turn = ends.turn(sink)
            ends.up_server.sendall(body)
            assert recv_until(ends.cl_client, len(body)) == body
            assert wait_done(sink) == [turn.id]
            reads, _, _ = taken(turn)
            assert sum(map(len, reads)) == len(body)
            ends.close()

    batch(200)  # warm up the allocator
    fds = open_fds()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stats = relayc.pump_stats()
    batch(3000)  # 180 MB relayed: a leak of the turns' buffers would show
    assert open_fds() - fds < 50  # a leak would be 6000 (two per turn); other threads' own may come and go
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 50_000  # KiB
    assert relayc.pump_stats()["turns"] == stats["turns"] + 3000


def test_last_read_is_the_threads_latest_read(sink, ends):
    turn = ends.turn(sink)
    before = time.perf_counter()
    ends.up_server.sendall(b"0\r\n\r\n")
    wait_done(sink)
    assert before <= relay_thread.last_read() <= time.perf_counter()
    assert turn.outcome[0] == "end"


def test_a_forked_child_starts_its_own_thread():
    """fork() copies only the forking thread: a child that relays must not wait on its parent's thread,
    nor count its parent's turns as its own (the cadence poll's gate counts the turns in flight)."""
    sink = relayc.Sink()
    ends = Ends()
    held = ends.turn(sink)  # the parent's thread is running, with a turn in flight
    pid = os.fork()
    if pid == 0:  # the child: one turn through its own thread, then report by exit status
        code = 1
        try:
            if relayc.pump_stats()["active"] != 0:
                os._exit(2)
            child_sink = relayc.Sink()
            child_ends = Ends()
            turn = child_ends.turn(child_sink)
            child_ends.up_server.sendall(b"0\r\n\r\n")
            ready, _, _ = select.select([child_sink.fileno()], [], [], 5)
            code = 0 if ready and child_sink.done() == [turn.id] else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    held.cancel()
    ends.close()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "2: the child counted its parent's turn"


def test_the_thread_failing_is_a_truncation_with_its_reason():
    assert relay_thread.ended_reason(("thread_error", 12, None)) == (
        "truncated", "the relay thread could not go on (Cannot allocate memory)")
