"""A client that never reads does not hold its place for ever: the send deadline (``send_timeout_s``).

Issue 32, "Deadlines on every wait": 1,030 clients that asked for a 20 MB response and never read kept
``in_flight`` at 1,024 (every other client got 503) until they hung up. Now no progress writing to a
client for ``send_timeout_s`` ends the exchange as ``client_stalled``, on both fronts and both relays,
and the upstream is closed: it never gave the proxy more than the kernel's buffers hold.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from faultkit import ScriptedUpstream, db_rows, post_head, sse_head, wait_until
from rawpeers import RawUpstream, chunk
from procmem import PeakRss
from serveproc import LoopThread, ServeProcess, cancel_leftovers

CHAT = "/v1/chat/completions"
BODY = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
BIG = 20 * 1024 * 1024
PIECE = chunk(b"data: " + b"x" * 65000 + b"\n\n")  # one 64 KiB event, written again and again
SMALL = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


def _big_upstream(sent: list[int], *, chunked: bool = True, size: int = BIG) -> ScriptedUpstream:
    """``CHAT`` gets a ``size`` stream (20 MB; chunked, or with a Content-Length), written as fast as the
    proxy takes it; any other path a 2-byte answer. ``sent`` gets the bytes each big answer got out."""

    async def respond(req, writer, _i):
        if req.line.split(b" ")[1] != CHAT.encode():
            writer.write(SMALL)
            await writer.drain()
            return True
        out = 0
        i = len(sent)
        sent.append(0)
        size_ = -(-size // len(PIECE)) * len(PIECE)  # whole pieces
        writer.write(sse_head() if chunked else sse_head(f"Content-Length: {size_}\r\n", chunked=False))
        while out < size_:
            writer.write(PIECE)
            await writer.drain()  # the proxy's backpressure: blocks while it does not read
            out += len(PIECE)
            sent[i] = out
        if chunked:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        return False

    return ScriptedUpstream(respond)


def _stalled_client(port: int, path: str = CHAT) -> socket.socket:
    """Connects, asks, and never reads (a small receive buffer: the kernel holds little for it)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    s.sendall(post_head(path, BODY))
    return s


def test_a_client_that_never_reads_is_cut_after_send_timeout(make_stack, each_front, each_relay):
    """Three clients ask for 20 MB and never read: with ``send_timeout_s`` 1 s each exchange ends as
    ``client_stalled`` (the upstream's connection closed, nothing in flight), well before the 20 MB
    could have gone anywhere; the turns are recorded with the reason."""
    sent: list[int] = []
    up = _big_upstream(sent, chunked=each_relay == "thread")
    stack = make_stack(raw_script=up.serve, send_timeout_s=1.0, scrape_interval_s=0)
    clients = [_stalled_client(stack.service.port) for _ in range(3)]
    try:
        wait_until(lambda: len(sent) == 3, 20, what="three big answers started")
        wait_until(lambda: len(up.peer_closed_at) == 3, 30, what="the proxy to close the three upstream connections")
        stack.settle(30)
        assert stack.service.counters.in_flight == 0
        assert max(sent) < BIG  # the upstream was held back, then let go: not read to the end
        turns = [r for r in stack.records if r.path == CHAT]
        assert [r.outcome for r in turns] == ["client_stalled"] * 3, [(r.outcome, r.error) for r in turns]
        assert all("send_timeout_s (1 s)" in (r.error or "") for r in turns)
        counted = {key[3]: n for key, n in stack.service.metrics.turns.items()}  # /_specproxy/metrics' turns
        assert counted.get("client_stalled") == 3, counted
    finally:
        for s in clients:
            s.close()


def test_a_client_that_stops_reading_is_cut_though_the_upstream_went_quiet(make_stack, each_relay):
    """The upstream sends 24 kB of a stream and then nothing (it holds the connection), to a client that
    never reads: the kernel took those bytes, so no write of the relay is held back, and the relay waits
    on the upstream. The client never acknowledges them, so with ``send_timeout_s`` 1 s the turn ends as
    ``client_stalled`` within seconds, not at the upstream's ``idle_timeout_s`` (60 s) as
    ``upstream_truncated``: the case of a thousand clients not reading, whose receive buffers use up the
    kernel's TCP memory until the upstreams' bytes stop coming too."""
    piece = chunk(b"data: " + b"x" * 24000 + b"\n\n")

    async def respond(req, writer, _i):
        writer.write(sse_head() + piece)
        await writer.drain()
        return True  # then silence, until the proxy closes the connection (read_request sees it)

    up = ScriptedUpstream(respond)
    stack = make_stack(raw_script=up.serve, send_timeout_s=1.0, idle_timeout_s=60.0, scrape_interval_s=0)
    client = _stalled_client(stack.service.port)
    try:
        wait_until(lambda: len(up.peer_closed_at) == 1, 30, what="the proxy to cut the turn and its upstream")
        stack.settle(30)
        turns = [r for r in stack.records if r.path == CHAT]
        assert [(r.outcome, r.error) for r in turns] == [
            ("client_stalled", "the client took no bytes for send_timeout_s (1 s)")]
        assert stack.service.counters.in_flight == 0
    finally:
        client.close()


def test_clients_that_never_read_do_not_hold_max_concurrent_from_readers(make_stack, each_front, each_relay):
    """``max_concurrent`` 3 and three clients that ask for 20 MB and never read (``send_timeout_s`` 60 s):
    once their responses wait on them alone, a client that reads is answered (it got 503 until the
    stalled ones were cut, a minute later); past twice ``max_concurrent`` in flight, 503 again."""
    sent: list[int] = []
    up = _big_upstream(sent, chunked=each_relay == "thread")
    stack = make_stack(raw_script=up.serve, send_timeout_s=60.0, scrape_interval_s=0, max_concurrent=3)
    clients = [_stalled_client(stack.service.port) for _ in range(3)]
    try:
        wait_until(lambda: len(sent) == 3, 20, what="three big answers started")
        proxy = stack.service.proxy
        # as soon as the three wait on their clients (a moment after they started), not after 60 s
        wait_until(lambda: _small_get(stack.service.port) == 200, 20, 0.1, "a reading client answered")
        wait_until(lambda: proxy.counters.in_flight == 3, 20, what="the reading client's exchange over")
        # a reader may be answered once two of the three wait on their clients: the third follows
        wait_until(lambda: proxy.held_by_clients == 3, 20, what="all three held by their clients alone")
        clients += [_stalled_client(stack.service.port) for _ in range(3)]
        wait_until(lambda: proxy.counters.in_flight == 6, 20, what="three more stalled exchanges admitted")
        busy = proxy.counters.rejected_busy
        assert _small_get(stack.service.port) == 503  # twice max_concurrent in flight: the bound holds
        assert proxy.counters.rejected_busy == busy + 1
    finally:
        for s in clients:
            s.close()


def test_a_slow_reader_that_keeps_reading_is_never_cut(make_stack, each_relay):
    """``send_timeout_s`` 1 s, and a client that reads 4 kB every 20 ms (200 kB/s, far slower than the
    upstream sends): it gets the whole 3 MB answer and the turn is ``ok``. Progress is the client's
    TCP taking bytes, not the proxy's writes: the kernel reports a full socket writable again only once
    half its send queue (megabytes) has gone, seconds apart at this pace."""
    sent: list[int] = []
    size = 3 * 1024 * 1024
    up = _big_upstream(sent, chunked=each_relay == "thread", size=size)
    stack = make_stack(raw_script=up.serve, send_timeout_s=1.0, scrape_interval_s=0)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(10)
    s.connect(("127.0.0.1", stack.service.port))
    s.sendall(post_head(CHAT, BODY))
    got = 0
    try:
        for _ in range(5000):  # bounded: 3 MB at 4 kB a read is under 1,000 reads
            data = s.recv(4096)
            if not data:
                break
            got += len(data)
            time.sleep(0.02)  # the client's pace, not a wait for an event
            if sent and sent[0] >= size and got > size:  # the upstream has sent it all, the client read it
                s.settimeout(1.0)
    except TimeoutError:
        pass  # the answer is whole: nothing more comes on a kept-alive connection
    finally:
        s.close()
    stack.settle(30)
    turns = [r for r in stack.records if r.path == CHAT]
    assert [r.outcome for r in turns] == ["ok"], [(r.outcome, r.error) for r in turns]
    assert got > size


def test_an_answer_left_unread_in_the_buffer_does_not_hold_the_connection():
    """A body that ended with its last bytes still in the client's write buffer (seen with a 3 MB
    answer nobody read): closing a transport waits for that buffer to drain, for ever if the client
    never reads, so the connection stayed open past its keep-alive deadline. Once it is closing and the
    client has taken nothing for the send deadline, it is cut; a client that takes bytes, or a buffer
    that drained, is left alone. (Driven with a transport of our own: which answers end so depends on
    the kernel's buffers.)"""
    from specproxy.wire.exchange import watch_unsent

    class Out:
        def __init__(self, takes: int = 0) -> None:
            self.unsent, self.takes, self.looks = 65536, takes, 0
            self.aborted, self.looked_at = asyncio.Event(), asyncio.Event()

        def get_write_buffer_size(self) -> int:
            self.looks += 1
            if self.looks >= 8:
                self.looked_at.set()
            self.unsent -= self.takes  # a reading client has taken some since the last look
            return self.unsent

        def get_extra_info(self, name: str):
            return None  # no socket: progress is the buffer shrinking

        def is_closing(self) -> bool:
            return True  # the keep-alive deadline has closed it

        def abort(self) -> None:
            self.aborted.set()

    async def scenario() -> tuple[bool, bool, bool]:
        loop = asyncio.get_running_loop()
        stuck, reading, drained = Out(), Out(takes=100), Out()
        for out in (stuck, reading, drained):
            watch_unsent(out, loop, 0.01)
        drained.unsent = 0
        await asyncio.wait_for(stuck.aborted.wait(), 10)
        await asyncio.wait_for(reading.looked_at.wait(), 10)  # several looks, each finding it took some
        return stuck.aborted.is_set(), reading.aborted.is_set(), drained.aborted.is_set()

    assert asyncio.run(scenario()) == (True, False, False)


# --- 1,030 clients that never read, against the real serve -------------------------------------------------


class _WideListener(RawUpstream):
    """A listener whose accept queue takes a thousand connects at once (asyncio's default is 100)."""

    async def start(self) -> _WideListener:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=2048)
        self.port = self._server.sockets[0].getsockname()[1]
        return self


def _small_get(port: int) -> int:
    """One request from a client that reads: its status."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /small HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n")
        head = b""
        while b"\r\n" not in head:
            data = s.recv(4096)
            if not data:
                break
            head += data
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0


@pytest.mark.slow
@pytest.mark.alone
def test_1030_clients_that_never_read_do_not_lock_others_out(tmp_path):
    """1,030 clients ask ``serve`` (its defaults, but ``--send-timeout 3``) for a 20 MB stream and never
    read, nor hang up. Within the deadline and a margin every one of those exchanges has ended:
    ``in_flight`` is back to 0 while their sockets are still open, a client that reads gets 200, every
    stalled turn is recorded as ``client_stalled`` (or was refused with a 503 past ``max_concurrent``),
    and the proxy's RSS stayed within its memory budget plus the constant docs/operations.md gives (160
    MiB): the kernel's buffers hold what it did not read.

    ``--memory-budget-bytes`` at its least (twice ``max_body_bytes``: 64 MiB): each measured turn keeps
    what the kernel took for its client before it stalled (about 0.4 MB each here, 1,024 of them: more than
    the budget), so the budget, not the default 16 MiB per turn, is what bounds the bytes kept."""
    loop = LoopThread()
    sent: list[int] = []
    up = _big_upstream(sent)
    listener = _WideListener(up.serve)
    loop.run(listener.start())
    up.port = listener.port
    db = tmp_path / "turns.db"
    budget = 64 << 20
    proc = ServeProcess(tmp_path, up.url, db, "--send-timeout", "3", "--memory-budget-bytes", str(budget))
    clients: list[socket.socket] = []
    try:
        assert _small_get(proc.port) == 200
        rss = PeakRss(proc.proc.pid)
        t0 = time.monotonic()
        for _ in range(1030):
            clients.append(_stalled_client(proc.port))
        opened_s = time.monotonic() - t0
        wait_until(lambda: len(sent) >= 1024, 60, 0.05, "1,024 big answers started")
        # every stalled exchange ends within send_timeout_s of stalling (plus a loaded machine's margin)
        wait_until(lambda: proc.state()["in_flight"] == 0, 120, 0.5, "in_flight back to 0")
        statuses = [_small_get(proc.port) for _ in range(5)]
        peak = rss.stop()
        state = proc.state()
        assert statuses == [200] * 5, statuses
        assert state["in_flight"] == 0 and state["rejected_busy"] <= 6, state
        assert max(sent) < BIG
        print(f"opened 1030 in {opened_s:.1f} s; RSS {rss.first / 2**20:.0f} MB -> peak {peak / 2**20:.0f} MB; "
              f"upstream got out at most {max(sent) / 2**20:.1f} MB of an answer; state {state}")
        # forwarding never stopped: what it holds per stalled client is its buffers, not the answer
        assert peak - rss.first < budget + (160 << 20), (rss.first, peak)
    finally:
        for s in clients:
            s.close()
        proc.stop()
        loop.run(listener.close())
        loop.run(cancel_leftovers())
        loop.close()
    outcomes = dict(db_rows(db, "SELECT outcome, count(*) FROM turns WHERE path = ? GROUP BY outcome", (CHAT,)))
    busy = state["rejected_busy"]
    assert outcomes.get("client_stalled", 0) + busy == 1030, (outcomes, busy)
