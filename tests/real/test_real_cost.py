"""One priced audit of real agents' traffic: the official ``anthropic`` SDK (Messages) and ``openai`` SDK
(Responses and chat completions), each with its own API key, through specproxy (``--tenant-from-key``) to
the REAL llama-server. Each request is sent twice, so the second finds its prompt in the server's prefix
cache and the server says so (``cache_read_input_tokens``, ``cached_tokens``). Then ``audit --by tenant
--prices`` and ``report --by tenant --prices`` must price each turn's cached tokens at the cached price
and the rest at the input price, from the counts the database holds; the tenants are keyed hashes of
the two keys, and neither key is anywhere in the database's files."""

from __future__ import annotations

import hashlib
import hmac
import sqlite3
from pathlib import Path

import anthropic
import openai
import orjson
import pytest
from click.testing import CliRunner
from faultkit import wait_until
from real.clientkit import Arrivals
from real.test_real_agent_apis import messages_body, responses_body

from specproxy.app.cli import main

pytestmark = pytest.mark.real

KEY_CLAUDE = "sk-ant-api03-realcost34-CLAUDEKEYxxxxxxxxxxxx"
KEY_CODEX = "sk-proj-realcost34-CODEXKEYyyyyyyyyyyyyyyy"
PRICE = {"input": 3.0, "cached_input": 0.3, "output": 15.0}  # made up for the test: USD per million tokens


def anthropic_twice(base_url: str) -> None:
    with anthropic.Anthropic(base_url=base_url, api_key=KEY_CLAUDE, max_retries=0,
                             http_client=anthropic.DefaultHttpxClient(trust_env=False, timeout=60.0)) as client:
        for _ in range(2):
            list(client.messages.create(**messages_body(), stream=True))


def openai_twice(base_url: str) -> None:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY_CODEX, max_retries=0,
                       http_client=openai.DefaultHttpxClient(trust_env=False, timeout=60.0)) as client:
        for _ in range(2):
            client.responses.create(**responses_body())
        for _ in range(2):
            list(client.chat.completions.create(
                model="tiny", max_tokens=32, stream=True, stream_options={"include_usage": True},
                messages=[{"role": "system", "content": "You are a terse agent."},
                          {"role": "user", "content": "What is the weather in Zürich?"}]))


def _measured_rows(db) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT count(*) FROM turns WHERE measured = 1").fetchone()[0]
    finally:
        conn.close()


def expected_usd(r: dict) -> float:
    """The rule by hand: the server's cached count at the cached price, the rest of the prompt at input,
    the output at output (the table prices reasoning as output)."""
    cached = min(r["usage_cached_tokens"], r["prompt_tokens"])
    return ((r["prompt_tokens"] - cached) * PRICE["input"] + cached * PRICE["cached_input"]
            + r["completion_tokens"] * PRICE["output"]) / 1e6


def test_a_priced_audit_per_tenant_of_both_sdks(make_stack, counter, tool_server, tmp_path):
    stack = make_stack(counter, upstream=tool_server.url, scrape_interval_s=0, tenant_from_key=True)
    arrivals = Arrivals(stack)
    anthropic_twice(stack.url)
    openai_twice(stack.url)
    arrivals.wait(6)
    stack.settle()
    db = stack.cfg.db
    # the records reach the writer's queue as they are measured; its thread commits them a moment later
    wait_until(lambda: _measured_rows(db) >= 6, 30, 0.02, "the six turns written")
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    stored = [dict(r) for r in conn.execute("SELECT * FROM turns WHERE measured = 1 ORDER BY rowid")]
    secret = bytes.fromhex(conn.execute("SELECT value FROM store_meta WHERE key = 'tenant_key_secret'").fetchone()[0])
    conn.close()
    assert [r["api"] for r in stored] == ["messages", "messages", "responses", "responses", "chat", "chat"]
    assert all(r["outcome"] == "ok" for r in stored)

    def tenant(key: str) -> str:
        return "key:" + hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:16]

    assert [r["tenant"] for r in stored] == [tenant(KEY_CLAUDE)] * 2 + [tenant(KEY_CODEX)] * 4
    # the second of each pair found its prompt in the server's cache, and the server said how much
    for first, second in zip(stored[::2], stored[1::2]):
        assert second["usage_cached_tokens"] > 0 and second["usage_cached_tokens"] <= second["prompt_tokens"]

    prices = tmp_path / "prices.toml"
    prices.write_text('[prices."tiny"]\n' + "".join(f"{k} = {v}\n" for k, v in PRICE.items()))
    result = CliRunner().invoke(main, ["audit", "--db", db, "--json", "--by", "tenant", "--prices", str(prices)])
    assert result.exit_code == 0, result.output
    audit = orjson.loads(result.output)
    groups = {g["group"]: g for g in audit["groups"]}
    assert set(groups) == {tenant(KEY_CLAUDE), tenant(KEY_CODEX)}
    for key, rows in ((KEY_CLAUDE, stored[:2]), (KEY_CODEX, stored[2:])):
        cost = groups[tenant(key)]["cost"]
        assert cost["priced"] == len(rows) and cost["unpriced"] == {}
        assert cost["usd"] == pytest.approx(sum(expected_usd(r) for r in rows), rel=1e-9)
    # cached tokens are priced at a tenth: the cached second turn costs less than the first
    claude = groups[tenant(KEY_CLAUDE)]
    per_turn = next(iter(claude["session_detail"].values()))["per_turn"]
    assert [t["cost_usd"] for t in per_turn] == pytest.approx([expected_usd(r) for r in stored[:2]], rel=1e-9)
    assert per_turn[1]["cost_usd"] < per_turn[0]["cost_usd"]
    share = claude["cost"]["parts"]["of_every_dollar"]
    assert share["tools"] > 0 and sum(share.values()) == pytest.approx(1.0)

    result = CliRunner().invoke(main, ["report", "--db", db, "--json", "--by", "tenant", "--prices", str(prices)])
    assert result.exit_code == 0, result.output
    report = orjson.loads(result.output)
    assert report["cost"]["usd"] == pytest.approx(sum(expected_usd(r) for r in stored), rel=1e-9)
    assert {g["group"]: g["turns"] for g in report["by"]["groups"]} == {tenant(KEY_CLAUDE): 2, tenant(KEY_CODEX): 4}

    for path in Path(db).parent.iterdir():  # the database, its write-ahead log, its shared memory
        if path.is_file():
            data = path.read_bytes()
            assert KEY_CLAUDE.encode() not in data and KEY_CODEX.encode() not in data, path
