"""A Mooncake trace replayed on a real llama-server: the server's own cached-token count follows the trace's
block sharing.

The server has one slot (``-np 1``): llama-server keeps a slot's last prompt and reuses the longest prefix
a new prompt shares with it, token by token (``timings.cache_n``), with no page granularity. With one slot
every request meets the one served before it, so the reuse to expect is exactly the blocks the two share
(leading equal hash ids, 256 tokens each), plus the chat template's tokens before the message, which every
request has. The trace is built so that the request served before is also the earlier request sharing the
most with each one: a server that also keeps older prompts in host memory (llama-server's prompt cache)
expects the same. The margin: the template trims the message's leading space, so two messages that share
no block can still begin with the same token or two of a re-split first word; 3 tokens, against block
sharing that moves the count by 256 at a time.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from real.server import LlamaServer

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 256
# (offset ms, input tokens, hash ids): each shares the most with the request just before it
TRACE = [
    (0, 700, [0, 1, 2]),
    (500, 1000, [0, 1, 3, 4]),  # 512 tokens with the one before
    (1000, 900, [0, 1, 3, 5]),  # 768
    (1500, 400, [6, 7]),  # none (the template's tokens only)
    (2000, 650, [6, 7, 8]),  # all 400 of the one before
]


def _lead(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _by_trace_line(timings: list[dict], lengths: list[int]) -> list[int]:
    """For each trace line, the index of its replayed turn. Not the order sent: requests close together in
    the schedule may cross the socket out of it (one waits to open a connection while the next takes one
    that just came free), so each turn is known by its prompt's length instead (``cache_n + prompt_n``: the
    line's tokens plus the template's, the same for every line), which the trace makes distinct."""
    assert len(set(lengths)) == len(lengths), lengths
    totals = [t["cache_n"] + t["prompt_n"] for t in timings]
    lines = sorted(range(len(lengths)), key=lengths.__getitem__)
    turns = sorted(range(len(totals)), key=totals.__getitem__)
    out = [0] * len(lengths)
    for line, turn in zip(lines, turns):
        out[line] = turn
    template = {totals[out[i]] - lengths[i] for i in range(len(lengths))}
    assert len(template) == 1, (lengths, totals)  # the template's tokens alike for every turn: paired right
    return out


def test_replayed_trace_gives_the_cached_tokens_its_blocks_share(llama_server_bin, tiny_model_path, hf_tokenizer_dir,
                                                                 tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 4, "hash_ids": ids}) + "\n"
                             for t, n, ids in TRACE))
    db = tmp_path / "replay.db"
    with LlamaServer(llama_server_bin, tiny_model_path, parallel=1, n_ctx=4096) as srv:
        proc = subprocess.run([sys.executable, "-m", "specproxy.app.cli", "bench", "--upstream", srv.url, "--from",
                               str(trace), "--tokenizer", f"hf:{hf_tokenizer_dir}", "--block-size", str(BLOCK),
                               "--timing", "recorded", "--speed", "2", "--repeats", "1", "--db", str(db), "--json"],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT t_first_token, server_timings, outcome FROM turns WHERE measured = 1").fetchall()
    conn.close()
    assert len(rows) == len(TRACE) and all(r[2] == "ok" for r in rows), rows
    # row i is trace line i's turn; served one at a time by the one slot, in t_first_token's order
    rows = [rows[k] for k in _by_trace_line([json.loads(r[1]) for r in rows], [n for _, n, _ in TRACE])]
    served = sorted(range(len(rows)), key=lambda i: rows[i][0])
    timings = [json.loads(r[1]) for r in rows]
    extra = []
    for k, i in enumerate(served):
        prev = served[k - 1] if k else None
        shared = 0 if prev is None else min(_lead(TRACE[i][2], TRACE[prev][2]) * BLOCK, TRACE[i][1], TRACE[prev][1])
        cache_n, prompt_n = timings[i]["cache_n"], timings[i]["prompt_n"]
        template = cache_n + prompt_n - TRACE[i][1]  # the prompt's tokens outside the message
        assert 0 <= cache_n - shared <= template, (i, cache_n, shared, template, timings)
        extra.append(cache_n - shared)
    # the same template prefix every time: the cached tokens moved with the blocks shared, and only with them
    assert max(extra) - min(extra) <= 3, (extra, timings)


def _session(name: str, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You review pull requests for a storage engine, tersely. " * 25}]
    for k in range(turns):
        messages += [{"role": "user", "content": f"{name}, change {k}: " + "the lock order of the pager " * 12},
                     {"role": "assistant", "content": f"Change {k} is fine. " * 10}]
    return messages + [{"role": "user", "content": f"{name}: and the next change?"}]


def test_real_traffic_exported_then_replayed_keeps_the_servers_reuse(llama_server_bin, tiny_model_path,
                                                                    hf_tokenizer_dir, counter, make_stack, tmp_path):
    """Turns of two sessions sent through the proxy to a one-slot llama-server (the chat template rendered
    by the server, counted by specproxy with the same template) -> ``export --format mooncake`` -> ``bench
    --from`` to the same server. On the real turns, the hash ids say what the server reused: at least the
    blocks a turn shares with the prompt in the slot (the turn served before), less than one block more
    than the most it shares with any earlier turn (the server reuses to the token, the ids to the block).
    On the replay, plus the template's tokens before the message: never more than the ids allow, and at
    least a block where the turn served before shares blocks with it (not always all of them: under load a
    replayed request may be served after another, and the slot's cache then keeps less of the shared
    prefix than the ids say). The replayed turns are matched to the trace's lines by their prompts' lengths,
    not by the order they reached the server: two requests close in the schedule can cross over."""
    from real.clientkit import proxy, sdk

    block = 64
    with LlamaServer(llama_server_bin, tiny_model_path, parallel=1, n_ctx=8192) as srv:
        stack, _ = proxy(make_stack, srv, counter)
        client = sdk(stack.url)
        # Bob's name is longer than Ann's so that no two turns' prompts have the same length
        for messages in (_session("Ann", 0), _session("Ann", 1), _session("Bob the builder", 0), _session("Ann", 2)):
            stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True)
            for _ in stream:
                pass
        stack.settle()
        stack.run(stack.service.stop())
        conn = sqlite3.connect(stack.cfg.db)
        real = [json.loads(r[0]) for r in conn.execute(
            "SELECT server_timings FROM turns WHERE measured = 1 ORDER BY t_request")]
        conn.close()
        trace_file = tmp_path / "trace.jsonl"
        proc = subprocess.run([sys.executable, "-m", "specproxy.app.cli", "export", "--db", stack.cfg.db, "--format",
                               "mooncake", "--block-size", str(block), "-o", str(trace_file)],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        trace = [json.loads(line) for line in trace_file.read_text().splitlines()]
        assert len(trace) == len(real) == 4
        for i, (line, timings) in enumerate(zip(trace, real)):
            # the proxy's count of the rendered prompt is the server's
            assert line["input_length"] == timings["cache_n"] + timings["prompt_n"], (i, line, timings)
            if i == 0:
                continue
            prev = _lead(line["hash_ids"], trace[i - 1]["hash_ids"]) * block
            best = max(_lead(line["hash_ids"], t["hash_ids"]) for t in trace[:i]) * block
            assert prev <= timings["cache_n"] < best + block, (i, prev, best, timings)

        db = tmp_path / "replay.db"
        proc = subprocess.run([sys.executable, "-m", "specproxy.app.cli", "bench", "--upstream", srv.url, "--from",
                               str(trace_file), "--tokenizer", f"hf:{hf_tokenizer_dir}", "--block-size", str(block),
                               "--timing", "recorded", "--speed", "4", "--repeats", "1", "--db", str(db)],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT t_first_token, server_timings FROM turns WHERE measured = 1").fetchall()
    conn.close()
    assert len(rows) == len(trace), rows
    rows = [rows[k] for k in _by_trace_line([json.loads(r[1]) for r in rows], [t["input_length"] for t in trace])]
    served = sorted(range(len(rows)), key=lambda i: rows[i][0])
    replayed = [json.loads(r[1]) for r in rows]
    first = served[0]
    template = replayed[first]["cache_n"]  # after the warm-up (no block of the trace): the template's tokens only
    for k, i in enumerate(served[1:], 1):
        ids, n = trace[i]["hash_ids"], trace[i]["input_length"]
        prev = served[k - 1]
        low = min(_lead(ids, trace[prev]["hash_ids"]) * block, n, trace[prev]["input_length"])
        high = max(min(_lead(ids, trace[j]["hash_ids"]) * block, n, trace[j]["input_length"]) for j in served[:k])
        got = replayed[i]["cache_n"]
        assert template - 3 <= got <= template + high + 3, (i, low, high, template, replayed)  # never more
        if low >= block:  # shares blocks with the prompt served before it: the server reused some of them
            assert got >= template + block - 3, (i, low, high, template, replayed)
