"""What a response delivered: text per (choice, kind) and when each piece arrived, from the reads.

Two paths for a streamed response that must give identical ``Texts``. ``stream_texts_reference`` is the
obviously-correct one (the WHATWG SSE decoder, then ``openai.read_chunk`` per event). ``stream_texts``
is the one the measuring uses; it exists because the reference alone would cost about half the proxy's
whole CPU budget per chunk (docs/performance.md, "Design figures"). Its rule: no Python step per byte, and none per event for
the events that make up almost all of a stream; those are read by C calls over many events at once.

* Framing: the reads are joined once and split into lines with ``bytes.split`` when, and only when,
  the stream has the common shape (LF line ends, every event one ``data: `` line); anything else (CR,
  comments, ``event:``/``id:`` fields, multi-line data) goes to the reference for the whole stream. An
  event is timed by the read holding its last byte (the blank line's LF), found by bisecting the reads'
  cumulative end offsets: the same read the SSE decoder reports.
* Templates: most chunks of a stream differ only in their content string (and often a timestamp).
  Once that is proved on one chunk (``_content_template``, ``_varying_number``), a run of the chunks
  that follow is read window by window (``_Template.run``): their bodies are sliced at fixed offsets,
  the template's constant bytes joined between them and the result compared with the buffer at once,
  the bodies checked and decoded joined (bodies with escapes: parsed by orjson as one JSON array). No
  regular expression holds a template's bytes: compiling one costs more than the whole turn, and the
  chunk id differs every turn.
* Every other event (the first ones, the last ones, another shape) is parsed with orjson: the common
  chunk shape (one choice whose delta holds only role/content) is read inline, any other by
  ``read_chunk``. Text is gathered in lists and joined once. A chunk with a tool call is never of the
  common shape nor a template's (its delta holds ``tool_calls``), so ``read_chunk`` reads every one:
  the names of the tools called (``Texts.calls``) cost nothing on the chunks that have none.

With ``specproxy.frames._scanc`` built (``_stream_texts_c``, what ships), the same reading walks the joined
payload by positions instead of splitting it into lines, and a template's run is one C call
(``_scanc.template_run``) that checks each event's bytes, decodes its JSON string and joins the text: no
object per event. Events outside runs are read by the same ``_Gather`` in both paths. Without the C
module (no compiler at install, or Config ``scan = "python"``, set by ``use_c_scans`` at start) the
Python fast path runs.

``tests/unit/test_measure_fast.py`` checks both fast paths against the reference on random streams and random
read splits, and that they parse and look at no more than they need to; ``tests/unit/test_scanc.py`` checks
that ``template_run`` takes exactly the strings orjson reads.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import itemgetter

import orjson

from specproxy.frames.chunked import _scanc  # the per-chunk scans in C; None when not built (the Python paths below)
from specproxy.measure.openai import parse_json, read_chunk, read_full_response
from specproxy.frames.sse import SSEDecoder

C_BUILT = _scanc is not None
_use_c = True  # Config's scan, given by use_c_scans() when the service starts


def use_c_scans(on: bool) -> None:
    """Config ``scan``: the C scans (``True``, where built) or the Python ones, from now on."""
    global _use_c
    _use_c = on


def c_scans() -> bool:
    """Whether measuring runs the C scans: built, and not switched off."""
    return C_BUILT and _use_c


__all__ = ["C_BUILT", "MAX_VARYING_DIGITS", "Texts", "body_texts", "c_scans", "use_c_scans", "stream_texts", "stream_texts_joined", "stream_texts_reference"]


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
    calls: list[str] = field(default_factory=list)  # the distinct tools the output called, first call first

    def first_text(self, t: float, first_lens: dict[tuple[int, str], int]) -> None:
        """The first event carrying output text arrived, completed by the read timed ``t``: the one
        place ``t_first`` is set (TTFT is ``t_first - t_request``, in ``RecordBuilder._record``).
        ``first_lens``: that event's characters per (choice, kind), so tokens map to the first chunk."""
        self.t_first = t
        self.first_lens = first_lens

    def add(self, delta_texts: dict[tuple[int, str], str], t: float) -> None:
        if not delta_texts:
            return
        for key, text in delta_texts.items():
            self.texts[key] = self.texts.get(key, "") + text
        self.chunks += 1
        if self.t_first is None:
            self.first_text(t, {k: len(v) for k, v in self.texts.items()})
        self.t_last = t


_ROLE_CONTENT = frozenset(("role", "content"))
_UNSET = object()
# a "content" key and its value's opening quote (a literal first, so the search is fast; a key whose
# opening quote is escaped is skipped by the caller), and the rest of a JSON string up to its closing quote
_CONTENT_KEY = re.compile(rb'"content"[ \t]*:[ \t]*"')
_STRING_REST = re.compile(rb'(?:[^"\\]|\\.)*+')


def _content_template(seg: bytes, obj: dict, content: str, texts: list[str]) -> _Template | None:
    """A template of the events that are ``seg`` but for their content string, if provably safe.

    ``seg`` is ``data: `` + JSON that parsed to ``obj``, a chunk whose only text is ``content`` in its
    one choice's delta (checked by the caller). Cut around that string's raw bytes, ``seg`` is ``prefix +
    raw + suffix``; any event ``prefix + body + suffix`` where ``"body"`` alone is a JSON string is the
    same JSON token stream with another string token in that one place: valid, and equal to ``obj`` but
    for that string's value, which is ``body`` read as a JSON string (decoded with replacement characters
    first, as the SSE decoder decodes). Which value that string is, is proved by parsing once with a
    different body: the delta's content must change to it and nothing else may (a duplicate key, or a
    ``"content"`` key elsewhere in the chunk, fails this and gives no template). ``texts``: the list the
    template's text goes to.
    """
    for m in _CONTENT_KEY.finditer(seg):
        start = m.end()
        if seg[m.start() - 1] == 92:  # the key's opening quote is escaped: it is inside another string
            continue
        end = _STRING_REST.match(seg, start).end()
        try:
            if orjson.loads(seg[start - 1 : end + 1]) == content:
                break
        except ValueError:
            continue
    else:
        return None
    prefix, raw, suffix = seg[:start], seg[start:end], seg[end:]
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
    head, dlen, closing = _varying_number(prefix[6:] + raw, suffix, obj)
    return _Template(prefix, head, dlen, closing, texts)


# the chunk fields the measuring reads (openai.read_chunk): a digit run anywhere else cannot change a Record
_READ_KEYS = frozenset(("choices", "usage", "timings"))
_DIGIT_RUN = re.compile(rb"[0-9]+")
MAX_VARYING_DIGITS = 19  # an int64, e.g. a nanosecond timestamp


def _varying_number(json_head: bytes, suffix: bytes, obj: dict) -> tuple[bytes, int, bytes]:
    """Split ``suffix`` into ``(head, len(digits), tail)`` around its last run of digits that only a field
    the measuring never reads holds (a timestamp like ``created`` or a benchmark's send time, which
    change from chunk to chunk), or return ``(suffix, 0, b"")``.

    Proved like the content: the event parsed with other digits there must equal ``obj`` but for one
    top-level key outside ``_READ_KEYS`` (or not differ at all). Any digit string of the allowed shape
    (at most ``MAX_VARYING_DIGITS``, no leading zero) sits in the same JSON token, so the same proof
    holds for every such event; a shape that might not parse (a leading zero) is left to orjson. The
    template's events have as many digits as this one (a nanosecond or second timestamp keeps its
    length for centuries): the body then ends at a fixed offset from the event's end."""
    for m in reversed(list(_DIGIT_RUN.finditer(suffix))):
        start, end = m.span()
        if end - start > MAX_VARYING_DIGITS or (suffix[start] == 48 and end - start > 1):
            continue  # too long, or not of the shape every event of the template must have
        probe = suffix[:start] + b"7" * (end - start) + suffix[end:]
        try:
            other = orjson.loads(json_head + probe)
        except ValueError:
            continue
        if type(other) is not dict or other.keys() != obj.keys():
            continue
        differ = [k for k in obj if other[k] != obj[k]]
        if len(differ) <= 1 and not (set(differ) & _READ_KEYS):
            return suffix[:start], end - start, suffix[end:]
    return suffix, 0, b""


# the bytes a body written raw (the common case, decoded joined) never holds: a quote, a backslash, a
# control character (LF is left out: bodies are joined with it, and no event line holds one)
_UNSAFE_BYTES = b'"\\' + bytes(range(10)) + bytes(range(11, 32))
_MARK_UNSAFE = bytes.maketrans(_UNSAFE_BYTES, b"\\" * len(_UNSAFE_BYTES))
# varying numbers, each followed by LF: no leading zero (see _varying_number)
_NUMBERS = re.compile(rb"(?:(?:0|[1-9][0-9]*)\n)*")
# a run is read in windows of events that double while it lasts, the first twice as long as the last
# run, within these bounds: a usual turn's run costs one call, a run that breaks
# early costs its window once, and a shape that keeps breaking runs short (two choices taking turns)
# costs little per run
_WINDOWS = (4, 256)
_PAYING_RUN = 4  # a run this long repays a derivation: only such a run refills the derivations left
_TRAILING = 16  # at most this many events at the end of a stream are looked at to end runs before them


class _Template:
    """The events ``prefix + body + head + digits + closing`` of one plain content chunk
    (``_content_template``): ``"body"`` a JSON string and, when the chunk has a varying number, ``dlen``
    digits of the allowed shape between ``head`` and ``closing`` (without one, ``head`` is all the rest).

    ``run`` reads a window of events with a fixed number of C calls, none per byte or event in Python:
    the bodies (and digits) are sliced at fixed offsets, the template's constant bytes are joined
    between them and the result compared with the buffer at once; the bodies are checked for anything
    but raw text at once and decoded joined."""

    __slots__ = ("body", "closing", "digits", "dlen", "end", "glue", "head", "plen", "prefix", "texts")

    def __init__(self, prefix: bytes, head: bytes, dlen: int, closing: bytes, texts: list[str]) -> None:
        self.prefix, self.head, self.dlen, self.closing = prefix, head, dlen, closing
        self.texts = texts  # the text list of the template's choice
        self.plen = len(prefix)
        clen = len(closing)
        self.body = itemgetter(slice(self.plen, -(len(head) + dlen + clen)))  # head starts with a quote
        self.digits = itemgetter(slice(-dlen - clen, -clen or None) if dlen else slice(0, 0))
        self.end = (closing if dlen else head) + b"\n\n"  # an event's bytes after its last variable part
        self.glue = self.end + prefix  # ... and the next event's before its body

    def fits(self, seg: bytes) -> bool:
        """``seg`` has this template's shape (its body and digits are not checked)."""
        return b"".join((self.prefix, self.body(seg), self.head, self.digits(seg), self.closing)) == seg

    def run(self, segs: list[bytes], i: int, j: int, buf: bytes, pos: int) -> tuple[int, int, str, int, int]:
        """How many of ``segs[i:j]`` in a row are this template's events (``segs[i]`` is at ``buf[pos]``):
        ``(count, their bytes with blank lines, their text, how many had text, the bytes up to the end of
        the last one that had)``."""
        window = segs[i:j]
        count = len(window)
        bodies = list(map(self.body, window))
        if self.dlen:
            digits = list(map(self.digits, window))
            pieces = [None, self.head, None, self.glue] * count
            pieces[0::4] = bodies
            pieces[2::4] = digits
            pieces[-1] = self.end
            rebuilt = b"".join(pieces)
            size = self.plen + len(rebuilt)
            same = buf.startswith(rebuilt, pos + self.plen)
        else:
            digits = repeat(b"")
            rebuilt = self.glue.join(bodies)
            size = self.plen + len(rebuilt) + len(self.end)
            same = buf.startswith(rebuilt, pos + self.plen) and buf.startswith(self.end, pos + size - len(self.end))
        # equal bytes prove every cut: the blank lines joined in can only fall on the events' own (no
        # body or digit run holds a LF), so each event is prefix + its body + head + its digits + closing
        if not (same and buf.startswith(self.prefix, pos)):
            # then not all are (or those bytes would be equal): which is the first that is not
            closing = self.closing if self.dlen else b""
            rebuilt_events = map(b"".join, zip(repeat(self.prefix), bodies, repeat(self.head), digits, repeat(closing)))
            alike = list(map(bytes.__eq__, window, rebuilt_events))
            alike.append(False)
            count = alike.index(False)
        if self.dlen and count:
            numbers = b"".join(digits[:count])  # dlen digits each
            if not numbers.isdigit() or (self.dlen > 1 and b"0" in numbers[:: self.dlen]):
                numbers = b"\n".join(digits[:count]) + b"\n"
                count = numbers.count(b"\n", 0, _NUMBERS.match(numbers).end())
        if count < len(window):
            bodies = bodies[:count]
            size = sum(map(len, window[:count])) + 2 * count
        joined = b"\n".join(bodies)
        if len(joined.translate(None, _UNSAFE_BYTES)) == len(joined):
            # LF is ASCII: each body decodes (with replacement) as it would alone
            text = joined.decode("utf-8", "replace").replace("\n", "")
        else:
            text, ok = _escaped_bodies(joined)
            if ok < count:
                count = ok
                bodies = bodies[:count]
                size = sum(map(len, window[:count])) + 2 * count
        nonempty = count - bodies.count(b"")
        if not nonempty or bodies[-1]:
            return count, size, text, nonempty, size if nonempty else 0
        with_text = count - list(map(bool, reversed(bodies))).index(True)  # trailing bodies were empty
        return count, size, text, nonempty, sum(map(len, window[:with_text])) + 2 * with_text


def _escaped_bodies(joined: bytes) -> tuple[str, int]:
    """The text of the bodies ``joined`` with LF, of which some hold an escape, a quote or a control
    character, and how many in a row from the first are JSON strings (their decoded text, as the
    reference parses the decoded event)."""
    # all at once, as the strings of one JSON array, when every quote comes after a backslash: then
    # each string of the array is one body, as one that ends a string early (after an escaped
    # backslash) or a backslash at a body's end would leave the rest outside any string: not JSON
    if b'"' not in joined.replace(b'\\"', b""):
        try:
            values = orjson.loads(b'["' + joined.replace(b"\n", b'","') + b'"]')
            return "".join(values), len(values)
        except ValueError:  # not UTF-8, a control character, a bad escape: see which, one by one
            pass
    values = joined.decode("utf-8", "replace").split("\n")  # each body decoded as alone
    # those with such bytes: split at each one (all made backslashes) and count the LFs before it
    pieces = joined.translate(_MARK_UNSAFE).split(b"\\")
    pieces.pop()
    for k in dict.fromkeys(accumulate(map(bytes.count, pieces, repeat(b"\n")))):
        try:
            values[k] = orjson.loads('"' + values[k] + '"')
        except ValueError:
            return "".join(values[:k]), k
    return "".join(values), len(values)


def stream_texts(reads: list[bytes], times: list[float]) -> Texts:
    """The same Texts as ``stream_texts_reference``, fast for the common stream shape."""
    texts = _stream_texts_fast(reads, times)
    return texts if texts is not None else stream_texts_reference(reads, times)


def stream_texts_joined(buf: bytes, ends: list[int], times: list[float]) -> Texts:
    """``stream_texts`` of the reads whose payloads are ``buf``, read i ending at ``ends[i]``
    (``_scanc.join_frames``): no list of reads is made unless the reference has to decide."""
    texts = _stream_texts_c(buf, ends, times) if c_scans() else None
    if texts is None:
        reads = list(map(buf.__getitem__, map(slice, [0, *ends[:-1]], ends)))
        texts = stream_texts_reference(reads, times)  # the Python fast path would refuse them too
    return texts


def _stream_texts_fast(reads: list[bytes], times: list[float]) -> Texts | None:
    """``None`` when the stream is not LF-only single-``data: ``-line events (the reference decides)."""
    nreads = len(reads)
    if len(times) < nreads:
        return None
    if c_scans():
        return _stream_texts_c(b"".join(reads), list(accumulate(map(len, reads))), times)
    buf = b"".join(reads)
    if b"\r" in buf:
        return None
    # LF-only events of one line each: the lines are event, "", event, "", ..., tail (the bytes after
    # the last blank line, b"" when the stream ended on an event boundary); that every event is one
    # "data: " line is checked as they are read (a run of template events proves it for its events)
    lines = buf.split(b"\n")
    if not len(lines) & 1 or any(lines[1::2]):
        return None
    segs = lines[0::2]
    tail = segs.pop()
    nevents = len(segs)  # events ended by a blank line; the tail, if any, comes after them
    if tail:
        segs.append(tail)  # the SSE decoder's finish() dispatches it, timed by the last read
    # an event is timed by the read holding its blank line's LF: bisect the reads' running end offsets
    cum = list(accumulate(map(len, reads)))  # read i holds buf[cum[i-1]:cum[i]]
    g = _Gather()
    tmpl: _Template | None = None
    stop = 0  # the template's runs end before this event (the trailing ones that cannot be its own)
    last = _WINDOWS[1]  # the length of the last run
    i = pos = 0  # the event, and its offset in buf
    while i < len(segs):
        seg = segs[i]
        if i < stop and tmpl.fits(seg):
            width = min(max(2 * last, _WINDOWS[0]), _WINDOWS[1])
            start = i
            while i < stop:
                count, size, text, nonempty, text_size = tmpl.run(segs, i, min(stop, i + width), buf, pos)
                if text_size:
                    tmpl.texts.append(text)
                    g.chunks += nonempty
                    # (t_first is set: a template is derived from a chunk with text)
                    g.t_last = times[bisect_right(cum, pos + text_size - 1)]
                i += count
                pos += size
                if count < width:
                    break
                width *= 2
            last = i - start
            if last >= _PAYING_RUN:
                g.derive = 3
            if last:
                continue
        t = times[bisect_right(cum, pos + len(seg) + 1)] if i < nevents else times[nreads - 1]
        pos += len(seg) + 2
        i += 1
        if not g.event(seg, t):
            return None
        if g.tmpl is not tmpl:
            tmpl = g.tmpl
            # the last events of a stream (finish, usage, [DONE]) end its runs
            stop = nevents
            while stop > i and stop > nevents - _TRAILING and not segs[stop - 1].startswith(tmpl.prefix):
                stop -= 1
    return g.texts()


def _stream_texts_c(buf: bytes, cum: list[int], times: list[float]) -> Texts | None:
    """``_stream_texts_fast`` over the reads' payloads joined (``cum``: each read's running end offset),
    walking ``buf`` by positions: a template's runs are read by ``_scanc.template_run`` (no line split,
    no object per event), every other event as in the Python path."""
    nreads = len(cum)
    if len(times) < nreads or b"\r" in buf:
        return None
    g = _Gather()
    run = _scanc.template_run
    find = buf.find
    n = len(buf)
    pos = 0
    while pos < n:
        tmpl = g.tmpl
        if tmpl is not None:
            count, size, text, nonempty, text_size = run(buf, pos, tmpl.prefix, tmpl.head, tmpl.dlen, tmpl.closing)
            if count:
                if text_size:
                    tmpl.texts.append(text)
                    g.chunks += nonempty
                    g.t_last = times[bisect_right(cum, pos + text_size - 1)]
                pos += size
                if count >= _PAYING_RUN:
                    g.derive = 3
                continue
        lf = find(b"\n", pos)
        if lf < 0:  # the tail: the SSE decoder's finish() dispatches it, timed by the last read
            seg = buf[pos:]
            t = times[nreads - 1]
            pos = n
        elif lf + 1 < n and buf[lf + 1] == 10:  # an event line and a blank line
            seg = buf[pos:lf]
            t = times[bisect_right(cum, lf + 1)]
            pos = lf + 2
        else:  # lines that are not event, blank, event, blank, ...
            return None
        if not g.event(seg, t):
            return None
    return g.texts()


class _Gather:
    """What the events read one by one add up to, for both fast paths: text in lists per (choice, kind),
    joined once at the end; the common chunk shape read inline, any other by ``read_chunk``; and the
    template derived from a plain content chunk (``tmpl``, at most ``derive`` more derivations)."""

    __slots__ = ("acc", "chunks", "cur", "cur_idx", "derive", "parts", "t_last", "tmpl")

    def __init__(self) -> None:
        self.acc = Texts(saw_done=False)  # t_first, usage, timings, finish_reason, saw_done, bad_events
        self.parts: dict[tuple[int, str], list[str]] = {}
        self.chunks = 0
        self.t_last: float | None = None
        self.cur_idx: object = _UNSET  # the choice index of the last inline content, and its list in parts
        self.cur: list[str] = []
        self.tmpl: _Template | None = None
        self.derive = 3  # template derivations left, so that a shape that keeps changing is not re-derived forever

    def event(self, seg: bytes, t: float) -> bool:
        """Read one event line timed ``t``; False when it is not a ``data: `` line (the reference decides)."""
        if not seg.startswith(b"data: "):
            return False
        payload = seg[6:]
        if not payload:
            return True
        acc = self.acc
        if b"[DONE]" in payload and payload.decode("utf-8", "replace").strip() == "[DONE]":
            acc.saw_done = True  # str.strip(), as the reference: Unicode whitespace counts
            return True
        try:
            obj = orjson.loads(payload)
        except ValueError:
            try:  # invalid UTF-8: the reference parses the text decoded with replacement characters
                obj = orjson.loads(payload.decode("utf-8", "replace"))
            except (ValueError, RecursionError):
                acc.bad_events += 1
                return True
        except RecursionError:
            acc.bad_events += 1
            return True
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
                            acc.finish_reason = str(fr)
                        content = d.get("content")
                        if type(content) is str and content:
                            idx = ch.get("index", 0)
                            if idx is not self.cur_idx:
                                if not isinstance(idx, int):
                                    idx = 0
                                key = (idx, "content")
                                lst = self.parts.get(key)
                                if lst is None:
                                    lst = self.parts[key] = []
                                self.cur_idx, self.cur = idx, lst
                            self.cur.append(content)
                            self.chunks += 1
                            if acc.t_first is None:
                                acc.first_text(t, {(idx, "content"): len(content)})
                            self.t_last = t
                            if self.derive and not fr:
                                self.derive -= 1
                                derived = _content_template(seg, obj, content, self.cur)
                                if derived is not None:
                                    self.tmpl = derived
                        return True
        delta = read_chunk(obj)
        dt = delta.texts
        if dt:
            for key, text in dt.items():
                lst = self.parts.get(key)
                if lst is None:
                    self.parts[key] = [text]
                else:
                    lst.append(text)
            self.chunks += 1
            if acc.t_first is None:
                acc.first_text(t, {k: len(v) for k, v in dt.items()})
            self.t_last = t
        _take_accounting(acc, delta)
        return True

    def texts(self) -> Texts:
        out = self.acc
        out.texts = {key: "".join(lst) for key, lst in self.parts.items()}
        out.chunks = self.chunks
        out.t_last = self.t_last
        return out


def stream_texts_reference(reads: list[bytes], times: list[float], read=read_chunk) -> Texts:
    """The reference parse: the SSE decoder, then ``read`` (an API's event reader) for every event."""
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
            delta = read(parse_json(data))
        except (ValueError, RecursionError):
            texts.bad_events += 1
            continue
        texts.add(delta.texts, times[min(ev.read_index, len(times) - 1)])
        _take_accounting(texts, delta)
    return texts


def body_texts(reads: list[bytes], times: list[float], read=read_full_response) -> Texts:
    """A non-streamed body, read by ``read`` (an API's body reader)."""
    texts = Texts()
    if not reads:
        return texts
    try:
        delta = read(parse_json(b"".join(reads)))
    except (ValueError, RecursionError):
        texts.unreadable = "response body was not JSON"
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
    if delta.done:
        texts.saw_done = True
    if delta.error is not None:
        texts.error = delta.error
    if delta.calls:  # which events name a call is the API reader's rule; here only: distinct, in order
        for name in delta.calls:
            if name not in texts.calls:
                texts.calls.append(name)
