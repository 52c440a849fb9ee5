"""The native chunked-framing parser (``_chunked.h``, through ``_relayc.ChunkedEnd``) against its Python
reference (``frames/chunked.py``'s ``ChunkedEnd``), and which relay carries a body.

The parser must find a chunked body's end, keep the same state between reads and refuse the same
malformed framing with the same message at the same read as the reference, whatever the read boundaries:
the relay thread runs it, and the Python relay (the reference path, and the one for what the thread
cannot take) runs the reference. The relay thread itself is held to the reference on real sockets in
tests/integration/test_relay_thread.py; end to end, test_relay_framing.py runs through both relays.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from faultkit import ScriptedUpstream, chunk, db_records, exchange, parse_response
from readsplit import split
from specproxy.config import RELAY_MODES
from specproxy.frames.chunked import MAX_LINE_BYTES, ChunkedEnd, FramingError
from specproxy.wire import relay_thread, upstream

from framing_strategies import chunked_bodies  # noqa: E402

relayc = relay_thread._relayc
needs_relayc = pytest.mark.skipif(relayc is None, reason="specproxy.wire._relayc is not built")


def test_relayc_is_built_where_required():
    """CI sets SPECPROXY_REQUIRE_RELAYC=1: a build that silently fell back to pure Python fails here."""
    if os.environ.get("SPECPROXY_REQUIRE_RELAYC") != "1":
        pytest.skip("SPECPROXY_REQUIRE_RELAYC is not set")
    assert relayc is not None and relay_thread.THREAD_BUILT


def _trace(tracker, reads):
    """Each feed's result (or the error's text), and the state left behind."""
    out = []
    for data in reads:
        try:
            out.append(("end", tracker.feed(data), tracker.rem))
        except FramingError as exc:
            out.append(("error", str(exc)))
            break
    return out


@needs_relayc
@settings(max_examples=examples(300), deadline=None)
@given(chunked_bodies(), st.lists(st.integers(0, 12_000), max_size=25))
def test_the_native_parser_behaves_like_the_reference(body, cuts):
    reads = split(body, cuts)
    assert _trace(relayc.ChunkedEnd(), reads) == _trace(ChunkedEnd(), reads)


# framing a lenient parser would pass on, each refused by both parsers at the read that shows it
MALFORMED = [
    ([b"5\nhello\r\n0\n\n"], "not ended by CRLF"),  # bare-LF size lines
    ([b"5\r\nhello\r\n0\n\n"], "not ended by CRLF"),  # a bare-LF last chunk
    ([b"5\r\nhello\r\n0\r\nT: 1\n\r\n"], "not ended by CRLF"),  # a bare-LF trailer
    ([b"5\r\nhello\n10\r\n\r\n"], "chunk data not followed by CRLF"),
    ([b"5\r\nhello", b"\n10\r\n\r\n"], "chunk data not followed by CRLF"),  # the CRLF due in the next read
    ([b"5\r\nhello\r", b"X0\r\n\r\n"], "chunk data not followed by CRLF"),  # its LF due in the next read
    ([b"5\r\nhel", b"loXY0\r\n\r\n"], "chunk data not followed by CRLF"),
    ([b"5;a\rb\r\nhello\r\n"], "bare CR"),
    ([b" 5\r\nhello\r\n"], "malformed chunk size"),  # no leading space
    ([b"5;\x01x\r\nhello\r\n"], "malformed chunk extension"),  # a control byte in an extension
    ([b"5;a=b;\r\nhello\r\n"], "malformed chunk extension"),  # no name
    ([b'5;a="b\r\nhello\r\n'], "malformed chunk extension"),  # an unclosed quoted-string
    ([b"5;a", b"=\x00\r\n"], "malformed chunk extension"),  # a NUL value, the line across reads
    ([b"5\r\nhello\r\n0\r\nX-A: a\x00b\r\n\r\n"], "malformed trailer field"),  # a NUL in a trailer
    ([b"5\r\nhello\r\n0\r\nnocolon\r\n\r\n"], "malformed trailer field"),  # a trailer line with no colon
    ([b"5\r\nhello\r\n0\r\nX : 1\r\n\r\n"], "malformed trailer field"),  # a space before the colon
    ([b"0\r\nT: 1\r\n", b" folded\r\n\r\n"], "malformed trailer field"),  # an obs-fold line
    ([b"5" + b" " * MAX_LINE_BYTES + b"\r\n"], "over 4096 bytes"),
    ([b"5;" + b"x" * (MAX_LINE_BYTES // 2), b"x" * (MAX_LINE_BYTES // 2)], "over 4096 bytes"),  # across reads
]


@pytest.mark.parametrize("reads,why", MALFORMED)
@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
def test_malformed_framing_is_refused_at_the_read_that_shows_it(reads, why, native):
    if native and relayc is None:
        pytest.skip("specproxy.wire._relayc is not built")
    got = _trace(relayc.ChunkedEnd() if native else ChunkedEnd(), reads)
    assert got[-1][0] == "error" and why in got[-1][1] and len(got) == len(reads), got


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
def test_well_formed_framing_split_anywhere_ends_where_it_ends(native):
    if native and relayc is None:
        pytest.skip("specproxy.wire._relayc is not built")
    body = b'5;x=1 \r\nhello\r\na ; y ;z = "q\\"\t;" \r\n0123456789\r\n0\r\nT: 1\r\nV:\ta b\xff\r\n\r\n'
    line = b"5" + b" " * (MAX_LINE_BYTES - 1) + b"\r\nhello\r\n0\r\n\r\n"  # a line of exactly the limit
    for whole in (body, line):
        for cut in range(len(whole) + 1):
            parser = relayc.ChunkedEnd() if native else ChunkedEnd()
            first = parser.feed(whole[:cut])
            assert (first if first >= 0 else cut + parser.feed(whole[cut:])) == len(whole)


@needs_relayc
def test_the_native_parser_takes_any_buffer_and_refuses_collecting():
    assert relayc.ChunkedEnd().feed(memoryview(b"3\r\nabc\r\n0\r\n\r\nextra")) == 13
    assert relayc.ChunkedEnd().payload is None
    with pytest.raises(ValueError):
        relayc.ChunkedEnd(collect=True)


EVENTS = [b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n',
          b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n', b"data: [DONE]\n\n"]
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
           b"Content-Length: 56\r\nConnection: close\r\n\r\n"
           b'{"model":"m","stream":true,"messages":[{"role":"user"}]}')


async def _answer_in_pieces(_req, writer, _i):
    import asyncio

    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    await writer.drain()
    for e in EVENTS:  # one read per event, as an engine writes them
        await asyncio.sleep(0.02)
        writer.write(chunk(e))
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


@pytest.mark.parametrize("relay", RELAY_MODES)
def test_body_reads_take_the_path_the_relay_setting_says(make_stack, tiktoken_tok, monkeypatch, relay):
    """With ``relay = "thread"`` no read of the body reaches Python (the thread's counters show it relayed
    them); with ``python`` they all do. Both give the same turn."""
    if relay == "thread" and relayc is None:
        pytest.skip("specproxy.wire._relayc is not built")
    before = relayc.pump_stats() if relayc is not None else None
    body_reads_in_python = []
    original = upstream.UpstreamConn.data_received

    def spy(self, data):
        if self.state is upstream.ConnState.BODY:
            body_reads_in_python.append(data)
        return original(self, data)

    monkeypatch.setattr(upstream.UpstreamConn, "data_received", spy)
    scripted = ScriptedUpstream(_answer_in_pieces)
    stack = make_stack(tiktoken_tok, raw_script=scripted.serve, scrape_interval_s=0, relay=relay)
    raw, _ = stack.run(exchange(stack.service.port, REQUEST, timeout=5))
    resp, _ = parse_response(raw)
    assert resp.status == 200 and resp.complete and resp.body == b"".join(EVENTS)
    (rec,) = db_records(stack, 1)
    assert rec["outcome"] == "ok" and rec["chunks"] == 2 and rec["saw_done"] == 1
    if relay == "python":
        assert len(body_reads_in_python) >= len(EVENTS)
    else:
        assert body_reads_in_python == []
    if relayc is not None:
        after = relayc.pump_stats()
        if relay == "thread":
            assert after["turns"] == before["turns"] + 1
            assert after["reads"] >= before["reads"] + len(EVENTS)
        else:
            assert after["turns"] == before["turns"]
