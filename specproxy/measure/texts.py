"""What a response delivered: text per (choice, kind) and when each piece arrived, from the reads.

Here are ``Texts`` (what is gathered), the reference parse of a stream and the reading of a
non-streamed body. ``stream_texts_reference`` is the obviously-correct parse (the WHATWG SSE decoder,
then an API's event reader per event), and the path without a compiler; the chat stream has a native
reader too (``fast_texts.read_chat_stream``), which must give identical ``Texts`` and exists because
the reference alone would cost about half the proxy's whole CPU budget per chunk (docs/performance.md,
"Design figures"). Which reads a turn is ``Api.read_stream``'s choice (``apis.py``). What an event says
besides its text (usage, timings, finish reason, ``[DONE]``, an error) is taken by one rule,
``take_accounting``, for every path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from specproxy.measure.json_keys import sole_key
from specproxy.measure.openai import parse_json, read_chunk, read_full_response
from specproxy.frames.sse import SSEDecoder

__all__ = ["Texts", "body_accounting", "body_texts", "stream_texts_reference", "take_accounting"]


@dataclass(slots=True)
class Texts:
    """Delivered text per (choice, kind), with when it arrived, gathered from the response."""

    texts: dict[tuple[int, str], str] = field(default_factory=dict)
    first_lens: dict[tuple[int, str], int] = field(default_factory=dict)  # chars after the first chunk
    chunks: int = 0
    t_first: float | None = None
    t_last: float | None = None
    usage: dict | None = None
    timings: dict | None = None
    finish_reason: str | None = None
    saw_done: bool | None = None
    bad_events: int = 0
    error: str | None = None  # an error event's type (Messages, Responses)
    unreadable: str | None = None  # why the body could not be read: its figures are unknown, not zero
    unparsed: bool = False  # a whole body too large to parse: its text is unknown, not empty (body_accounting)
    calls: list[str] = field(default_factory=list)  # the distinct tools the output called, first call first
    t_first_event: float | None = None  # the first event with data (any: a role-only chunk too), streamed
    # when the stream's chunks arrived, a chunk being any event with data (the one meaning of both
    # per-chunk metrics; measure/chunk_gaps.py): chunk_counts[i] of them completed at chunk_times[i]
    # (times distinct and increasing; chunk_gaps buckets their gaps), or, read with the C scans, their
    # gaps bucketed already (``gap_buckets``' result; the lists left empty). Not compared: the paths
    # keep them in different forms; tests compare what ``build_record`` makes of them (StreamTiming).
    chunk_times: list[float] = field(default_factory=list, compare=False)
    chunk_counts: list[int] = field(default_factory=list, compare=False)
    gaps: tuple[tuple[int, ...], float] | None = field(default=None, compare=False)

    def first_text(self, t: float, first_lens: dict[tuple[int, str], int]) -> None:
        """The first event carrying output text arrived, completed by the read timed ``t``: the one
        place ``t_first`` is set (TTFT is ``t_first - t_request``, in ``build._derive``).
        ``first_lens``: that event's characters per (choice, kind), so tokens map to the first chunk."""
        self.t_first = t
        self.first_lens = first_lens

    def tick(self, t: float, n: int = 1) -> None:
        """``n`` events with data completed by the read timed ``t`` (the one rule for every path)."""
        times = self.chunk_times
        if times and times[-1] == t:
            self.chunk_counts[-1] += n
        else:
            times.append(t)
            self.chunk_counts.append(n)

    def add(self, delta_texts: dict[tuple[int, str], str], t: float) -> None:
        if not delta_texts:
            return
        for key, text in delta_texts.items():
            self.texts[key] = self.texts.get(key, "") + text
        self.chunks += 1
        if self.t_first is None:
            self.first_text(t, {k: len(v) for k, v in self.texts.items()})
        self.t_last = t


def stream_texts_reference(reads: Iterable[bytes], times: list[float], read=read_chunk) -> Texts:
    """The reference parse: the SSE decoder, then ``read`` (an API's event reader) for every event, each
    event read as soon as it is decoded (``reads`` may be produced lazily: nothing of the stream is held
    twice)."""
    texts = Texts(saw_done=False)
    decoder = SSEDecoder()
    for data in reads:
        for ev in decoder.feed(data):
            _stream_event(texts, ev, times, read)
    for ev in decoder.finish():
        _stream_event(texts, ev, times, read)
    return texts


def _stream_event(texts: Texts, ev, times: list[float], read) -> None:
    data = ev.data
    if not data:
        return
    t = times[min(ev.read_index, len(times) - 1)]
    if texts.t_first_event is None:  # the first chunk, whatever it carries ([DONE] too)
        texts.t_first_event = t
    texts.tick(t)  # every event with data is a chunk the client received ([DONE] too)
    if data.strip() == "[DONE]":
        texts.saw_done = True
        return
    try:
        delta = read(parse_json(data))
    except (ValueError, RecursionError):
        texts.bad_events += 1
        return
    texts.add(delta.texts, t)
    take_accounting(texts, delta)


def body_texts(body: bytes, times: list[float], read=read_full_response) -> Texts:
    """A non-streamed body (its payload, framing and encoding removed), read by ``read`` (an API's body
    reader); ``times``: its reads' (none: nothing of it was kept)."""
    texts = Texts()
    if not times:
        return texts
    try:
        delta = read(parse_json(body))
    except (ValueError, RecursionError):
        texts.unreadable = "response body was not JSON"
        return texts
    texts.add(delta.texts, times[-1])  # a non-streamed answer is usable only once it is whole
    take_accounting(texts, delta)
    return texts


def body_accounting(body: bytes, times: list[float]) -> Texts:
    """A non-streamed body too large to parse (over ``max_counted_bytes``: a JSON parser copies the body
    and makes its text beside it, about three times its size at once): its text is left unread, the
    answer arrived with its last read, and the server's ``usage`` and ``timings`` objects are read by a
    byte search for their one key each (``object_of_key``)."""
    texts = Texts(unparsed=True)
    if not times:
        return texts
    texts.t_first = texts.t_last = times[-1]  # a non-streamed answer is usable only once it is whole
    usage = object_of_key(body, b"usage")
    texts.usage = usage
    texts.timings = object_of_key(body, b"timings")
    return texts


_KEY = re.compile(rb'"(usage|timings)"\s*:\s*\{')


def object_of_key(body: bytes, key: bytes) -> dict | None:
    """The JSON object that is the value of the body's one ``key``, found without parsing the body: None
    when there is none, more than one, or it is not a small well-formed object. (In valid JSON, a quote
    not escaped by a backslash delimits a string: ``"key":{`` outside an escape is a key and its value.)"""
    m = sole_key(body, (k for k in _KEY.finditer(body) if k.group(1) == key))
    if m is None:
        return None
    found = m.end() - 1
    end = _object_end(body, found)
    try:
        value = parse_json(body[found:end]) if end is not None else None
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _object_end(body: bytes, start: int, limit: int = 1 << 16) -> int | None:
    """Past the ``}`` closing the object that opens at ``body[start]``, read at most ``limit`` bytes."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, min(len(body), start + limit)):
        c = body[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:
                escaped = True
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def take_accounting(texts: Texts, delta) -> None:
    """What one event says besides its text (usage, timings, finish reason, ``[DONE]``, an error, the
    calls it names), into ``texts``: the one rule for every reader of a stream, native or not."""
    if delta.usage is not None:
        texts.usage = delta.usage  # servers may send usage cumulatively: the last one wins
    if delta.timings is not None:
        texts.timings = delta.timings
    if delta.finish_reason is not None:
        texts.finish_reason = delta.finish_reason
    if delta.done:
        texts.saw_done = True
    if delta.error is not None:
        texts.error = delta.error
    if delta.calls:  # which events name a call is the API reader's rule; here only: distinct, in order
        for name in delta.calls:
            if name not in texts.calls:
                texts.calls.append(name)
