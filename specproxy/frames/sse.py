"""A sans-I/O decoder for server-sent events.

Why sans-I/O: the proxy forwards bytes first and measures afterwards, so the decoder must accept the
bytes exactly as they were read from the socket, in any split (one byte a read, an event split inside
a UTF-8 character, many events in one read) and tell, for every event, which read completed it. That
read's monotonic timestamp is when the event reached the proxy.

It follows the WHATWG event-stream rules: lines end in CRLF, LF or CR; a line starting with ``:`` is a
comment (``: ping``); ``data:`` lines of one event are joined with ``\\n``; a blank line dispatches the
event. Unlike a browser, ``finish()`` also returns an event left without its closing blank line, since a
measuring tool would rather count a final token a sloppy server sent than drop it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Event", "SSEDecoder"]


@dataclass(frozen=True, slots=True)
class Event:
    """One dispatched event.

    ``read_index`` is the index of the ``feed`` call whose bytes completed the event (the read in which
    its terminating blank line arrived). ``data`` is the joined ``data:`` lines, decoded as UTF-8 with
    replacement (a server that sends invalid UTF-8 still gets measured).
    """

    data: str
    event: str
    read_index: int


class SSEDecoder:
    """Feed it reads in order; it returns the events each read completed."""

    __slots__ = ("_buf", "_data", "_event", "_has_data", "_parts", "_reads", "_skip_lf")

    def __init__(self) -> None:
        self._buf = b""  # bytes of an unfinished line
        self._parts: list[bytes] = []  # later reads of that line, not yet joined
        self._data: list[bytes] = []
        self._event = b""
        self._has_data = False
        self._reads = -1
        self._skip_lf = False  # the previous read ended in CR: a leading LF belongs to that CRLF

    def feed(self, chunk: bytes) -> list[Event]:
        """Decode one read; return the events completed by it (often none, sometimes many)."""
        self._reads += 1
        if not chunk:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\n" not in chunk and b"\r" not in chunk:
            self._parts.append(chunk)  # the line goes on: join once it ends (linear, not quadratic)
            return []
        if self._parts:
            self._parts.append(chunk)
            chunk = b"".join(self._parts)
            self._parts = []
        buf = self._buf + chunk if self._buf else chunk
        events: list[Event] = []
        start = 0
        n = len(buf)
        while start < n:
            # find the next line terminator (CR, LF or CRLF)
            lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start, lf if lf != -1 else n)
            if cr != -1:
                end = cr
                if cr + 1 < n:
                    nxt = cr + 2 if buf[cr + 1 : cr + 2] == b"\n" else cr + 1
                else:
                    nxt = cr + 1
                    self._skip_lf = True  # a LF may follow in the next read
            elif lf != -1:
                end, nxt = lf, lf + 1
            else:
                break
            self._line(buf[start:end], events)
            start = nxt
        self._buf = buf[start:]
        return events

    def finish(self) -> list[Event]:
        """The stream ended: dispatch what is pending (an unterminated last line or event)."""
        events: list[Event] = []
        if self._parts:
            self._buf += b"".join(self._parts)
            self._parts = []
        if self._buf:
            self._line(self._buf, events)
            self._buf = b""
        if self._has_data:
            self._dispatch(events)
        return events

    def _line(self, line: bytes, events: list[Event]) -> None:
        if not line:
            if self._has_data:
                self._dispatch(events)
            else:
                self._event = b""
            return
        if line[:1] == b":":
            return  # comment, e.g. ": ping"
        colon = line.find(b":")
        if colon == -1:
            field, value = line, b""
        else:
            field = line[:colon]
            value = line[colon + 1 :]
            if value[:1] == b" ":
                value = value[1:]
        if field == b"data":
            self._data.append(value)
            self._has_data = True
        elif field == b"event":
            self._event = value
        # "id" and "retry" do not matter for measuring; unknown fields are ignored as the spec says

    def _dispatch(self, events: list[Event]) -> None:
        data = b"\n".join(self._data).decode("utf-8", "replace")
        events.append(Event(data, self._event.decode("utf-8", "replace"), self._reads))
        self._data = []
        self._event = b""
        self._has_data = False
