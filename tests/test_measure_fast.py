"""The fast stream parse gives exactly the reference's result (a differential test).

``RecordBuilder.build`` parses streams with ``texts.stream_texts`` (bytes.split, templates of plain content
chunks, inline reading of the common chunk shape); ``_build(fast=False)`` uses the reference (the SSE
decoder and ``read_chunk`` per event). On random streams of many shapes, split at random read
boundaries and optionally sent with HTTP/1.1 chunked framing, both must give equal Texts and Records.
"""

from __future__ import annotations

import json

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specproxy import texts as texts_mod
from specproxy.chunked import dechunk_reads
from specproxy.measure import RecordBuilder
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


def builder(reads: list[bytes], chunked: bool) -> RecordBuilder:
    body = b'{"model":"m","stream":true,"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]}'
    b = RecordBuilder(method="POST", path="/v1/chat/completions", body=body, t_wall=1.0, t_request=0.5)
    b.on_headers(0.6, 200, "text/event-stream", chunked=chunked)
    for i, r in enumerate(reads):
        b.on_bytes(r, 1.0 + i, 1.0 + i + 0.001 * (i % 3))
    b.finish(2.0 + len(reads))
    return b


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=stream(), cuts=st.lists(st.integers(0, 100_000), max_size=30), chunked=st.booleans(),
       sizes=st.lists(st.integers(1, 64), min_size=1, max_size=4), framed_cut=st.integers(0, 10))
def test_fast_path_equals_reference(tiktoken_tok, data, cuts, chunked, sizes, framed_cut):
    wire = frame(data, sizes) if chunked else data
    if chunked and framed_cut == 0:
        wire = wire[: len(wire) // 2]  # truncated inside the framing
    reads = split(wire, cuts, empty_reads=True)
    b = builder(reads, chunked)
    payload = b.reads if not chunked else dechunk_reads(reads)
    fast = texts_mod.stream_texts(list(payload), b.read_times)
    ref = texts_mod.stream_texts_reference(list(payload), b.read_times)
    assert fast == ref
    assert b._build(tiktoken_tok, fast=True) == b._build(tiktoken_tok, fast=False)


def test_template_stream_is_fast_and_equal(tiktoken_tok):
    """The common shape: a template is derived once and matches the following content chunks."""
    head = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    reads = [head + b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n']
    words = ["Hello", " wörld", " 日本", " 🚀", " \\n", " x\\\"y", "\xa0", " end"]
    for w in words * 5:
        reads.append(head + b'"delta":{"content":"' + w.encode() + b'"},"finish_reason":null}]}\n\n')
    reads.append(head + b'"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    b = builder(reads, False)
    fast = texts_mod._stream_texts_fast(b.reads, b.read_times)
    assert fast is not None and fast == texts_mod.stream_texts_reference(b.reads, b.read_times)
    assert fast.texts[(0, "content")].startswith("Hello wörld 日本 🚀 \n x\"y\xa0 end")
    assert fast.chunks == 40 and fast.finish_reason == "stop" and fast.saw_done
    assert b._build(tiktoken_tok, fast=True) == b._build(tiktoken_tok, fast=False)


def test_odd_shapes_fall_back_to_the_reference():
    for data in (b"data: {}\r\n\r\n", b": ping\n\ndata: {}\n\n", b"data: a\ndata: b\n\n", b"data:{}\n\n",
                 b"event: x\ndata: {}\n\n", b"data: {}\n\n\n", b"data: {}\n"):
        assert texts_mod._stream_texts_fast([data], [1.0]) is None, data


def test_chunked_record_matches_the_unframed_one(tiktoken_tok):
    events = b"".join(b'data: {"choices":[{"index":0,"delta":{"content":"w%d "}}]}\n\n' % i for i in range(20))
    framed = frame(events + b"data: [DONE]\n\n", [37, 5, 80])
    reads = split(framed, list(range(0, len(framed), 23)), empty_reads=True)
    chunked = builder(reads, True)
    plain = builder(list(dechunk_reads(reads)), False)
    a, b = chunked.build(tiktoken_tok), plain.build(tiktoken_tok)
    assert a.response_bytes == len(events) + len(b"data: [DONE]\n\n")
    fields = [f for f in a.__dataclass_fields__ if f != "id"]
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    assert a.error is None and a.saw_done and a.chunks == 20


def test_malformed_chunked_framing_sets_an_error(tiktoken_tok):
    reads = [b"10\r\ndata: {\"choices\"\r\n", b"zz\r\n"]
    rec = builder(reads, True).build(tiktoken_tok)
    assert rec.error and "malformed chunked framing" in rec.error


def _counting_loads(monkeypatch) -> list:
    calls: list = []
    real = orjson.loads

    def loads(data):
        calls.append(data)
        return real(data)

    monkeypatch.setattr(orjson, "loads", loads)
    return calls


def _varying(field: bytes, values: list[bytes]) -> list[bytes]:
    head = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    return [head + b'"delta":{"content":" w%d"},"finish_reason":null}],%b:%b}\n\n' % (i, field, v)
            for i, v in enumerate(values)]


def test_a_number_the_record_never_reads_may_vary_without_a_parse(monkeypatch, tiktoken_tok):
    """A send time or ``created`` changing every chunk: after one derivation, no event is parsed."""
    reads = _varying(b'"t_send"', [b"%d" % (1_000_000_007 * i + 13) for i in range(60)])
    reads[30] = reads[30].replace(b'"t_send":', b'"t_send":0')  # a leading zero: not JSON
    b = builder(reads, False)
    calls = _counting_loads(monkeypatch)
    fast = texts_mod._stream_texts_fast(b.reads, b.read_times)
    parsed = len(calls)
    assert fast == texts_mod.stream_texts_reference(b.reads, b.read_times)
    assert fast.chunks == 59 and fast.bad_events == 1
    assert parsed <= 8  # the first event, its two probes, the leading-zero one (and its retry)


def test_digits_the_record_reads_never_vary_in_a_template(monkeypatch):
    """A choice index after the delta decides which text the content belongs to: every event is parsed."""
    head = b'data: {"choices":[{"delta":{"content":" w%d"},"index":%d}]}\n\n'
    reads = [head % (i, i % 3) for i in range(30)]
    b = builder(reads, False)
    calls = _counting_loads(monkeypatch)
    fast = texts_mod._stream_texts_fast(b.reads, b.read_times)
    assert len(calls) >= 30
    assert fast == texts_mod.stream_texts_reference(b.reads, b.read_times)
    assert sorted(fast.texts) == [(0, "content"), (1, "content"), (2, "content")]
