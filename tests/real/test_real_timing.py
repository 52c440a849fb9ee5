"""specproxy's timings and the server's counters against the REAL llama-server's own accounting: TTFT
and decode time against ``timings``, speculative decoding's drafts and acceptances against its
``/metrics``, and a restart seen as two instances. Servers started here run one compute thread (see
``timing_servers`` for why); the rest is ``fixtures``' and ``clientkit``'s.
"""
from __future__ import annotations

import json
import sqlite3
import statistics
from pathlib import Path

import pytest
from real.clientkit import (
    SYSTEM,
    chat,
    proxy,
    wait_for,
)
from real.server import LlamaServer

from specproxy.store.sqlite_source import SQLiteSource
from specproxy.analyze.report_data import build_report
from specproxy.analyze.report import render_text
from specproxy.store.dataset import load_turns

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def timing_servers(llama_server_bin: Path, tiny_model_path: Path, looping_model_path: Path):
    """(reciting, looping) servers with one compute thread each.

    Why one thread: the models are tiny, so a second thread buys nothing, and llama.cpp's worker
    threads meet at a barrier every step: on a 2-vCPU machine shared with other jobs, one
    descheduled worker stalls the step (64 tokens took 1.5-4.4 s with two threads and 0.1-0.13 s
    with one, on the same loaded machine). Timing comparisons need the server to be steady.
    """
    with LlamaServer(llama_server_bin, tiny_model_path, threads=1) as tiny, \
            LlamaServer(llama_server_bin, looping_model_path, threads=1) as looping:
        yield tiny, looping


def timed_turns(make_stack, counter, server: LlamaServer, n: int, **kw) -> list:
    """``n`` streamed turns with prompts of 30 to 30+60(n-1) words, one at a time, each measured
    before the next starts."""
    stack, arrivals = proxy(make_stack, server, counter)
    for i in range(n):
        words = " ".join(f"word{i}x{j}" for j in range(30 + 60 * i))  # new from the start: no cache reuse
        chat(stack.url, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": words}],
             stream=True, stream_options={"include_usage": True}, **kw)
        arrivals.wait(i + 1)
    return arrivals.wait(n)


@pytest.mark.alone
def test_ttft_and_decode_time_agree_with_the_servers_timings(make_stack, counter, timing_servers):
    """specproxy's ``ttft_s`` and ``decode_s`` against llama-server's own ``timings`` of the same turns.

    What llama-server measures: ``prompt_ms`` from the slot starting on the prompt to the first
    token being sampled; ``predicted_ms`` from that first token to the last token sampled
    (``predicted_n`` tokens, so ``predicted_n - 1`` decoding steps). What specproxy measures:
    ``ttft_s`` from having read the request to the arrival of the first chunk with text; ``decode_s``
    from there to the arrival of the last chunk with text. Both clocks are CLOCK_MONOTONIC on one
    machine, so the durations compare.

    What is specproxy's, and so asserted with margins a loaded machine cannot cross:

    * TTFT nests the server's prefill, every turn, with no tolerance: ``ttft_s >= prompt_ms/1000`` (the
      request reaches the server after the proxy read it; the first token leaves the server after it was
      sampled). The excess is the server's work outside ``prompt_ms`` (HTTP parse, chat template,
      tokenising) plus two loopback hops and thread wake-ups: median 6-13 ms on a quiet 2-vCPU machine.
      Bound: median excess under half the median decode time of the turns cut at 64 tokens (100-200 ms on
      a quiet machine, and slower, with the excess, when the machine is busy): a TTFT that ran to the last
      token, or waited for the whole answer, would exceed it by far.
    * Decode time spans the server's decoding. Cut by ``max_tokens`` (looping model, 64 tokens), the last
      text token is the last one sampled, so ``decode_s ~ predicted_ms/1000``: the two differ only by the
      difference of the first and last chunks' delivery delays (within +-3 ms quiet; ratios 0.95-1.00 with
      the machine at load average 9). Bound: median ratio within [0.75, 1.25]: a proxy that buffered the
      stream, or timed chunks when it parsed them rather than when they arrived, reads about 0.
    * Ended by the model (``finish_reason == "stop"``): the last token sampled is ``<|eot_id|>``, one step
      after the last text token, and it is never sent, so ``decode_s`` ends before the server's last
      sample; with steps of equal length ``decode_s ~ predicted_ms/1000 * (n-2)/(n-1)`` (measured within
      3 ms on a quiet machine). These turns decode 11 tokens in 25-30 ms: llama-server's end-of-turn
      accounting stretches on a busy core (14 ms short of the estimate with a CPU burner beside it), and
      on a loaded machine the whole answer can reach the proxy in one read (``decode_s`` 0, as it
      should be for what arrived at once), so they are held to the sanity bound only.

    Per turn, for every kind, sanity: ``ttft_s <= prompt_ms/1000 + 2 s`` and ``decode_s <= predicted_ms/1000
    + 2 s``. The servers run one compute thread (see ``timing_servers``), and each turn is measured before
    the next starts, so the proxy's measuring thread never competes with a stream it is timing.
    """
    n_turns = 5
    tiny, looping = timing_servers
    stops = timed_turns(make_stack, counter, tiny, n_turns)
    cuts = timed_turns(make_stack, counter, looping, n_turns, max_tokens=64)

    ttft_excess, ratios, cut_decode = [], [], []
    for rec in stops + cuts:
        t = json.loads(rec.server_timings)
        prompt_s, predicted_s, n = t["prompt_ms"] / 1000, t["predicted_ms"] / 1000, t["predicted_n"]
        assert rec.outcome == "ok" and rec.chunks == t["predicted_n"] - (rec.finish_reason == "stop")
        assert rec.t_request <= rec.t_upstream_headers <= rec.t_first_token <= rec.t_last_token <= rec.t_done
        assert prompt_s <= rec.ttft_s <= prompt_s + 2.0, (rec.ttft_s, t)
        ttft_excess.append(rec.ttft_s - prompt_s)
        assert 0 <= rec.decode_s <= predicted_s + 2.0, (rec.decode_s, t)
        if rec.finish_reason == "length":
            assert n == 64
            ratios.append(rec.decode_s / predicted_s)
            cut_decode.append(predicted_s)
        else:
            assert rec.finish_reason == "stop" and n == rec.completion_tokens + 1
    assert len(ratios) == n_turns, ratios
    assert statistics.median(ttft_excess) < statistics.median(cut_decode) / 2, (ttft_excess, cut_decode)
    assert 0.75 <= statistics.median(ratios) <= 1.25, ratios


# ============================================================ 5. speculative decoding
@pytest.mark.parametrize("spec", ["draft-simple", "ngram-mod"])
def test_speculative_decoding_counters_match_the_servers_accounting(make_stack, counter, llama_server_bin,
                                                                    looping_model_path, draft_model_path, spec):
    """Speculative decoding on: the server's acceptance shows up in the turn, the counters and the report.

    A dedicated llama-server (looping model; ``--spec-type draft-simple -md draft.gguf`` or
    ``ngram-mod``), the proxy in front with scraping every 50 ms, four turns one after the other
    (each a lone turn, so ``turn_counters`` holds exactly its own counter deltas; the next turn
    starts only once the join was written).

    * The turn's ``server_timings`` has ``draft_n_accepted > 0``.
    * Its ``turn_counters`` row: ``accepted_tokens == draft_n_accepted``, ``draft_tokens ==
      draft_n``, ``generated_tokens == predicted_n``, ``mal == 1 + accepted/drafts > 1``: the MAL
      from the counters is the server's own ``draft_n_accepted`` accounting.
    * draft-simple drafts before every verification pass, so ``drafts + accepted == predicted_n - 1``
      (the first token comes from the prefill): the counters' MAL is exactly tokens per forward
      pass. ngram-mod drafts only when its n-gram table matches, so there ``drafts + accepted <=
      predicted_n - 1`` and the counters' MAL is the mean length of the passes that drafted
      (documented: it overstates tokens per forward pass when some passes draft nothing).
    * ``tokens_per_chunk`` does NOT show the MAL on llama.cpp (an exact, documented difference):
      llama-server sends one SSE event per generated token, accepted drafts included, so ``chunks
      == predicted_n`` and ``tokens_per_chunk = completion_tokens / predicted_n <= 1 < mal``. (It is
      below 1 because the looping text re-tokenises at each "dog.The" seam into one token fewer
      than the model generated: ``completion_tokens == predicted_n - seams``.)
    * The report puts both side by side: per-turn MAL from the counters and the same turns' tokens
      per chunk, on one line of ``render_text``.
    """
    extra = ["--spec-type", spec] + (["-md", str(draft_model_path)] if spec == "draft-simple" else [])
    with LlamaServer(llama_server_bin, looping_model_path, extra_args=extra, threads=1) as srv:
        # store_text: the delivered text is needed to count the re-tokenisation seams below
        stack, arrivals = proxy(make_stack, srv, counter, scrape_interval_s=0.05, store_text=True)
        watch = stack.service.watch
        wait_for(lambda: watch.instance_id is not None, "the first scrape")
        n_turns = 4
        for i in range(n_turns):
            chat(stack.url, messages=[{"role": "user", "content": f"Recite, please ({i})."}], max_tokens=60,
                 temperature=0, stream=True, stream_options={"include_usage": True})
            arrivals.wait(i + 1)
            wait_for(lambda: watch.joined >= i + 1, f"turn {i} joined with its counter deltas")
        records = arrivals.wait(n_turns)
        stack.run(stack.service.stop())  # drains the measurements and the writer's queue
    conn = sqlite3.connect(stack.cfg.db)
    rows = {r[0]: r for r in conn.execute(
        "SELECT turn_id, generated_tokens, drafts, draft_tokens, accepted_tokens, mal FROM turn_counters")}
    assert set(rows) == {rec.id for rec in records}

    mals, tpcs = [], []
    for rec in records:
        t = json.loads(rec.server_timings)
        _, generated, drafts, draft_tokens, accepted, mal = rows[rec.id]
        assert rec.outcome == "ok" and rec.concurrency == 1 and rec.finish_reason == "length"
        assert t["draft_n_accepted"] > 0
        assert (accepted, draft_tokens, generated) == (t["draft_n_accepted"], t["draft_n"], t["predicted_n"])
        assert t["predicted_n"] == 60
        assert drafts > 0 and mal == pytest.approx(1 + accepted / drafts) and mal > 1
        if spec == "draft-simple":
            assert drafts + accepted == t["predicted_n"] - 1
        else:
            assert drafts + accepted <= t["predicted_n"] - 1
        assert rec.chunks == t["predicted_n"] == rec.usage_completion_tokens
        seams = rec.response_text.count(".The")
        assert seams == 5  # 60 tokens of an 11-token sentence: five times "dog." then "The"
        assert rec.completion_tokens == counter.count(rec.response_text) == t["predicted_n"] - seams
        assert rec.tokens_per_chunk == pytest.approx(rec.completion_tokens / rec.chunks)
        assert rec.tokens_per_chunk <= 1 < mal
        mals.append(mal)
        tpcs.append(rec.tokens_per_chunk)

    report = build_report(SQLiteSource(conn).load(server=True, context=True), source="spec")
    lone = report["server"]["lone_turns"]
    assert lone["joined"] == n_turns
    assert lone["mal"]["median"] == pytest.approx(statistics.median(mals))
    assert lone["tokens_per_chunk"]["median"] == pytest.approx(statistics.median(tpcs))
    assert report["user"]["tokens_per_chunk"]["median"] == pytest.approx(statistics.median(tpcs))
    # one instance, one restart-free window from before the first turn to after the last: the
    # window's counters are exactly the sum of the turns' (a false restart would split and lose some)
    assert len(report["server"]["instances"]) == 1 and report["server"]["window"]["segments"] == 1
    assert report["server"]["window"]["accepted_tokens"] == sum(rows[r.id][4] for r in records)
    assert report["server"]["window"]["drafts"] == sum(rows[r.id][2] for r in records)
    text = render_text(report)
    assert (f"per-turn MAL median {statistics.median(mals):.2f} beside tokens per chunk median "
            f"{statistics.median(tpcs):.2f}") in text
    assert f"MAL {report['server']['window']['mal']:.2f} (counters" in text
    conn.close()


# ============================================================ 6. a restart during a run
def test_server_restart_shows_as_two_instances(make_stack, counter, llama_server_bin, tiny_model_path):
    """``LlamaServer.restart()`` mid-run: the turns before and after carry two instance ids.

    The proxy scrapes every 50 ms; llama-server's ``/metrics`` names its start time, so the new
    process is a new instance. Turns before the restart carry the first id; the turn sent the
    moment the new process is healthy must succeed (the proxy's pooled connection to the dead
    process must not turn into a 502) and carries whichever instance the watch knew when it
    started (stamping lags a restart by up to one scrape interval); turns after the watch saw the
    new instance carry the second id. The report counts two instances, the text says so, and the
    instances table has both.
    """
    with LlamaServer(llama_server_bin, tiny_model_path, threads=1) as srv:
        stack, arrivals = proxy(make_stack, srv, counter, scrape_interval_s=0.05)
        watch = stack.service.watch
        wait_for(lambda: watch.instance_id is not None, "the first scrape")
        first = watch.instance_id
        msgs = [{"role": "user", "content": "Say something."}]
        for _ in range(2):
            chat(stack.url, messages=msgs, stream=True)
        srv.restart()
        chat(stack.url, messages=msgs, stream=True)  # the first turn on the new process
        wait_for(lambda: watch.instance_id not in (None, first), "the watch to see the new instance")
        second = watch.instance_id
        for _ in range(2):
            chat(stack.url, messages=msgs, stream=True)
        records = arrivals.wait(5)
        stack.run(stack.service.stop())

    records.sort(key=lambda r: r.t_request)
    assert [r.outcome for r in records] == ["ok"] * 5
    ids = [r.instance_id for r in records]
    assert ids[:2] == [first, first] and ids[2] in (first, second) and ids[3:] == [second, second]
    conn = sqlite3.connect(stack.cfg.db)
    report = build_report(SQLiteSource(conn).load(server=True, context=True), source="restart")
    assert sorted(report["server"]["instances"]) == sorted([first, second])
    assert sorted(report["server"]["turn_instances"]) == sorted([first, second])
    assert report["server"]["window"]["segments"] == 2
    assert "2 server instances" in render_text(report)
    assert conn.execute("SELECT count(*) FROM instances").fetchone()[0] == 2
    conn.close()
