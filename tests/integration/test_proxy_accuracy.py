"""The proxy measures exactly what the fake upstream says it sent, under any shape of stream.

Truth comes from the fake upstream (same process, same monotonic clock): which text it sent, in how
many chunks, and when each byte left it. Hypothesis varies the stream's shape: tokens per chunk,
events split across writes (inside UTF-8 characters), merged events, pings, CRLF, role chunks,
reasoning and tool-call deltas, usage on every chunk.
"""

from __future__ import annotations

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specproxy.app.fake_upstream import Script, pieces_of

WORDS = ["Hello", " world", ",", " speculative", " decoding", " café", " 日本語", " 🚀", "\n", " tokens", " é", "!"]


async def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes, list[tuple[float, int]]]:
    """POST and read the response read by read; return status, body and (time, size) of each read."""
    import time

    reads = []
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
            data = bytearray()
            async for chunk in r.content.iter_any():
                reads.append((time.perf_counter(), len(chunk)))
                data.extend(chunk)
            return r.status, bytes(data), reads


scripts = st.builds(
    Script,
    pieces=st.lists(st.sampled_from(WORDS), min_size=1, max_size=25),
    reasoning_pieces=st.lists(st.sampled_from(WORDS), max_size=6),
    tool_args_pieces=st.one_of(st.just([]), st.just(['{"path"', ': "a.txt"', "}"])),
    tokens_per_chunk=st.one_of(st.integers(1, 4), st.lists(st.integers(1, 5), min_size=1, max_size=5)),
    role_chunk=st.booleans(),
    split_events=st.booleans(),
    merge_events=st.integers(1, 3),
    ping_every=st.integers(0, 3),
    crlf=st.booleans(),
    usage=st.sampled_from(["none", "last", "cumulative"]),
    interval_s=st.sampled_from([0.0, 0.002]),
    ttft_s=st.sampled_from([0.0, 0.01]),
)


@pytest.fixture
def stack(make_stack, tiktoken_tok):
    return make_stack(tiktoken_tok)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(script=scripts)
def test_counts_and_times_match_the_truth(stack, tiktoken_tok, script):
    stack.upstream.script = script
    stack.records.clear()
    n_sent = len(stack.upstream.sent)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    status, data, _ = stack.run(post(stack.url, body))
    stack.settle()
    truth = stack.upstream.sent[n_sent]
    assert status == 200
    assert data == bytes(truth.body), "the client must get the upstream's bytes, unchanged"
    (rec,) = stack.records
    tok = tiktoken_tok
    expect = {k: tok.count(v) for k, v in truth.texts.items()}
    assert rec.content_tokens == expect["content"]
    assert rec.reasoning_tokens == expect["reasoning"]
    assert rec.tool_args_tokens == expect["tool_args"]
    assert rec.completion_tokens == sum(expect.values())
    assert rec.saw_done is True and rec.outcome == "ok"
    # merged events arrive in one read, but each carried output text: chunks are events, not reads
    assert rec.chunks == truth.chunks
    # timestamps: the proxy saw each byte after the upstream sent it (causality: no tolerance), and not
    # grossly later; holding bytes back is caught by test_inter_chunk_gaps_are_preserved and the precision
    # by test_timing_precision, over many turns, where one scheduling hiccup of a busy machine cannot decide it
    assert 0 <= rec.t_first_token - truth.t_first_text < 1.0
    assert 0 <= rec.t_last_token - truth.t_last_text < 1.0
    if script.usage == "none":
        assert rec.usage_completion_tokens is None  # missing is missing, not 0
    else:
        assert rec.usage_completion_tokens == sum(len(p) for p in (script.pieces, script.reasoning_pieces,
                                                                    script.tool_args_pieces))
    if rec.decode_s > 0:
        assert rec.decode_tps == pytest.approx((rec.completion_tokens - rec.first_chunk_tokens) / rec.decode_s)
    assert stack.tokenizer.calls_on_loop == 0


def test_role_only_first_chunk_is_not_the_first_token(stack, tiktoken_tok):
    stack.upstream.script = Script(pieces=pieces_of("The answer is forty-two.", tiktoken_tok), role_chunk=True,
                                   ttft_s=0.05)
    stack.run(post(stack.url, {"model": "m", "stream": True, "messages": [{"role": "user", "content": "q"}]}))
    stack.settle()
    (rec,) = stack.records
    truth = stack.upstream.sent[-1]
    assert rec.ttft_s >= 0.05  # the role chunk came at once; the first token only after 50 ms
    assert rec.t_first_token >= truth.t_first_text


def test_speculative_chunks_are_not_tokens(stack, tiktoken_tok):
    """Four tokens per chunk: tokens_per_chunk is 4, not 1, and decode_tps counts tokens."""
    pieces = pieces_of(" one two three four five six seven eight nine ten eleven twelve", tiktoken_tok)
    assert len(pieces) == 12
    # 100 ms apart: only a stall that long of the proxy's reader, while the upstream kept writing, could merge
    # the chunks into one read and leave no decode time
    stack.upstream.script = Script(pieces=pieces, tokens_per_chunk=4, interval_s=0.1, role_chunk=False)
    stack.run(post(stack.url, {"model": "m", "stream": True, "messages": [{"role": "user", "content": "q"}]}))
    stack.settle()
    (rec,) = stack.records
    assert rec.chunks == 3
    assert rec.completion_tokens == 12
    assert rec.tokens_per_chunk == 4.0
    assert rec.first_chunk_tokens == 4
    # 8 tokens (not 2 chunks) after the first chunk, over the decode time: ~40 tok/s on a quiet machine, not
    # ~10; the speed itself depends on the machine's scheduling, the tokens in it do not
    assert rec.decode_s > 0 and rec.decode_tps == pytest.approx(8 / rec.decode_s)


@pytest.mark.alone
def test_inter_chunk_gaps_are_preserved(stack, tiktoken_tok):
    """No buffering: what the upstream spaces 30 ms apart reaches the client 30 ms apart."""
    pieces = pieces_of(" a b c d e f g h", tiktoken_tok)
    stack.upstream.script = Script(pieces=pieces, interval_s=0.03, role_chunk=False, usage="none", done=False)
    _, _, reads = stack.run(post(stack.url, {"model": "m", "stream": True,
                                             "messages": [{"role": "user", "content": "q"}]}))
    truth = stack.upstream.sent[-1].write_times
    client = [t for t, _ in reads]
    assert len(client) >= len(pieces)  # one read per chunk at least: nothing was held back and merged
    up_gaps = [b - a for a, b in zip(truth, truth[1:])]
    # match each upstream write to the first client read at or after it
    arrivals = []
    i = 0
    for t in truth:
        while client[i] < t:
            i += 1
        arrivals.append(client[i])
    import numpy as np

    gap_errors = np.array([abs((b - a) - gap) for (a, b), gap in zip(zip(arrivals, arrivals[1:]), up_gaps)])
    lags = np.array([t_client - t_up for t_up, t_client in zip(truth, arrivals)])
    # Buffering would show as gaps of ~0 instead of 30 ms (errors of ~30 ms) and growing lags. Typical here:
    # median error and lag under 0.5 ms; with the machine loaded (load average 7 on 2 cores) single gaps up to
    # 5 ms. The medians hold the proxy to a third of a gap; the maxima are sanity bounds that one descheduled
    # thread on a busy machine cannot cross, while the medians catch any systematic hold-back.
    assert np.median(gap_errors) < 0.010 and gap_errors.max() < 0.5, gap_errors
    assert (lags >= 0).all() and np.median(lags) < 0.010 and lags.max() < 0.5, lags


def test_non_streamed_turn(stack, tiktoken_tok):
    pieces = pieces_of("A whole answer at once.", tiktoken_tok)
    stack.upstream.script = Script(pieces=pieces, ttft_s=0.02)
    status, data, _ = stack.run(post(stack.url, {"model": "m", "messages": [{"role": "user", "content": "q"}]}))
    stack.settle()
    (rec,) = stack.records
    assert status == 200 and data == bytes(stack.upstream.sent[-1].body)
    assert rec.streamed is False
    assert rec.completion_tokens == len(pieces)
    assert rec.chunks == 1 and rec.decode_s == 0 and rec.decode_tps is None
    assert rec.ttft_s >= 0.02


def test_usage_counting_an_unseen_token_is_kept_apart(stack, tiktoken_tok):
    pieces = pieces_of("Short reply.", tiktoken_tok)
    stack.upstream.script = Script(pieces=pieces, extra_usage_tokens=1)
    stack.run(post(stack.url, {"model": "m", "stream": True, "messages": [{"role": "user", "content": "q"}]}))
    stack.settle()
    (rec,) = stack.records
    assert rec.completion_tokens == len(pieces)
    assert rec.usage_completion_tokens == len(pieces) + 1


@pytest.mark.parametrize("crlf", [False, True])  # the native reader (LF) and the reference (CRLF)
def test_cached_tokens_from_llama_cpp_timings_on_a_stream_without_usage(stack, tiktoken_tok, crlf):
    """llama-server closes every stream with ``timings`` (its ``cache_n``: prompt tokens from its cache),
    also one sent without ``stream_options.include_usage``, which has no usage: the record's cached
    count comes from it, and the server's prompt count stays null (the server did not say one)."""
    pieces = pieces_of("Short reply, cached prompt.", tiktoken_tok)
    stack.upstream.script = Script(pieces=pieces, usage="none", timings=True, cache_n=3, crlf=crlf)
    stack.run(post(stack.url, {"model": "m", "stream": True, "messages": [{"role": "user", "content": "q"}]}))
    stack.settle()
    (rec,) = stack.records
    assert rec.usage_cached_tokens == 3 and rec.usage_prompt_tokens is None
    assert rec.usage_cache_write_tokens is None and rec.completion_tokens == len(pieces)


@pytest.mark.alone
def test_timing_precision(stack, tiktoken_tok):
    """ttft_s and decode_s against the truth over 40 turns of varied shapes: median error under 5 ms, three in
    four under 10 ms, none off by half a second.

    Measured: median 0.5-0.8 ms and 75th percentile about 1 ms, quiet or with the machine loaded (load
    average 7 on 2 cores), where the 95th percentile reached 4.6 ms and single turns 40 ms (a descheduled
    thread). A systematic error (a timestamp taken at parse time rather than arrival, a shape whose first
    token is missed) moves the median or the quartile by a chunk interval or more; scheduling does not."""
    import numpy as np

    pieces = pieces_of(" one two three four five six seven eight nine ten", tiktoken_tok)
    errors = []
    for i in range(40):
        stack.upstream.script = Script(pieces=pieces, ttft_s=0.01 * (i % 4), interval_s=0.003 * (i % 3),
                                       tokens_per_chunk=1 + i % 3, split_events=bool(i % 2))
        stack.records.clear()
        stack.run(post(stack.url, {"model": "m", "stream": True, "messages": [{"role": "user", "content": "q"}]}))
        stack.settle()
        (rec,) = stack.records
        truth = stack.upstream.sent[-1]
        errors.append(abs(rec.ttft_s - (truth.t_first_text - truth.t_received)))
        errors.append(abs(rec.decode_s - (truth.t_last_text - truth.t_first_text)))
    errors = np.array(errors)
    assert np.median(errors) < 0.005 and np.percentile(errors, 75) < 0.010, sorted(errors)
    assert errors.max() < 0.5, sorted(errors)[-5:]
