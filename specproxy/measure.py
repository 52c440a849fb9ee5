"""``RecordBuilder``: turns the bytes of one turn, stamped as they crossed the sockets, into a Record.

Why it is shaped this way: the forwarding path may only append (``on_bytes`` is three list appends);
everything that costs CPU (SSE decoding, JSON parsing, decompression, tokenizing) happens in ``build``,
which runs once per turn in a worker thread after the last byte was forwarded. Events are timed by the
read that completed them, so deferring the parse loses no precision.

The streamed-response parse has two paths that must give identical Records. ``_stream_texts_reference``
is the obviously-correct one (the WHATWG SSE decoder, then ``read_chunk`` per event). ``_stream_texts``
is the one ``build`` uses; it exists because the reference costs ~8.5 µs per chunk in Python and the
proxy's whole CPU budget is ~13 µs per chunk. It does the per-byte work in C: it joins the reads once
and splits them on blank lines with ``bytes.split`` when, and only when, the stream has the common
shape (LF line ends, every event one ``data: `` line), which it proves with a few ``bytes.count`` calls
over the whole stream; anything else (CR, comments, ``event:``/``id:`` fields, multi-line data) goes to
the reference for the whole stream. An event is timed by the read holding its last byte (the blank
line's LF), found by bisecting the reads' cumulative end offsets: the same read the SSE decoder
reports. Per event it reads the common chunk shape (one choice whose delta holds only role/content)
inline and hands every other shape to ``read_chunk``; text is gathered in lists and joined once
(``Texts.add`` re-concatenates per chunk, quadratic on long answers). ``tests/test_measure_fast.py``
checks the two paths against each other on random streams and random read splits.

When the proxy relays HTTP/1.1 chunked framing verbatim (``on_headers(..., chunked=True)``), the reads
hold framed bytes; ``build`` removes the framing first (``chunked.dechunk_reads``, one payload per
read, so read times stay aligned), then undoes a Content-Encoding, then parses.

Lifecycle (an invariant, asserted): ``RecordBuilder(...)`` -> ``on_headers`` (at most once) ->
``on_bytes`` (any number) -> exactly one of ``finish`` or ``fail`` -> ``build`` (once).
"""

from __future__ import annotations

import re
import statistics
import uuid
import zlib
from bisect import bisect_right
from itertools import accumulate, repeat
from operator import add
from dataclasses import dataclass, field

import orjson

from .chunked import dechunk_reads
from .content import classify
from .openai import MEASURED_PATHS, PromptParts, parse_json, read_chunk, read_full_response, split_prompt
from .record import Record
from .sse import SSEDecoder
from .tokens import Tokenizer, tokens_in_first

__all__ = ["RecordBuilder", "Texts"]


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


class RecordBuilder:
    """Collects one turn on the forwarding path; ``build`` makes the Record off it."""

    __slots__ = (
        "_ended",
        "body",
        "chunked",
        "concurrency",
        "content_encoding",
        "content_type",
        "error",
        "id",
        "instance_id",
        "label",
        "method",
        "outcome",
        "path",
        "read_times",
        "request_encoding",
        "reads",
        "status",
        "store_text",
        "t_done",
        "t_request",
        "t_upstream_headers",
        "t_wall",
        "write_times",
    )

    def __init__(
        self,
        *,
        method: str,
        path: str,
        body: bytes,
        t_wall: float,
        t_request: float,
        concurrency: int = 1,
        label: str | None = None,
        instance_id: str | None = None,
        store_text: bool = False,
        request_encoding: str = "",
    ) -> None:
        self.id = uuid.uuid4().hex  # known before the record is built, so counter deltas can join it
        self.method = method
        self.path = path
        self.body = body
        self.t_wall = t_wall
        self.t_request = t_request
        self.concurrency = concurrency
        self.label = label
        self.instance_id = instance_id
        self.store_text = store_text
        self.request_encoding = request_encoding
        self.status: int | None = None
        self.content_type = ""
        self.content_encoding = ""
        self.chunked = False
        self.t_upstream_headers: float | None = None
        self.reads: list[bytes] = []
        self.read_times: list[float] = []
        self.write_times: list[float] = []
        self.t_done: float | None = None
        self.outcome: str | None = None
        self.error: str | None = None
        self._ended = False

    # --- the forwarding path: cheap, no parsing --------------------------------------------------

    def on_headers(
        self, t: float, status: int, content_type: str, content_encoding: str = "", *, chunked: bool = False
    ) -> None:
        """``chunked``: the reads will hold the response's HTTP/1.1 chunked framing as relayed verbatim."""
        assert self.t_upstream_headers is None, "on_headers called twice"
        self.t_upstream_headers = t
        self.status = status
        self.content_type = content_type
        self.content_encoding = content_encoding
        self.chunked = chunked

    def on_bytes(self, data: bytes, t_read: float, t_written: float) -> None:
        self.reads.append(data)
        self.read_times.append(t_read)
        self.write_times.append(t_written)

    def finish(self, t_done: float, outcome: str = "ok", error: str | None = None) -> None:
        """The response ended (normally, or with an outcome the proxy observed)."""
        assert not self._ended, "a turn ends once: finish xor fail"
        self._ended = True
        self.t_done = t_done
        self.outcome = outcome
        self.error = error

    def fail(self, t_done: float, outcome: str, status: int | None, error: str) -> None:
        """No response came from the upstream (the client got an error from specproxy itself)."""
        assert not self._ended, "a turn ends once: finish xor fail"
        self._ended = True
        self.t_done = t_done
        self.outcome = outcome
        self.status = status
        self.error = error

    # --- off the forwarding path: parse, count, derive ------------------------------------------

    def build(self, tokenizer: Tokenizer | None) -> Record:
        """Make the Record. CPU work: call from a worker thread, once, after finish/fail."""
        return self._build(tokenizer, fast=True)

    def _build(self, tokenizer: Tokenizer | None, *, fast: bool) -> Record:
        """``fast=False`` parses a stream with the reference path only (for differential tests)."""
        assert self._ended, "build before finish/fail"
        request = _read_request(_inflate(self.body, self.request_encoding))
        payload = self.reads
        framing_error = None
        if self.chunked:
            payload = dechunk_reads(self.reads)
            if payload.error is not None:
                framing_error = f"malformed chunked framing: {payload.error}"
        reads = self._decoded_reads(payload)
        streamed = self.content_type.startswith("text/event-stream")
        if streamed:
            texts = (_stream_texts if fast else _stream_texts_reference)(reads, self.read_times)
        else:
            texts = _body_texts(reads, self.read_times)
        outcome = self.outcome or "ok"
        if outcome == "client_abort" and texts.saw_done:
            outcome = "ok"  # the client (e.g. the openai SDK) hung up after reading [DONE]: all delivered
        if outcome == "ok" and self.status is not None and self.status >= 400:
            outcome = "upstream_error"
        return self._record(request, texts, streamed, outcome, tokenizer, sum(map(len, payload)), framing_error)

    def _decoded_reads(self, reads: list[bytes]) -> list[bytes]:
        """Undo a Content-Encoding for measuring (the client got the encoded bytes, untouched)."""
        enc = self.content_encoding.lower()
        if enc not in ("gzip", "deflate", "x-gzip"):
            return reads
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header, auto-detected
        out: list[bytes] = []
        try:
            for data in reads:
                out.append(inflater.decompress(data))
        except zlib.error:
            out.extend(b"" for _ in range(len(reads) - len(out)))
        return out

    def _record(
        self,
        request: _Request,
        texts: Texts,
        streamed: bool,
        outcome: str,
        tok: Tokenizer | None,
        response_bytes: int,
        framing_error: str | None,
    ) -> Record:
        t_req = self.t_request
        counts = _count_completion(texts, tok) if tok is not None else None
        prompt = None
        if tok is not None and request.parts is not None:
            try:
                prompt = tok.count_prompt(request.parts)
            except Exception:
                prompt = None
        usage = texts.usage or {}
        ttft = texts.t_first - t_req if texts.t_first is not None else None
        decode = texts.t_last - texts.t_first if texts.t_first is not None and texts.t_last is not None else None
        completion = counts["completion"] if counts else None
        if counts is None and tok is not None and not texts.texts and self.status is not None and self.status < 400:
            completion = 0  # a tokenizer and a successful answer with no text: truly zero tokens
        decode_tps = None
        if counts and decode and decode > 0:
            decode_tps = (counts["completion"] - counts["first"]) / decode
        delays = [w - r for r, w in zip(self.read_times, self.write_times)]
        response_text = None
        if self.store_text and texts.texts:
            response_text = "".join(texts.texts[k] for k in sorted(texts.texts))
        return Record(
            id=self.id,
            t_wall=self.t_wall,
            method=self.method,
            path=self.path,
            status=self.status,
            outcome=outcome,
            error=self.error
            or framing_error
            or (f"{texts.bad_events} stream events were not JSON" if texts.bad_events else None),
            streamed=streamed,
            model=request.model,
            label=self.label,
            instance_id=self.instance_id,
            request_parsed=request.parsed,
            concurrency=self.concurrency,
            t_request=t_req,
            t_upstream_headers=self.t_upstream_headers,
            t_first_token=texts.t_first,
            t_last_token=texts.t_last,
            t_done=self.t_done,
            ttft_s=ttft,
            decode_s=decode,
            total_s=self.t_done - t_req if self.t_done is not None else None,
            completion_tokens=completion,
            content_tokens=counts["content"] if counts else None,
            reasoning_tokens=counts["reasoning"] if counts else None,
            tool_args_tokens=counts["tool_args"] if counts else None,
            content_class=_content_class(texts),
            first_chunk_tokens=counts["first"] if counts else None,
            usage_completion_tokens=_int_or_none(usage.get("completion_tokens")),
            usage_prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
            chunks=texts.chunks if (texts.chunks or self.status is not None) else None,
            tokens_per_chunk=counts["completion"] / texts.chunks if counts and texts.chunks else None,
            decode_tps=decode_tps,
            prompt_tokens=prompt.total if prompt else None,
            prompt_system_tokens=prompt.system if prompt else None,
            prompt_tools_tokens=prompt.tools if prompt else None,
            prompt_history_tokens=prompt.history if prompt else None,
            prompt_new_tokens=prompt.new if prompt else None,
            proxy_delay_s=statistics.median(delays) if delays else None,
            request_bytes=len(self.body),
            response_bytes=response_bytes,
            saw_done=texts.saw_done,
            finish_reason=texts.finish_reason,
            server_timings=orjson.dumps(texts.timings).decode() if texts.timings else None,
            tokenizer=tok.name if tok is not None else None,
            prompt_text=self.body.decode("utf-8", "replace") if self.store_text else None,
            response_text=response_text,
        )


@dataclass(frozen=True, slots=True)
class _Request:
    parsed: bool
    model: str | None = None
    parts: PromptParts | None = None


def _inflate(body: bytes, encoding: str) -> bytes:
    """A gzip/deflate request body, decoded for reading (it was forwarded as sent)."""
    if encoding.strip().lower() not in ("gzip", "x-gzip", "deflate") or not body:
        return body
    try:
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)
        out = inflater.decompress(body, 64 * 1024 * 1024)  # bounded: a zip bomb is not our business
        return out if not inflater.unconsumed_tail else b""
    except zlib.error:
        return b""


def _read_request(body: bytes) -> _Request:
    try:
        obj = parse_json(body)
        parts = split_prompt(obj)
    except (ValueError, TypeError, RecursionError):
        return _Request(parsed=False)
    model = obj.get("model")
    return _Request(parsed=True, model=model if isinstance(model, str) else None, parts=parts)


_ROLE_CONTENT = frozenset(("role", "content"))
_UNSET = object()
_CONTENT_KEY = re.compile(rb'(?<!\\)"content"[ \t]*:[ \t]*"')


def _content_template(seg: bytes, obj: dict, content: str) -> tuple[bytes, bytes] | None:
    """Cut a plain content event into the bytes before and after its content string, if provably safe.

    ``seg`` is ``data: `` + JSON that parsed to ``obj``, a chunk whose only text is ``content`` in its
    one choice's delta (checked by the caller). If the content is written raw in ``seg`` (no escapes),
    then any event ``prefix + body + suffix`` whose ``body`` holds no ``"``, no backslash and decodes
    to printable text (so no control character) is the same JSON token stream with another string token in that one place:
    valid, and equal to ``obj`` but for that string's value, which is ``body`` decoded (with
    replacement characters, as the SSE decoder decodes). Which value that string is, is proved by
    parsing once with a different body: the delta's content must change to it and nothing else may
    (a duplicate key, or a ``"content"`` key elsewhere in the chunk, fails this and gives no template).
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
    return (prefix, suffix) if other == obj else None


def _stream_texts(reads: list[bytes], times: list[float]) -> Texts:
    """The same Texts as ``_stream_texts_reference``, fast for the common stream shape."""
    texts = _stream_texts_fast(reads, times)
    return texts if texts is not None else _stream_texts_reference(reads, times)


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
    plen = slen = tmin = 1
    tlist: list[str] = []  # the text list of the template's choice
    derive = 3  # template derivations left: a hit refills them, so a varying chunk is not re-derived forever
    for seg, t in zip(segs, ev_times):
        if seg.startswith(tprefix) and seg.endswith(tsuffix) and len(seg) >= tmin:
            body = seg[plen:-slen]
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
                                    tprefix, tsuffix = tmpl
                                    plen, slen = len(tprefix), len(tsuffix)  # slen >= 1: it starts with '"'
                                    tmin = plen + slen
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


def _stream_texts_reference(reads: list[bytes], times: list[float]) -> Texts:
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


def _body_texts(reads: list[bytes], times: list[float]) -> Texts:
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


def _count_completion(texts: Texts, tok: Tokenizer) -> dict[str, int] | None:
    """Encode each (choice, kind) text once; map tokens to the first chunk by character offsets."""
    if not texts.texts:
        return None
    out = {"content": 0, "reasoning": 0, "tool_args": 0, "first": 0}
    for key, text in texts.texts.items():
        ends = tok.token_ends(text)
        out[key[1]] += len(ends)
        out["first"] += tokens_in_first(ends, texts.first_lens.get(key, 0))
    out["completion"] = out["content"] + out["reasoning"] + out["tool_args"]
    return out


def _content_class(texts: Texts) -> str | None:
    by_kind: dict[str, str] = {}
    for (_, kind), text in texts.texts.items():
        by_kind[kind] = by_kind.get(kind, "") + text
    return classify(by_kind.get("content", ""), by_kind.get("tool_args", ""))


def _int_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def is_measured(method: str, path: str) -> bool:
    """Only generation endpoints are measured; everything else is forwarded and not recorded."""
    return method == "POST" and path in MEASURED_PATHS
