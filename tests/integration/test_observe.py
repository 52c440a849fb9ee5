"""The server's own counters beside the traffic: instances, restarts, scrape failures, lone turns."""

from __future__ import annotations

import sqlite3

import aiohttp

from specproxy.store.sqlite_source import SQLiteSource
from specproxy.store.dataset import load_turns
from specproxy.analyze.report_data import build_report
from specproxy.analyze.report import render_text
from specproxy.app.fake_upstream import Script
from waits import wait_for


async def chat(url: str, n: int, stream: bool = True) -> list[int]:
    statuses = []
    async with aiohttp.ClientSession() as c:
        for _ in range(n):
            async with c.post(url + "/v1/chat/completions", json={
                    "model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}) as r:
                await r.read()
                statuses.append(r.status)
    return statuses


def report_of(stack):
    stack.settle()
    stack.run(stack.service.stop())  # drains the measurements and the writer's queue
    conn = sqlite3.connect(stack.cfg.db)
    r = build_report(SQLiteSource(conn).load(server=True, context=True), source="test")
    return r, conn


def test_restart_shows_two_instances(make_stack, tiktoken_tok):
    stack = make_stack(tiktoken_tok, scrape_interval_s=0.05)
    stack.upstream.script = Script(pieces=["a", " b", " c", " d"], tokens_per_chunk=2, drafts_per_chunk=2)
    watch = stack.service.watch
    assert wait_for(lambda: watch.instance_id is not None)
    first = watch.instance_id
    assert stack.run(chat(stack.url, 3)) == [200] * 3
    stack.upstream.restart()
    assert wait_for(lambda: watch.instance_id not in (None, first))
    assert stack.run(chat(stack.url, 3)) == [200] * 3
    r, conn = report_of(stack)
    ids = [rec.instance_id for rec in sorted(stack.records, key=lambda x: x.t_request)]
    assert ids[:3] == [first] * 3 and len(set(ids[3:])) == 1 and ids[3] != first
    assert len(r["server"]["instances"]) == 2 and r["server"]["window"]["segments"] == 2
    assert "2 server instances" in render_text(r)
    assert conn.execute("SELECT count(*) FROM instances").fetchone()[0] == 2


def test_scrape_failure_never_touches_traffic_and_is_reported(make_stack, tiktoken_tok):
    stack = make_stack(tiktoken_tok, scrape_interval_s=0.05)
    watch = stack.service.watch
    assert wait_for(lambda: watch.instance_id is not None)
    stack.upstream.metrics_status = 500
    assert wait_for(lambda: watch.failures >= 3)
    assert stack.run(chat(stack.url, 3)) == [200] * 3
    r, _ = report_of(stack)
    assert r["server"]["scrape_failures"] >= 3
    assert f"{r['server']['scrape_failures']} failed" in render_text(r)
    assert [rec.outcome for rec in stack.records] == ["ok"] * 3


def test_lone_turns_are_joined_with_their_counter_deltas(make_stack, tiktoken_tok):
    """Each turn alone: the server's counter delta over it is exactly that turn's drafts and accepts."""
    stack = make_stack(tiktoken_tok, scrape_interval_s=0.05)
    # 12 tokens in chunks of 3: 4 chunks, each a verification pass with 2 drafted, 2 accepted
    stack.upstream.script = Script(pieces=[f" w{i}" for i in range(12)], tokens_per_chunk=3, drafts_per_chunk=2)
    watch = stack.service.watch
    assert wait_for(lambda: watch.instance_id is not None)
    for _ in range(4):
        assert stack.run(chat(stack.url, 1)) == [200]
        stack.settle()  # the turn has ended in the proxy, so its post-turn scrape has been started ...
        assert wait_for(lambda: not watch._turn_tasks, 5)  # ... and has landed before the next turn
    r, conn = report_of(stack)
    rows = conn.execute("SELECT drafts, draft_tokens, accepted_tokens, generated_tokens, mal FROM turn_counters").fetchall()
    assert len(rows) >= 3
    for drafts, draft_tokens, accepted, generated, mal in rows:
        assert (drafts, draft_tokens, accepted, generated) == (4, 8, 8, 12)
        assert mal == 3.0
    assert r["server"]["lone_turns"]["mal"]["median"] == 3.0
    assert r["server"]["window"]["mal"] == 3.0


def test_lone_non_streamed_turns_stay_out_of_the_stream_figures(make_stack, tiktoken_tok):
    """Streamed and non-streamed chats through the real proxy: the stream figures are the streamed turns',
    the non-streamed ones (one chunk of all their tokens each) have their own. (The per-turn MAL join
    over streamed turns only is checked on fixed data in test_report_kinds.)"""
    stack = make_stack(tiktoken_tok, scrape_interval_s=0.05)
    stack.upstream.script = Script(pieces=[f" w{i}" for i in range(12)], tokens_per_chunk=3, drafts_per_chunk=2)
    watch = stack.service.watch
    assert wait_for(lambda: watch.instance_id is not None)
    for stream in (True, False, True, False, True, False):
        assert stack.run(chat(stack.url, 1, stream=stream)) == [200]
        stack.settle()
        assert wait_for(lambda: not watch._turn_tasks, 5)
    r, _ = report_of(stack)
    streamed = [rec for rec in stack.records if rec.streamed]
    whole = [rec for rec in stack.records if not rec.streamed]
    assert len(streamed) == len(whole) == 3 and all(rec.chunks == 1 for rec in whole)
    tpc = streamed[0].tokens_per_chunk  # tokens / 4 chunks, the same for every streamed turn
    assert all(rec.tokens_per_chunk == tpc for rec in streamed) and whole[0].tokens_per_chunk == 4 * tpc
    assert r["user"]["tokens_per_chunk"]["median"] == tpc and r["user"]["tokens_per_chunk"]["p95"] == tpc
    assert r["user"]["ttft_s"]["n"] == 3
    assert r["completed_turns"] == {"streamed": 3, "non_streamed": 3}
    assert r["non_streamed"]["total_s"]["n"] == 3
    assert r["non_streamed"]["completion_tokens"]["median"] == whole[0].completion_tokens


async def test_overlapping_scrapes_never_make_a_false_restart():
    """The poller's scrape and a lone turn's after-scrape overlap; the older page finishes last.

    Without one-scrape-at-a-time, the scraper compared the newer page with the older one, saw a
    counter go down and declared a restart: a new instance id and a window split in two (seen
    against a real llama-server with speculative decoding, whose page is parsed in a thread).
    """
    import asyncio
    import tempfile

    from aiohttp import web

    from specproxy.config import load_config
    from specproxy.serve.watch import ServerWatch

    state = {"n": 0, "slow": False}

    async def metrics(request):
        n, slow = state["n"], state["slow"]
        state["slow"] = False
        resp = web.StreamResponse(headers={"Content-Type": "text/plain", "Process-Start-Time-Unix": "1700000000"})
        await resp.prepare(request)  # the scraper stamps the sample when the headers arrive
        if slow:
            await asyncio.sleep(0.3)  # ... and this older page's body arrives late
        await resp.write(f"# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total {n}\n"
                         "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 0\n".encode())
        await resp.write_eof()
        return resp

    async def models(_request):
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    cfg = load_config(env={}, overrides={"upstream": f"http://127.0.0.1:{port}", "scrape_interval_s": 3600,
                                         "db": tempfile.mktemp(suffix=".db")})
    watch = ServerWatch(cfg, None)
    try:
        await watch.start()
        first = watch.instance_id
        state.update(n=100, slow=True)
        older = asyncio.create_task(watch._scrape())  # e.g. the poller's
        while state["slow"]:  # until the server has started answering it
            await asyncio.sleep(0.005)
        state["n"] = 160  # a turn ended meanwhile
        await asyncio.gather(older, watch._scrape())  # e.g. the turn's after-scrape
        assert watch.instance_id == first and watch.scraper.restarts == 0
        assert [s.snapshot.generation_tokens_total for s in watch.recent] == [0, 100, 160]
    finally:
        await watch.stop()
        await runner.cleanup()


def test_the_servers_prefix_cache_counters_join_the_server_section(make_stack, tiktoken_tok):
    """A llama.cpp-shaped server that reuses 5 prompt tokens of each turn from its cache (its
    ``prompt_tokens_cached_total``; its prompt counter leaves them out): over the window the server's
    counters say hits 5 per turn of the prompt tokens looked up, as scraped."""
    stack = make_stack(tiktoken_tok, scrape_interval_s=0.05)
    stack.upstream.script = Script(pieces=["a", " b"], timings=True, cache_n=5)
    watch = stack.service.watch
    assert wait_for(lambda: watch.instance_id is not None)
    before = dict(stack.upstream.counters)
    assert stack.run(chat(stack.url, 4)) == [200] * 4
    after = dict(stack.upstream.counters)
    stack.settle()
    assert wait_for(lambda: watch.recent and watch.recent[-1].snapshot.prefix_cache_hits_total == after["cached"])
    r, _ = report_of(stack)
    w = r["server"]["window"]
    assert w["prefix_cache_hits"] == after["cached"] - before["cached"] == 20
    assert w["prefix_cache_queries"] == (after["prompt"] + after["cached"]) - (before["prompt"] + before["cached"])
    assert w["prefix_cache_hit_rate"] == 20 / w["prefix_cache_queries"]
    assert [rec.usage_cached_tokens for rec in stack.records] == [5] * 4
    assert "20 of" in render_text(r) and "prompt tokens looked up were found" in render_text(r)
