"""One large kept response (issue 32, "Memory": "peak RSS of one large turn within about 1.5x what it
keeps, and memory returned after"): the real ``serve`` with its limits raised for one 128 MB response,
a scripted upstream, RSS read from /proc (VmHWM: the process's peak).

The response is what a long completion looks like on the wire: small content deltas, one SSE event each,
chunk-framed (relayed by the relay thread or by Python), or one whole JSON body. What measuring keeps is
the body's bytes; what it derives from them (the delivered text, a few percent of the bytes) is small.
"""

from __future__ import annotations

import asyncio
import gzip

import orjson
import pytest

from faultkit import KeptClient, ScriptedUpstream, chunk, db_rows, sse_head, wait_until
from procmem import memory
from serveproc import LoopThread, ServeProcess
from stream_shapes import delta_event

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
MIB = 1 << 20
SIZE = 128 * MIB
SLACK = 32 * MIB  # the interpreter's own churn while one turn is relayed and measured


@pytest.fixture(scope="module")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


def _events() -> bytes:
    """About SIZE bytes of chat deltas of a few characters each, as a server streams a long answer."""
    words = [delta_event(w, b"\n") for w in (" the", " cache", " was", " warm", ".", " And", " then")]
    block = b"".join(words)
    return block * (SIZE // len(block)) + b"data: [DONE]\n\n"


def _framed(payload: bytes, piece: int = 64 * 1024) -> list[bytes]:
    frames = [chunk(payload[i:i + piece]) for i in range(0, len(payload), piece)]
    frames.append(b"0\r\n\r\n")
    return [b"".join(frames[i:i + 16]) for i in range(0, len(frames), 16)]


def _whole_body() -> bytes:
    text = "the cache was warm. " * (SIZE // 20)
    return orjson.dumps({"id": "c", "object": "chat.completion", "model": "big",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 5}})


def _gzipped() -> tuple[bytes, list[bytes]]:
    return sse_head("Content-Encoding: gzip\r\n"), _framed(gzip.compress(_events(), 1))


SHAPES = {
    "chunked_stream": lambda: (sse_head(), _framed(_events())),
    "gzip_chunked_stream": _gzipped,
    "length_stream": lambda: (None, _events()),
    "whole_json": lambda: (None, _whole_body()),
}
# What measuring must hold at once besides what it keeps: a compressed body is read inflated (its size
# is the inflated one). A whole JSON body this large (over max_counted_bytes) is not parsed: a parser
# would copy it and make its text beside it, about three times its size (docs/operations.md, "Memory").
HELD = {"gzip_chunked_stream": lambda: len(_events())}


def _head_for(shape: str, body: bytes) -> bytes:
    kind = "text/event-stream" if shape == "length_stream" else "application/json"
    return (f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n").encode()


# a chunked body by either relay; a Content-Length body is relayed by Python whatever the setting
CASES = [(shape, relay) for shape in SHAPES for relay in ("thread", "python")
         if relay == "thread" or "chunked" in shape]


@pytest.mark.parametrize(("shape", "relay"), CASES)
def test_one_large_kept_response_peaks_near_its_size_and_is_let_go_of(tmp_path, loop_thread, shape, relay):
    head, body = SHAPES[shape]()
    if head is None:
        head, body = _head_for(shape, body), [body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)]
    kept = sum(map(len, body))
    held = HELD[shape]() if shape in HELD else kept

    async def respond(req, writer, index) -> bool:
        if b'"model":"big"' not in req.body[:64]:
            writer.write(sse_head() + chunk(delta_event("hi", b"\n") + b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            return True
        writer.write(head)
        for piece in body:
            writer.write(piece)
            await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)
    loop_thread.run(upstream.start())
    env = {"SPECPROXY_MEMORY_BUDGET_BYTES": str(1024 * MIB), "SPECPROXY_MAX_MEASURED_BYTES": str(256 * MIB),
           "SPECPROXY_RELAY": relay}
    db = tmp_path / "turns.db"
    proc = ServeProcess(tmp_path, upstream.url, db, env=env)

    def request(model: str) -> bytes:
        b = orjson.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": "go"}]})
        return (f"POST {CHAT} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(b)}\r\n\r\n").encode() + b

    async def ask(model: str) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", proc.port)
        writer.write(request(model))
        got = 0
        try:
            while piece := await asyncio.wait_for(reader.read(1 << 20), 120):
                got += len(piece)  # read and dropped: the test's own memory stays small
                if got >= kept or (model == "warm" and piece.endswith(b"0\r\n\r\n")):
                    break
        finally:
            writer.close()
        return got

    for i in range(3):  # warm: the relay thread, the measuring thread, the writer
        asyncio.run(ask("warm"))
    wait_until(lambda: len(db_rows(db)) >= 3, 30, 0.05, "the warm-up rows")
    before = memory(proc.proc.pid)
    assert asyncio.run(ask("big")) >= kept
    wait_until(lambda: len(db_rows(db)) >= 4, 120, 0.05, "the large turn's row")
    wait_until(lambda: proc.state()["pending_measure"] == 0, 60, 0.05, "measuring done")
    after = memory(proc.proc.pid)
    capped, reason, response_bytes, outcome, usage = db_rows(
        db, "SELECT measure_capped, measure_capped_reason, response_bytes, outcome, usage_completion_tokens "
            "FROM turns ORDER BY rowid DESC LIMIT 1")[0]
    print(f"{shape}/{relay}: kept {kept / MIB:.0f} MiB, RSS before {before['VmRSS'] / MIB:.0f} MiB, "
          f"peak +{(after['VmHWM'] - before['VmRSS']) / MIB:.0f}, after +{(after['VmRSS'] - before['VmRSS']) / MIB:.0f}")
    proc.stop()
    loop_thread.run(upstream.close())
    if shape == "whole_json":  # read for its usage alone, and says so
        assert (outcome, capped, reason, usage) == ("ok", 1, "response_over_max_counted_bytes", 5)
    else:
        assert (outcome, capped, reason) == ("ok", 0, None)
    assert after["VmHWM"] - before["VmRSS"] <= 1.5 * held + SLACK
    assert after["VmRSS"] - before["VmRSS"] <= SLACK, "the large response was not let go of"
