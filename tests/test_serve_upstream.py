"""The upstream as users give it and as it behaves: a base URL with or without ``/v1``, clients whose base
URL has no ``/v1``, and an upstream that does not answer (said at start-up, scrape failures logged and
reported)."""

from __future__ import annotations

import time

import aiohttp
import pytest
from yarl import URL

from specproxy.config import load_config, server_root
from specproxy.testing import Script


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


async def post(url: str, path: str, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as c:
        async with c.post(url + path, json=body) as r:
            return r.status, await r.read()


CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


# --- a base URL with or without /v1 ---------------------------------------------------------------------

@pytest.mark.parametrize(("given", "root"), [
    ("http://h:8000/v1", "http://h:8000"),
    ("http://h:8000/v1/", "http://h:8000"),
    ("http://h:8000", "http://h:8000"),
    ("http://h/llm/v1", "http://h/llm"),
    ("http://h/llm", "http://h/llm"),
    ("http://h/v1x", "http://h/v1x"),  # only a whole /v1 segment is the API's, not a prefix
])
def test_a_trailing_v1_is_the_apis_not_a_prefix(given, root):
    assert str(server_root(URL(given))).rstrip("/") == root
    cfg = load_config(env={}, overrides={"upstream": given})
    assert cfg.forwards_to("/v1/chat/completions") == root + "/v1/chat/completions"
    assert cfg.forwards_to("/chat/completions") == root + "/chat/completions"


@pytest.mark.usefixtures("each_front")
@pytest.mark.parametrize(("base", "arrives"), [
    ("/v1", "/v1/chat/completions"),
    ("/v1/", "/v1/chat/completions"),
    ("/llm/v1", "/llm/v1/chat/completions"),
    ("/llm", "/llm/v1/chat/completions"),
])
def test_an_upstream_given_with_v1_gets_no_doubled_prefix(make_stack, tiktoken_tok, base, arrives):
    """What the upstream receives, and the scraper's /metrics at the server's root (where llama-server and
    vLLM serve it), for a base URL copied from a server's docs."""
    stack = make_stack(tiktoken_tok, upstream_path=base, scrape_interval_s=0.05)
    stack.upstream.script = Script(pieces=["a", " b"])
    assert stack.run(post(stack.url, "/v1/chat/completions", CHAT))[0] == 200
    assert stack.upstream.sent[-1].path == arrives
    stack.settle()
    (rec,) = stack.records
    assert rec.outcome == "ok" and rec.path == "/v1/chat/completions" and rec.completion_tokens == 2
    if not base.startswith("/llm"):  # the fake upstream serves /metrics at its root only
        watch = stack.service.watch
        assert watch.scraper.url == stack.upstream.url + "/metrics"
        assert wait_for(lambda: watch.instance_id is not None)
        assert watch.scraper.disabled_reason is None


# --- clients whose base URL has no /v1 --------------------------------------------------------------------

@pytest.mark.usefixtures("each_front", "each_relay")
def test_paths_without_v1_are_measured_like_their_v1_twins(make_stack, tiktoken_tok):
    stack = make_stack(tiktoken_tok)
    stack.upstream.script = Script(pieces=["one", " two", " three"])
    assert stack.run(post(stack.url, "/chat/completions", CHAT))[0] == 200
    status, body = stack.run(post(stack.url, "/completions", {"model": "m", "prompt": "count"}))
    assert status == 200 and b"one two three" in body
    assert [s.path for s in stack.upstream.sent] == ["/chat/completions", "/completions"]
    stack.settle()
    recs = sorted(stack.records, key=lambda r: r.t_request)
    assert [r.path for r in recs] == ["/chat/completions", "/completions"]  # what the client sent
    assert [r.outcome for r in recs] == ["ok", "ok"]
    assert [r.streamed for r in recs] == [True, False]
    assert [r.completion_tokens for r in recs] == [3, 3]
    assert recs[1].prompt_new_tokens == tiktoken_tok.count("count")
