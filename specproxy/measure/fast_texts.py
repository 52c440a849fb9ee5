"""The fast parse of a streamed response: the same ``Texts`` as ``texts.stream_texts_reference``.

It exists because the reference alone would cost about half the proxy's whole CPU budget per chunk
(docs/performance.md, "Design figures"). Its rule: no Python step per byte, and none per event for
the events that make up almost all of a stream; those are read by C calls over many events at once.

* Framing: the reads are joined once and split into lines with ``bytes.split`` when, and only when,
  the stream has the common shape (LF line ends, every event one ``data: `` line); anything else (CR,
  comments, ``event:``/``id:`` fields, multi-line data) goes to the reference for the whole stream. An
  event is timed by the read holding its last byte (the blank line's LF), found by bisecting the reads'
  cumulative end offsets: the same read the SSE decoder reports.
* Templates: most chunks of a stream differ only in their content string (and often a timestamp); a run
  of them is read window by window by a template proved on one chunk (``chunk_templates``).
* Every other event (the first ones, the last ones, another shape) is parsed with orjson: the common
  chunk shape (one choice whose delta holds only role/content) is read inline, any other by
  ``read_chunk``. Text is gathered in lists and joined once. A chunk with a tool call is never of the
  common shape nor a template's (its delta holds ``tool_calls``), so ``read_chunk`` reads every one:
  the names of the tools called (``Texts.calls``) cost nothing on the chunks that have none.

With ``specproxy.frames._scanc`` built (``_stream_texts_c``, what ships), the same reading walks the joined
payload by positions instead of splitting it into lines, and a template's run is one C call
(``_scanc.template_run``) that checks each event's bytes, decodes its JSON string and joins the text: no
object per event. Events outside runs are read by the same ``_Gather`` in both paths. Without the C
module (no compiler at install, or ``c_scans=False``: Config ``scan = "python"``, which the proxy gives
each ``RecordBuilder``) the Python fast path runs. The choice is an argument, not a module setting, so
that two proxies in one process with different Configs each scan as their own says.

``tests/unit/test_measure_fast.py`` checks both fast paths against the reference on random streams and random
read splits, and that they parse and look at no more than they need to; ``tests/unit/test_scanc.py`` checks
that ``template_run`` takes exactly the strings orjson reads.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

import orjson

from specproxy.frames.chunked import _scanc  # the per-chunk scans in C; None when not built (the Python paths below)
from specproxy.measure.chunk_templates import _Template, _content_template
from specproxy.measure.openai import read_chunk
from specproxy.measure.texts import Texts, _take_accounting, stream_texts_reference

C_BUILT = _scanc is not None

__all__ = ["C_BUILT", "stream_texts", "stream_texts_joined"]


_ROLE_CONTENT = frozenset(("role", "content"))
_UNSET = object()
# a run is read in windows of events that double while it lasts, the first twice as long as the last
# run, within these bounds: a usual turn's run costs one call, a run that breaks
# early costs its window once, and a shape that keeps breaking runs short (two choices taking turns)
# costs little per run
_WINDOWS = (4, 256)
_PAYING_RUN = 4  # a run this long repays a derivation: only such a run refills the derivations left
_TRAILING = 16  # at most this many events at the end of a stream are looked at to end runs before them


def stream_texts(reads: list[bytes], times: list[float], *, c_scans: bool = True) -> Texts:
    """The same Texts as ``stream_texts_reference``, fast for the common stream shape. ``c_scans``: with
    the C scans where built (Config ``scan = "c"``), else the Python ones."""
    texts = _stream_texts_fast(reads, times, c_scans=c_scans)
    return texts if texts is not None else stream_texts_reference(reads, times)


def stream_texts_joined(buf: bytes, ends: list[int], times: list[float], *, c_scans: bool = True) -> Texts:
    """``stream_texts`` of the reads whose payloads are ``buf``, read i ending at ``ends[i]``
    (``_scanc.join_frames``): no list of reads is made unless the reference has to decide."""
    texts = _stream_texts_c(buf, ends, times) if c_scans and C_BUILT else None
    if texts is None:
        reads = list(map(buf.__getitem__, map(slice, [0, *ends[:-1]], ends)))
        texts = stream_texts_reference(reads, times)  # the Python fast path would refuse them too
    return texts


def _stream_texts_fast(reads: list[bytes], times: list[float], *, c_scans: bool = True) -> Texts | None:
    """``None`` when the stream is not LF-only single-``data: ``-line events (the reference decides).
    ``c_scans``: as in ``stream_texts``."""
    nreads = len(reads)
    if len(times) < nreads:
        return None
    if c_scans and C_BUILT:
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
                    _tick_run(g.acc, tmpl, buf, cum, times, pos, size, count, nonempty)
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
                    _tick_run(g.acc, tmpl, buf, cum, times, pos, size, count, nonempty)
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


def _tick_run(acc: Texts, tmpl: _Template, buf: bytes, cum: list[int], times: list[float], pos: int, size: int,
              count: int, nonempty: int) -> None:
    """Time the text-carrying chunks of a template's run (``buf[pos:pos + size]``, ``count`` events):
    each by the read holding its blank line's LF, as every other event. When all carry text (the usual
    run) the events ending in each read are counted with one ``bytes.count`` per read, not one step per
    event (an event's JSON line holds no raw LF, so its end is the only ``\n\n``); a run with empty
    contents is walked event by event (the events whose body is empty carry no text)."""
    end = pos + size
    if nonempty == count:
        r = bisect_right(cum, pos)
        while True:
            lo = cum[r - 1] - 1 if r else 0  # an end whose first LF closes the previous read is this read's
            n = buf.count(b"\n\n", lo if lo > pos else pos, min(end, cum[r]))
            if n:
                acc.tick(times[r], n)
            if cum[r] >= end:
                return
            r += 1
    fixed = len(tmpl.head) + tmpl.dlen + len(tmpl.closing)  # an event's bytes after its body, before its LF
    plen = tmpl.plen
    while pos < end:
        lf = buf.find(b"\n", pos)
        if lf - fixed - pos - plen > 0:
            acc.tick(times[bisect_right(cum, lf + 1)])
        pos = lf + 2


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
        if acc.t_first_event is None:
            acc.t_first_event = t
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
                            acc.tick(t)
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
            acc.tick(t)
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
