"""The relay's per-read path in C (``specproxy/wire/_relayc.c``) against its Python reference.

``_relayc.ChunkedEnd`` must find a chunked body's end, keep the same state between reads and refuse the
same malformed framing with the same message as ``http1.ChunkedEnd``, whatever the read boundaries;
``RelayBase.data_received`` must really take the body's reads (else the accelerator is dead code) and
leave every other read to ``_data_received_py``. End to end, the relay tests (test_relay_framing.py,
test_faults_upstream.py) run in both modes through the ``each_relay`` fixture.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faultkit import ScriptedUpstream, chunk, db_records, exchange, parse_response
from readsplit import split
from specproxy.wire import upstream
from specproxy.wire.upstream import ChunkedEnd, FramingError

from framing_strategies import chunked_bodies  # noqa: E402

relayc = upstream._relayc
needs_relayc = pytest.mark.skipif(relayc is None, reason="specproxy.wire._relayc is not built")


def test_relayc_is_built_where_required():
    """CI sets SPECPROXY_REQUIRE_RELAYC=1: a build that silently fell back to pure Python fails here."""
    if os.environ.get("SPECPROXY_REQUIRE_RELAYC") != "1":
        pytest.skip("SPECPROXY_REQUIRE_RELAYC is not set")
    assert relayc is not None and upstream.RELAY_C


def _trace(tracker, reads):
    """Each feed's result (or the error's type and text), and the state left behind."""
    out = []
    for data in reads:
        try:
            out.append(("end", tracker.feed(data), tracker.rem))
        except FramingError as exc:
            out.append(("error", str(exc)))
            break
    return out


@needs_relayc
@settings(max_examples=600, deadline=None)
@given(chunked_bodies(), st.lists(st.integers(0, 12_000), max_size=25))
def test_c_chunked_end_behaves_like_the_python_one(body, cuts):
    reads = split(body, cuts)
    assert _trace(relayc.ChunkedEnd(), reads) == _trace(ChunkedEnd(), reads)


@needs_relayc
def test_c_chunked_end_takes_any_buffer_and_refuses_collecting():
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


@pytest.mark.parametrize("mode", upstream.RELAY_MODES)
def test_body_reads_take_the_path_the_mode_says(make_stack, tiktoken_tok, monkeypatch, mode):
    """With the relay thread or the C per-read path no read of the body reaches Python (the thread's
    counters show which of the two relayed it); in Python mode they all do. All give the same turn."""
    if mode != "python" and relayc is None:
        pytest.skip("specproxy.wire._relayc is not built")
    monkeypatch.setattr(upstream, "RELAY_C", mode != "python")
    monkeypatch.setattr(upstream, "RELAY_THREAD", mode == "thread")
    before = relayc.pump_stats() if relayc is not None else None
    body_reads_in_python = []
    original = upstream.UpstreamConn._data_received_py

    def spy(self, data):
        if self.state == upstream._BODY:
            body_reads_in_python.append(data)
        return original(self, data)

    monkeypatch.setattr(upstream.UpstreamConn, "_data_received_py", spy)
    if relayc is None:  # the pure-Python class binds data_received to the method itself
        monkeypatch.setattr(upstream.UpstreamConn, "data_received", spy)
    scripted = ScriptedUpstream(_answer_in_pieces)
    stack = make_stack(tiktoken_tok, raw_script=scripted.serve, scrape_interval_s=0)
    raw, _ = stack.run(exchange(stack.service.port, REQUEST, timeout=5))
    resp, _ = parse_response(raw)
    assert resp.status == 200 and resp.complete and resp.body == b"".join(EVENTS)
    (rec,) = db_records(stack, 1)
    assert rec["outcome"] == "ok" and rec["chunks"] == 2 and rec["saw_done"] == 1
    if mode == "python":
        assert len(body_reads_in_python) >= len(EVENTS)
    else:
        assert body_reads_in_python == []
    if relayc is not None:
        after = relayc.pump_stats()
        if mode == "thread":
            assert after["turns"] == before["turns"] + 1
            assert after["reads"] >= before["reads"] + len(EVENTS)
        else:
            assert after == before


class _Transport:
    def __init__(self, closing: bool = False, buffered: int = 0) -> None:
        self.written: list[bytes] = []
        self.closing = closing
        self.buffered = buffered

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered


class _Builder:
    def __init__(self) -> None:
        self.reads: list[bytes] = []
        self.read_times: list[float] = []
        self.write_times: list[float] = []


class _Pool:
    last_read = 0.0


def _armed(out: _Transport, builder=None):
    class Probe(relayc.RelayBase):
        def __init__(self) -> None:
            self.calls: list[tuple] = []
            self.pool = _Pool()

        def _data_received_py(self, data):
            self.calls.append(("py", data))

        def _complete(self, outcome, error):
            self.calls.append(("complete", outcome, error))

        def _truncated(self, reason):
            self.calls.append(("truncated", reason))

        def _client_gone(self, reason):
            self.calls.append(("client_gone", reason))

        def _pause(self):
            self.calls.append(("pause",))

    p = Probe()
    p.state = upstream._BODY
    p.framing = relayc.ChunkedEnd()
    p._fast_attach(out, builder)
    return p


@needs_relayc
def test_the_armed_path_writes_stamps_and_ends_like_the_python_body():
    out, b = _Transport(), _Builder()
    p = _armed(out, b)
    p.data_received(b"3\r\nabc\r\n")
    p.data_received(b"0\r\n\r\nstray")
    assert out.written == [b"3\r\nabc\r\n", b"0\r\n\r\n"]  # bytes past the body never reach the client
    assert b.reads == out.written and len(b.read_times) == len(b.write_times) == 2
    assert all(r <= w for r, w in zip(b.read_times, b.write_times)) and p.last_read == b.read_times[-1]
    assert p.pool.last_read == b.read_times[-1] and not p.reusable
    assert p.calls == [("complete", "ok", None)]


@needs_relayc
def test_the_armed_path_hands_every_edge_to_python():
    p = _armed(_Transport(buffered=10**6))
    p._high = 1000
    p.data_received(b"3\r\nabc\r\n")
    assert p.calls == [("pause",)]  # the client's buffer is over the high-water mark
    p = _armed(out := _Transport(closing=True))
    p.data_received(b"3\r\nabc\r\n")
    assert p.calls == [("client_gone", "client disconnected")] and out.written == []
    p = _armed(out := _Transport())
    p.data_received(b"zz\r\n")
    assert p.calls == [("truncated", "malformed chunked framing from the upstream (malformed chunk size)")]
    assert out.written == []


@needs_relayc
def test_reads_go_to_python_unless_armed_for_a_body():
    p = _armed(out := _Transport())
    p.state = upstream._WAIT_HEAD
    p.data_received(b"HTTP/1.1 200 OK\r\n")
    p.state = upstream._BODY
    p.framing = None  # not the C framing (e.g. reassigned by Python code): never dereferenced as one
    p.data_received(b"3\r\nabc\r\n")
    p.framing = relayc.ChunkedEnd()
    p._fast_detach()
    p.data_received(b"x")
    assert [c[0] for c in p.calls] == ["py", "py", "py"] and out.written == []
