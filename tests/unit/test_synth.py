"""Prompts synthesised from hash ids (``app/synth.py``) and Mooncake lines read and written
(``app/mooncake.py``): the same id is the same tokens, different ids differ from their first token, and
every prompt is exactly ``input_length`` tokens for the tokenizer it was made for. The generators are
seeded: each assertion holds or fails the same way on every run."""

from __future__ import annotations

import orjson
import pytest

from specproxy.app.mooncake import read_trace, trace_lines, trace_requests
from specproxy.app.replay import parse_line
from specproxy.app.synth import BlockText
from specproxy.errors import ConfigError
from specproxy.measure.blocks import block_digests


def _lead(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("which", ["tiktoken_tok", "hf_tok"])
def test_blocks_are_token_exact_and_shared_exactly_as_the_ids_say(which, request):
    tok = request.getfixturevalue(which)
    blocks = BlockText(tok, 128)
    prompts = {  # (hash ids, input_length)
        "a": ([0, 1, 2], 300), "b": ([0, 1, 3], 384), "c": ([0, 1, 2], 300), "d": ([4], 100),
        "e": ([0, 1], 400), "f": ([0], 5), "g": ([4000 + 1, 9], 256), "h": ([1], 128),
    }
    enc = {k: tok.encode(blocks.prompt(ids, n, k)) for k, (ids, n) in prompts.items()}
    for k, (ids, n) in prompts.items():
        assert len(enc[k]) == n, k  # exactly input_length tokens
    for k, (ids_k, n_k) in prompts.items():
        for j, (ids_j, n_j) in prompts.items():
            if j == k:
                continue
            # equal ids -> identical blocks; the first different id (or the end of one's ids) -> a different token
            expect = min(_lead(ids_k, ids_j) * 128, n_k, n_j)
            if ids_k == ids_j and n_k == n_j:
                assert enc[k] == enc[j]
            else:
                assert _lead(enc[k], enc[j]) == expect, (k, j)
    # the same id gives the same block from a fresh generator (another run of bench)
    assert BlockText(tok, 128).block(3) == blocks.block(3)


def test_a_tokenizer_without_one_token_words_is_one_line():
    class Bytes:  # one token per character: no two-letter word is one token
        name = "bytes"

        def encode(self, text):
            return list(text.encode())

    with pytest.raises(ConfigError, match="cannot synthesise exact blocks"):
        BlockText(Bytes(), 64)


def test_the_mooncake_lines_number_ids_from_0_and_read_back(tmp_path):
    import numpy as np

    def digests(tokens):
        return b"".join(block_digests(np.asarray(tokens, dtype=np.uint32))).hex()

    base = list(range(1500))
    rows = [(100.0, 1500, 7, None, digests(base)), (100.25, 1600, None, 9, digests(base + [1] * 100)),
            (100.5, 1500, 3, 3, None), (101.0, 10, 2, 2, digests(list(range(10, 20))))]
    skipped = [0]
    lines = [orjson.loads(x) for x in trace_lines(rows, 512, skipped)]
    assert skipped == [1]
    assert lines == [{"timestamp": 0, "input_length": 1500, "output_length": 7, "hash_ids": [0, 1, 2]},
                     {"timestamp": 250, "input_length": 1600, "output_length": 9, "hash_ids": [0, 1, 3, 4]},
                     {"timestamp": 1000, "input_length": 10, "output_length": 2, "hash_ids": [5]}]
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(trace_lines(rows, 512, [0])))
    trace = read_trace(path)
    assert [r.hash_ids for r in trace] == [(0, 1, 2), (0, 1, 3, 4), (5,)]


def test_trace_requests_carry_offsets_and_ask_for_the_output(tmp_path, tiktoken_tok):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 1500, "input_length": 70, "output_length": 9, "hash_ids": [1, 2]}\n'
                    '{"timestamp": 500, "input_length": 64, "output_length": 3, "hash_ids": [1]}\n')
    requests, warm = trace_requests(read_trace(path), tiktoken_tok, 64, "m")
    assert [r.offset_s for r in requests] == [0.0, 1.0]  # ordered by timestamp, from the first
    bodies = [orjson.loads(r.body) for r in requests]
    assert [b["max_tokens"] for b in bodies] == [3, 9] and all(b["ignore_eos"] and b["stream"] for b in bodies)
    texts = [tiktoken_tok.encode(b["messages"][0]["content"]) for b in bodies]
    assert [len(t) for t in texts] == [64, 70] and texts[1][:64] == texts[0]
    warm_tokens = tiktoken_tok.encode(orjson.loads(warm.body)["messages"][0]["content"])
    assert len(warm_tokens) == 64 and _lead(warm_tokens, texts[0]) == 0


def test_a_replay_wrapper_may_carry_its_timestamp():
    r = parse_line(b'{"path": "/v1/chat/completions", "timestamp": 2500, "body": {"messages": []}}', "f:1")
    assert r.offset_s == 2.5
    assert parse_line(b'{"messages": []}', "f:2").offset_s is None
    with pytest.raises(ConfigError, match="timestamp"):
        parse_line(b'{"path": "/v1/chat/completions", "timestamp": -1, "body": {"messages": []}}', "f:3")


def test_captures_and_exported_replay_lines_keep_their_times():
    from specproxy.app.replay import replay_line, requests_from_captures
    from specproxy.store.captures import Captured

    caps = [Captured("a", 50.0, "POST", "/v1/chat/completions", "", b'{"messages": []}'),
            Captured("b", 50.1, "GET", "/v1/models", "", b""),
            Captured("c", 51.25, "POST", "/v1/chat/completions", "", b'{"messages": []}')]
    assert [r.offset_s for r in requests_from_captures(caps)] == [0.0, 1.25]
    line = replay_line(caps[2], 50.0)
    assert orjson.loads(line)["timestamp"] == 1250 and parse_line(line.rstrip(b"\n"), "f:1").offset_s == 1.25
