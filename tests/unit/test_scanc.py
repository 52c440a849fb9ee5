"""specproxy.frames._scanc, the measuring's per-chunk scans in C, read by their own contracts.

The streams it reads are checked against the reference in test_measure_fast.py and the join against
the state machine in test_chunked.py. Here: that CI builds it; that ``template_run`` takes exactly the
content strings orjson reads (the reference parses each event with orjson), reading them as orjson
does; that ``chunk_gaps`` counts and buckets the chunks each read ended as a plain count of its blank
lines does; and that the proxy measures chat streams with it.
"""

from __future__ import annotations

import math
import os
from itertools import accumulate

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from measurekit import builder
from specproxy.app.fake_upstream import Script
from specproxy.measure import fast_texts
from specproxy.measure.build import build_record
from specproxy.measure.chunk_gaps import GAP_BOUNDS_S, gap_buckets
from specproxy.measure.texts import Texts

_scanc = fast_texts.scans
pytestmark = pytest.mark.skipif(_scanc is None, reason="specproxy.frames._scanc is not built")

PREFIX, HEAD, CLOSING = b'data: {"choices":[{"delta":{"content":"', b'"}}],"t":', b"}"


def test_scanc_is_built_where_required():
    """CI sets SPECPROXY_REQUIRE_RELAYC=1 (it requires both C modules): a silent fallback fails here."""
    if os.environ.get("SPECPROXY_REQUIRE_RELAYC") != "1":
        pytest.skip("SPECPROXY_REQUIRE_RELAYC is not set")
    assert _scanc is not None


def _orjson_string(body: bytes) -> str | None:
    try:
        value = orjson.loads(b'"' + body + b'"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


pieces = st.sampled_from([
    b"a", b" ", b'"', b"\\", b"\\n", b"\\t", b"\\/", b"\\b", b"\\f", b"\\r", b'\\"', b"\\\\", b"\\x", b"\\u",
    b"\\u00e9", b"\\u00E9", b"\\u0000", b"\\ud83d", b"\\ude80", b"\\ud83d\\ude80", b"\\uDBFF\\uDFFF", b"\\uzzzz", b"\\uE000",
    b"\x01", b"\x1f", b"\x7f", "é".encode(), "日".encode(), "🚀".encode(), b"\xe6\x97", b"\xa5", b"\xff", b"\xc0\xaf",
    b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf0\x8f\xbf\xbf", b"\xef\xbf\xbf", b"\xf4\x8f\xbf\xbf",
])
bodies = st.one_of(st.lists(pieces, max_size=8).map(b"".join),
                   st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")))


@settings(max_examples=examples(800), deadline=None)
@given(body=bodies)
def test_a_body_is_taken_exactly_when_orjson_reads_it(body):
    event = PREFIX + body + HEAD + b"17" + CLOSING + b"\n\n"
    count, size, text, nonempty, text_size = _scanc.template_run(event, 0, PREFIX, HEAD, 2, CLOSING)
    expected = _orjson_string(body)
    if expected is None:
        assert (count, size, text, nonempty, text_size) == (0, 0, "", 0, 0)
    else:
        assert (count, size, text) == (1, len(event), expected)
        assert (nonempty, text_size) == ((1, len(event)) if body else (0, 0))


@pytest.mark.parametrize("body", [b"\\ud83d\\ude80", b"\\ud83d\\uE000", b"\\ud83d\\uDBFF", b"\\ud83d\\u0041", b"\\ude80\\ud83d",
                                  b"\\ud83d", b"\\ud83dx", b"\\uDBFF\\uDFFF", b"\\uD800\\uDC00", b"\\u0000", b"\\uFFFF"])
def test_surrogate_escapes_are_read_as_orjson_reads_them(body):
    test_a_body_is_taken_exactly_when_orjson_reads_it.hypothesis.inner_test(body=body)


@settings(max_examples=examples(250), deadline=None)
@given(events=st.lists(st.tuples(bodies, st.sampled_from([b"17", b"99", b"07", b"1", b"x7", b"170"])),
                       min_size=1, max_size=6), tail=st.sampled_from([b"", b"data: [DONE]\n\n", b"data: x"]))
def test_a_run_stops_at_the_first_event_that_is_not_the_templates(events, tail):
    buf = b"".join(PREFIX + body + HEAD + digits + CLOSING + b"\n\n" for body, digits in events) + tail
    count, size, text, nonempty, text_size = _scanc.template_run(buf, 0, PREFIX, HEAD, 2, CLOSING)
    ok = 0
    for body, digits in events:  # two digits, no leading zero, and a string orjson reads
        if len(digits) != 2 or not digits.isdigit() or digits[0] == 48 or _orjson_string(body) is None:
            break
        ok += 1
    lens = [len(PREFIX + b + HEAD + d + CLOSING) + 2 for b, d in events[:ok]]
    with_text = [i for i, (b, _) in enumerate(events[:ok]) if b]
    assert count == ok and size == sum(lens)
    assert text == "".join(_orjson_string(b) for b, _ in events[:ok])
    assert nonempty == len(with_text)
    assert text_size == (sum(lens[: with_text[-1] + 1]) if with_text else 0)


def test_a_run_starts_where_it_is_told_and_needs_its_blank_line():
    event = PREFIX + b"hi" + HEAD + b"12" + CLOSING
    buf = b"data: [DONE]\n\n" + event + b"\n\n" + event + b"\n" + event
    assert _scanc.template_run(buf, 14, PREFIX, HEAD, 2, CLOSING) == (1, len(event) + 2, "hi", 1, len(event) + 2)
    assert _scanc.template_run(buf, 0, PREFIX, HEAD, 2, CLOSING)[0] == 0
    assert _scanc.template_run(event, 0, PREFIX, HEAD, 2, CLOSING)[0] == 0  # a tail: no blank line after it
    no_digits = PREFIX + b"x" + HEAD + CLOSING + b"\n\n"
    assert _scanc.template_run(no_digits, 0, PREFIX, HEAD + CLOSING, 0, b"")[:3] == (1, len(no_digits), "x")


def test_bad_arguments_are_errors_not_crashes():
    with pytest.raises(TypeError):
        _scanc.template_run("str", 0, PREFIX, HEAD, 2, CLOSING)
    with pytest.raises(TypeError):
        _scanc.template_run(b"", 0, PREFIX, HEAD, 2)
    with pytest.raises(ValueError):
        _scanc.template_run(b"abc", 4, PREFIX, HEAD, 2, CLOSING)
    with pytest.raises(ValueError):
        _scanc.template_run(b"abc", 0, b"", HEAD, 2, CLOSING)
    with pytest.raises(TypeError):
        _scanc.join_frames(b"1\r\nx\r\n", True)
    with pytest.raises(TypeError):
        _scanc.join_frames([b"1\r\nx\r\n"])


class _Runs:
    """How many times ``template_run`` read a run of like chunks since the last ``take``."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        run = _scanc.template_run

        def counted(*args):
            self.calls += 1
            return run(*args)

        monkeypatch.setattr(_scanc, "template_run", counted)

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


def test_a_builder_reads_a_chat_stream_natively_and_as_the_reference_does(monkeypatch, tiktoken_tok):
    """A chunked chat stream is read by the C scans (a run of its like chunks in one call), and its
    Record is the reference's."""
    events = [b'data: {"choices":[{"index":0,"delta":{"content":" w%d"}}]}\n\n' % i for i in range(30)]
    reads = [b"%x\r\n%b\r\n" % (len(e), e) for e in [*events, b"data: [DONE]\n\n"]] + [b"0\r\n\r\n"]
    runs = _Runs(monkeypatch)
    native = build_record(builder(reads, True), tiktoken_tok)
    assert runs.take() > 0
    reference = build_record(builder(reads, True), tiktoken_tok, fast=False)
    assert runs.take() == 0
    fields = [f for f in native.__dataclass_fields__ if f != "id"]
    assert [getattr(native, f) for f in fields] == [getattr(reference, f) for f in fields]
    assert native.chunks == 30 and native.saw_done


async def _chat(url: str) -> bytes:
    async with aiohttp.ClientSession() as c:
        async with c.post(url + "/v1/chat/completions", json={
                "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200
            return await r.read()


def test_the_proxy_measures_chat_streams_with_the_c_scans(make_stack, monkeypatch):
    """What ships: a streamed turn through the proxy is read by the C scans, not left to the reference."""
    runs = _Runs(monkeypatch)
    stack = make_stack(None, scrape_interval_s=0)
    stack.upstream.script = Script(pieces=[f" w{i}" for i in range(30)])
    assert b"[DONE]" in stack.run(_chat(stack.url))
    stack.settle()
    assert runs.take() > 0
    assert len(stack.records) == 1 and stack.records[0].chunks == 30


@st.composite
def clocked(draw):
    """Events ended by blank lines (some without data: ``skip`` names the read holding their second LF),
    maybe a tail event after them, cut into reads (empty ones too), at nondecreasing times: repeated,
    the buckets' bounds apart (from 0.0, exactly), or anything."""
    events = draw(st.lists(st.tuples(st.sampled_from([b"data: x", b"a", b"data: {}"]), st.booleans()), max_size=30))
    tail = draw(st.sampled_from([b"", b"data: t"]))
    buf = b"".join(body + b"\n\n" for body, _ in events) + tail
    cum = sorted(min(c, len(buf)) for c in draw(st.lists(st.integers(0, len(buf)), max_size=12))) + [len(buf)]
    skip, end = [], 0
    for body, text in events:
        end += len(body) + 2
        if not text:
            skip.append(next(r for r, c in enumerate(cum) if c >= end))
    steps = draw(st.lists(st.one_of(st.sampled_from([0.0, 0.0, *GAP_BOUNDS_S]), st.floats(0.0, 5.0)),
                          min_size=len(cum), max_size=len(cum)))
    times = list(accumulate(steps, initial=draw(st.sampled_from([0.0, 1.0, 1234.5678]))))[1:]
    return buf, cum, times, skip, bool(tail) and draw(st.booleans())


def _chunk_clock(buf: bytes, cum: list[int], times: list[float], skip: list[int], tail_chunk: bool) -> Texts:
    """The plain count ``chunk_gaps`` is held to: each LF LF pair (counted from the start without
    overlap, as ``bytes.count``) ends a chunk in the read holding its second LF, less one per ``skip``
    entry, plus the tail in the last read; each read's chunks ticked at its time (``Texts.tick``)."""
    per_read = [0] * len(cum)
    at = buf.find(b"\n\n")
    while at >= 0:
        per_read[next(r for r, end in enumerate(cum) if end > at + 1)] += 1
        at = buf.find(b"\n\n", at + 2)
    for r in skip:
        per_read[r] -= 1
    if tail_chunk:
        per_read[-1] += 1
    ref = Texts()
    for t, n in zip(times, per_read):
        if n:
            ref.tick(t, n)
    return ref


@settings(max_examples=examples(300), deadline=None)
@given(case=clocked())
def test_chunk_gaps_equal_a_plain_count_bucketed(case):
    """``chunk_gaps``: the chunks each read completed (blank lines ended in it, less ``skip``, plus the
    tail) and their gaps bucketed, exactly as a plain count, ticked and bucketed by ``gap_buckets``."""
    buf, cum, times, skip, tail_chunk = case
    ref = _chunk_clock(buf, cum, times, skip, tail_chunk)
    assert _scanc.chunk_gaps(buf, cum, times, skip, tail_chunk, GAP_BOUNDS_S) == gap_buckets(
        ref.chunk_times, ref.chunk_counts)


def test_chunk_gaps_put_a_gap_equal_to_a_bound_in_its_bucket():
    """``le``: a gap equal to a bound is in its bucket, one a hair above it in the next; fewer than two
    chunks have no gaps; a read that ended no event cannot have one without data."""
    buf, cum = b"a\n\nb\n\n", [3, 6]
    for i, bound in enumerate(GAP_BOUNDS_S):
        for gap, bucket in ((bound, i), (math.nextafter(bound, math.inf), i + 1)):
            counts, total = _scanc.chunk_gaps(buf, cum, [0.0, gap], [], False, GAP_BOUNDS_S)
            assert (counts.index(1), sum(counts), total) == (bucket, 1, gap)
    assert _scanc.chunk_gaps(buf, cum, [0.0, 1.0], [1], False, GAP_BOUNDS_S) is None
    assert _scanc.chunk_gaps(buf + b"data: t", [3, 6, 13], [0.0, 0.0, 0.0], [0, 1], True, GAP_BOUNDS_S) is None
    with pytest.raises(ValueError):
        _scanc.chunk_gaps(buf, [3, 6], [0.0, 1.0], [0, 0], False, GAP_BOUNDS_S)
    with pytest.raises(ValueError):
        _scanc.chunk_gaps(buf, [len(buf) + 1], [0.0], [], False, GAP_BOUNDS_S)
