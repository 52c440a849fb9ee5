"""The prefix cache on the REAL llama-server: what it says it reused (``timings.cache_n``, which closes every
stream, also one sent without ``stream_options.include_usage``) against specproxy's own prediction, through
the proxy to ``audit`` and the report, and its ``/metrics`` counter of cached prompt tokens.

The server has one slot (``-np 1``) and no host-memory prompt cache (``--cache-ram 0``), so what its cache
holds is known: the previous request's prompt and
answer. A second turn of the same chat finds all of the first turn's prompt there (its cache may hold more:
the answer's tokens, which the second turn resends as history); a third turn after another conversation
took the slot finds next to nothing of it: the lost part is most of the prediction.
"""
from __future__ import annotations

import sqlite3

import orjson
import pytest
from click.testing import CliRunner
from real.clientkit import SYSTEM, proxy, streamed_text
from real.clientkit import chat as sdk_chat
from real.server import LlamaServer
from waits import wait_for

from specproxy.app.cli import main
from specproxy.observe.server_metrics import parse_exposition

pytestmark = pytest.mark.real


def test_cached_tokens_from_timings_against_the_prediction(make_stack, counter, llama_server_bin, tiny_model_path):
    # one slot and no host-memory prompt cache (``--cache-ram 0``; on by default, it would save the evicted
    # prompt and restore it): the slot holds the last request's tokens and nothing else
    with LlamaServer(llama_server_bin, tiny_model_path, parallel=1, extra_args=["--cache-ram", "0"]) as srv:
        stack, arrivals = proxy(make_stack, srv, counter, scrape_interval_s=0.2)
        db = stack.cfg.db
        messages = [{"role": "system", "content": SYSTEM}]
        answers = []

        def turn(k: int, msgs: list[dict]) -> list[dict]:
            # streamed without include_usage: the only cached count is the last chunk's timings.cache_n
            answer = sdk_chat(stack.url, messages=msgs, stream=True, max_tokens=16)
            assert not any(c.get("usage") for c in answer) and "timings" in answer[-1]
            arrivals.wait(k)
            return answer

        for k, text in enumerate(["Tell me about the slot cache.", "And about eviction?"]):
            messages.append({"role": "user", "content": text})
            answers.append(turn(k + 1, messages))
            messages.append({"role": "assistant", "content": streamed_text(answers[-1])[0]})
        # another conversation takes the one slot: the chat's prefix is evicted
        answers.append(turn(3, [{"role": "user", "content": "Something else entirely, with other words."}]))
        messages.append({"role": "user", "content": "Back to the cache: what was lost?"})
        answers.append(turn(4, messages))
        first, second, other, third = arrivals.wait(4)

        cache_n = [a[-1]["timings"]["cache_n"] for a in answers]
        assert [r.usage_cached_tokens for r in (first, second, other, third)] == cache_n
        assert all(r.usage_prompt_tokens is None for r in (first, second, other, third))  # no usage was sent
        assert first.session == second.session == third.session != other.session
        # the prediction: the second turn only appended to the first, so all of the first's prompt is reusable
        assert second.prefix_reused_tokens == first.prompt_tokens and second.prefix_break_part is None
        assert second.usage_cached_tokens >= second.prefix_reused_tokens - 1  # llama.cpp re-evaluates at most one
        assert third.prefix_reused_tokens == second.prompt_tokens
        assert third.usage_cached_tokens < third.prefix_reused_tokens // 2  # evicted: little left but the start
        lost = [max(r.prefix_reused_tokens - r.usage_cached_tokens, 0) for r in (second, third)]
        assert lost[1] > 0

        stack.settle()
        assert wait_for(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0] == 4)
        audit = orjson.loads(CliRunner().invoke(main, ["audit", "--db", str(db), "--json"]).output)
        (client,) = audit["clients"]
        chat_session = client["session_detail"][first.session]
        per_turn = chat_session["per_turn"]
        assert [t["reused_tokens"] for t in per_turn] == [None, second.prefix_reused_tokens, third.prefix_reused_tokens]
        assert [t["server_cached_tokens"] for t in per_turn] == [cache_n[0], cache_n[1], cache_n[3]]
        assert [t["lost_tokens"] for t in per_turn] == [None, *lost]
        assert chat_session["prefix_cache"]["lost_tokens"] == sum(lost)
        text = CliRunner().invoke(main, ["audit", "--db", str(db), "--session", first.session]).output
        assert f"server reused {cache_n[3]:,}, lost {lost[1]:,}" in text
        # the proxy's scrapes: one after the last turn ended that has every request's cached tokens
        end = max(r.t_wall + r.total_s for r in (first, second, other, third))
        watch = stack.service.watch
        assert wait_for(lambda: watch.recent and watch.recent[-1].t_wall > end
                        and watch.recent[-1].snapshot.prefix_cache_hits_total == sum(cache_n), 20)
        assert wait_for(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM scrapes WHERE t_wall > ? AND "
                                                            "prefix_cache_hits_total IS NOT NULL", (end,)).fetchone()[0])
        report = orjson.loads(CliRunner().invoke(main, ["report", "--db", str(db), "--json"]).output)
        assert report["prefix_cache"]["lost_tokens"] == sum(lost) and report["prefix_cache"]["turns"] == 2
        # the server section over the turns' span: the fresh server's counters saw these four requests only
        window = report["server"]["window"]
        assert window["prefix_cache_hits"] == sum(cache_n)
        assert window["prefix_cache_queries"] == sum(r.prompt_tokens for r in (first, second, other, third))

        # the server's own counter of cached prompt tokens: every request's cache_n, on this fresh server
        snap = parse_exposition(srv.metrics_text())
        assert snap.server_kind == "llamacpp" and snap.prefix_cache_hits_total == sum(cache_n)
        assert snap.prefix_cache_queries_total == sum(r.prompt_tokens for r in (first, second, other, third))
