"""The relay interface, and the relay on the event loop: how a response body goes to the client.

Two classes relay a body, behind one interface (``Relay``): ``PythonRelay`` here, read by read on the
event loop, and ``relay_thread.ThreadRelay``, a native thread that never takes the interpreter lock. The
exchange (``exchange.py``) chooses one per body and hears from either the same way (``RelayReport``):
the body ended, the framing was malformed or the upstream went, the client went. ``PythonRelay`` relays
every body the thread does not take (a TLS upstream, bytes still queued for the client, a body that is
not chunked or not passed through, Config ``relay = "python"``), and is the reference the thread is
tested against (tests/unit/test_relayc.py, tests/integration/test_relay_thread.py).

The per-read work in ``PythonRelay.on_read`` is: finding out whether the body ended (``framing.feed``:
chunk sizes are skipped over, the payload is never copied, malformed framing is refused), the write, a
clock read, and three list appends into the turn's recorder. Nothing is parsed or counted here; the
measuring thread strips the framing later. Malformed chunked framing ends the turn as
``upstream_truncated`` with the parser's reason: nothing of that read, and no invented end of the body,
reaches the client.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from specproxy.frames.chunked import FramingError
from specproxy.recorder import Recorder

__all__ = ["DECHUNK", "ENCODE", "OK", "PASS", "TRUNCATED", "CLIENT_GONE", "PythonRelay", "Relay", "RelayReport"]

clock = time.perf_counter

# how the body goes to the client
PASS, DECHUNK, ENCODE = 0, 1, 2

# how a relay saw a body end (RelayReport.relay_ended)
OK, TRUNCATED, CLIENT_GONE = "ok", "truncated", "client_gone"


class RelayReport(Protocol):
    """Whom a relay reports to: the exchange whose body it relays."""

    def relay_ended(self, how: str, reason: str | None, past_end: bool = False) -> None:
        """The body ended as the relay saw it (``OK``, ``TRUNCATED``, ``CLIENT_GONE``); ``past_end``:
        bytes came after its end, not relayed (the connection is not one to reuse)."""

    def client_slow(self) -> None:
        """The client's buffer is full: the relay stopped reading the upstream until it drains."""

    def abandon(self, outcome: str, reason: str) -> None:
        """End the exchange for a fault of ours (``outcome``), dropping the connection."""


class Relay(Protocol):
    """What the exchange asks of whichever relays its body."""

    paused: bool  # waiting for the exchange's handler to see the client drain (the loop's relay only)
    watches_client: bool  # the client may hold the body back without a pause: look at it on a timer

    @property
    def blocked(self) -> bool:
        """The client is what holds the body back now."""

    @property
    def last_activity(self) -> float:
        """The latest read of the body (``perf_counter`` seconds), or progress of a write the client held."""

    def resume(self) -> None:
        """The client drained: read the upstream again."""

    def settled(self) -> bool:
        """Before the loop ends the exchange itself: True when the relay had already ended the body (its
        report then delivered now, and it stands)."""

    def stop(self) -> None:
        """Relay no more (idempotent); the reads it kept go to the recorder."""


class PythonRelay:
    """A body relayed on the event loop, one ``on_read`` per read of the upstream's socket."""

    __slots__ = ("framing", "high", "last_activity", "mode", "out", "paused", "recorder", "report", "upstream")
    watches_client = True  # the kernel may hold bytes for a client that takes none, unpaused (sockets.owed)

    def __init__(self, report: RelayReport, upstream: asyncio.Transport | None, out: asyncio.Transport,
                 framing, mode: int, recorder: Recorder | None) -> None:
        self.report = report
        self.upstream = upstream
        self.out = out
        self.framing = framing
        self.mode = mode
        self.recorder = recorder
        limits = out.get_write_buffer_limits() if hasattr(out, "get_write_buffer_limits") else (0, 65536)
        self.high = max(limits[1], 1)
        self.paused = False
        self.last_activity = clock()

    def on_read(self, data: bytes, t_read: float) -> None:
        """The forwarding path of one read. Keep it short."""
        self.last_activity = t_read
        try:
            end = self.framing.feed(data)
        except FramingError as exc:
            self.report.relay_ended(TRUNCATED, f"malformed chunked framing from the upstream ({exc})")
            return
        past_end = end >= 0 and end != len(data)
        if past_end:
            data = data[:end]
        out = self.out
        if out.is_closing():
            self.report.relay_ended(CLIENT_GONE, "client disconnected", past_end)
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
        recorder = self.recorder
        if recorder is not None:
            recorder.on_bytes(data, t_read, t_written)
        if end >= 0:
            self.report.relay_ended(OK, None, past_end)
        elif out.get_write_buffer_size() > self.high:
            self._pause()

    def _pause(self) -> None:
        """The client is not reading as fast as the upstream sends: stop reading the upstream (the kernel's
        buffers then push back on it) until the handler has seen the client drain."""
        if self.upstream is not None:
            self.upstream.pause_reading()
        self.paused = True
        self.report.client_slow()

    @property
    def blocked(self) -> bool:
        return self.paused

    def resume(self) -> None:
        self.paused = False
        self.last_activity = clock()
        if self.upstream is not None and not self.upstream.is_closing():
            self.upstream.resume_reading()

    def settled(self) -> bool:
        return False  # every end of this relay is reported as it happens, on the loop

    def stop(self) -> None:
        self.recorder = None
