"""The proxy is transparent and honest when things go wrong: real openai SDK through it, 502s,
truncations, clients hanging up after [DONE], hop-by-hop headers, labels, unparsable bodies."""

from __future__ import annotations

import asyncio
import time

import sqlite3

import aiohttp
import openai
import orjson
import pytest

from rawpeers import SSE_HEAD, chunk, read_request, wait_closed
from specproxy.store.sqlite_source import SQLiteSource
from specproxy.analyze.report_data import build_report
from specproxy.app.fake_upstream import Script, pieces_of
from specproxy.store.dataset import load_turns
from waits import wait_for

pytestmark = pytest.mark.usefixtures("each_front")  # the lane and aiohttp's server alone (conftest.py)

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a thing up.",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture
def stack(make_stack, tiktoken_tok):
    return make_stack(tiktoken_tok)


def _sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="sk-test-not-a-secret", max_retries=0, timeout=30)


def test_openai_sdk_same_results_through_the_proxy(stack, tiktoken_tok):
    stack.upstream.script = Script(pieces=pieces_of("Proxies should be invisible.", tiktoken_tok),
                                   reasoning_pieces=pieces_of("Think first.", tiktoken_tok), interval_s=0.001)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say it."}]
    results = {}
    for name, base in (("direct", stack.upstream.url), ("proxy", stack.url)):
        client = _sdk(base)
        full = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        stream = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                                stream_options={"include_usage": True})
        chunks = [c.model_dump() for c in stream]
        results[name] = (full.model_dump(), chunks)
    assert results["direct"] == results["proxy"]
    stack.settle()
    recs = [r for r in stack.records]
    assert len(recs) == 2  # only the proxied turns are recorded
    streamed = next(r for r in recs if r.streamed)
    assert streamed.outcome == "ok"  # the SDK hangs up after [DONE]; the turn still counts as complete
    assert streamed.completion_tokens == tiktoken_tok.count("Proxies should be invisible.") + tiktoken_tok.count("Think first.")
    assert streamed.reasoning_tokens == tiktoken_tok.count("Think first.")
    assert streamed.prompt_system_tokens == tiktoken_tok.count("You are terse.")
    assert streamed.prompt_tools_tokens > 0 and streamed.prompt_new_tokens == tiktoken_tok.count("Say it.")


def test_unreachable_upstream_gives_502_json(make_stack, refused):
    stack = make_stack(upstream=f"http://127.0.0.1:{refused}")

    async def go():
        async with aiohttp.ClientSession() as c:
            t0 = time.monotonic()
            async with c.post(stack.url + "/v1/chat/completions", data=b'{"messages": []}') as r:
                return r.status, await r.json(), time.monotonic() - t0

    status, body, elapsed = stack.run(go())
    assert status == 502 and elapsed < 5
    assert body["error"]["type"] == "upstream_unreachable"
    stack.settle()
    (rec,) = stack.records
    assert rec.outcome == "upstream_unreachable" and rec.status == 502
    assert rec.completion_tokens is None  # nothing measured is not zero


async def _die_mid_stream(reader, writer):
    await read_request(reader)
    writer.write(SSE_HEAD + chunk(b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'))
    await writer.drain()
    writer.transport.abort()  # reset, no terminating chunk


def test_upstream_death_mid_stream_aborts_the_client(make_stack, tiktoken_tok):
    stack = make_stack(tiktoken_tok, raw_script=_die_mid_stream)

    async def go():
        got = bytearray()
        async with aiohttp.ClientSession() as c:
            async with c.post(stack.url + "/v1/chat/completions", json={"stream": True, "messages": []}) as r:
                try:
                    async for data in r.content.iter_any():
                        got.extend(data)
                except aiohttp.ClientPayloadError:
                    return bytes(got), "truncated"
        return bytes(got), "complete"

    got, how = stack.run(go())
    assert how == "truncated", "the client must see the truncation"
    assert b"[DONE]" not in got  # nothing invented
    stack.settle()
    (rec,) = stack.records
    assert rec.outcome == "upstream_truncated"
    assert rec.completion_tokens == 1 and rec.saw_done is False


def test_a_turn_stays_pending_until_its_record_is_handed_on(stack, tiktoken_tok):
    """Whoever reads ``pending_measure`` as 0 from another thread (a test settling, a drain) finds every
    record already with the sinks: the interpreter may switch threads between any two lines of the loop's
    hand-over, so the count drops only after the records went on (it once dropped first, and a test
    thread now and then read 0 with the streamed turn's record not yet appended)."""
    proxy = stack.service.proxy
    pending_at_hand_over: list[int] = []
    stack.service.extra_sinks.append(lambda record: pending_at_hand_over.append(proxy.pending_measure))
    stack.upstream.script = Script(pieces=pieces_of("One two three.", tiktoken_tok))
    client = _sdk(stack.url)
    for _ in range(3):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count."}])
        stack.settle()
    assert len(pending_at_hand_over) == 3 and min(pending_at_hand_over) >= 1, pending_at_hand_over


def test_a_record_reaches_the_store_while_the_event_loop_is_held(stack, tiktoken_tok):
    """The measuring thread puts each record in the writer's queue itself: the event loop, held here from
    the moment the turn was handed to measuring, is not on the record's way to the store (it once was: the
    record went to the loop, and from there to the writer's queue)."""
    from specproxy.record import Record

    writer, measurer = stack.service.writer, stack.service.proxy._measurer
    taken: list = []
    put = writer.put
    writer.put = lambda item: (taken.append(item), put(item))[1]
    submit = measurer.submit
    reached: list[bool] = []

    def submit_then_hold_the_loop(builder, *, more_in_flight: bool) -> None:
        submit(builder, more_in_flight=more_in_flight)
        deadline = time.monotonic() + 20  # a loaded machine builds in far less; the old way never arrives
        while not any(isinstance(i, Record) for i in taken) and time.monotonic() < deadline:
            pass  # held without a blocking call (the suite forbids those on the loop): the GIL still switches
        reached.append(any(isinstance(i, Record) for i in taken))

    measurer.submit = submit_then_hold_the_loop
    stack.upstream.script = Script(pieces=pieces_of("One two three.", tiktoken_tok))
    _sdk(stack.url).chat.completions.create(model="m", messages=[{"role": "user", "content": "Count."}])
    stack.settle()
    assert reached == [True]
    assert [r.completion_tokens for r in stack.records] == [tiktoken_tok.count("One two three.")]


async def _done_then_hold(reader, writer):
    await read_request(reader)
    writer.write(SSE_HEAD + chunk(b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n')
                 + chunk(b"data: [DONE]\n\n"))
    await writer.drain()
    # keep the stream open (no final chunk) until the proxy lets go of us
    writer.peer_closed_after = await wait_closed(reader, 10)


def test_client_hanging_up_after_done_is_a_complete_turn_and_frees_the_upstream(make_stack, tiktoken_tok):
    # no scrape: this upstream answers every request with the held stream, /metrics too
    stack = make_stack(tiktoken_tok, raw_script=_done_then_hold, scrape_interval_s=0)

    async def go():
        r, w = await asyncio.open_connection("127.0.0.1", stack.service.port)
        body = b'{"stream": true, "messages": [{"role": "user", "content": "x"}]}'
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await w.drain()
        seen = b""
        while b"[DONE]" not in seen:
            seen += await asyncio.wait_for(r.read(4096), 10)
        w.close()  # like the openai SDK: gone the moment it reads [DONE]
        await asyncio.sleep(0)

    stack.run(go())
    stack.settle()
    deadline = time.monotonic() + 5
    while not stack.records and time.monotonic() < deadline:
        stack.settle()
    (rec,) = stack.records
    assert rec.outcome == "ok" and rec.saw_done is True and rec.completion_tokens == 1


def test_hop_by_hop_headers_and_label(stack):
    stack.upstream.script = Script()

    async def go():
        async with aiohttp.ClientSession() as c:
            async with c.post(stack.url + "/v1/chat/completions?x=1", data=b'{"messages":[]}', headers={
                "Connection": "keep-alive, X-Drop-Me", "X-Drop-Me": "1", "Keep-Alive": "timeout=5",
                "X-Specproxy-Label": "arm-b", "X-End-To-End": "kept", "Authorization": "Bearer sk-canary",
                "Content-Type": "application/json"}) as r:
                return r.status, await r.read()

    status, _ = stack.run(go())
    assert status == 200
    sent = stack.upstream.sent[-1]
    got = {k.lower(): v for k, v in sent.request_headers.items()}
    assert got["x-end-to-end"] == "kept" and got["authorization"] == "Bearer sk-canary"
    assert "x-drop-me" not in got and "keep-alive" not in got and "x-specproxy-label" not in got
    assert got["host"] == f"127.0.0.1:{stack.upstream.port}"
    stack.settle()
    (rec,) = stack.records
    assert rec.label == "arm-b"
    assert rec.prompt_text is None and rec.response_text is None  # text only with the opt-in


def test_a_label_header_beginning_with_at_is_refused_before_the_upstream(stack):
    """``compare`` reads an arm that begins with "@" as a time window, so a turn labelled "@x" could never be
    named: the header is refused with 400, as ``serve --label @x`` is, and nothing reaches the upstream."""
    stack.upstream.script = Script()

    async def go():
        async with aiohttp.ClientSession() as c:
            async with c.post(stack.url + "/v1/chat/completions", data=b'{"messages":[]}',
                              headers={"X-Specproxy-Label": "@x"}) as r:
                return r.status, await r.json()

    status, body = stack.run(go())
    assert status == 400 and body["error"]["type"] == "bad_label" and "time window" in body["error"]["message"]
    assert stack.upstream.sent == [] and stack.service.counters.rejected_bad == 1


@pytest.mark.parametrize("body", [b'{"messages": [', b"\xff\xfe not json", b'{"model": NaN}'])
def test_unparsable_body_is_forwarded_unchanged_and_marked(stack, body):
    async def go():
        async with aiohttp.ClientSession() as c:
            async with c.post(stack.url + "/v1/chat/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                return r.status

    assert stack.run(go()) == 200
    assert stack.upstream.sent[-1].request_body == body
    stack.settle()
    (rec,) = stack.records
    assert rec.request_parsed is False and rec.prompt_tokens is None


def test_upstream_4xx_passes_verbatim_and_is_recorded(stack):
    stack.upstream.script = Script(status=429, error_body=b'{"error": {"message": "slow down"}}')

    async def go():
        async with aiohttp.ClientSession() as c:
            async with c.post(stack.url + "/v1/chat/completions", json={"messages": []}) as r:
                return r.status, await r.read()

    assert stack.run(go()) == (429, b'{"error": {"message": "slow down"}}')
    stack.settle()
    (rec,) = stack.records
    assert rec.outcome == "upstream_error" and rec.status == 429


def test_other_paths_are_forwarded_untouched_and_recorded_unmeasured(stack):
    """A GET /v1/models reaches the client byte for byte as the upstream sent it, and leaves one row
    that says what the forwarding path saw (method, path, status, timings, outcome) and nothing measured;
    it is no turn of the figures (the observers, the report) and specproxy's own pages leave no row."""
    async def get(base: str, path: str) -> tuple[int, bytes, str | None]:
        async with aiohttp.ClientSession() as c:
            async with c.get(base + path) as r:
                return r.status, await r.read(), r.headers.get("Content-Type")

    direct = stack.run(get(stack.upstream.url, "/v1/models"))
    assert direct[0] == 200 and orjson.loads(direct[1])["data"][0]["id"] == "fake-model"
    assert stack.run(get(stack.url, "/v1/models")) == direct
    stack.run(get(stack.url, "/_specproxy/metrics"))  # reserved: answered by specproxy, never forwarded
    stack.settle()
    assert stack.records == []  # observers of measured turns see none of it
    db = stack.cfg.db
    assert wait_for(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0] >= 1)
    stack.run(stack.service.stop())  # every row written
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    (row,) = conn.execute("SELECT * FROM turns").fetchall()
    assert (row["method"], row["path"], row["status"], row["outcome"], row["measured"]) == ("GET", "/v1/models", 200,
                                                                                          "ok", 0)
    assert row["t_request"] <= row["t_upstream_headers"] <= row["t_done"]
    assert row["total_s"] == row["t_done"] - row["t_request"]
    assert row["ttft_s"] is None and row["response_bytes"] is None and row["api"] is None
    for cache in (False, True):  # the figures are over measured turns only, from SQL or the column cache
        assert load_turns(db, cache=cache).num["t_wall"].size == 0
    report = build_report(SQLiteSource(sqlite3.connect(db)).load(server=True, context=True))
    assert report["turns"] == 0 and report["unmeasured"] == 1


def test_store_text_opt_in(make_stack, tiktoken_tok):
    stack = make_stack(tiktoken_tok, store_text=True)
    stack.upstream.script = Script(pieces=["Kept", " text"])

    async def go():
        async with aiohttp.ClientSession() as c:
            async with c.post(stack.url + "/v1/chat/completions",
                              json={"stream": True, "messages": [{"role": "user", "content": "secret plan"}]}) as r:
                return await r.read()

    stack.run(go())
    stack.settle()
    (rec,) = stack.records
    assert rec.response_text == "Kept text" and "secret plan" in rec.prompt_text
    assert orjson.loads(rec.prompt_text)["messages"][0]["content"] == "secret plan"


def test_the_state_line_is_logged_without_blocking_the_loop(make_stack, caplog):
    """SIGUSR1's state line counts open descriptors, which lists a directory: that must not run on the
    event loop. ``make_stack`` runs the stack under blockbuster, which fails any blocking call made there;
    the line still comes, with a real count."""
    stack = make_stack()
    caplog.set_level("INFO", logger="specproxy")

    async def go():
        await stack.service.log_state()  # the count, taken off the loop; the line is logged before this resumes

    stack.run(go())
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("state ")]
    fields = dict(kv.split("=", 1) for kv in line.split()[1:])
    assert int(fields["fds"]) > 2 and int(fields["in_flight"]) == 0


def test_turns_on_one_kept_alive_connection_share_a_conn_id(stack):
    """An HTTP/1.1 connection carries one turn at a time: its turns are one serial chain (a lane of
    compare's aggregate interval) and share a conn_id; another connection's differ. The lane hands a
    connection to aiohttp's server at a request it declines (a target with "/."): the id stays."""
    stack.upstream.script = Script()

    async def go():
        one = lambda: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))  # noqa: E731
        async with one() as a, one() as b:
            for c, method, path in ((a, "POST", "/v1/chat/completions"), (a, "POST", "/v1/chat/completions"),
                                    (b, "POST", "/v1/chat/completions"), (a, "GET", "/v1/models?next=/.x"),
                                    (a, "POST", "/v1/chat/completions")):
                body = {"messages": []} if method == "POST" else None
                async with c.request(method, stack.url + path, json=body) as r:
                    assert r.status == 200
                    await r.read()

    stack.run(go())
    stack.settle()
    stack.run(stack.service.stop())  # every row written, the unmeasured GET's too
    rows = sqlite3.connect(stack.cfg.db).execute("SELECT method, conn_id FROM turns ORDER BY t_request").fetchall()
    assert [m for m, _ in rows] == ["POST", "POST", "POST", "GET", "POST"]
    ids = [i for _, i in rows]
    assert all(isinstance(i, int) for i in ids)
    assert ids[0] == ids[1] == ids[3] == ids[4] != ids[2]
    assert sorted(r.conn_id for r in stack.records) == sorted(ids[:3] + ids[4:])  # the Record has it as stored
