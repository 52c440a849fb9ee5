"""The chat stream's native reader gives exactly the reference's result (a differential test).

``build_record`` reads a chat stream with ``Api.read_stream``: the native reader
(``fast_texts.read_chat_stream``: runs of chunks read by a template of a plain content chunk in C, every
other event by ``read_chunk``) where it is built and the stream has its shape, else the reference;
``build_record(turn, tok, fast=False)`` uses the reference alone (the SSE decoder and ``read_chunk`` per
event). On random streams of many shapes, split at random read boundaries and optionally sent with HTTP/1.1
chunked framing, both must give equal Texts and Records; ``template_stream`` makes streams of mostly
one chunk shape, so that runs are long and meet every kind of body and deviation. What the native
reader must not do (parse, derive templates or look at events more than it needs to) is checked in
test_measure_fast_work.py.
"""

from __future__ import annotations

import json
from itertools import accumulate

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budget import examples
from specproxy.frames.chunked import dechunk_reads
from specproxy.measure import fast_texts
from specproxy.measure import texts as texts_mod
from specproxy.measure.build import build_record
from specproxy.measure.chunk_gaps import GAP_BOUNDS_S, StreamTiming
from specproxy.measure.turn_recorder import TurnRecorder
from measurekit import builder, counting_loads, needs_native, read_chat, read_native
from readsplit import split


texts = st.lists(st.one_of(
    st.sampled_from(list("ab ,.\"\\/\n\t\x01\x7f{}:[]é日本🚀\u2028\xa0") + ["content", "[DONE]", "\\n", "\\u00e9"]),
    st.characters(blacklist_categories=("Cs",))), max_size=8).map("".join)
HEAD = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":['


def dumps(obj, style: int) -> bytes:
    if style == 0:
        return orjson.dumps(obj)
    if style == 1:
        return json.dumps(obj).encode()  # ", " and ": " separators, \\u escapes for non-ASCII
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


@st.composite
def content_event(draw, style, t_send):
    text = draw(texts)
    choice = {"index": draw(st.sampled_from([0, 0, 0, 1, None, True, "x"])), "delta": {"content": text},
              "logprobs": None, "finish_reason": None}
    if draw(st.booleans()):
        del choice["index"]
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
           "choices": [choice]}
    if t_send:
        obj["t_send"] = draw(st.integers(0, 2**63 - 1))
    # digits that vary from chunk to chunk after the content, where a Record reads them (the choice's
    # index) or does not (a signature string, a number, an over-long number that parses as a float)
    tail = draw(st.sampled_from(["", "", "", "index_after", "sig", "big", "created"]))
    if tail == "index_after":
        choice["index"] = choice.pop("index", 0)  # moved after the delta, into the template's suffix
        choice["index"] = draw(st.sampled_from([0, 0, 1, 2, 10]))
    elif tail == "sig":
        obj["sig"] = f"s{draw(st.integers(0, 10**6))}x"
    elif tail == "big":
        obj["n"] = draw(st.integers(10**18, 2**64 - 1))
    elif tail == "created":
        obj["created"] = draw(st.integers(1, 10**10))
    out = dumps(obj, style)
    if tail == "big" and draw(st.booleans()):  # longer than 64 bits (orjson reads it as a float)
        out = out.replace(b'"n":', b'"n":9', 1).replace(b'"n": ', b'"n": 9', 1)
    if t_send and draw(st.integers(0, 9)) == 0:  # a leading zero: not JSON, a bad event either way
        out = out.replace(b'"t_send":', b'"t_send":0', 1).replace(b'"t_send": ', b'"t_send": 0', 1)
    return out


RAW = [
    b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
    b'{"choices":[{"index":0,"delta":{"role":"assistant"}}]}',
    b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"{\\"a\\": 1}"}}]}}]}',
    b'{"choices":[{"index":0,"delta":{"reasoning_content":"hmm, "}}]}',
    b'{"choices":[{"index":0,"delta":{"reasoning":"think"}}]}',
    b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
    b'{"choices":[{"index":0,"delta":{"content":"end"},"finish_reason":"length"}]}',
    b'{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":7,"total_tokens":17}}',
    b'{"choices":[{"index":0,"delta":{"content":"x"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}',
    b'{"choices":[{"index":0,"delta":{}}],"timings":{"predicted_n":7,"predicted_ms":70.5}}',
    b'{"choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{"content":"b"}}]}',
    b'{"choices":[{"index":0,"text":"completion text"}]}',
    b'{"choices":[{"index":0,"delta":{"content":"a","content":"b"}}]}',
    b'{"model":"content","x":{"content":"hi"},"choices":[{"index":0,"delta":{"content":"hi"}}]}',
    b'{"x":{"abc\\"content":"hi"},"choices":[{"index":0,"delta":{"con\\u0074ent":"hi"}}]}',
    b'{"choices":[{"index":0,"delta":{"content":"raw\x01ctl"}}]}',
    b'{"choices":[{"index":0,"delta":{"content":"bad \xff\xfe utf8"}}]}',
    b'{"choices":[{"index":0,"delta":{"content":"\xe6\x97"}}]}',
    b'{"choices":[{"index":0,"delta":{"content":null}}]}',
    b'{"choices":"nope"}', b'[1,2]', b'"str"', b'null', b'{"choices":[null, 3]}',
    b'not json{', b'', b'[DONE]', b' [DONE] ', b'\xc2\xa0[DONE]', b'[DONE]x',
    # tool calls (Texts.calls): a call's first delta names it, later ones do not; two in one chunk; legacy
    b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"c","type":"function","function":{"name":"g","arguments":""}}]}}]}',
    b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"name":null,"arguments":"{}"}}]}}]}',
    b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"h"}},{"index":1,"function":{"name":"f"}}]}}]}',
    b'{"choices":[{"index":0,"delta":{"function_call":{"name":"legacy","arguments":"{}"}}}]}',
]


@st.composite
def stream(draw):
    style = draw(st.integers(0, 2))
    t_send = draw(st.booleans())
    events: list[bytes] = []
    for _ in range(draw(st.integers(0, 25))):
        if draw(st.integers(0, 3)):
            events.append(draw(content_event(style, t_send)))
        else:
            events.append(draw(st.sampled_from(RAW)))
    if draw(st.booleans()):
        events.append(b"[DONE]")
    nl = draw(st.sampled_from([b"\n"] * 6 + [b"\r\n", b"\r"]))
    out = bytearray()
    for ev in events:
        shape = draw(st.integers(0, 20))
        if shape == 0:
            out += b": ping" + nl
        elif shape == 1:
            out += b"event: message" + nl
        elif shape == 2 and len(ev) > 2:
            cut = len(ev) // 2
            out += b"data: " + ev[:cut] + nl + b"data: " + ev[cut:] + nl + nl  # multi-line data
            continue
        elif shape == 3:
            out += b"data:" + ev + nl + nl  # no space after the colon
            continue
        elif shape == 4:
            out += nl  # an extra blank line
        elif shape == 5:
            out += b"id: 7" + nl
        out += b"data: " + ev + nl + nl
    data = bytes(out)
    if data and draw(st.integers(0, 4)) == 0:
        data = data[: draw(st.integers(0, len(data) - 1))]  # a truncated stream
    return data


def frame(payload: bytes, sizes: list[int]) -> bytes:
    out, pos, i = bytearray(), 0, 0
    while pos < len(payload):
        n = sizes[i % len(sizes)]
        data = payload[pos : pos + n]
        out += b"%x" % len(data) + (b";e=1" if i % 3 == 1 else b"") + b"\r\n" + data + b"\r\n"
        pos += len(data)
        i += 1
    return bytes(out) + b"0\r\nX-T: 1\r\n\r\n"


def _equal_to_reference(tok, b: TurnRecorder, payload: list[bytes]) -> None:
    """The native reader (when built and the stream has its shape) and the builder's reading equal the
    reference, in Texts, in the Record and in what the per-chunk metrics get."""
    ref = texts_mod.stream_texts_reference(list(payload), b.read_times)
    ref_record = build_record(b, tok, fast=False)
    ref_timing = b.timing
    if fast_texts.C_BUILT:
        native = read_native(list(payload), b.read_times)
        assert native is None or native == ref
    assert read_chat(list(payload), b.read_times) == ref
    assert build_record(b, tok, fast=True) == ref_record
    assert b.timing == ref_timing


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=stream(), cuts=st.lists(st.integers(0, 100_000), max_size=30), chunked=st.booleans(),
       sizes=st.lists(st.integers(1, 64), min_size=1, max_size=4), framed_cut=st.integers(0, 10))
def test_fast_path_equals_reference(tiktoken_tok, data, cuts, chunked, sizes, framed_cut):
    wire = frame(data, sizes) if chunked else data
    if chunked and framed_cut == 0:
        wire = wire[: len(wire) // 2]  # truncated inside the framing
    reads = split(wire, cuts, empty_reads=True)
    b = builder(reads, chunked)
    _equal_to_reference(tiktoken_tok, b, b.reads if not chunked else dechunk_reads(reads))


# content written in place of the placeholder, byte for byte: raw text the template path decodes joined
# (some of it not UTF-8, split characters included), escapes it parses one by one, and bodies that
# are no JSON string (raw quotes and control characters, a bad escape, a closing quote escaped away)
BODIES = [b" hello", b"", b"x", b" w0rd", "é".encode(), "日本".encode(), "🚀".encode(), b"\x7f", "\x85".encode(),
          "\u2028".encode(), "\uffff".encode(), "\xa0".encode(), b"\xe6\x97", b"\xa5", b"\xff", b"\xed\xa0\x80",
          b"\xc0\xa2", b"\\n", b'\\"', b"\\\\", b"\\u00e9", b"\\ud83d\\ude80", b"\\/", b" a\\tb", b"\\ud800",
          b"\\q", b"\\u12", b"a\\", b"\x01", b"\t", b'a"b', b'x","role":"user', b'"', b"p"]
PLACEHOLDER = "PLACEHOLDER"
NUMBER = 987654321987654321


@st.composite
def template_stream(draw):
    """Events that mostly share one chunk shape (so the fast path reads them in runs) with deviations:
    another index or digit count, digits no template allows, other chunks, and bodies of every kind."""
    style = draw(st.integers(0, 2))
    index_first = draw(st.booleans())
    varying = draw(st.sampled_from(["", "t_send", "sig", "created"]))
    digits = draw(st.integers(1, 19))

    def event(body: bytes, index: int, ndigits: int) -> bytes:
        choice = {"delta": {"content": PLACEHOLDER}, "logprobs": None, "finish_reason": None}
        choice = {"index": index, **choice} if index_first else {**choice, "index": index}
        obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
               "choices": [choice]}
        if varying == "sig":
            obj["sig"] = f"s{NUMBER}"
        elif varying:
            obj[varying] = NUMBER
        number = b"%d" % draw(st.integers(10 ** (ndigits - 1) if ndigits > 1 else 0, 10**ndigits - 1))
        if draw(st.integers(0, 20)) == 0:  # not a number the template allows, of the same length or not
            number = draw(st.sampled_from([b"0" + number, b"0" + number[1:], b"-" + number[1:], b"x" + number[1:]]))
        return dumps(obj, style).replace(b"%d" % NUMBER, number).replace(PLACEHOLDER.encode(), body)

    events = [b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}']
    for _ in range(draw(st.integers(0, 90))):
        kind = draw(st.integers(0, 40))
        if kind == 0:
            events.append(draw(st.sampled_from(RAW)))
        elif kind == 1:
            events.append(event(draw(st.sampled_from(BODIES)), draw(st.sampled_from([1, 2])), digits))
        elif kind == 2:
            events.append(event(draw(st.sampled_from(BODIES)), 0, draw(st.integers(1, 19))))
        else:
            body = draw(st.sampled_from(BODIES[:8] if kind > 12 else BODIES))
            events.append(event(body, 0, digits))
    events += draw(st.sampled_from([[], [RAW[5], b"[DONE]"], [RAW[6], RAW[7], b"[DONE]"]]))
    data = b"".join(b"data: " + ev + b"\n\n" for ev in events)
    if draw(st.integers(0, 20)) == 0:
        data += b": ping\n\n"  # the reference decides (found after the fast path read most of the stream)
    if draw(st.integers(0, 6)) == 0:
        data = data[: draw(st.integers(0, len(data)))]  # a truncated stream
    return data


def per_event(data: bytes) -> list[bytes]:
    """The events of ``data``, each with its blank line, and what follows the last one."""
    *events, tail = data.split(b"\n\n")
    return [ev + b"\n\n" for ev in events] + ([tail] if tail else [])


def one_frame_per_event(data: bytes, upper: bool) -> list[bytes]:
    """What an engine writes: a chunked frame per event, then the last chunk."""
    size = b"%X" if upper else b"%x"
    return [size % len(p) + b"\r\n" + p + b"\r\n" for p in per_event(data)] + [b"0\r\n\r\n"]


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=template_stream(), framing=st.integers(0, 3), cuts=st.lists(st.integers(0, 100_000), max_size=20))
def test_template_runs_equal_reference(tiktoken_tok, data, framing, cuts):
    if framing == 0:
        reads = split(data, cuts)
    elif framing == 1:
        reads = per_event(data)
    else:
        reads = one_frame_per_event(data, framing == 3)
    b = builder(reads, framing >= 2)
    _equal_to_reference(tiktoken_tok, b, b.reads if framing < 2 else dechunk_reads(reads))


@needs_native
def test_template_stream_is_fast_and_equal(tiktoken_tok):
    """The common shape: a template is derived once and matches the following content chunks."""
    head = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    reads = [head + b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n']
    words = ["Hello", " wörld", " 日本", " 🚀", " \\n", " x\\\"y", "\xa0", " end"]
    for w in words * 5:
        reads.append(head + b'"delta":{"content":"' + w.encode() + b'"},"finish_reason":null}]}\n\n')
    reads.append(head + b'"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    b = builder(reads, False)
    fast = read_native(b.reads, b.read_times)
    assert fast is not None and fast == texts_mod.stream_texts_reference(b.reads, b.read_times)
    assert fast.texts[(0, "content")].startswith("Hello wörld 日本 🚀 \n x\"y\xa0 end")
    assert fast.chunks == 40 and fast.finish_reason == "stop" and fast.saw_done
    ref_record = build_record(b, tiktoken_tok, fast=False)  # first: the fast build consumes the reads
    assert build_record(b, tiktoken_tok, fast=True) == ref_record


@needs_native
def test_odd_shapes_fall_back_to_the_reference():
    for data in (b"data: {}\r\n\r\n", b": ping\n\ndata: {}\n\n", b"data: a\ndata: b\n\n", b"data:{}\n\n",
                 b"event: x\ndata: {}\n\n", b"data: {}\n\n\n", b"data: {}\n"):
        assert read_native([data], [1.0]) is None, data


def test_chunked_record_matches_the_unframed_one(tiktoken_tok):
    events = b"".join(b'data: {"choices":[{"index":0,"delta":{"content":"w%d "}}]}\n\n' % i for i in range(20))
    framed = frame(events + b"data: [DONE]\n\n", [37, 5, 80])
    reads = split(framed, list(range(0, len(framed), 23)), empty_reads=True)
    chunked = builder(reads, True)
    plain = builder(list(dechunk_reads(reads)), False)
    a, b = build_record(chunked, tiktoken_tok), build_record(plain, tiktoken_tok)
    assert a.response_bytes == len(events) + len(b"data: [DONE]\n\n")
    fields = [f for f in a.__dataclass_fields__ if f != "id"]
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    assert a.error is None and a.saw_done and a.chunks == 20


def test_malformed_chunked_framing_sets_an_error(tiktoken_tok):
    reads = [b"10\r\ndata: {\"choices\"\r\n", b"zz\r\n"]
    rec = build_record(builder(reads, True), tiktoken_tok)
    assert rec.error and "malformed chunked framing" in rec.error


def _varying(field: bytes, values: list[bytes]) -> list[bytes]:
    head = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    return [head + b'"delta":{"content":" w%d"},"finish_reason":null}],%b:%b}\n\n' % (i, field, v)
            for i, v in enumerate(values)]


@needs_native
def test_a_number_the_record_never_reads_may_vary_without_a_parse(monkeypatch, tiktoken_tok):
    """A send time or ``created`` changing every chunk: after one derivation, no event is parsed."""
    reads = _varying(b'"t_send"', [b"%d" % (1_700_000_000_000_000_000 + 1_000_000_007 * i) for i in range(60)])
    reads[30] = reads[30].replace(b'"t_send":', b'"t_send":0')  # a leading zero: not JSON
    b = builder(reads, False)
    calls = counting_loads(monkeypatch)
    fast = read_native(b.reads, b.read_times)
    parsed = len(calls)
    assert fast == texts_mod.stream_texts_reference(b.reads, b.read_times)
    assert fast.chunks == 59 and fast.bad_events == 1
    assert parsed <= 8  # the first event, its two probes, the leading-zero one (and its retry)


@needs_native
def test_digits_the_record_reads_never_vary_in_a_template(monkeypatch):
    """A choice index after the delta decides which text the content belongs to: every event is parsed."""
    head = b'data: {"choices":[{"delta":{"content":" w%d"},"index":%d}]}\n\n'
    reads = [head % (i, i % 3) for i in range(30)]
    b = builder(reads, False)
    calls = counting_loads(monkeypatch)
    fast = read_native(b.reads, b.read_times)
    assert len(calls) >= 30
    assert fast == texts_mod.stream_texts_reference(b.reads, b.read_times)
    assert sorted(fast.texts) == [(0, "content"), (1, "content"), (2, "content")]



def _chunk(content: str) -> bytes:
    return b"data: " + (HEAD + json.dumps({"index": 0, "delta": {"content": content}}) + "]}").encode()


def test_chunk_times_count_each_read_s_events_with_data():
    """When each chunk arrived (``chunk_times``, ``chunk_counts``), as the reference times them: a chunk
    is any event with data, whatever it carries (a role-only chunk, empty content in a run, ``[DONE]``,
    as well as text), timed by the read that ended it; a bare ``data: `` is none; a stream's tail not
    ended by a blank line is timed by the last read."""
    role = b"data: " + (HEAD + '{"index":0,"delta":{"role":"assistant","content":""}}]}').encode() + b"\n\n"
    events = [role] + [_chunk(w) + b"\n\n" for w in ("a", " b", "", " c", " d", "", "", " e")]
    reads = [events[0], b"".join(events[1:3]), events[3] + events[4][:5], events[4][5:] + events[5],
             b"".join(events[6:8]), events[8][:-2] + b"\n", b"\ndata: \n\ndata: [DONE]\n\n"]
    tail = [role, _chunk("a") + b"\n\n", _chunk(" b") + b"\n\n", _chunk(" c")]  # the last has no blank line
    for stream in (reads, tail):
        times = [float(i) for i in range(len(stream))]
        assert read_chat(stream, times) == texts_mod.stream_texts_reference(stream, times)
    ref = texts_mod.stream_texts_reference(reads, [float(i) for i in range(len(reads))])
    assert (ref.chunk_times, ref.chunk_counts, ref.t_first_event, ref.chunks) == (
        [0.0, 1.0, 2.0, 3.0, 4.0, 6.0], [1, 2, 1, 2, 2, 2], 0.0, 5)  # ten chunks, five with text
    ref = texts_mod.stream_texts_reference(tail, [0.0, 1.0, 2.0, 3.0])
    assert (ref.chunk_times, ref.chunk_counts) == ([0.0, 1.0, 2.0, 3.0], [1, 1, 1, 1])
    # what the builder hands the metrics, native and reference (the reads timed 1.0 + i, the request at 0.5):
    # between the reads that completed chunks, gaps of 1 s (the 1.28 s bucket) and 2 s (the 2.56 s
    # one); the chunks that came with another in one read, gaps of 0 (the first bucket)
    def bucketed(**at: int) -> tuple[int, ...]:
        out = [0] * (len(GAP_BOUNDS_S) + 1)
        for bound, n in at.items():
            out[GAP_BOUNDS_S.index(float(bound[1:].replace("_", ".")))] += n
        return tuple(out)

    for stream, want in ((reads, StreamTiming(0.5, bucketed(b0_001=4, b1_28=4, b2_56=1), 6.0)),
                         (tail, StreamTiming(0.5, bucketed(b1_28=3), 3.0))):
        b = builder(stream, False)
        build_record(b, None, fast=False)  # first: the fast build consumes the reads
        ref = b.timing
        build_record(b, None, fast=True)
        assert b.timing == ref == want


@st.composite
def timed_stream(draw):
    """The common stream shape, as the per-chunk metrics time it: a role chunk, content chunks (some
    empty: no text, inside template runs too), reasoning chunks (read one by one), bare ``data: ``
    events (no chunk), a finish chunk, and either ``[DONE]`` or a tail event not ended by a blank line; cut into reads at random points (empty
    reads too), read at nondecreasing times: repeated, at the buckets' bounds apart, or anything."""
    reasoning = b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}\n\n'
    events = [b"data: " + (HEAD + '{"index":0,"delta":{"role":"assistant","content":""}}]}').encode() + b"\n\n"]
    for i in range(draw(st.integers(0, 60))):
        kind = draw(st.integers(0, 11))
        events.append(reasoning if kind == 0 else b"data: \n\n" if kind == 11
                      else _chunk("" if kind == 1 else f" w{i}") + b"\n\n")
    events.append(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')
    if draw(st.booleans()):
        events.append(b"data: [DONE]\n\n")
    else:
        events.append(_chunk(" tail"))  # dispatched at the end of the stream, timed by the last read
    data = b"".join(events)
    reads = split(data, draw(st.lists(st.integers(0, len(data)), max_size=40)), empty_reads=True)
    steps = draw(st.lists(st.one_of(st.sampled_from([0.0, 0.0, *GAP_BOUNDS_S]), st.floats(0.0, 5.0)),
                          min_size=len(reads), max_size=len(reads)))
    times = list(accumulate(steps, initial=draw(st.sampled_from([1.0, 1.0001, 1234.5678]))))[1:]
    return reads, times


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream_times=timed_stream())
def test_the_gaps_the_metrics_get_equal_the_reference_s(stream_times):
    """What a streamed turn hands the per-chunk metrics (``StreamTiming``: the gaps bucketed, their sum),
    as the builder reads it (natively: counted and bucketed by ``_scanc.chunk_gaps``), is
    exactly what the reference parse's chunk times bucketed by ``gap_buckets`` give."""
    reads, times = stream_times
    b = builder(reads, False, times)
    build_record(b, None, fast=False)  # first: the fast build consumes the reads
    ref = b.timing
    build_record(b, None, fast=True)
    fast = b.timing
    assert fast == ref
    chunks = sum(1 for e in b"".join(reads).split(b"\n\n") if len(e) > 6)  # events with data (not a bare "data: ")
    assert sum(fast.gap_counts or ()) == max(chunks - 1, 0)
