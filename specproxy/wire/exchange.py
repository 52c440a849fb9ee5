"""``Exchange``: one request to the upstream and its response, from sending to the one place it ends.

Why one object: an exchange's head, framing, relay, recorder, deadlines and outcome belong together, and
every way it can end (the body's end, malformed framing, the upstream gone or silent, the client gone or
not reading, a fault of ours) must end it once, the same way: ``end(outcome, reason)`` stops the relay,
tells the recorder, and gives the connection back to the pool (``checkin``) or drops it (``discard``).

The handler (``serve/proxy.py``) makes one per request: ``send`` (a connection from the pool, the request,
the response head; a kept-alive connection the upstream closed as the request went out is tried once
more on a new one), then, once the client has the response head, ``attach`` starts the body: to the relay
thread (``relay_thread.ThreadRelay``) when it is a chunked body passed through and the thread can take
it, the reads that came with the head included, else on the loop (``relay.PythonRelay``); either reports
back through ``relay_ended``. The handler
waits on ``wait()``, which returns when the body has ended (``outcome``) or when the client's transport is
full (``paused``): then it waits for the client to drain and calls ``resume()``.

Deadlines of the body (the head's is the connection's): ``idle_timeout_s`` between reads of the body (not
while the client is the one not reading); ``send_timeout_s`` while the client is the one not reading (bytes
wait for it and it acknowledges none: the turn ends as ``client_stalled``). There is no total deadline: a long prefill
or a long answer is not an error. All of it runs on the event loop.
"""

from __future__ import annotations

import asyncio
import time

from specproxy.errors import UpstreamError
from specproxy.frames.chunked import ChunkedEnd
from specproxy.recorder import Recorder
from specproxy.wire.http1 import LengthEnd, UntilClose
from specproxy.wire.pool import UpstreamPool
from specproxy.wire.relay import CLIENT_GONE, DECHUNK, ENCODE, OK, PASS, PythonRelay, Relay
from specproxy.wire.relay_thread import NativeChunkedEnd, ThreadRelay
from specproxy.wire.response_head import CHUNKED, CLOSE, LENGTH, NO_BODY, ResponseHead
from specproxy.wire.sockets import owed, taken
from specproxy.wire.upstream import UpstreamConn

__all__ = ["LOOKS", "Exchange", "watch_unsent"]

clock = time.perf_counter

LOOKS = 4  # looks at a client that holds the body back per send_timeout_s (Exchange._send_left)

# outcomes after which the client must see the cut: no invented end of the body
_CUT = frozenset({"upstream_truncated", "client_stalled"})


class Exchange:
    """One request and its response over one upstream connection (``conn``), recorded by ``recorder``."""

    def __init__(self, pool: UpstreamPool, recorder: Recorder | None) -> None:
        self.pool = pool
        self.recorder = recorder
        self.conn: UpstreamConn | None = None
        self.head: ResponseHead | None = None
        self.relay: Relay | None = None
        self.framing: ChunkedEnd | LengthEnd | UntilClose | None = None
        self.mode = PASS
        self.out: asyncio.Transport | None = None
        self.outcome: str | None = None  # "ok", "upstream_truncated", "client_abort", ... once ended
        self.error: str | None = None
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._took = 0  # how far the client had taken the body at the last look (sockets.taken)
        self._took_at = 0.0  # and when it was last seen taking more
        self._idle_from = 0.0  # the upstream's idle deadline counts from here at the earliest
        self._owed = False  # at the last look, bytes waited for the client (sockets.owed)

    @property
    def held_by_client(self) -> bool:
        """The body waits on the client alone: its relay paused for it, or the thread's turn blocked on it
        (``Proxy`` does not count such an exchange toward ``max_concurrent``: clients that never read must
        not lock the readers out until their ``send_timeout_s``)."""
        relay = self.relay
        return self.outcome is None and relay is not None and relay.blocked

    # --- the request and the head ----------------------------------------------------------------

    async def send(self, method: str, data: bytes | tuple[bytes, bytes],
                   owner: asyncio.BaseTransport | None) -> ResponseHead:
        """Send one request (head and body in ``data``, or a tuple of them) for the client connection
        ``owner`` (its transport; None: a client that will not send another request); return its response
        head, and tell the recorder. Raises ``UpstreamError``."""
        pool = self.pool
        conn = pool.checkout(owner)
        if conn is not None:
            try:
                return await self._send_on(conn, method, data)
            except UpstreamError:
                if not (conn.unanswered and conn.exchanges > 1):
                    raise
                # A kept-alive connection the upstream closed as the request went out, before a byte of any
                # answer: the idle close raced our send (llama-server closes after each streamed response;
                # the peek at checkout cannot see a close still on its way). Once more, on a new connection.
        return await self._send_on(await pool.connect(owner), method, data)

    async def _send_on(self, conn: UpstreamConn, method: str, data: bytes | tuple[bytes, bytes]) -> ResponseHead:
        self.conn = conn
        try:
            head = await conn.send(method, data)
        except BaseException:
            conn.fail_head("no response")
            self.pool.discard(conn)
            raise
        self.head = head
        recorder = self.recorder
        if recorder is not None:
            recorder.on_headers(conn.t_head, head.status, head.content_type, head.content_encoding,
                                chunked=head.framing == CHUNKED)
        return head

    # --- the body ----------------------------------------------------------------------------------

    def attach(self, out: asyncio.Transport, mode: int) -> None:
        """Start relaying the body to ``out`` (``mode``: PASS, DECHUNK or ENCODE); reads that arrived
        meanwhile go first, with their times."""
        conn, head, pool = self.conn, self.head, self.pool
        assert conn is not None and head is not None
        self.out = out
        self.mode = mode
        thread = pool.relay_thread and mode == PASS and head.framing == CHUNKED
        if head.framing == CHUNKED:  # the native parser when the thread may take the body (it takes its state)
            framing = NativeChunkedEnd() if thread else ChunkedEnd(collect=mode == DECHUNK)
        elif head.framing == LENGTH:
            framing = LengthEnd(head.length)
        elif head.framing == CLOSE:
            framing = UntilClose()
        else:
            framing = LengthEnd(0)
        self.framing = framing
        parked, eof = conn.start_body(self._lost, self._let_go)
        if head.framing == NO_BODY or (head.framing == LENGTH and head.length == 0):
            if parked:
                conn.forbid_reuse()  # bytes after a body-less response: not a connection to reuse
            self.end("ok", None)
            return
        upstream = conn.transport
        if thread and not eof and upstream is not None:
            # the thread relays the reads that came with the head too, before it returns
            threaded = ThreadRelay.start(pool.turn_sink(), self, upstream, conn.fd, out, framing, self.recorder,
                                         parked)
            if threaded is not None:
                self.relay = threaded
                self._took, self._took_at = taken(out), clock()  # from where the client's progress counts
                self._arm(self._look())  # soon enough to see the client hold the thread back (_send_left)
                return
        relay = PythonRelay(self, upstream, out, framing, mode, self.recorder)
        self.relay = relay
        conn.read_to(relay.on_read)
        for data, t_read in parked:
            relay.on_read(data, t_read)
            if self.outcome is not None:
                return
        if eof:
            self._lost(None)
            return
        if upstream is not None:
            self._arm(self._look())  # the upstream's idle deadline, and looks at the client

    @property
    def paused(self) -> bool:
        """The loop's relay stopped reading the upstream until the client drains (the handler's cue)."""
        relay = self.relay
        return relay is not None and relay.paused

    async def wait(self) -> None:
        """Until the body has ended or the relay is paused for the client."""
        if self.outcome is not None or self.paused:
            return
        self._waiter = self.pool.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def resume(self) -> None:
        """The client drained what waited for it: read the upstream again."""
        relay = self.relay
        if relay is None or not relay.paused or self.outcome is not None:
            return
        relay.resume()
        self._arm(self._look())

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- what the relay reports (relay.RelayReport) -------------------------------------------------

    def relay_ended(self, how: str, reason: str | None, past_end: bool = False) -> None:
        if past_end:
            self.conn.forbid_reuse()  # bytes past the end of the response nobody asked for
        if how == OK:
            self.end("ok", None)
        elif how == CLIENT_GONE:
            self.conn.forbid_reuse()
            self.end("client_abort", reason)
        else:
            self.end("upstream_truncated", reason)

    def client_slow(self) -> None:
        # not the upstream's silence: no idle deadline while we hold it back, but the client's send deadline
        self._took, self._took_at = taken(self.out), clock()
        self._arm(self.pool.send_timeout_s / LOOKS)
        self._wake()

    def abandon(self, outcome: str, reason: str) -> None:
        """The handler is going away (the client hung up, or a fault of ours): end the exchange, drop the
        connection. Nothing when it had ended already, or the relay thread had ended it (that stands). While
        its head is awaited, ``send`` raises ``UpstreamError(reason)``."""
        conn = self.conn
        if conn is None:
            return
        if self.head is None:
            conn.fail_head(reason)
            self.pool.discard(conn)
            return
        self._cut(outcome, reason)

    def _cut(self, outcome: str, reason: str) -> None:
        """End the exchange from the loop, the connection not to be reused."""
        relay = self.relay
        if self.outcome is not None or (relay is not None and relay.settled()):
            return
        self.conn.forbid_reuse()
        self.end(outcome, reason)

    def _lost(self, exc: BaseException | None) -> None:
        """The upstream's connection went during the body: its end, for a body that ends so."""
        if isinstance(self.framing, UntilClose):
            self.end("ok", None)
        else:
            why = f"{type(exc).__name__}: connection lost" if exc else "the upstream closed the connection"
            self.end("upstream_truncated", f"body incomplete: {why}")

    def _let_go(self) -> None:
        """The connection is being closed: the relay lets go of its sockets first."""
        if self.relay is not None:
            self.relay.stop()

    # --- the end: the one place ----------------------------------------------------------------------

    def end(self, outcome: str, reason: str | None) -> None:
        """End the exchange (once): the relay stops, the recorder is told, the connection goes back to the
        pool after a body that ended well on a connection to keep, else is closed; after a truncation or a
        stalled client the client's connection is cut (it must see the cut)."""
        if self.outcome is not None:
            return
        relay = self.relay
        if relay is not None and relay.settled():
            return  # the thread had ended the body, its report on the way: delivered now, and it stands
        self.outcome, self.error = outcome, reason
        conn = self.conn
        if conn is not None:
            conn.end_body()
        if relay is not None:
            relay.stop()
        self._cancel_timer()
        out, self.out = self.out, None
        ok = outcome == "ok"
        if ok and self.mode == ENCODE and out is not None and not out.is_closing():
            out.write(b"0\r\n\r\n")
        recorder, self.recorder = self.recorder, None
        if recorder is not None and not recorder.ended:
            recorder.finish(clock(), outcome, reason)
        if ok and out is not None and out.get_write_buffer_size():
            watch_unsent(out, self.pool.loop, self.pool.send_timeout_s)
        if conn is not None:
            if ok and conn.reusable and self.head is not None and self.head.keep_alive:
                self.pool.checkin(conn)
            else:
                self.pool.discard(conn)
        if outcome in _CUT and out is not None:
            out.abort()
        # the relay refers back to this exchange: let go of it, so that the pair is freed by reference
        # counting when the handler is done, not left to the cyclic collector once per turn
        self.relay = None
        self._wake()

    # --- deadlines -------------------------------------------------------------------------------------

    def _look(self) -> float:
        """The time to the next look: the upstream's idle deadline, or sooner (``LOOKS`` per send
        deadline) to see a client that holds the body back."""
        return min(self.pool.idle_timeout_s, self.pool.send_timeout_s / LOOKS)

    def _arm(self, delay: float) -> None:
        self._cancel_timer()
        self._timer = self.pool.loop.call_later(delay, self._check_idle)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_idle(self) -> None:
        """One timer per idle period, not per read: re-armed for what is left when bytes came meanwhile.
        While the client is what holds the body back, its send deadline instead (``_send_left``)."""
        self._timer = None
        relay = self.relay
        if self.outcome is not None or relay is None:
            return
        now = clock()
        left = self._send_left(now, relay)
        if left is not None:
            if left > 0:
                self._timer = self.pool.loop.call_later(left, self._check_idle)
            return
        last = max(self.conn.last_read, relay.last_activity, self._idle_from)
        left = last + self.pool.idle_timeout_s - now
        if left > 0:
            if relay.watches_client:  # soon enough to see the client hold the thread back (send_timeout_s)
                left = min(left, self.pool.send_timeout_s / LOOKS)
            self._timer = self.pool.loop.call_later(left, self._check_idle)
            return
        if not relay.paused:
            self.end("upstream_truncated", f"no byte from the upstream within idle_timeout_s "
                                           f"({self.pool.idle_timeout_s:g} s)")

    def _send_left(self, now: float, relay: Relay) -> float | None:
        """While the client is what holds the body back (the thread's turn blocked on it, the loop's relay
        paused for it, or bytes of the thread's waiting unacknowledged in the kernel for it): when to look
        again (``LOOKS`` times per ``send_timeout_s``), and the turn ended as ``client_stalled`` once the
        client has taken no byte for ``send_timeout_s``. None while the client keeps up. Looked at once per
        timer, never per read: bytes taken between two looks count from the later one, so a client is cut
        between ``send_timeout_s`` and a ``LOOKS``th more after it stopped.

        Why bytes owed count without a blocked write: when the kernel's TCP memory runs short (a thousand
        clients not reading, each holding megabytes of receive buffer), the upstream's bytes stop arriving
        too; the thread then waits on the upstream, not the client, and only the client's silence on bytes
        already sent to it tells that it is the one not reading."""
        out = self.out
        if out is None or not (relay.watches_client or relay.paused):
            return None
        took = taken(out)
        if relay.blocked:
            floor = relay.last_activity  # the thread's last progress, its write to the client included
            self._idle_from = now  # the upstream's idle deadline starts again once the client takes more
        elif owed(out):
            floor = 0.0  # the thread reads on: only the client's own progress counts
            if not self._owed:
                self._took, self._took_at = took, now
        else:  # the client keeps up with the thread: from now on
            self._took, self._took_at, self._owed = took, now, False
            return None
        self._owed = True
        if took > self._took:  # the client took some since the last look
            self._took, self._took_at = took, now
        send_timeout_s = self.pool.send_timeout_s
        left = max(self._took_at, floor) + send_timeout_s - now
        if left <= 0:
            self._cut("client_stalled", f"the client took no bytes for send_timeout_s ({send_timeout_s:g} s)")
        return min(left, send_timeout_s / LOOKS)


def watch_unsent(out: asyncio.Transport, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
    """A body ended with bytes of it still in the client's write buffer (the kernel's was full): once
    the client's connection is closing (its keep-alive deadline), a transport waits for that buffer to
    drain before it lets go, for ever if the client never reads. Cut it ``timeout`` after the client
    last took a byte; nothing to do once the buffer is empty. One look per ``timeout``, from the end."""
    took = taken(out)

    def look() -> None:
        nonlocal took
        if not out.get_write_buffer_size():
            return
        now = taken(out)
        if now == took and out.is_closing():
            out.abort()
            return
        took = now
        loop.call_later(timeout, look)

    loop.call_later(timeout, look)

