"""The relay thread's side on the event loop: ``ThreadRelay`` (one body) and ``TurnSink`` (one loop's mailbox).

Why a thread: relayed on the event loop, even in C, each read costs uvloop's callbacks under the
interpreter lock and objects per read, several times nginx's CPU per chunk (docs/performance.md). Once a
response's head is out and its body is a chunked stream passed through, the exchange hands the body to
one native thread (``_pump.c``) that never takes the interpreter lock: it reads, finds the end, sends,
stamps and keeps each read; the loop hears back once per turn.

``ThreadRelay`` is the ``relay.Relay`` of a body the thread has; it reports to its exchange as
``PythonRelay`` does. ``TurnSink`` starts turns, and when the thread has ended some (the body's end, a
framing error, a closed upstream, a client gone) it calls each one's ``ThreadRelay.ended`` on the loop.
Everything else (the idle deadline, the client hanging up, closing) ends a turn from the loop with
``Turn.cancel()`` (``ThreadRelay.stop``), after which the thread touches neither socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from specproxy.recorder import Recorder
from specproxy.wire.relay import CLIENT_GONE, OK, TRUNCATED, RelayReport
from specproxy.wire.sockets import plain_socket_fd

__all__ = ["THREAD_BUILT", "NativeChunkedEnd", "ThreadRelay", "TurnSink", "ended_reason", "last_read",
           "relay_nice"]

log = logging.getLogger("specproxy.relay")

clock = time.perf_counter

try:
    from specproxy.wire import _relayc
except ImportError:  # without a compiler there is no thread: every body is relayed in Python
    _relayc = None

THREAD_BUILT = _relayc is not None
# _chunked.h's parser: the framing of a body the thread may take (Turn starts from its state)
NativeChunkedEnd = _relayc.ChunkedEnd if _relayc is not None else None


def last_read() -> float:
    """The thread's latest read of any turn (``perf_counter`` seconds; 0.0 before the first)."""
    return _relayc.pump_last_read() if _relayc is not None else 0.0


def relay_nice() -> int:
    """The relay thread's nice value (Config ``relay_nice``, where the process may lower it); 0 before it runs."""
    return _relayc.pump_stats()["nice"] if _relayc is not None else 0


class ThreadRelay:
    """A body the relay thread relays: its ``_relayc.Turn``, and the exchange it reports to."""

    __slots__ = ("_last", "recorder", "report", "sink", "turn", "upstream")
    paused = False  # the thread holds the upstream back itself: the handler never waits for a drain

    def __init__(self, sink: TurnSink, report: RelayReport, upstream: asyncio.Transport,
                 recorder: Recorder | None, last_read: float) -> None:
        self.sink = sink
        self.report = report
        self.upstream = upstream
        self.recorder = recorder
        self.turn = None
        self._last = last_read  # the body's latest read before the thread took it

    @classmethod
    def start(cls, sink: TurnSink, report: RelayReport, upstream: asyncio.Transport, upstream_fd: int | None,
              out: asyncio.Transport, framing: Any, recorder: Recorder | None,
              first: list[tuple[bytes, float]]) -> ThreadRelay | None:
        """Hand the body to the thread, with ``first``, the reads that came with the response head (the
        thread's turn relays them before it returns): only when both ends are plain sockets and nothing of
        ours waits in the client's write buffer (the thread's bytes must come after it). None: relay it on
        the loop (nothing of the body has been relayed)."""
        if upstream_fd is None or out.is_closing() or out.get_write_buffer_size():
            return None
        client_fd = plain_socket_fd(out)
        if client_fd is None:
            return None
        relay = cls(sink, report, upstream, recorder, first[-1][1] if first else clock())
        upstream.pause_reading()  # from now on the thread reads this socket, not the loop
        try:
            # keep for measuring what the recorder has room for; of an unmeasured turn, nothing
            keep = max(recorder.room, 0) if recorder is not None else 0
            relay.turn = sink.start(relay, upstream_fd, client_fd, framing, keep, first)
        except OSError:
            upstream.resume_reading()
            return None
        return relay

    @property
    def watches_client(self) -> bool:
        return self.turn is not None

    @property
    def blocked(self) -> bool:
        turn = self.turn
        return turn is not None and turn.blocked

    @property
    def last_activity(self) -> float:
        turn = self.turn
        return max(self._last, turn.last_activity) if turn is not None else self._last

    def resume(self) -> None:
        pass  # never paused: the thread itself waits for the client

    def ended(self) -> None:
        """From ``TurnSink``: the thread ended this turn; reported as ``PythonRelay`` reports the same event."""
        turn = self.turn
        if turn is None:
            return
        past_end = turn.past_end
        how, reason = ended_reason(turn.outcome)
        self.stop()
        self.report.relay_ended(how, reason, past_end)

    def settled(self) -> bool:
        """If the thread had already ended the turn, its report still on the way to the loop, that ending
        stands (the client has the whole body, say, before it hung up): delivered now. True: it was.
        False: the thread has let go of it now (cancelled), for the loop to end it."""
        turn = self.turn
        if turn is None:
            return False
        if not turn.cancel():
            self.ended()
            return True
        self.stop()
        return False

    def stop(self) -> None:
        """Take the body back from the thread (it stops, if it had not): its reads go to the recorder."""
        turn = self.turn
        if turn is None:
            return
        self.turn = None
        turn.cancel()
        self.sink.forget(turn)
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            recorder.relayed_by_thread(turn)  # its reads become objects in the measuring thread, not here
        self._last = max(self._last, turn.last_activity)
        upstream = self.upstream
        if not upstream.is_closing():
            upstream.resume_reading()


class TurnSink:
    """The turns one event loop handed to the relay thread; ended ones come back through an eventfd."""

    def __init__(self, loop: asyncio.AbstractEventLoop, slice_us: int, nice: int = 0) -> None:
        self.loop = loop
        self._sink = _relayc.Sink(slice_us, nice)  # the thread's slice and nice value, if this loop's turn starts it
        self._relays: dict[int, ThreadRelay] = {}
        self._fd = self._sink.fileno()
        loop.add_reader(self._fd, self._collect)
        self.closed = False
        self.started = 0  # turns handed to the thread: tests read it to know the thread took a body

    def start(self, relay: ThreadRelay, upstream_fd: int, client_fd: int, framing: Any, keep: int,
              first: list[tuple[bytes, float]]):
        """The thread relays the body from now on, ``first`` (reads that came with the head) at once, keeping
        its first reads within ``keep`` bytes for measuring. Raises OSError (no descriptor left, no thread:
        nothing was relayed then)."""
        turn = _relayc.Turn(self._sink, upstream_fd, client_fd, framing, keep, first)
        self._relays[turn.id] = relay
        self.started += 1
        return turn

    def forget(self, turn) -> None:
        self._relays.pop(turn.id, None)

    def _collect(self) -> None:
        for turn_id in self._sink.done():
            relay = self._relays.pop(turn_id, None)
            if relay is None:  # the loop had cancelled it meanwhile
                continue
            try:
                relay.ended()
            except Exception as exc:  # a bug: the other turns of this report must still end
                log.error("ending a relayed turn failed: %s", type(exc).__name__)
                relay.report.abandon("proxy_error", f"{type(exc).__name__} while ending the turn")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self._fd)


def ended_reason(outcome: tuple[str, int, str | None]) -> tuple[str, str | None]:
    """What a turn the thread ended means to its exchange: (``OK`` | ``TRUNCATED`` | ``CLIENT_GONE``,
    reason), in the words the Python relay uses for the same event."""
    name, err, framing = outcome
    if name == "end":
        return OK, None
    if name == "framing":
        return TRUNCATED, f"malformed chunked framing from the upstream ({framing})"
    if name == "upstream_eof":
        return TRUNCATED, "body incomplete: the upstream closed the connection"
    if name == "upstream_error":
        return TRUNCATED, f"body incomplete: {type(OSError(err, os.strerror(err))).__name__}: connection lost"
    if name == "client_gone":
        return CLIENT_GONE, "client disconnected"
    why = os.strerror(err) if err else name  # "thread_error": out of memory, or epoll refused the socket
    return TRUNCATED, f"the relay thread could not go on ({why})"
