"""What ``/_specproxy/metrics`` says, against what the fake upstream did and what the database holds: each
API under its own labels, the per-chunk histograms as the OpenTelemetry GenAI conventions define them
(one observation per chunk, the first chunk whatever it carries) with the per-token figures beside
them, and counts that stay the store's rows when the store drops records."""

from __future__ import annotations

import sqlite3

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specproxy.app.fake_upstream import Script
from faultkit import wait_until

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages",
         "responses": "/v1/responses"}


def body_for(api: str) -> dict:
    if api == "chat":
        return {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    if api == "completions":
        return {"model": "m", "stream": True, "prompt": "hi"}
    if api == "messages":
        return {"model": "m", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    return {"model": "m", "stream": True, "input": "hi"}


async def post(url: str, api: str) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + PATHS[api], json=body_for(api)) as r:
            await r.read()
            return r.status


async def get(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/_specproxy/metrics") as r:
            assert r.status == 200
            return await r.text()


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def buckets(s: dict[str, list], name: str) -> dict[str, float]:
    """One series' cumulative bucket counts, by ``le``."""
    rows = s[name + "_bucket"]
    assert len({tuple(sorted((k, v) for k, v in x.labels.items() if k != "le")) for x in rows}) == 1
    return {x.labels["le"]: x.value for x in rows}


def turn(stack, api: str, script: Script) -> None:
    stack.upstream.script = script
    assert stack.run(post(stack.url, api)) == 200
    stack.settle()


def test_each_api_has_its_own_series(make_stack, tiktoken_tok):
    stack = make_stack(tiktoken_tok, scrape_interval_s=0)
    for api in PATHS:
        turn(stack, api, Script(pieces=("a", " b", " c")))
    stack.service.writer.close()
    with sqlite3.connect(stack.cfg.db) as conn:
        rows = dict(conn.execute("SELECT api, count(*) FROM turns GROUP BY api").fetchall())
    s = samples(stack.run(get(stack.url)))
    by_api = {(x.labels["api"], x.labels["gen_ai_operation_name"]): x.value for x in s["specproxy_turns_total"]}
    assert by_api == {("chat", "chat"): 1, ("completions", "text_completion"): 1, ("messages", "chat"): 1,
                      ("responses", "chat"): 1}
    assert rows == {"chat": 1, "completions": 1, "messages": 1, "responses": 1}
    for name in ("gen_ai_client_operation_duration_seconds_count",
                 "gen_ai_client_operation_time_to_first_chunk_seconds_count",
                 "gen_ai_client_operation_time_per_output_chunk_seconds_count"):
        assert {x.labels["api"] for x in s[name]} == set(PATHS), name


def test_time_per_output_chunk_holds_each_gap(make_stack, tiktoken_tok):
    """Two chat turns, each a role-only chunk, its text chunks 0.9 s later, a finish chunk carrying
    usage and ``[DONE]``: every one is a chunk the client receives, so each gap after a turn's first
    chunk is one observation. Turn one's text gaps are about 0 and 0.45 s taking turns, turn two's
    0.23 s. Counting only the gaps between text chunks (7) would miss the two of 0.9 s and the four
    before the finish chunk and ``[DONE]``. Each gap lies at least 70 ms inside its bucket (the bounds
    double): a busy machine delays a read by less, so where each gap lands is the proxy's doing."""
    stack = make_stack(tiktoken_tok, scrape_interval_s=0)
    turn(stack, "chat", Script(pieces=("a", " b", " c", " d", " e"), interval_s=(0.0, 0.45), ttft_s=0.9))
    turn(stack, "chat", Script(pieces=("a", " b", " c", " d"), interval_s=0.23, ttft_s=0.9))
    stack.service.writer.close()
    with sqlite3.connect(stack.cfg.db) as conn:
        chunks, decode, ttft, total_s = conn.execute(
            "SELECT sum(chunks), sum(decode_s), sum(ttft_s), sum(total_s) FROM turns").fetchone()
    s = samples(stack.run(get(stack.url)))
    b = buckets(s, "gen_ai_client_operation_time_per_output_chunk_seconds")
    # turn one: role, 5 texts, finish, [DONE] (8 chunks, 7 gaps); turn two: role, 4 texts, finish, [DONE] (7, 6)
    assert chunks == 9 and b["+Inf"] == 13
    # about 0: turn one's two text gaps of 0 and both turns' finish chunk and [DONE] right after the last text
    assert b["0.16"] == 6
    assert b["0.32"] == 9  # the three of 0.23 s
    assert b["0.64"] == 11  # the two of 0.45 s
    assert b["1.28"] == 13  # the two of 0.9 s, role chunk to first text
    (total,) = s["gen_ai_client_operation_time_per_output_chunk_seconds_sum"]
    (first_chunk,) = s["gen_ai_client_operation_time_to_first_chunk_seconds_sum"]
    # the gaps sum to first chunk to last chunk: first chunk to first text, the decode, last text to [DONE]
    assert ttft - first_chunk.value + decode - 1e-9 <= total.value <= total_s - first_chunk.value + 1e-9
    assert total.value >= decode + 1.5  # the two role gaps of 0.9 s, less any delay of a role chunk's read


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_first_chunk_is_the_first_event_and_first_token_the_first_text(make_stack, tiktoken_tok, api):
    """The first event (a role-only chunk; Messages' message_start) comes at once, the first text 0.3 s
    later: time to first chunk is the former, specproxy's time to first token the latter."""
    stack = make_stack(tiktoken_tok, scrape_interval_s=0)
    turn(stack, api, Script(pieces=("a", " b"), ttft_s=0.3, role_chunk=True))
    stack.service.writer.close()
    with sqlite3.connect(stack.cfg.db) as conn:
        (ttft,) = conn.execute("SELECT ttft_s FROM turns").fetchone()
    assert ttft >= 0.3
    s = samples(stack.run(get(stack.url)))
    first_chunk = buckets(s, "gen_ai_client_operation_time_to_first_chunk_seconds")
    assert first_chunk["+Inf"] == 1 and first_chunk["0.16"] == 1  # before the text's 0.3 s
    first_token = buckets(s, "specproxy_time_to_first_token_seconds")
    assert first_token["+Inf"] == 1 and first_token["0.16"] == 0
    assert s["specproxy_time_to_first_token_seconds_sum"][0].value == pytest.approx(ttft, abs=1e-9)
    assert s["gen_ai_client_operation_time_to_first_chunk_seconds_sum"][0].value < ttft - 0.14


def test_counts_agree_with_the_store_when_it_drops_records(make_stack, tiktoken_tok):
    """Another process holds the database's write lock and the writer's queue holds one record: turns
    go on until one is dropped. The turn counters then say what the store holds, and the dropped ones
    are counted apart."""
    stack = make_stack(tiktoken_tok, scrape_interval_s=0, queue_size=1)
    writer = stack.service.writer
    stack.upstream.script = Script(pieces=("a", " b"))
    locker = sqlite3.connect(stack.cfg.db, timeout=5, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    sent = 0
    try:
        while writer.dropped == 0 and sent < 50:
            assert stack.run(post(stack.url, "chat")) == 200
            sent += 1
            stack.settle()
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert writer.dropped > 0
    wait_until(lambda: writer.written + writer.dropped == sent and not writer.pending, 20,
               what="the writer to catch up")
    with sqlite3.connect(stack.cfg.db) as conn:
        (rows,) = conn.execute("SELECT count(*) FROM turns").fetchone()
    s = samples(stack.run(get(stack.url)))
    assert sum(x.value for x in s["specproxy_turns_total"]) == rows == sent - writer.dropped
    assert s["specproxy_dropped_records_store_total"][0].value == writer.dropped
    assert s["gen_ai_client_operation_duration_seconds_count"][0].value == rows
