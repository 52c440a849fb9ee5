"""Never break what it measures: bytes. Whatever shape, encoding or content the bytes have, the client
gets exactly the upstream's bytes and the request reaches the upstream exactly as the client sent it;
measuring copes or says it could not, and every turn still gets its row.

Issue 6, items 1 (byte identity under any split), 7 (gzip) and 11 (hostile JSON).
"""

from __future__ import annotations

import asyncio
import gzip
import random
import time
import zlib

import aiohttp
import orjson
import pytest

from specproxy.frames.chunked import dechunk_reads

from faultkit import ScriptedUpstream, chunk, db_records
from stream_shapes import Stream, make_stream, split_plan

pytestmark = pytest.mark.usefixtures("each_front")  # the lane and aiohttp's server alone (conftest.py)

CHAT = "/v1/chat/completions"


def _spy_reads(stack) -> dict[bytes, list[int]]:
    """Record, per request body, the payload size of every read the proxy made from the upstream (the
    reads hold chunked framing as relayed; the payload is what the events are decoded from)."""
    proxy = stack.service.proxy
    seen: dict[bytes, list[int]] = {}
    submit = proxy._submit

    def spy(builder):
        builder.take_relayed()  # the relay thread's reads (the product makes these objects at build time)
        reads = dechunk_reads(builder.reads) if builder.chunked else builder.reads
        seen[builder.body] = [len(r) for r in reads if r]
        submit(builder)

    proxy._submit = spy
    return seen


async def _stream_body(url: str) -> bytes:
    """One streamed chat request through the proxy; the body exactly as the client received it."""
    async with aiohttp.ClientSession(auto_decompress=False) as s, \
            s.post(url + CHAT, json={"stream": True, "messages": []}) as r:
        return await r.read()


# --- 1. byte identity -----------------------------------------------------------------------------

N_STREAMS = 1000
ONE_BYTE_STREAMS = 150  # the first ones: written a byte at a time, in lockstep with the client


def _streams_through(front: str) -> list[int]:
    """The lane (what ships) takes all the streams; aiohttp's server alone, which relays with the same relay
    and differs in reading requests and writing heads, a third of the one-byte streams (the costly ones:
    a round trip per byte) and 250 of the others."""
    return list(range(N_STREAMS)) if front == "lane" else [*range(50), *range(ONE_BYTE_STREAMS, ONE_BYTE_STREAMS + 250)]


@pytest.mark.slow
def test_byte_identity_over_1000_streams_of_every_shape(make_stack, tiktoken_tok, each_front):
    """1000 streams: 150 written one byte a write in lockstep with the client (so the proxy reads one
    byte at a time: every multi-byte UTF-8 character is split across reads), the rest cut at random
    (always once inside a UTF-8 character), merged several events to a write, or whole; CRLF or LF,
    ``: ping``, ``event:``/``id:``/``retry:`` lines; chunked, Content-Length or close-delimited framing.
    The client gets the upstream's bytes exactly and every count matches the truth. Through aiohttp's
    server alone, 300 of the same streams (``_streams_through``)."""
    rng = random.Random(6001)
    seeds = _streams_through(each_front)
    specs: dict[int, tuple[Stream, list[bytes], str, bool]] = {}
    for seed in range(N_STREAMS):  # every stream made, whichever are sent: the same streams through each front
        st = make_stream(rng)
        mode = "bytes" if seed < ONE_BYTE_STREAMS else rng.choice(["cut", "cut", "cut", "merge", "merge", "one"])
        framing = rng.choice(["chunked", "chunked", "chunked", "length", "close"])
        specs[seed] = (st, split_plan(rng, st, mode), framing, mode == "bytes")
    progress: dict[int, int] = {}
    state: dict[str, asyncio.Condition] = {}

    async def respond(req, writer, _i):
        seed = orjson.loads(req.body)["seed"]
        st, plan, framing, lockstep = specs[seed]
        extra = {"chunked": "Transfer-Encoding: chunked\r\n", "length": f"Content-Length: {len(st.body)}\r\n",
                 "close": "Connection: close\r\n"}[framing]
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" + extra.encode() + b"\r\n")
        sent = 0
        cond = state["cond"]
        for piece in plan:
            writer.write(chunk(piece) if framing == "chunked" else piece)
            await writer.drain()
            sent += len(piece)
            if lockstep:  # the next byte only once the client has this one: one byte per proxy read
                async with cond:
                    await asyncio.wait_for(cond.wait_for(lambda: progress.get(seed, 0) >= sent), 10)
        if framing == "chunked":
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        return framing != "close"

    upstream = ScriptedUpstream(respond)
    stack = make_stack(tiktoken_tok, raw_script=upstream.serve, scrape_interval_s=0)
    reads = _spy_reads(stack)
    got: dict[int, bytes] = {}

    async def one(session, seed, sem):
        async with sem:
            body = orjson.dumps({"model": f"m{seed}", "stream": True, "seed": seed,
                                 "messages": [{"role": "user", "content": "hi"}]})
            buf = bytearray()
            async with session.post(stack.url + CHAT, data=body, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200
                async for data in r.content.iter_any():
                    buf += data
                    async with state["cond"]:
                        progress[seed] = len(buf)
                        state["cond"].notify_all()
            got[seed] = bytes(buf)

    async def run_all():
        state["cond"] = asyncio.Condition()
        sem = asyncio.Semaphore(32)
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            await asyncio.gather(*(one(s, seed, sem) for seed in seeds))

    stack.run(run_all(), timeout=600)  # a bound on a hang, not a speed test: how fast is the machine's doing
    stack.settle()
    recs = {r.model: r for r in stack.records}
    assert len(recs) == len(seeds)
    one_byte_reads = 0
    for seed in seeds:
        st, _plan, _framing, lockstep = specs[seed]
        assert got[seed] == st.body, f"stream {seed}: the client must get the upstream's bytes, unchanged"
        rec = recs[f"m{seed}"]
        assert rec.outcome == "ok" and rec.status == 200 and rec.streamed
        assert rec.response_bytes == len(st.body)
        assert rec.content_tokens == tiktoken_tok.count(st.content), seed
        assert rec.chunks == st.text_events, seed
        assert rec.saw_done is st.done
        assert rec.usage_completion_tokens == st.usage  # None when the server sent no usage, never 0
        body = next(b for b in reads if orjson.loads(b)["seed"] == seed) if lockstep else None
        if lockstep:
            assert reads[body] == [1] * len(st.body), f"stream {seed} was not read one byte at a time"
            one_byte_reads += len(st.body)
    assert one_byte_reads > 20000 * sum(seed < ONE_BYTE_STREAMS for seed in seeds) // ONE_BYTE_STREAMS  # ~140 a stream


def test_one_mebibyte_data_line(make_stack, tiktoken_tok):
    """A single ``data:`` line of 1 MiB (one event), written in 16 KiB pieces: identical bytes, and the
    event is measured as one chunk with every token counted."""
    words = ["alpha", " beta", " gamma", " délta", " 日本", " 🚀", "\n"]
    rng = random.Random(7)
    text = ""
    while len(text.encode()) < 1 << 20:
        text += "".join(rng.choice(words) for _ in range(1000))
    event = b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}) + b"\n\n"
    body = event + b"data: [DONE]\n\n"
    assert len(event) > 1 << 20

    async def respond(_req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(body), 16384):
            writer.write(chunk(body[i : i + 16384]))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    stack = make_stack(tiktoken_tok, raw_script=ScriptedUpstream(respond).serve, scrape_interval_s=0)
    assert stack.run(_stream_body(stack.url)) == body
    stack.settle()
    (rec,) = stack.records
    assert rec.outcome == "ok" and rec.chunks == 1 and rec.saw_done is True
    assert rec.content_tokens == tiktoken_tok.count(text)


# --- 7. gzip ----------------------------------------------------------------------------------------


def test_gzip_sse_stays_incremental_bytes_and_header_untouched(make_stack, tiktoken_tok):
    """A gzip-encoded SSE stream, flushed per event: the client can decode each event before the
    upstream writes the next (lockstep, so any buffering in the proxy would deadlock and fail), gets
    the compressed bytes exactly with ``Content-Encoding: gzip``, and the turn is measured (the record
    decompresses off the hot path) with the first token timed at the first event's read."""
    pieces = ["Zip", "ped", " café", " 日本", " 🚀", " done"]
    events = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n']
    events += [b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": p}}]}) + b"\n\n" for p in pieces]
    events.append(b"data: [DONE]\n\n")
    decoded_events = [0]
    write_times: list[float] = []
    sent_body = bytearray()
    cond_box: dict[str, asyncio.Condition] = {}

    async def respond(_req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        comp = zlib.compressobj(6, zlib.DEFLATED, 31)
        for n, ev in enumerate(events, 1):
            data = comp.compress(ev) + comp.flush(zlib.Z_SYNC_FLUSH)
            write_times.append(time.perf_counter())
            writer.write(chunk(data))
            sent_body.extend(data)
            await writer.drain()
            async with cond_box["c"]:
                await asyncio.wait_for(cond_box["c"].wait_for(lambda n=n: decoded_events[0] >= n), 5)
        tail = comp.flush(zlib.Z_FINISH)
        sent_body.extend(tail)
        writer.write(chunk(tail) + b"0\r\n\r\n")
        await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)

    stack = make_stack(tiktoken_tok, raw_script=upstream.serve, scrape_interval_s=0)

    async def go():
        cond_box["c"] = asyncio.Condition()
        raw = bytearray()
        inflater = zlib.decompressobj(31)
        plain = b""
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            async with s.post(stack.url + CHAT, json={"stream": True, "messages": []}) as r:
                headers = dict(r.headers)
                async for data in r.content.iter_any():
                    raw += data
                    plain += inflater.decompress(data)
                    async with cond_box["c"]:
                        decoded_events[0] = plain.count(b"\n\n")
                        cond_box["c"].notify_all()
        return headers, bytes(raw), plain

    headers, raw, plain = stack.run(go())
    assert headers["Content-Encoding"] == "gzip"
    assert raw == bytes(sent_body)
    assert plain == b"".join(events)
    stack.settle()
    (rec,) = stack.records
    assert rec.outcome == "ok" and rec.saw_done is True
    assert rec.chunks == len(pieces)
    assert rec.content_tokens == tiktoken_tok.count("".join(pieces))
    assert write_times[1] <= rec.t_first_token < write_times[2]  # the first text event's read, not the last


def test_gzip_json_response_keeps_length_and_encoding(make_stack, tiktoken_tok):
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Compressed answer é"},
                           "finish_reason": "stop"}], "usage": {"completion_tokens": 4, "prompt_tokens": 1}}
    body = gzip.compress(orjson.dumps(answer))

    async def respond(_req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)

    stack = make_stack(tiktoken_tok, raw_script=upstream.serve, scrape_interval_s=0)

    async def go():
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            async with s.post(stack.url + CHAT, json={"messages": []}, headers={"Accept-Encoding": "gzip"}) as r:
                return dict(r.headers), await r.read()

    headers, got = stack.run(go())
    assert got == body
    assert headers["Content-Encoding"] == "gzip" and headers["Content-Length"] == str(len(body))
    assert upstream.requests[0].header("Accept-Encoding") == "gzip"
    stack.settle()
    (rec,) = stack.records
    assert rec.outcome == "ok" and rec.content_tokens == tiktoken_tok.count("Compressed answer é")
    assert rec.usage_completion_tokens == 4


def test_gzip_request_body_reaches_the_upstream_as_sent(make_stack):
    """A client may send a compressed body with ``Content-Encoding: gzip``: the upstream must get those
    bytes and that header, not a decompressed body still labelled gzip; and the proxy compresses
    nothing on the way back even when the client accepts gzip."""
    plain = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "squeezed"}]})
    body = gzip.compress(plain)
    answer = b'{"choices": []}' * 100

    async def respond(_req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(answer) + answer)
        await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)
    stack = make_stack(raw_script=upstream.serve, scrape_interval_s=0)

    async def go():
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            async with s.post(stack.url + CHAT, data=body, headers={
                    "Content-Type": "application/json", "Content-Encoding": "gzip", "Accept-Encoding": "gzip"}) as r:
                return r.status, dict(r.headers), await r.read()

    status, headers, got = stack.run(go())
    assert status == 200 and got == answer and "Content-Encoding" not in headers
    (req,) = upstream.requests
    assert req.body == body
    assert req.header("Content-Encoding") == "gzip" and req.header("Content-Length") == str(len(body))
    stack.settle()
    (rec,) = stack.records
    assert rec.request_parsed is True and rec.model == "m"  # measured from the decoded body


# --- 11. hostile JSON ---------------------------------------------------------------------------------

HOSTILE = {
    "nesting_100k": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "nesting_100k_objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "digits_5000": b'{"model": "m", "messages": [], "seed": ' + b"9" * 5000 + b"}",
    "float_5000_digits": b'{"model": "m", "messages": [], "temperature": 0.' + b"1" * 5000 + b"}",
    "nan": b'{"model": "m", "messages": [], "temperature": NaN}',
    "infinity": b'{"model": "m", "messages": [], "temperature": -Infinity}',
    "invalid_utf8": b'{"model": "m\xff\xfe", "messages": []}',
    "overlong_utf8": b'{"model": "\xc0\xaf", "messages": []}',
    "lone_surrogate_escaped": b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
    "lone_surrogate_raw": b'{"model": "m", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
    "duplicate_keys": b'{"model": "a", "model": "b", "messages": [{"role": "user", "content": "x"}]}',
    "nul_in_string": b'{"model": "m", "messages": [{"role": "user", "content": "a\\u0000b"}]}',
    "not_an_object": b"[1, 2, 3]",
    "messages_not_list": b'{"model": "m", "messages": "hello"}',
    "odd_message_shapes": b'{"model": 5, "tools": "x", "messages": [{"role": ["user"], "content": {"a": 1}},'
                          b' {"role": "assistant", "tool_calls": 7}, {"content": [{"type": "text", "text": 5}]}]}',
    "empty": b"",
    "trailing_garbage": b'{"model": "m", "messages": []} trailing',
    "bom": b'\xef\xbb\xbf{"model": "m", "messages": []}',
}


def _orjson_accepts(body: bytes) -> bool:
    try:
        orjson.loads(body)
        return True
    except orjson.JSONDecodeError:
        return False


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_json_is_forwarded_byte_identical_and_its_row_written(make_stack, tiktoken_tok, name):
    body = HOSTILE[name]
    stack = make_stack(tiktoken_tok, scrape_interval_s=0)

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(stack.url + CHAT, data=body, headers={"Content-Type": "application/json"}) as r:
                return r.status

    assert stack.run(go()) == 200
    assert stack.upstream.sent[-1].request_body == body
    (rec,) = db_records(stack, 1)
    assert rec["outcome"] == "ok", rec["error"]
    assert rec["request_bytes"] == len(body)
    if not _orjson_accepts(body):
        assert rec["request_parsed"] == 0
        assert rec["prompt_tokens"] is None and rec["model"] is None


def test_hostile_json_in_the_response_stream_is_survived(make_stack, tiktoken_tok):
    """Events a parser must refuse (deep nesting, NaN, invalid UTF-8, huge numbers) between good ones:
    the bytes pass unchanged, the good events are counted, the bad ones are counted as such."""
    events = [
        b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n',
        b"data: " + b"[" * 50_000 + b"]" * 50_000 + b"\n\n",
        b'data: {"choices":[{"index":0,"delta":{"content":NaN}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe"}}]}\n\n',
        b'data: {"usage":{"completion_tokens":' + b"9" * 5000 + b"}}\n\n",
        b'data: {"choices":[{"index":0,"delta":{"content":" fine"}}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    body = b"".join(events)

    async def respond(_req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(body))
        for ev in events:
            writer.write(ev)
            await writer.drain()
        return True

    stack = make_stack(tiktoken_tok, raw_script=ScriptedUpstream(respond).serve, scrape_interval_s=0)
    assert stack.run(_stream_body(stack.url)) == body
    (rec,) = db_records(stack, 1)
    assert rec["outcome"] == "ok" and rec["saw_done"] == 1
    # invalid UTF-8 is measured as U+FFFD (what a lenient client shows), not dropped
    assert rec["content_tokens"] == tiktoken_tok.count("ok\ufffd\ufffd fine")
    assert rec["chunks"] == 3
    assert rec["usage_completion_tokens"] is None  # the 5000-digit usage was refused, not read as 0
    assert rec["error"] == "3 stream events were not JSON"


def test_a_turn_whose_measuring_fails_still_gets_its_row(make_stack, monkeypatch):
    """Measuring is code too, and input nobody foresaw may break it: the bytes were already forwarded,
    and the turn still gets a row (``proxy_error``, saying where measuring failed, not what was sent)."""
    from specproxy.measure.build import build_record
    from specproxy.serve import measuring

    def fragile(turn, tokenizer, prefixes=None):
        if b"break-me" in turn.body:
            raise KeyError("sk-secret-in-a-message")
        return build_record(turn, tokenizer, prefixes)

    monkeypatch.setattr(measuring, "build_record", fragile)  # what the proxy's measuring worker builds with
    stack = make_stack(scrape_interval_s=0)

    async def go(content):
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}]}
            async with s.post(stack.url + CHAT, json=body) as r:
                return r.status, await r.read()

    assert stack.run(go("break-me"))[0] == 200
    assert stack.run(go("fine"))[0] == 200
    bad, good = db_records(stack, 2)
    assert bad["outcome"] == "proxy_error" and bad["status"] == 200 and bad["response_bytes"] > 0
    assert bad["error"].startswith("measuring failed: KeyError (raised at ") and "sk-secret" not in bad["error"]
    assert bad["error"].endswith("forwarding outcome ok")
    assert good["outcome"] == "ok"
    assert stack.service.counters.measure_errors == 1


def test_a_prompt_count_that_fails_is_null_and_counted(make_stack, tiktoken_tok):
    """The tokenizer raising on a prompt costs the prompt's figures only: they are null (never 0), the
    rest of the turn is measured, and the failure is counted (``measure_failures`` on the state line)."""
    from specproxy.measure.failures import FAILURES

    class PromptRaises:
        name = tiktoken_tok.name

        def count(self, text):
            return tiktoken_tok.count(text)

        def token_ends(self, text):
            return tiktoken_tok.token_ends(text)

        def count_prompt(self, parts):
            raise RuntimeError("a tokenizer bug")

    stack = make_stack(tokenizer=PromptRaises(), scrape_interval_s=0)
    before = FAILURES.total()

    async def go():
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with s.post(stack.url + CHAT, json=body) as r:
                return r.status, await r.read()

    assert stack.run(go())[0] == 200
    (rec,) = db_records(stack, 1)
    assert rec["outcome"] == "ok" and rec["prompt_tokens"] is None and rec["completion_tokens"] > 0
    assert FAILURES.total() == before + 1
