"""The native reader of a streamed chat answer: the same ``Texts`` as ``texts.stream_texts_reference``
with ``openai.read_chunk``, read by C calls over many events at once.

It exists because the reference alone would cost about half the proxy's whole CPU budget per chunk
(docs/performance.md, "Design figures"). Its rule: no Python step per byte, and none per event for
the events that make up almost all of a stream.

* Shape: it reads the common stream only (LF line ends, every event one ``data: `` line ended by a
  blank line, the last one maybe not); on anything else (CR, comments, ``event:``/``id:`` fields,
  multi-line data) it returns None and the reference reads the whole stream. An event is timed by the
  read holding its last byte (the blank line's LF), found by bisecting the reads' cumulative end
  offsets: the same read the SSE decoder reports.
* Templates: most chunks of a stream differ only in their content string (and often a timestamp). Once
  a template is proved on one chunk (``chunk_templates``), a run of the chunks that follow is one C call
  (``scans.template_run``) that checks each event's bytes, decodes its JSON string and joins the
  text: no object per event.
* Every other event (the first ones, the last ones, another shape) is parsed with orjson and read by
  ``openai.read_chunk``, the reference's own reader: a chat chunk is read one way. A chunk with a tool
  call is never a template's (its delta holds ``tool_calls``), so the tools called (``Texts.calls``)
  cost nothing on the chunks that have none.
* When the chunks arrived (for the per-chunk metrics; a chunk is any event with data, ``[DONE]`` too):
  one C call (``scans.chunk_gaps``) counts the events each read ended, less those with no data (a
  bare ``data: ``), and buckets the gaps between them (``Texts.gaps``).

Without ``specproxy.frames._scanc`` (no C compiler at install) there is no native reader:
``read_chat_stream`` is None and the reference reads every stream.

``tests/unit/test_measure_fast.py`` holds it to the reference on random streams and read splits,
``tests/unit/test_measure_fast_work.py`` checks that it parses and looks at no more than it needs to,
and ``tests/unit/test_scanc.py`` the C calls by their own contracts.
"""

from __future__ import annotations

from bisect import bisect_right

import orjson

from specproxy.frames.chunked import scans  # the per-chunk scans in C; None when not built
from specproxy.measure.chunk_gaps import GAP_BOUNDS_S
from specproxy.measure.chunk_templates import ChunkTemplate, content_template
from specproxy.measure.openai import read_chunk
from specproxy.measure.texts import Texts, take_accounting

C_BUILT = scans is not None

__all__ = ["C_BUILT", "read_chat_stream"]

_PAYING_RUN = 4  # a run this long repays a derivation: only such a run refills the derivations left


def _read_chat_stream(buf: bytes, ends: list[int], times: list[float]) -> Texts | None:
    """The Texts of a chat stream whose payload is ``buf``, read i ending at ``ends[i]`` and timed
    ``times[i]``; None when the stream is not of the common shape (the reference decides)."""
    nreads = len(ends)
    if len(times) < nreads or b"\r" in buf:
        return None
    g = _Gather()
    run = scans.template_run
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
                    # (t_first is set: a template is derived from a chunk with text)
                    g.t_last = times[bisect_right(ends, pos + text_size - 1)]
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
            r = bisect_right(ends, lf + 1)
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
    return g.texts(buf, ends, times)


read_chat_stream = _read_chat_stream if C_BUILT else None


class _Gather:
    """What the events read one by one add up to: text in lists per (choice, kind), joined once at the
    end, and the template derived from a plain content chunk (``tmpl``, at most ``derive`` more
    derivations, so that a shape that keeps changing is not derived again and again)."""

    __slots__ = ("acc", "chunks", "derive", "parts", "skip", "t_last", "tail_chunk", "tmpl")

    def __init__(self) -> None:
        self.acc = Texts(saw_done=False)  # t_first, usage, timings, finish_reason, saw_done, bad_events
        self.parts: dict[tuple[int, str], list[str]] = {}
        self.chunks = 0
        self.t_last: float | None = None
        self.tmpl: ChunkTemplate | None = None
        self.derive = 3
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
            if self.derive and _plain_content(delta):
                self.derive -= 1
                (key, content), = dt.items()
                derived = content_template(seg, obj, content, self.parts[key])
                if derived is not None:
                    self.tmpl = derived
        take_accounting(acc, delta)
        return True

    def texts(self, buf: bytes, ends: list[int], times: list[float]) -> Texts:
        out = self.acc
        out.texts = {key: "".join(lst) for key, lst in self.parts.items()}
        out.chunks = self.chunks
        out.t_last = self.t_last
        if out.t_first_event is not None:  # a chunk came (an event with data): counted and bucketed in C
            out.gaps = scans.chunk_gaps(buf, ends, times, self.skip, self.tail_chunk, GAP_BOUNDS_S)
        return out


def _plain_content(delta) -> bool:
    """The chunk was read as one choice's content and nothing else: a template may be derived from it
    (``content_template`` proves the rest)."""
    return (len(delta.texts) == 1 and next(iter(delta.texts))[1] == "content" and delta.usage is None
            and delta.timings is None and delta.finish_reason is None and not delta.calls)
