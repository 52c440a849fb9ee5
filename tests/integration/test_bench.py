"""Capture, replay and ``specproxy bench`` against the fake upstream, through the real command line.

Capture -> export -> bench must send the captured bodies byte for byte (the fake records what it
received); bench's turns are the proxy's records, labelled, with the warm-up left out; probes, roofline,
durations, rates and Ctrl-C. Restarts and every way a run can go wrong: test_bench_failures.py.
"""

from __future__ import annotations

import gzip
import json
import sqlite3
import subprocess
from pathlib import Path

import aiohttp
import pytest

from benchkit import BODIES, bench_with_second_line, ROOT, SPECPROXY, one_line_error, specproxy, upstream_thread, workload
from specproxy.app.fake_upstream import Script

__all__ = ["upstream_thread"]  # a fixture the tests take by name


def test_capture_then_export_then_bench_sends_the_same_bytes(make_stack, tmp_path, upstream_thread):
    """serve --capture stores each body as sent (a gzip one too), never a header; export --format replay
    writes them; bench --from FILE (and --from captured) sends exactly those bytes again."""
    stack = make_stack(None, capture=True, label="users")
    gz = gzip.compress(BODIES[0])

    async def send() -> None:
        async with aiohttp.ClientSession() as session:
            for body in BODIES:
                path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
                async with session.post(stack.url + path, data=body, headers={
                        "Authorization": "Bearer sk-secret-key-123", "Content-Type": "application/json"}) as r:
                    await r.read()
            async with session.post(stack.url + "/v1/chat/completions", data=gz, headers={
                    "Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
                await r.read()

    stack.run(send())
    stack.settle()
    stack.run(stack.service.stop())  # the writer drained: every capture is in the file
    db = Path(stack.cfg.db)
    conn = sqlite3.connect(db)
    stored = conn.execute("SELECT body, content_encoding FROM captures ORDER BY t_wall").fetchall()
    conn.close()
    assert stored == [(b, "") for b in BODIES] + [(gz, "gzip")]
    files = [p for p in (db, Path(f"{db}-wal")) if p.exists()]
    assert not any(b"sk-secret-key-123" in p.read_bytes() for p in files)  # headers are never stored

    replay = tmp_path / "replay.jsonl"
    proc = specproxy("export", "--db", str(db), "--format", "replay", "-o", str(replay))
    assert proc.returncode == 0, proc.stderr
    assert len(replay.read_text().splitlines()) == 4

    for source in (str(replay), "captured:users"):
        up = upstream_thread()
        out = tmp_path / f"bench-{len(source)}.db"
        if source.startswith("captured"):
            out.write_bytes(db.read_bytes())
        proc = specproxy("bench", "--upstream", up.url, "--from", source, "--db", str(out), "--repeats", "1",
                         "--warmup", "0", "--label", "replayed")
        assert proc.returncode == 0, proc.stderr
        # the bytes as they arrived at the fake, before it inflates the gzip one to read it
        received = [(s.raw_request_body, s.request_headers.get("Content-Encoding", "")) for s in up.sent]
        assert received == [(b, "") for b in BODIES] + [(gz, "gzip")]
        assert up.sent[-1].request_body == BODIES[0]  # and the server read the body the client compressed


# one body of each API, as a client would write it, bare (the API inferred from its fields) and wrapped
API_BODIES = {
    "chat": ("/v1/chat/completions",
             b'{"model": "m", "max_tokens": 8, "stream": true, "messages": [{"role": "system", "content": "terse"}, '
             b'{"role": "user", "content": "hi"}]}'),
    "completions": ("/v1/completions", b'{"model": "m", "prompt": "Once upon", "stream": true}'),
    "messages": ("/v1/messages",
                 b'{"model": "m", "max_tokens": 64, "system": "Be brief.", "stream": true,\n'
                 b' "messages": [{"role": "user", "content": "hi"}]}'),
    "responses": ("/v1/responses", b'{"model": "m", "instructions": "Be brief.", "input": "hi", "stream": true}'),
}


def test_bodies_of_every_api_go_to_their_path_bare_or_wrapped(tmp_path, upstream_thread):
    """A hand-written file of all four APIs' bodies: each bare one is sent to its API's path (inferred from
    its fields), each wrapped one to the path it names, byte for byte, and stored with its API."""
    lines, expect = [], []
    for api, (path, body) in API_BODIES.items():
        lines.append(body.replace(b"\n", b""))  # a bare body is one line
        expect.append((path, body.replace(b"\n", b""), api))
        lines.append(json.dumps({"body": body.decode()}).encode())  # wrapped, path inferred as for a bare one
        expect.append((path, body, api))
    lines.append(json.dumps({"path": "/v1/messages", "body": '{"model": "m", "max_tokens": 9, "stream": true, '
                                                             '"messages": [{"role": "user", "content": "hi"}]}'}).encode())
    expect.append(("/v1/messages", json.loads(lines[-1])["body"].encode(), "messages"))  # shared shape, path named
    work = tmp_path / "apis.jsonl"
    work.write_bytes(b"\n".join(lines) + b"\n")
    up = upstream_thread()
    db = tmp_path / "apis.db"
    proc = specproxy("bench", "--upstream", up.url, "--from", str(work), "--db", str(db), "--repeats", "1",
                     "--warmup", "0", "--label", "apis")
    assert proc.returncode == 0, proc.stderr
    assert [(s.path, s.request_body) for s in up.sent] == [(p, b) for p, b, _ in expect]
    conn = sqlite3.connect(db)
    stored = conn.execute("SELECT path, api, outcome FROM turns ORDER BY t_request").fetchall()
    conn.close()
    assert stored == [(p, api, "ok") for p, _, api in expect]


@pytest.mark.parametrize(("line", "needle"), [
    # signs of two APIs: a chat role and an Anthropic top-level system prompt
    (b'{"system": "s", "messages": [{"role": "system", "content": "x"}]}', 'write it as {"path": "/v1/messages"'),
    (b'{"messages": [], "input": "x"}', 'both "messages" and "input"'),
    (b'{"body": {"prompt": "x", "input": "y"}}', 'no "path", and the body has both "prompt" and "input"'),
])
def test_a_body_of_no_one_api_asks_for_its_path(tmp_path, upstream_thread, line, needle):
    up = upstream_thread()
    proc, work = bench_with_second_line(tmp_path, up, line, "two.jsonl")
    one_line_error(proc, f"{work}:2", needle, '"path"')
    assert up.sent == []


def test_captured_messages_and_responses_turns_replay_byte_for_byte(make_stack, tmp_path, upstream_thread):
    """Turns of the Anthropic Messages and OpenAI Responses APIs captured through the proxy, exported, and
    replayed by bench: the same bytes reach the same paths, and bench stores them as the same APIs."""
    stack = make_stack(None, capture=True, label="agents")
    sent = [(API_BODIES[api][0] + ("?beta=true" if api == "messages" else ""), API_BODIES[api][1])
            for api in ("messages", "responses", "messages")]

    async def send() -> None:
        async with aiohttp.ClientSession() as session:
            for path, body in sent:
                async with session.post(stack.url + path, data=body, headers={
                        "x-api-key": "sk-ant-secret-456", "Content-Type": "application/json"}) as r:
                    assert r.status == 200
                    await r.read()

    stack.run(send())
    stack.settle()
    stack.run(stack.service.stop())
    db = Path(stack.cfg.db)
    replay = tmp_path / "agents.jsonl"
    proc = specproxy("export", "--db", str(db), "--format", "replay", "-o", str(replay))
    assert proc.returncode == 0, proc.stderr
    assert b"sk-ant-secret-456" not in replay.read_bytes()
    up = upstream_thread()
    out = tmp_path / "replayed.db"
    proc = specproxy("bench", "--upstream", up.url, "--from", str(replay), "--db", str(out), "--repeats", "1",
                     "--warmup", "0", "--label", "replayed")
    assert proc.returncode == 0, proc.stderr
    # the captured path is without its query string: what the proxy measures by
    assert [(s.path, s.request_body) for s in up.sent] == [(p.partition("?")[0], b) for p, b in sent]
    conn = sqlite3.connect(out)
    apis = [r[0] for r in conn.execute("SELECT api FROM turns ORDER BY t_request")]
    conn.close()
    assert apis == ["messages", "responses", "messages"]


def test_bench_records_labelled_turns_per_concurrency_without_the_warm_up(tmp_path, upstream_thread):
    up = upstream_thread()
    work = tmp_path / "w.jsonl"
    work.write_bytes(BODIES[0] + b"\n\n" + BODIES[2] + b"\n")  # a blank line is skipped
    db = tmp_path / "b.db"
    proc = specproxy("bench", "--upstream", up.url, "--from", str(work), "--db", str(db), "--concurrency", "1,3",
                     "--repeats", "2", "--warmup", "2", "--tokenizer", "tiktoken:o200k_base", "--label", "sweep")
    assert proc.returncode == 0, proc.stderr
    # 2 warm-up requests straight to the server; then per repeat max(2, level) requests at each level
    assert len(up.sent) == 2 + 2 * (2 + 3)
    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT label, outcome, count(*) FROM turns GROUP BY label, outcome").fetchall()
    # each closed-loop worker keeps one connection for its round: compare's lanes are the workers
    lanes = [r[0] for r in conn.execute("SELECT conn_id FROM turns ORDER BY t_request")]
    conn.close()
    assert rows == [("sweep", "ok", 10)]
    assert None not in lanes
    # rounds in order: level 1 (2 turns, one worker), level 3 (3 workers), then both again
    rounds = [lanes[0:2], lanes[2:5], lanes[5:7], lanes[7:10]]
    assert [len(set(r)) for r in rounds] == [1, 3, 1, 3]
    assert len(set(lanes)) == 8  # no connection carried over from one round to the next
    out = proc.stdout
    assert "2 warm-up requests per instance ran first and is not counted" in out
    assert "per-stream tok/s [95% CI]" in out and "aggregate tok/s [95% CI]" in out
    levels = [line.split()[0] for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert levels == ["1", "3"]




def test_nothing_captured_is_one_line(tmp_path, upstream_thread, make_stack):
    stack = make_stack(None)  # serve without --capture: a database with turns and no bodies
    stack.run(stack.service.stop())
    up = upstream_thread()
    one_line_error(specproxy("export", "--db", stack.cfg.db, "--format", "replay"), "no captured request bodies")
    out = tmp_path / "none.jsonl"
    one_line_error(specproxy("export", "--db", stack.cfg.db, "--format", "replay", "-o", str(out)),
                   "no captured request bodies")
    assert not out.exists() and list(tmp_path.glob("none.jsonl*")) == []  # no file left behind, no temporary
    one_line_error(specproxy("bench", "--upstream", up.url, "--from", "captured", "--db", stack.cfg.db),
                   "no captured request bodies")


def test_roofline_beside_the_measured_forward_passes(tmp_path, upstream_thread):
    # paced pieces: a turn needs two reads to have a decode speed, and back-to-back pieces may arrive in one
    up = upstream_thread(Script(pieces=["a", " b", " c"] * 4, interval_s=0.005))
    db = tmp_path / "b.db"
    proc = specproxy("bench", "--upstream", up.url, "--from", str(workload(tmp_path)), "--db", str(db),
                     "--tokenizer", "tiktoken:o200k_base", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    proc = specproxy("roofline", "--active-params", "8e9", "--bits", "4", "--bandwidth-gbs", "273", "--mal", "2",
                     "--db", str(db), "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    proc = specproxy("report", "--db", str(db), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert r["measured_tokens_per_s"] == report["user"]["decode_tps"]["median"]
    assert r["measured_passes_per_s"] == pytest.approx(r["measured_tokens_per_s"] / 2)
    assert r["share"] == pytest.approx(r["measured_passes_per_s"] / (273e9 / 4e9))


def test_roofline_reads_the_mal_from_the_counters_and_says_which_turns_it_measured(tmp_path, upstream_thread):
    """No --mal: the MAL is the server's counters' over the turns' window (the fake drafts one token per
    two-token chunk, all accepted: MAL 2); the text says the share of the ceiling, which turns the median
    is over, and each concurrency level's own figure; a database of two labels is refused without --label."""
    up = upstream_thread(Script(pieces=["a", " b", " c", " d"] * 4, tokens_per_chunk=2, drafts_per_chunk=1,
                                interval_s=0.005))
    db = tmp_path / "b.db"
    # long enough for the proxy's scraper (once a second) to read the counters on both sides of the turns
    proc = specproxy("bench", "--upstream", up.url, "--from", str(workload(tmp_path)), "--db", str(db),
                     "--tokenizer", "tiktoken:o200k_base", "--repeats", "1", "--concurrency", "1,2",
                     "--duration", "1.5", "--label", "spec")
    assert proc.returncode == 0, proc.stderr
    args = ("roofline", "--active-params", "8e9", "--bits", "4", "--bandwidth-gbs", "273", "--db", str(db))
    proc = specproxy(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    report = json.loads(specproxy("report", "--db", str(db), "--json").stdout)
    assert r["mal"] == pytest.approx(2.0) and report["server"]["window"]["mal"] == r["mal"]
    assert r["mal_source"] == "from the server's counters"
    assert r["measured_passes_per_s"] == pytest.approx(report["user"]["decode_tps"]["median"] / 2)
    assert r["measured_over"] == {"database": str(db), "label": "spec", "turns": report["user"]["decode_tps"]["n"]}
    assert [row["concurrency"] for row in r["by_concurrency"]] == ["1", "2"]
    ceiling = 273e9 / 4e9
    text = specproxy(*args)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert f"{r['measured_passes_per_s']:.1f} forward passes/s = {r['share']:.0%} of the ceiling" in text.stdout
    assert f"at most {ceiling:.1f} forward passes/s" in lines[0]
    assert f"x MAL 2.00 (from the server's counters) = {ceiling * 2:.1f} tok/s" in lines[1]
    assert (f"over: the median of {r['measured_over']['turns']} streamed turns labelled spec in {db}, "
            "at concurrency 1, 2") in text.stdout
    for row in r["by_concurrency"]:
        assert (f"at concurrency {row['concurrency']}: {row['passes_per_s']:.1f} forward passes/s = "
                f"{row['share']:.0%} of the ceiling ({row['turns']} turns)") in text.stdout
    # a second label in the database: the median over both would describe neither
    proc = specproxy("bench", "--upstream", up.url, "--from", str(workload(tmp_path)), "--db", str(db),
                     "--tokenizer", "tiktoken:o200k_base", "--repeats", "1", "--label", "other")
    assert proc.returncode == 0, proc.stderr
    one_line_error(specproxy(*args), "several labels (other, spec)", "--label")
    proc = specproxy(*args, "--label", "spec", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["measured_over"]["label"] == "spec", proc.stderr


def test_phase_probes_send_what_they_measure(tmp_path, upstream_thread):
    """prefill: max_tokens 1 at each prompt length, every prompt new (no cache hit); the output has the
    prefill column and no decode one. decode: ignore_eos to --max-tokens."""
    up = upstream_thread()
    db = tmp_path / "p.db"
    proc = specproxy("bench", "--upstream", up.url, "--phase", "prefill", "--prompt-lengths", "50,400", "--db",
                     str(db), "--tokenizer", "tiktoken:o200k_base", "--repeats", "2", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr
    sent = [json.loads(s.request_body) for s in up.sent]
    assert len(sent) == 4 and all(b["max_tokens"] == 1 and b["stream"] for b in sent)
    assert len({b["messages"][0]["content"] for b in sent}) == 4  # a fresh first word at every send
    # the fresh word, the prompt length asked for, and "Repeat the first word."
    assert sorted(len(b["messages"][0]["content"].split()) for b in sent) == [55, 55, 405, 405]
    assert "prefill tok/s [95% CI]" in proc.stdout and "per-stream tok/s" not in proc.stdout
    proc = specproxy("bench", "--upstream", up.url, "--phase", "decode", "--max-tokens", "40", "--db", str(db),
                     "--repeats", "1", "--warmup", "0", "--label", "dec")
    assert proc.returncode == 0, proc.stderr
    body = json.loads(up.sent[-1].request_body)
    assert (body["max_tokens"], body["ignore_eos"], body["stream"], body["model"]) == (40, True, True, up.model)


def test_a_prefill_probe_says_so_in_its_label_and_never_gives_a_decode_figure(tmp_path, upstream_thread):
    """Each phase's turns are labelled with it by default, so report, compare and roofline can tell them
    apart; a prefill probe's JSON has no decode speed or aggregate throughput (one token out); and a server
    that ignores max_tokens 1 (the fake does: it sends its whole script) gets a one-line warning."""
    up = upstream_thread()  # 12 pieces, whatever max_tokens says
    db = tmp_path / "p.db"
    common = ("--upstream", up.url, "--db", str(db), "--tokenizer", "tiktoken:o200k_base", "--repeats", "1",
              "--warmup", "0", "--json")
    proc = specproxy("bench", "--phase", "prefill", "--prompt-lengths", "30", *common)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("specproxy: warning:")]
    assert len(warnings) == 1 and "1 of 1 prefill probe turns got more than one output token" in warnings[0]
    summary = json.loads(proc.stdout)
    (level,) = summary["arms"][0]["levels"]
    assert summary["labels"] == ["bench-prefill"] and summary["warnings"] == [warnings[0].split("warning: ", 1)[1]]
    assert "decode_tps" not in level and "aggregate_tps" not in level and level["prefill_tps"]["median"] > 0
    proc = specproxy("bench", "--phase", "decode", "--max-tokens", "12", *common)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr and json.loads(proc.stdout)["arms"][0]["levels"][0]["decode_tps"]
    conn = sqlite3.connect(db)
    labels = conn.execute("SELECT label, count(*) FROM turns GROUP BY label ORDER BY label").fetchall()
    conn.close()
    assert labels == [("bench-decode", 1), ("bench-prefill", 1)]
    one = upstream_thread(Script(pieces=["a"]))  # a server that honours max_tokens 1: no warning
    proc = specproxy("bench", "--phase", "prefill", "--prompt-lengths", "30", *common[2:], "--upstream", one.url)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_probe_of_a_replayed_workload_sets_each_apis_own_fields(tmp_path, upstream_thread, phase):
    """--from with --phase: chat and completions get max_tokens, stream_options (and ignore_eos to
    decode), a chat body's max_completion_tokens is dropped; Anthropic Messages gets max_tokens and
    stream only; Responses gets max_output_tokens and stream, no max_tokens or stream_options."""
    chat = json.loads(API_BODIES["chat"][1])
    chat["max_completion_tokens"] = 500
    work = tmp_path / "apis.jsonl"
    work.write_bytes(b"\n".join([json.dumps(chat).encode(), *(API_BODIES[api][1].replace(b"\n", b"")
                                                             for api in ("completions", "messages", "responses"))]))
    up = upstream_thread()
    proc = specproxy("bench", "--upstream", up.url, "--from", str(work), "--db", str(tmp_path / "p.db"),
                     "--phase", phase, "--max-tokens", "40", "--repeats", "1", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr
    limit = 1 if phase == "prefill" else 40
    sent = {s.path: json.loads(s.request_body) for s in up.sent}
    openai = {"max_tokens": limit, "stream": True, "stream_options": {"include_usage": True},
              **({"ignore_eos": True} if phase == "decode" else {})}
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert {k: sent[path].get(k) for k in openai} == openai
        assert "max_completion_tokens" not in sent[path]
    messages, responses = sent["/v1/messages"], sent["/v1/responses"]
    assert (messages["max_tokens"], messages["stream"], messages["system"]) == (limit, True, "Be brief.")
    assert not {"stream_options", "ignore_eos", "max_output_tokens"} & messages.keys()
    assert (responses["max_output_tokens"], responses["stream"], responses["input"]) == (limit, True, "hi")
    assert not {"stream_options", "ignore_eos", "max_tokens"} & responses.keys()


def stored_turns(db: Path, label: str) -> int:
    if not db.exists():
        return 0
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT count(*) FROM turns WHERE label = ?", (label,)).fetchone()[0]
    except sqlite3.OperationalError:  # the schema is not there yet
        return 0
    finally:
        conn.close()


def test_ctrl_c_summarises_what_was_measured_and_exits_non_zero(tmp_path, upstream_thread):
    """SIGINT in the middle of a long round: the turns that ended are stored, summarised, and the run
    ends with one line and status 2 (not a traceback, not a silent 0)."""
    import signal
    import time

    up = upstream_thread(Script(pieces=["a", " b", " c"] * 4, interval_s=0.01))
    work = tmp_path / "w.jsonl"
    work.write_bytes(BODIES[0] + b"\n")
    db = tmp_path / "b.db"
    proc = subprocess.Popen([*SPECPROXY, "bench", "--upstream", up.url, "--from", str(work), "--db", str(db),
                             "--duration", "600", "--repeats", "1", "--warmup", "0", "--label", "cut",
                             "--tokenizer", "tiktoken:o200k_base"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while stored_turns(db, "cut") < 3:  # the writer commits as turns end: wait for a few (bounded)
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, (proc.returncode, err)
    errors = [line for line in err.splitlines() if line.startswith("specproxy: error:")]
    assert len(errors) == 1 and "interrupted (Ctrl-C)" in errors[0] and "Traceback" not in err, err
    stored = stored_turns(db, "cut")
    assert stored >= 3
    assert "per-stream tok/s [95% CI]" in out, out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1"]
    assert 3 <= int(rows[0][1]) <= stored  # the summary counts measured turns, each of them stored
    assert f"its {rows[0][1]} turns summarised above" in errors[0]


def bench_turns(db: Path, label: str) -> list[tuple[float, float, int]]:
    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT t_request, t_done, concurrency FROM turns WHERE label = ? AND outcome = 'ok' "
                        "ORDER BY t_request", (label,)).fetchall()
    conn.close()
    return rows


def test_duration_cycles_the_workload_for_that_long(tmp_path, upstream_thread):
    """Closed loop with --duration: each stream sends its next request as the last ends, cycling through
    the workload, and starts none after the duration; every request sent has its turn."""
    up = upstream_thread(Script(pieces=["a", " b", " c"] * 4, interval_s=0.01))  # ~0.12 s a turn
    work = tmp_path / "w.jsonl"
    work.write_bytes(BODIES[0] + b"\n" + BODIES[2] + b"\n")
    db = tmp_path / "d.db"
    proc = specproxy("bench", "--upstream", up.url, "--from", str(work), "--db", str(db), "--duration", "1.5",
                     "--concurrency", "2", "--repeats", "1", "--warmup", "0", "--label", "dur")
    assert proc.returncode == 0, proc.stderr
    turns = bench_turns(db, "dur")
    assert len(turns) == len(up.sent) > 2 * 2  # more than the workload once per stream: it cycled
    sent = [s.request_body for s in up.sent]
    assert set(sent) == {BODIES[0], BODIES[2]}
    # none started after the duration: a stream sends its next request only when its last one ended before the
    # duration was up, on bench's clock, which started before the first request was read (the proxy's clock
    # is the same monotonic clock): so each turn followed by another on its stream ended within 1.5 s of the
    # first request, however late a busy machine made the requests themselves
    conn = sqlite3.connect(db)
    streams = conn.execute("SELECT conn_id, t_request, t_done FROM turns WHERE label = 'dur' ORDER BY t_request").fetchall()
    conn.close()
    first = streams[0][1]
    by_stream: dict[int, list[float]] = {}
    for conn_id, _, t_done in streams:
        by_stream.setdefault(conn_id, []).append(t_done)
    followed = [t_done for ends in by_stream.values() for t_done in ends[:-1]]
    assert followed and all(t_done - first < 1.5 for t_done in followed), (first, by_stream)
    assert max(c for _, _, c in turns) == 2  # closed loop: never more than the streams in flight


def test_rate_starts_requests_on_a_schedule_with_at_most_concurrency_in_flight(tmp_path, upstream_thread):
    """Open loop with --rate: requests start at the rate whatever the answers' speed, with at most
    --concurrency in flight; with a low cap the cap rules, with a high one the rate does."""
    up = upstream_thread(Script(pieces=["a", " b", " c"] * 4, interval_s=0.05))  # ~0.6 s a turn
    work = tmp_path / "w.jsonl"
    work.write_bytes(BODIES[0] + b"\n")

    db = tmp_path / "open.db"
    proc = specproxy("bench", "--upstream", up.url, "--from", str(work), "--db", str(db), "--rate", "20",
                     "--duration", "2", "--concurrency", "64", "--repeats", "1", "--warmup", "0", "--label", "open")
    assert proc.returncode == 0, proc.stderr
    turns = bench_turns(db, "open")
    # Poisson arrivals at 20/s for 2 s: 40 expected; a closed loop of one stream would send ~3
    assert 15 <= len(turns) <= 75, len(turns)
    assert max(c for _, _, c in turns) > 2  # arrivals do not wait for answers: they overlap
    assert len(turns) == len(up.sent)

    db = tmp_path / "capped.db"
    proc = specproxy("bench", "--upstream", up.url, "--from", str(work), "--db", str(db), "--rate", "200",
                     "--duration", "1.5", "--concurrency", "2", "--repeats", "1", "--warmup", "0", "--label", "cap")
    assert proc.returncode == 0, proc.stderr
    turns = bench_turns(db, "cap")
    assert max(c for _, _, c in turns) <= 2  # never more than --concurrency in flight
    assert len(turns) < 200 * 1.5 / 4  # the cap held the rate back (two slots of ~0.6 s turns)
