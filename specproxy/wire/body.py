"""The body half of an upstream exchange: forwarded to the client read by read, or by the relay thread.

Why apart from ``upstream.py`` (which owns the connection, the request and the response head): this is
the forwarding path of every byte of a body, and the one place that decides who relays it. A chunked body
passed through (``PASS``) goes to the relay thread (``relay_thread.py``, ``_pump.c``) when the pool's
``relay`` setting is ``thread`` (Config ``relay``, the default) and both ends are plain sockets with
nothing of ours queued for the client; the thread reads, sends and stamps it without the interpreter lock
and reports once per turn to the same edges (``_complete``, ``_truncated``, ``_client_gone``). Every other
body, and a chunked one the thread cannot take (a TLS upstream, bytes still queued for the client) or
``relay = "python"``, is relayed here in ``_body``: the reference the thread is tested against
(tests/unit/test_relayc.py, tests/integration/test_relay_thread.py).

The per-read work in ``_body`` is: finding out whether the body ended (``framing.feed``: chunk sizes
are skipped over, the payload is never copied, malformed framing is refused), the write, a clock read,
and three list appends into the turn's ``RecordBuilder``. Nothing is parsed or counted here; the measuring
thread strips the framing later. Malformed chunked framing ends the turn as ``upstream_truncated`` with
the parser's reason, closes the upstream connection and aborts the client's: nothing of that read, and
no invented end of the body, reaches the client.
"""

from __future__ import annotations

import asyncio
import time

from specproxy.frames.chunked import ChunkedEnd, FramingError
from specproxy.wire.http1 import LengthEnd, UntilClose
from specproxy.wire.response_head import CHUNKED, CLOSE, LENGTH, NO_BODY
from specproxy.wire.relay_thread import NativeChunkedEnd, acked_bytes, ended_reason, plain_socket_fd

__all__ = ["DECHUNK", "ENCODE", "PASS", "BodyRelay"]

clock = time.perf_counter

# connection states (UpstreamConn.state)
_IDLE, _WAIT_HEAD, _PARKED, _BODY, _DONE = range(5)

# how the body goes to the client
PASS, DECHUNK, ENCODE = 0, 1, 2

LOOKS = 4  # looks at a client that holds the body back per send_timeout_s (BodyRelay._send_left)


class BodyRelay:
    """``UpstreamConn``'s body methods (a mixin: the attributes are the connection's, set in its
    ``__init__``). ``attach`` starts relaying; ``wait``/``resume`` are the handler's; ``_complete``,
    ``_truncated`` and ``_client_gone`` are the ends every path reports to."""

    def attach(self, out: asyncio.Transport, builder, mode: int) -> None:
        """Start forwarding the body to ``out``; reads that arrived meanwhile go first, with their times."""
        assert self.state == _PARKED and self.head is not None
        head = self.head
        self.out = out
        self.builder = builder
        self.mode = mode
        self.outcome = None
        self.paused = False
        limits = out.get_write_buffer_limits() if hasattr(out, "get_write_buffer_limits") else (0, 65536)
        self._high = max(limits[1], 1)
        thread = self.pool.relay_thread and mode == PASS
        if head.framing == CHUNKED:  # the native parser when the thread may take the body (it takes its state)
            self.framing = NativeChunkedEnd() if thread else ChunkedEnd(collect=mode == DECHUNK)
        elif head.framing == LENGTH:
            self.framing = LengthEnd(head.length)
        elif head.framing == CLOSE:
            self.framing = UntilClose()
        else:
            self.framing = LengthEnd(0)
        self.state = _BODY
        parked, self._parked = self._parked, []
        if head.framing == NO_BODY or (head.framing == LENGTH and head.length == 0):
            if parked:
                self.reusable = False  # bytes after a body-less response: not a connection to reuse
            self._complete("ok", None)
            return
        for data, t_read in parked:
            self._body(data, t_read)
            if self.state != _BODY:
                return
        if self._eof:
            self.connection_lost(None)
            return
        if self.transport is not None:
            if thread and head.framing == CHUNKED and self._thread_attach(out):
                # soon enough to see the client hold the thread back (_send_left), and from where
                self._took, self._took_at = self._taken(out), clock()
                self._arm_timer(min(self.pool.idle_timeout_s, self.pool.send_timeout_s / LOOKS))
            else:
                self._arm_timer()  # each read goes on through _body, on the loop

    def _thread_attach(self, out: asyncio.Transport) -> bool:
        """Hand the body to the relay thread: only when both ends are plain sockets and nothing of ours waits
        in the client's write buffer (the thread's bytes must come after it). False: relay it here."""
        if out.is_closing() or out.get_write_buffer_size():
            return False
        up_fd = plain_socket_fd(self.transport)
        client_fd = plain_socket_fd(out)
        if up_fd is None or client_fd is None:
            return False
        self.transport.pause_reading()  # from now on the thread reads this socket, not the loop
        try:
            b = self.builder  # keep for measuring what the builder has room for; of an unmeasured turn, nothing
            keep = max(b.room, 0) if b is not None else 0
            self._turn = self.pool.turn_sink().start(self, up_fd, client_fd, self.framing, keep)
        except OSError:
            self.transport.resume_reading()
            return False
        return True

    def _thread_ended(self) -> None:
        """From ``TurnSink``: the thread ended this turn; the same edges as the Python relay's."""
        turn = self._turn
        if turn is None:
            return
        past_end = turn.past_end
        how, reason = ended_reason(turn.outcome)
        self._thread_detach()
        if how == "ok":
            if past_end:
                self.reusable = False  # bytes past the end of the response nobody asked for
            self._complete("ok", None)
        elif how == "client_gone":
            self._client_gone(reason)
        else:
            self._truncated(reason)

    def _thread_ended_first(self) -> bool:
        """Before ending a turn the thread has (an idle deadline, a client hanging up, the upstream's
        connection lost): if the thread had already ended it, its report still on the way to the loop,
        that ending stands (the client has the whole body, say, before it hung up). True: handled."""
        turn = self._turn
        if turn is not None and not turn.cancel():
            self._thread_ended()
            return True
        return False

    def _thread_detach(self) -> None:
        """Take the body back from the thread (it stops, if it had not): its reads go to the builder."""
        turn = self._turn
        if turn is None:
            return
        self._turn = None
        turn.cancel()
        self.pool.turn_sink().forget(turn)
        b = self.builder
        if b is not None:
            b.relayed_by_thread(turn)  # its reads become objects in the measuring thread, not here
        self.last_read = max(self.last_read, turn.last_activity)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _body(self, data: bytes, t_read: float) -> None:
        """The forwarding path of one read. Keep it short."""
        try:
            end = self.framing.feed(data)
        except FramingError as exc:
            self._truncated(f"malformed chunked framing from the upstream ({exc})")
            return
        if end >= 0 and end != len(data):
            data = data[:end]
            self.reusable = False  # bytes past the end of the response nobody asked for
        out = self.out
        if out.is_closing():
            self._client_gone("client disconnected")
            return
        mode = self.mode
        if mode == PASS:
            out.write(data)
        elif mode == DECHUNK:
            payload = self.framing.payload
            if payload:
                out.write(b"".join(payload))
                payload.clear()
        elif data:
            out.write(b"%x\r\n%b\r\n" % (len(data), data))
        t_written = clock()
        b = self.builder
        if b is not None:
            b.on_bytes(data, t_read, t_written)
        if end >= 0:
            self._complete("ok", None)
        elif out.get_write_buffer_size() > self._high:
            self._pause()

    def _pause(self) -> None:
        """The client is not reading as fast as the upstream sends: stop reading the upstream (the kernel's
        buffers then push back on it) until the handler has seen the client drain."""
        if self.transport is not None:
            self.transport.pause_reading()
        self.paused = True
        # not the upstream's silence: no idle deadline while we hold it back, but the client's send deadline
        self._took, self._took_at = self._taken(self.out), clock()
        self._arm_timer(self.pool.send_timeout_s / LOOKS)
        self._wake()

    @staticmethod
    def _taken(out: asyncio.Transport) -> int:
        """How far the client has taken the response: the bytes its TCP acknowledged, or (where the kernel
        does not say) minus what waits in our buffer for it. Goes up exactly when the client takes bytes."""
        acked = acked_bytes(out)
        return acked if acked is not None else -out.get_write_buffer_size()

    def _send_left(self, now: float) -> float | None:
        """While the client is what holds the body back (the thread's turn blocked on it, or this relay
        paused for it): when to look again (``LOOKS`` times per ``send_timeout_s``), and the turn ended
        as ``client_stalled`` once the client has taken no byte for ``send_timeout_s``. None while the
        client keeps up. Looked at once per timer, never per read: bytes taken between two looks count
        from the later one, so a client is cut between ``send_timeout_s`` and a ``LOOKS``th more after
        it stopped."""
        turn = self._turn
        out = self.out
        if out is None or self.state != _BODY or (turn is None and not self.paused):
            return None
        took = self._taken(out)
        if turn is not None and not turn.blocked:  # the client keeps up with the thread: from now on
            self._took, self._took_at = took, now
            return None
        if took > self._took:  # the client took some since the last look
            self._took, self._took_at = took, now
        since = max(self._took_at, turn.last_activity) if turn is not None else self._took_at
        self.last_read = now  # the upstream's idle deadline starts again once the client takes more
        left = since + self.pool.send_timeout_s - now
        if left <= 0:
            self._stalled()
        return min(left, self.pool.send_timeout_s / LOOKS)

    @property
    def held_by_client(self) -> bool:
        """The body waits on the client alone: this relay paused for it, or the thread's turn blocked on
        it (``Proxy.exchange`` does not count such an exchange toward ``max_concurrent``)."""
        turn = self._turn
        return self.state == _BODY and (self.paused or (turn is not None and turn.blocked))

    def resume(self) -> None:
        if not self.paused or self.state != _BODY:
            return
        self.paused = False
        self.last_read = clock()
        if self.transport is not None:
            self.transport.resume_reading()
            self._arm_timer()

    async def wait(self) -> None:
        """Until the body has ended or the relay is paused for the client."""
        if self.outcome is not None or self.paused:
            return
        self._waiter = self.pool.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _complete(self, outcome: str, error: str | None) -> None:
        if self.state == _DONE:
            return
        self.state = _DONE
        self._thread_detach()
        self._cancel_timer()
        if outcome == "ok" and self.mode == ENCODE and self.out is not None and not self.out.is_closing():
            self.out.write(b"0\r\n\r\n")
        self.outcome = outcome
        self.error = error
        b = self.builder
        if b is not None and not b._ended:
            b.finish(clock(), outcome, error)
        self.builder = None
        out, self.out = self.out, None
        if outcome == "ok" and out is not None and out.get_write_buffer_size():
            _watch_unsent(out, self.pool.loop, self.pool.send_timeout_s)
        if outcome == "ok" and self.reusable and self.head is not None and self.head.keep_alive:
            self.pool._release(self)
        else:
            self.close()
        self._wake()

    def _truncated(self, reason: str) -> None:
        if self._thread_ended_first():
            return
        out = self.out
        self._complete("upstream_truncated", reason)
        if out is not None:
            out.abort()  # the client must see the truncation: no invented end of the body

    def _stalled(self) -> None:
        """The client took nothing for ``send_timeout_s``: cut it, close the upstream, record the turn."""
        if self._thread_ended_first():
            return
        out = self.out
        self.reusable = False
        self._complete("client_stalled", f"the client took no bytes for send_timeout_s "
                                         f"({self.pool.send_timeout_s:g} s)")
        if out is not None:
            out.abort()

    def _client_gone(self, reason: str) -> None:
        if self._thread_ended_first():
            return
        self.reusable = False
        self._complete("client_abort", reason)


def _watch_unsent(out: asyncio.Transport, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
    """A body ended with bytes of it still in the client's write buffer (the kernel's was full): once
    the client's connection is closing (its keep-alive deadline), a transport waits for that buffer to
    drain before it lets go, for ever if the client never reads. Cut it ``timeout`` after the client
    last took a byte; nothing to do once the buffer is empty. One look per ``timeout``, from the end."""
    took = BodyRelay._taken(out)

    def look() -> None:
        nonlocal took
        if not out.get_write_buffer_size():
            return
        now = BodyRelay._taken(out)
        if now == took and out.is_closing():
            out.abort()
            return
        took = now
        loop.call_later(timeout, look)

    loop.call_later(timeout, look)
