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

* When the chunks arrived (for the per-chunk metrics; a chunk is any event with data, ``[DONE]`` too):
  counted per read once the events are read, from the blank lines that end events in each read, less
  the events with no data (a bare ``data: ``, rare); no step per chunk. With the C scans one call (``_scanc.chunk_gaps``) counts them and buckets the gaps
  between them (``Texts.gaps``); the Python path fills ``Texts.chunk_times`` (``_chunk_clock``, numpy)
  and the builder buckets them (``chunk_gaps.gap_buckets``): the plain reference of the C call.

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
from itertools import accumulate, compress
from operator import eq

import numpy as np
import orjson

from specproxy.frames.chunked import _scanc  # the per-chunk scans in C; None when not built (the Python paths below)
from specproxy.measure.chunk_gaps import GAP_BOUNDS_S
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
    g = _Gather(c_scans=False)
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
        r = bisect_right(cum, pos + len(seg) + 1) if i < nevents else -1
        pos += len(seg) + 2
        i += 1
        if not g.event(seg, times[r] if r >= 0 else times[nreads - 1]):
            return None
        if len(seg) == 6:  # "data: " with no data: no chunk
            if r >= 0:
                g.skip.append(r)
        elif r < 0:
            g.tail_chunk = True
        if g.tmpl is not tmpl:
            tmpl = g.tmpl
            # the last events of a stream (finish, usage, [DONE]) end its runs
            stop = nevents
            while stop > i and stop > nevents - _TRAILING and not segs[stop - 1].startswith(tmpl.prefix):
                stop -= 1
    return g.texts(buf, cum, times)


def _stream_texts_c(buf: bytes, cum: list[int], times: list[float]) -> Texts | None:
    """``_stream_texts_fast`` over the reads' payloads joined (``cum``: each read's running end offset),
    walking ``buf`` by positions: a template's runs are read by ``_scanc.template_run`` (no line split,
    no object per event), every other event as in the Python path."""
    nreads = len(cum)
    if len(times) < nreads or b"\r" in buf:
        return None
    g = _Gather(c_scans=True)
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
            r = -1
            pos = n
        elif lf + 1 < n and buf[lf + 1] == 10:  # an event line and a blank line
            seg = buf[pos:lf]
            r = bisect_right(cum, lf + 1)
            pos = lf + 2
        else:  # lines that are not event, blank, event, blank, ...
            return None
        if not g.event(seg, times[r] if r >= 0 else times[nreads - 1]):
            return None
        if len(seg) == 6:  # "data: " with no data: no chunk
            if r >= 0:
                g.skip.append(r)
        elif r < 0:
            g.tail_chunk = True
    return g.texts(buf, cum, times)


class _Gather:
    """What the events read one by one add up to, for both fast paths: text in lists per (choice, kind),
    joined once at the end; the common chunk shape read inline, any other by ``read_chunk``; and the
    template derived from a plain content chunk (``tmpl``, at most ``derive`` more derivations)."""

    __slots__ = ("acc", "c_scans", "chunks", "cur", "cur_idx", "derive", "parts", "skip", "t_last", "tail_chunk",
                 "tmpl")

    def __init__(self, *, c_scans: bool) -> None:
        self.c_scans = c_scans  # which path reads: the chunks' times are counted by the same (``texts``)
        self.acc = Texts(saw_done=False)  # t_first, usage, timings, finish_reason, saw_done, bad_events
        self.parts: dict[tuple[int, str], list[str]] = {}
        self.chunks = 0
        self.t_last: float | None = None
        self.cur_idx: object = _UNSET  # the choice index of the last inline content, and its list in parts
        self.cur: list[str] = []
        self.tmpl: _Template | None = None
        self.derive = 3  # template derivations left, so that a shape that keeps changing is not re-derived forever
        self.skip: list[int] = []  # the read of each event ended by a blank line that had no data (no chunk)
        self.tail_chunk = False  # the stream's tail (an event not ended by a blank line) had data: a chunk

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

    def texts(self, buf: bytes, cum: list[int], times: list[float]) -> Texts:
        out = self.acc
        out.texts = {key: "".join(lst) for key, lst in self.parts.items()}
        out.chunks = self.chunks
        out.t_last = self.t_last
        if out.t_first_event is not None:  # a chunk came (an event with data)
            if self.c_scans:  # counted and bucketed in one call: the builder takes them as they are
                out.gaps = _scanc.chunk_gaps(buf, cum, times, self.skip, self.tail_chunk, GAP_BOUNDS_S)
            else:
                _chunk_clock(out, buf, cum, times, self.skip, self.tail_chunk)
        return out


def _chunk_clock(acc: Texts, buf: bytes, cum: list[int], times: list[float], skip: list[int],
                 tail_chunk: bool) -> None:
    """``acc.chunk_times`` and ``chunk_counts``: how many chunks (events with data) each read completed,
    with no Python step per chunk (the Python scans; ``_scanc.chunk_gaps`` does this and the bucketing
    in C). In a stream the fast paths read, every event is one line ended by a blank line and no line
    holds a raw LF, so each ``\\n\\n`` ends one event: the events ending in each read are counted, less
    those that had no data (``skip``: a bare ``data: ``), plus the tail when it had data (timed by the
    last read, as the SSE decoder's ``finish`` does)."""
    nreads = len(cum)
    lf = np.flatnonzero(np.frombuffer(buf, np.uint8) == 10)
    second = lf[1:][np.diff(lf) == 1]  # (no LF LF LF in such a stream: the pairs cannot overlap)
    per_read = np.bincount(np.searchsorted(np.asarray(cum, dtype=np.int64), second, side="right"),
                           minlength=nreads).tolist()
    for r in skip:
        per_read[r] -= 1
    if tail_chunk:
        per_read[nreads - 1] += 1
    chunk_times = list(compress(times[:nreads], per_read))
    if any(map(eq, chunk_times, chunk_times[1:])):  # two reads at one time: one entry, as Texts.tick keeps
        for t, c in zip(chunk_times, filter(None, per_read)):
            acc.tick(t, c)
        return
    acc.chunk_times = chunk_times
    acc.chunk_counts = list(filter(None, per_read))
