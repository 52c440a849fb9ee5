"""Mooncake traces: turns measured through the proxy -> ``export --format mooncake`` -> ``bench --from`` with
``--timing recorded``, against the fake upstream.

What must hold: the trace's hash ids share exactly the blocks the prompts shared (a session's turns
extend each other; another session shares only its system prompt); the replayed prompts share exactly
those blocks, token for token; and each request is sent in the trace's order, never before its recorded
offset (divided by ``--speed``). Offsets are checked as lower bounds from a time taken before bench
started, and the speed-up against an upper bound with seconds of margin: no assertion rests on a
scheduler being prompt."""

from __future__ import annotations

import math
import time
from pathlib import Path

import aiohttp
import orjson

from benchkit import one_line_error, specproxy, upstream_thread

__all__ = ["upstream_thread"]  # a fixture the tests take by name

SYSTEM = "You review pull requests for a storage engine. " * 60  # ~600 tokens: more than one 512-token block


def _turn(session: int, k: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for j in range(k):
        messages += [{"role": "user", "content": f"Session {session}, change {j}: " + "the lock order " * 100},
                     {"role": "assistant", "content": f"Change {j} looks right. " * 60}]
    messages.append({"role": "user", "content": f"Session {session}: and the next one?"})
    return {"model": "m", "messages": messages, "stream": True}


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_export_mooncake_then_bench_recorded_replays_the_block_sharing_and_the_timing(
        make_stack, tmp_path, upstream_thread, tiktoken_tok):
    stack = make_stack(tiktoken_tok)
    bodies = [_turn(1, 0), _turn(1, 1), _turn(2, 0), _turn(1, 2)]

    async def send() -> None:
        async with aiohttp.ClientSession() as session:
            for body in bodies:
                async with session.post(stack.url + "/v1/chat/completions", json=body) as r:
                    await r.read()

    stack.run(send())
    stack.settle()
    stack.run(stack.service.stop())
    db = stack.cfg.db

    trace_file = tmp_path / "trace.jsonl"
    proc = specproxy("export", "--db", db, "--format", "mooncake", "-o", str(trace_file))
    assert proc.returncode == 0, proc.stderr
    lines = [orjson.loads(line) for line in trace_file.read_bytes().splitlines()]
    assert [list(line) for line in lines] == [["timestamp", "input_length", "output_length", "hash_ids"]] * 4
    assert lines[0]["timestamp"] == 0 and [x["timestamp"] for x in lines] == sorted(x["timestamp"] for x in lines)
    ids = [x["hash_ids"] for x in lines]
    for x in lines:
        assert len(x["hash_ids"]) == math.ceil(x["input_length"] / 512) and x["output_length"] > 0
    # the reference: the prompts' own tokens, as the proxy counts them (each message on its own, no template)
    tokens = [[t for m in b["messages"] for t in tiktoken_tok.encode(m["content"])] for b in bodies]
    assert [x["input_length"] for x in lines] == [len(t) for t in tokens]
    for i in range(4):
        for j in range(4):
            shared = _common(tokens[i], tokens[j])
            for b in range(min(len(ids[i]), len(ids[j]))):
                end_i, end_j = min((b + 1) * 512, len(tokens[i])), min((b + 1) * 512, len(tokens[j]))
                assert (ids[i][b] == ids[j][b]) == (end_i == end_j and shared >= end_i), (i, j, b)
    assert ids[0][0] == ids[2][0] == ids[1][0]  # the system prompt's first block, in every session
    assert ids[1][:2] == ids[3][:2] and ids[2][1] != ids[1][1]  # a session's turns share more
    assert sorted({h for x in ids for h in x}) == list(range(len({h for x in ids for h in x})))  # numbered from 0

    # a trace with offsets far apart (the recorded turns came back to back): 0, 1.2, 2.4, 3.6 s, at --speed 3
    spaced = tmp_path / "spaced.jsonl"
    offsets = [0, 1200, 2400, 3600]
    spaced.write_bytes(b"".join(orjson.dumps({**x, "timestamp": t}) + b"\n" for x, t in zip(lines, offsets)))
    up = upstream_thread()
    before = time.perf_counter()  # the fake's clock: bench's round starts after this
    proc = specproxy("bench", "--upstream", up.url, "--from", str(spaced), "--db", str(tmp_path / "b.db"),
                     "--tokenizer", "tiktoken:o200k_base", "--repeats", "1", "--timing", "recorded", "--speed", "3",
                     "--model", "m", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = orjson.loads(proc.stdout)
    assert summary["timing"] == "recorded" and summary["speed"] == 3
    schedule = summary["schedule"]
    assert schedule["requests"] == 4 and 0 <= schedule["late_s_median"] <= schedule["late_s_max"]
    warm, *sent = up.sent
    assert len(sent) == 4
    got = [orjson.loads(s.request_body) for s in sent]
    contents = [g["messages"][0]["content"] for g in got]
    replayed = [tiktoken_tok.encode(c) for c in contents]
    # in the trace's order, each exactly input_length tokens, asking for output_length with ignore_eos
    assert [len(t) for t in replayed] == [x["input_length"] for x in lines]
    assert [g["max_tokens"] for g in got] == [x["output_length"] for x in lines]
    assert all(g["ignore_eos"] and g["stream"] and g["model"] == "m" for g in got)
    for i in range(4):
        for j in range(4):
            if i != j:  # shared exactly as the hash ids say: the leading equal ids' blocks, no more
                lead = _common(ids[i], ids[j])
                assert _common(replayed[i], replayed[j]) == min(lead * 512, len(replayed[i]), len(replayed[j]))
    # the warm-up went first, sharing no block of the trace
    warm_tokens = tiktoken_tok.encode(orjson.loads(warm.request_body)["messages"][0]["content"])
    assert all(_common(warm_tokens, t) == 0 for t in replayed)
    # never before its offset / 3: lower bounds from a time before bench started
    for s, t in zip(sent, offsets):
        assert s.t_received - before >= t / 1000 / 3
    assert [s.t_received for s in sent] == sorted(s.t_received for s in sent)
    # and compressed: the span is 1.2 s at --speed 3, 3.6 s were it ignored (seconds of margin either way)
    assert sent[-1].t_received - sent[0].t_received < 2.6


def test_what_a_trace_cannot_be_is_one_line(tmp_path, upstream_thread):
    up = upstream_thread()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}\n'
                   '{"timestamp": 5, "input_length": 10, "output_length": 5, "hash_ids": ["x"]}\n')
    one_line_error(specproxy("bench", "--upstream", up.url, "--from", str(bad), "--tokenizer", "tiktoken:o200k_base",
                             "--db", str(tmp_path / "b.db"), "--model", "m"), "bad.jsonl:2", "hash_ids")
    good = tmp_path / "good.jsonl"
    good.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}\n')
    one_line_error(specproxy("bench", "--upstream", up.url, "--from", str(good), "--db", str(tmp_path / "b.db"),
                             "--tokenizer", "none", "--model", "m"), "needs the model's tokenizer")
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"model": "m", "messages": [{"role": "user", "content": "hi"}]}\n')
    one_line_error(specproxy("bench", "--upstream", up.url, "--from", str(plain), "--db", str(tmp_path / "b.db"),
                             "--timing", "recorded"), "plain.jsonl:1", "timestamp")
    one_line_error(specproxy("export", "--db", str(tmp_path / "b.db"), "--format", "mooncake", "--block-size", "100"),
                   "multiple of 64")
