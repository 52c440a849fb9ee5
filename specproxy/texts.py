"""What a response delivered: text per (choice, kind) and when each piece arrived, from the reads.

Two paths for a streamed response that must give identical ``Texts``. ``stream_texts_reference`` is the
obviously-correct one (the WHATWG SSE decoder, then ``openai.read_chunk`` per event). ``stream_texts``
is the one the measuring uses; it exists because the reference costs ~8.5 µs per chunk in Python and
the proxy's whole CPU budget is ~13 µs per chunk. It does the per-byte work in C: it joins the reads
once and splits them on blank lines with ``bytes.split`` when, and only when, the stream has the common
shape (LF line ends, every event one ``data: `` line); anything else (CR, comments, ``event:``/``id:``
fields, multi-line data) goes to the reference for the whole stream. An event is timed by the read
holding its last byte (the blank line's LF), found by bisecting the reads' cumulative end offsets: the
same read the SSE decoder reports. Per event it reads the common chunk shape (one choice whose delta
holds only role/content) inline and hands every other shape to ``read_chunk``; text is gathered in
lists and joined once.

Most chunks of a stream differ only in their content string (and often a timestamp): after proving
that on one chunk (``_content_template``, ``_varying_number``), the following chunks of that shape are
read by slicing, without a JSON parse. ``tests/test_measure_fast.py`` checks the two paths against each
other on random streams and random read splits.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import add

import orjson

from .openai import parse_json, read_chunk, read_full_response
from .sse import SSEDecoder

__all__ = ["MAX_VARYING_DIGITS", "Texts", "body_texts", "stream_texts", "stream_texts_reference"]


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

    def add(self, delta_texts: dict[tuple[int, str], str], t: float) -> None:
        if not delta_texts:
            return
        for key, text in delta_texts.items():
            self.texts[key] = self.texts.get(key, "") + text
        self.chunks += 1
        if self.t_first is None:
            self.t_first = t
            self.first_lens = {k: len(v) for k, v in self.texts.items()}
        self.t_last = t



_ROLE_CONTENT = frozenset(("role", "content"))
_UNSET = object()
_CONTENT_KEY = re.compile(rb'(?<!\\)"content"[ \t]*:[ \t]*"')


def _content_template(seg: bytes, obj: dict, content: str) -> tuple[bytes, bytes, bytes, bytes | None] | None:
    """Cut a plain content event into the bytes before and after its content string, if provably safe.

    ``seg`` is ``data: `` + JSON that parsed to ``obj``, a chunk whose only text is ``content`` in its
    one choice's delta (checked by the caller). If the content is written raw in ``seg`` (no escapes),
    then any event ``prefix + body + suffix`` whose ``body`` holds no ``"``, no backslash and decodes
    to printable text (so no control character) is the same JSON token stream with another string token in that one place:
    valid, and equal to ``obj`` but for that string's value, which is ``body`` decoded (with
    replacement characters, as the SSE decoder decodes). Which value that string is, is proved by
    parsing once with a different body: the delta's content must change to it and nothing else may
    (a duplicate key, or a ``"content"`` key elsewhere in the chunk, fails this and gives no template).

    Returns ``(prefix, suffix, head, tail)``: events matching ``prefix + body + suffix`` exactly, and,
    when ``tail`` is not None, also ``prefix + body + head + digits + tail`` (see ``_varying_number``).
    """
    if '"' in content or "\\" in content:
        return None
    raw = content.encode()
    for m in _CONTENT_KEY.finditer(seg):
        start = m.end()
        end = start + len(raw)
        if seg[start:end] == raw and seg[end : end + 1] == b'"':
            break
    else:
        return None
    prefix, suffix = seg[:start], seg[end:]
    probe = "p" if content != "p" else "q"
    try:
        other = orjson.loads(prefix[6:] + probe.encode() + suffix)
        delta = other["choices"][0]["delta"]
        if delta.get("content") != probe:
            return None
        delta["content"] = content
    except (ValueError, LookupError, TypeError, AttributeError):
        return None
    if other != obj:
        return None
    head, tail = _varying_number(prefix[6:] + raw, suffix, obj)
    return prefix, suffix, head, tail


# the chunk fields the measuring reads (openai.read_chunk): a digit run anywhere else cannot change a Record
_READ_KEYS = frozenset(("choices", "usage", "timings"))
_DIGIT_RUN = re.compile(rb"[0-9]+")
MAX_VARYING_DIGITS = 19  # an int64, e.g. a nanosecond timestamp


def _varying_number(json_head: bytes, suffix: bytes, obj: dict) -> tuple[bytes, bytes | None]:
    """Split ``suffix`` around its last run of digits that only a field the measuring never reads holds
    (a timestamp like ``created`` or a benchmark's send time, which change from chunk to chunk), or
    return ``(suffix, None)``.

    Proved like the content: the event parsed with other digits there must equal ``obj`` but for one
    top-level key outside ``_READ_KEYS`` (or not differ at all). Any digit string of the allowed shape
    (at most ``MAX_VARYING_DIGITS``, no leading zero) sits in the same JSON token, so the same proof
    holds for every such event; a shape that might not parse (a leading zero) is left to orjson."""
    for m in reversed(list(_DIGIT_RUN.finditer(suffix))):
        start, end = m.span()
        if end - start > MAX_VARYING_DIGITS:
            continue
        probe = suffix[:start] + b"7" * (end - start) + suffix[end:]
        try:
            other = orjson.loads(json_head + probe)
        except ValueError:
            continue
        if type(other) is not dict or other.keys() != obj.keys():
            continue
        differ = [k for k in obj if other[k] != obj[k]]
        if len(differ) <= 1 and not (set(differ) & _READ_KEYS):
            return suffix[:start], suffix[end:]
    return suffix, None


def stream_texts(reads: list[bytes], times: list[float]) -> Texts:
    """The same Texts as ``stream_texts_reference``, fast for the common stream shape."""
    texts = _stream_texts_fast(reads, times)
    return texts if texts is not None else stream_texts_reference(reads, times)


def _stream_texts_fast(reads: list[bytes], times: list[float]) -> Texts | None:
    """``None`` when the stream is not LF-only single-``data: ``-line events (the reference decides)."""
    nreads = len(reads)
    if len(times) < nreads:
        return None
    buf = b"".join(reads)
    if b"\r" in buf:
        return None
    # LF-only events of one line each: the lines are event, "", event, "", ..., tail (the bytes after
    # the last blank line, b"" when the stream ended on an event boundary); every event "data: ..."
    lines = buf.split(b"\n")
    if not len(lines) & 1 or any(lines[1::2]):
        return None
    segs = lines[0::2]
    tail = segs.pop()
    if not all(map(bytes.startswith, segs, repeat(b"data: "))) or (tail and not tail.startswith(b"data: ")):
        return None
    # each event's time: the read holding its blank line's LF (offset = running sum of len + 2, less
    # one), found by bisecting the reads' running end offsets; all of it in C, no per-event frame
    cum = list(accumulate(map(len, reads)))  # read i holds buf[cum[i-1]:cum[i]]
    lfs = map(add, accumulate(map(len, segs)), range(1, 2 * len(segs), 2))
    ev_times = list(map(times.__getitem__, map(bisect_right, repeat(cum), lfs)))
    if tail:
        segs.append(tail)  # the SSE decoder's finish() dispatches it, timed by the last read
        ev_times.append(times[nreads - 1])
    texts = Texts(saw_done=False)
    parts: dict[tuple[int, str], list[str]] = {}
    chunks = 0
    t_first = t_last = None
    first_lens: dict[tuple[int, str], int] = {}
    cur_idx: object = _UNSET  # the choice index of the last inline content, and its list in parts
    cur: list[str] = []
    loads = orjson.loads
    # the template of a plain content chunk (see _content_template): prefix, suffix, their length
    tprefix = tsuffix = b"\xff"  # no template yet: every event starts with "data: ", so no match
    thead = b""  # with a varying number (see _varying_number): the suffix before it...
    ttail: bytes | None = None  # ...and after it
    plen = slen = tmin = hlen = tlen = 1
    tlist: list[str] = []  # the text list of the template's choice
    derive = 3  # template derivations left: a hit refills them, so a varying chunk is not re-derived forever
    for seg, t in zip(segs, ev_times):
        body = None
        if seg.startswith(tprefix):
            if seg.endswith(tsuffix) and len(seg) >= tmin:
                body = seg[plen:-slen]
            elif ttail is not None and seg.endswith(ttail):
                # prefix, body, the suffix up to the number, digits, the rest: the body holds no quote,
                # so the first one after it closes the content string
                q = seg.find(b'"', plen)
                if q >= 0 and seg.startswith(thead, q):
                    digits = seg[q + hlen : len(seg) - tlen]
                    if digits.isdigit() and len(digits) <= MAX_VARYING_DIGITS and (len(digits) == 1 or digits[0] != 48):
                        body = seg[plen:q]
        if body is not None:
            if b'"' not in body and b"\\" not in body:
                content = body.decode("utf-8", "replace")
                if content.isprintable():  # no control character: they are never raw in JSON strings
                    # the event is the template with another escape-free string as delta.content
                    derive = 3
                    if content:
                        tlist.append(content)
                        chunks += 1
                        t_last = t  # a template exists only after a chunk with text: t_first is set
                    continue
        payload = seg[6:]
        if not payload:
            continue
        if b"[DONE]" in payload and payload.decode("utf-8", "replace").strip() == "[DONE]":
            texts.saw_done = True  # str.strip(), as the reference: Unicode whitespace counts
            continue
        try:
            obj = loads(payload)
        except ValueError:
            try:  # invalid UTF-8: the reference parses the text decoded with replacement characters
                obj = loads(payload.decode("utf-8", "replace"))
            except (ValueError, RecursionError):
                texts.bad_events += 1
                continue
        except RecursionError:
            texts.bad_events += 1
            continue
        if type(obj) is dict:
            choices = obj.get("choices")
            if type(choices) is list and len(choices) == 1 and obj.get("usage") is None and obj.get("timings") is None:
                ch = choices[0]
                if type(ch) is dict:
                    d = ch.get("delta")
                    if type(d) is dict and d.keys() <= _ROLE_CONTENT and ch.get("text") is None:
                        # the common chunk: read_chunk would find exactly this
                        fr = ch.get("finish_reason")
                        if fr:
                            texts.finish_reason = str(fr)
                        content = d.get("content")
                        if type(content) is str and content:
                            idx = ch.get("index", 0)
                            if idx is not cur_idx:
                                if not isinstance(idx, int):
                                    idx = 0
                                key = (idx, "content")
                                lst = parts.get(key)
                                if lst is None:
                                    lst = parts[key] = []
                                cur_idx, cur = idx, lst
                            cur.append(content)
                            chunks += 1
                            if t_first is None:
                                t_first = t
                                first_lens = {(idx, "content"): len(content)}
                            t_last = t
                            if derive and not fr:
                                derive -= 1
                                tmpl = _content_template(seg, obj, content)
                                if tmpl is not None:
                                    tprefix, tsuffix, thead, ttail = tmpl
                                    plen, slen = len(tprefix), len(tsuffix)  # slen >= 1: it starts with '"'
                                    tmin = plen + slen
                                    hlen = len(thead)
                                    tlen = len(ttail) if ttail is not None else 0
                                    tlist = cur
                        continue
        delta = read_chunk(obj)
        dt = delta.texts
        if dt:
            for key, text in dt.items():
                lst = parts.get(key)
                if lst is None:
                    parts[key] = [text]
                else:
                    lst.append(text)
            chunks += 1
            if t_first is None:
                t_first = t
                first_lens = {k: len(v) for k, v in dt.items()}
            t_last = t
        _take_accounting(texts, delta)
    texts.texts = {key: "".join(lst) for key, lst in parts.items()}
    texts.first_lens = first_lens
    texts.chunks = chunks
    texts.t_first = t_first
    texts.t_last = t_last
    return texts


def stream_texts_reference(reads: list[bytes], times: list[float]) -> Texts:
    """The reference parse: the SSE decoder, then ``read_chunk`` for every event."""
    texts = Texts(saw_done=False)
    decoder = SSEDecoder()
    events = []
    for data in reads:
        events.extend(decoder.feed(data))
    events.extend(decoder.finish())
    for ev in events:
        data = ev.data
        if data.strip() == "[DONE]":
            texts.saw_done = True
            continue
        if not data:
            continue
        try:
            delta = read_chunk(parse_json(data))
        except (ValueError, RecursionError):
            texts.bad_events += 1
            continue
        texts.add(delta.texts, times[min(ev.read_index, len(times) - 1)])
        _take_accounting(texts, delta)
    return texts


def body_texts(reads: list[bytes], times: list[float]) -> Texts:
    texts = Texts()
    if not reads:
        return texts
    try:
        delta = read_full_response(parse_json(b"".join(reads)))
    except (ValueError, RecursionError):
        return texts
    texts.add(delta.texts, times[-1])  # a non-streamed answer is usable only once it is whole
    _take_accounting(texts, delta)
    return texts


def _take_accounting(texts: Texts, delta) -> None:
    if delta.usage is not None:
        texts.usage = delta.usage  # servers may send usage cumulatively: the last one wins
    if delta.timings is not None:
        texts.timings = delta.timings
    if delta.finish_reason is not None:
        texts.finish_reason = delta.finish_reason
