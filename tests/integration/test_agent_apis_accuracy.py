"""The Anthropic Messages and OpenAI Responses APIs are measured as exactly as chat completions.

Truth comes from the fake upstream speaking each API (``fake_apis.py``; same process, same monotonic
clock): which text it sent as which kind, in how many events, and when. Hypothesis varies the stream's
shape as for chat (``test_proxy_accuracy.py``): tokens per event, events split across writes (inside
UTF-8 characters) or merged, pings, CRLF, thinking and tool-input deltas, a usage or none. Around the
text the fake sends what a real server does and carries no output (message and block starts and stops,
``output_item.added``, ``*.done`` events repeating the text): none of it may be counted or taken for
the first token.
"""

from __future__ import annotations

import time

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specproxy.app.fake_upstream import Script, pieces_of

WORDS = ["Hello", " world", ",", " café", " 日本語", " 🚀", "\n", " tokens", "!"]
TOOL_PIECES = ['{"path"', ': "a.txt"', "}"]
PATHS = {"messages": "/v1/messages?beta=true", "responses": "/v1/responses"}


def body_for(api: str, stream: bool) -> dict:
    if api == "messages":
        return {"model": "m", "max_tokens": 64, "stream": stream, "system": "Be brief.",
                "messages": [{"role": "user", "content": "hi"}]}
    return {"model": "m", "stream": stream, "instructions": "Be brief.", "input": "hi"}


async def post(url: str, path: str, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.post(url + path, json=body, headers={"User-Agent": "agent-x/1.0"}) as r:
            data = bytearray()
            async for chunk in r.content.iter_any():
                data.extend(chunk)
            return r.status, bytes(data)


scripts = st.builds(
    Script,
    pieces=st.lists(st.sampled_from(WORDS), min_size=1, max_size=20),
    reasoning_pieces=st.lists(st.sampled_from(WORDS), max_size=5),
    tool_args_pieces=st.one_of(st.just([]), st.just(TOOL_PIECES)),
    tokens_per_chunk=st.one_of(st.integers(1, 3), st.lists(st.integers(1, 4), min_size=1, max_size=4)),
    split_events=st.booleans(),
    merge_events=st.integers(1, 3),
    ping_every=st.integers(0, 3),
    crlf=st.booleans(),
    usage=st.sampled_from(["none", "last"]),
    interval_s=st.sampled_from([0.0, 0.002]),
    ttft_s=st.sampled_from([0.0, 0.01]),
)


@pytest.fixture
def stack(make_stack, tiktoken_tok):
    return make_stack(tiktoken_tok)


def run_turn(stack, api: str, script: Script, stream: bool = True):
    stack.upstream.script = script
    stack.records.clear()
    n_sent = len(stack.upstream.sent)
    status, data = stack.run(post(stack.url, PATHS[api], body_for(api, stream)))
    stack.settle()
    truth = stack.upstream.sent[n_sent]
    assert data == bytes(truth.body), "the client must get the upstream's bytes, unchanged"
    (rec,) = stack.records
    return status, rec, truth


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(script=scripts, api=st.sampled_from(["messages", "responses"]))
def test_streamed_counts_and_times_match_the_truth(stack, tiktoken_tok, script, api):
    status, rec, truth = run_turn(stack, api, script)
    assert status == 200 and rec.api == api and rec.outcome == "ok" and rec.saw_done is True
    assert rec.path == PATHS[api].partition("?")[0] and rec.client == "agent-x/1.0" and rec.streamed
    expect = {k: tiktoken_tok.count(v) for k, v in truth.texts.items()}
    assert (rec.content_tokens, rec.reasoning_tokens, rec.tool_args_tokens) == (
        expect["content"], expect["reasoning"], expect["tool_args"])
    assert rec.completion_tokens == sum(expect.values())
    assert rec.chunks == truth.chunks  # events that carried text: not block starts, pings or *.done
    assert 0 <= rec.t_first_token - truth.t_first_text < 1.0
    assert 0 <= rec.t_last_token - truth.t_last_text < 1.0
    n = len(script.pieces) + len(script.reasoning_pieces) + len(script.tool_args_pieces)
    if script.usage == "none":
        assert rec.usage_completion_tokens is None
    else:
        assert rec.usage_completion_tokens == n
    assert stack.tokenizer.calls_on_loop == 0


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_non_streamed_answers(stack, tiktoken_tok, api):
    """A whole answer: its text, thinking and tool input counted (a Messages tool input is a JSON
    object in the body, counted as that JSON), the server's usage read in each API's words."""
    script = Script(pieces=["Hello", " world"], reasoning_pieces=["Let", " me", " think"],
                    tool_args_pieces=TOOL_PIECES)
    status, rec, truth = run_turn(stack, api, script, stream=False)
    assert status == 200 and rec.api == api and not rec.streamed and rec.outcome == "ok"
    args = "".join(TOOL_PIECES) if api == "responses" else orjson.dumps(orjson.loads("".join(TOOL_PIECES))).decode()
    assert rec.content_tokens == tiktoken_tok.count("Hello world")
    assert rec.reasoning_tokens == tiktoken_tok.count("Let me think")
    assert rec.tool_args_tokens == tiktoken_tok.count(args)
    assert rec.usage_completion_tokens == 2 + 3 + 3 and rec.usage_prompt_tokens == len(truth.request_body) // 4
    assert rec.chunks == 1 and rec.ttft_s == pytest.approx(rec.t_first_token - rec.t_request)


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_thinking_first_is_the_first_token_and_block_starts_are_not(stack, tiktoken_tok, api):
    """The first output is thinking, after 50 ms: TTFT is that event's, not the message start's (sent
    at once) or the block start's (sent right before it)."""
    script = Script(pieces=["Done."], reasoning_pieces=pieces_of("I should answer briefly.", tiktoken_tok),
                    ttft_s=0.05)
    _, rec, truth = run_turn(stack, api, script)
    assert rec.ttft_s >= 0.05 and rec.t_first_token >= truth.t_first_text
    assert rec.first_chunk_tokens == 1 and rec.reasoning_tokens == len(script.reasoning_pieces)


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_an_error_event_mid_stream(stack, tiktoken_tok, api):
    """The server fails after three events of text: the turn is an upstream error, says which error
    type (never its message), and counts the text that was delivered before it."""
    pieces = pieces_of(" one two three four five six", tiktoken_tok)
    _, rec, truth = run_turn(stack, api, Script(pieces=pieces, error_after=3))
    assert rec.outcome == "upstream_error" and rec.saw_done is False
    assert rec.error == ("error event in the stream: overloaded_error" if api == "messages"
                         else "error event in the stream: server_error")
    assert rec.completion_tokens == 3 == truth.chunks


def test_messages_usage_counts_cached_input(stack):
    """Messages usage splits the prompt into uncached input, cache reads and cache writes: the server's
    prompt is the sum, its reads are the cached tokens and its writes are kept apart from them."""
    _, rec, truth = run_turn(stack, "messages", Script(pieces=["ok"]))
    prompt = len(truth.request_body) // 4
    assert prompt // 4 > 0
    assert rec.usage_prompt_tokens == prompt and rec.usage_cached_tokens == prompt // 2
    assert rec.usage_cache_write_tokens == prompt // 4


def test_no_cache_write_count_where_the_server_says_none(stack):
    """A server whose usage has no cache-write count (this Responses fake, like OpenAI's) leaves it null,
    never 0."""
    _, rec, _ = run_turn(stack, "responses", Script(pieces=["ok"]))
    assert rec.usage_prompt_tokens is not None and rec.usage_cache_write_tokens is None


def test_query_string_and_other_paths(stack):
    """``?beta=true`` is still /v1/messages; count_tokens is forwarded and not a measured turn."""
    status, _ = stack.run(post(stack.url, "/v1/messages/count_tokens", body_for("messages", False)))
    stack.settle()
    assert status == 404 and stack.records == []  # the fake has no such route: forwarded as it answered
    start = time.perf_counter()
    _, rec, _ = run_turn(stack, "messages", Script(pieces=["ok"]))
    assert rec.path == "/v1/messages" and rec.t_request >= start
