"""Cost per tenant and per client through the real proxy, against the scripted upstream: chat turns whose
usage says how many prompt tokens the server had cached, two teams (``--tenant-header X-Team``), two
clients; then ``report --prices --by tenant`` and ``audit --by tenant --prices``. The expected dollars
are worked out here from the counts the database holds. And ``--tenant-from-key``: a keyed hash names
the tenant, and the key is nowhere in the database files or the logs."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import sqlite3
from pathlib import Path

import aiohttp
import orjson
import pytest
from click.testing import CliRunner

from specproxy.app.cli import main
from specproxy.app.fake_upstream import Script
from waits import wait_for

PRICE = {"input": 3.0, "cached_input": 0.3, "output": 15.0}  # made up for the test, USD per million tokens
TOOLS = [{"type": "function", "function": {"name": f"tool_{k}", "description": f"Tool number {k} of the agent.",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
         for k in range(6)]
KEY_A = "sk-proj-Zq8cost34tenantAAAAAAAAAAAAAAAA"
KEY_B = "sk-ant-api03-cost34tenantBBBBBBBBBBBBBBBB"


def body(k: int, model: str = "m") -> dict:
    return {"model": model, "stream": True, "stream_options": {"include_usage": True}, "tools": TOOLS,
            "messages": [{"role": "system", "content": "You are an agent. Use the tools."},
                         {"role": "user", "content": f"Task {k}: do it."}]}


async def post(url: str, payload: dict, headers: dict) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=payload, headers=headers) as r:
            await r.read()
            return r.status


def rows(db: str) -> list[dict]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM turns WHERE measured = 1 ORDER BY rowid")]
    finally:
        conn.close()


def expected_usd(r: dict) -> float:
    """The rule, by hand: cached prompt tokens at the cached price, the rest at input, output at output
    (reasoning is priced as output here: the table gives it no price of its own)."""
    cached = min(r["usage_cached_tokens"], r["prompt_tokens"])
    return ((r["prompt_tokens"] - cached) * PRICE["input"] + cached * PRICE["cached_input"]
            + r["completion_tokens"] * PRICE["output"]) / 1e6


def prices_file(tmp_path: Path) -> str:
    f = tmp_path / "prices.toml"
    f.write_text('[prices."m"]\n' + "".join(f"{k} = {v}\n" for k, v in PRICE.items()))
    return str(f)


def test_cost_per_tenant_and_client_from_the_servers_cached_count(make_stack, tiktoken_tok, tmp_path):
    stack = make_stack(tiktoken_tok, tenant_header="X-Team")
    stack.upstream.script = Script(pieces=["Done", " with", " it", "."], cached_tokens=40)
    sends = [("search", "agent-a/1"), ("search", "agent-a/1"), ("search", "agent-b/2"), ("ads", "agent-b/2"), (None, "agent-b/2")]
    for k, (team, agent) in enumerate(sends):
        headers = {"User-Agent": agent, **({"X-Team": team} if team else {})}
        assert stack.run(post(stack.url, body(k, model="m" if k < 4 else "unpriced"), headers)) == 200
    stack.settle()
    db = stack.cfg.db
    assert wait_for(lambda: len(rows(db)) == len(sends))
    stored = rows(db)
    assert [r["tenant"] for r in stored] == [t for t, _ in sends]
    assert all(r["usage_cached_tokens"] == 40 and r["prompt_tokens"] > 40 for r in stored)

    result = CliRunner().invoke(main, ["report", "--db", db, "--json", "--prices", prices_file(tmp_path), "--by", "tenant"])
    assert result.exit_code == 0, result.output
    report = orjson.loads(result.output)
    want = {r["id"]: expected_usd(r) for r in stored[:4]}
    assert report["cost"]["priced"] == 4 and report["cost"]["unpriced"] == {"no price for its model": 1}
    assert report["cost"]["usd"] == pytest.approx(sum(want.values()), rel=1e-9)
    groups = {g["group"]: g for g in report["by"]["groups"]}
    assert set(groups) == {"search", "ads", "(none)"}
    assert groups["search"]["turns"] == 3
    assert groups["search"]["cost"]["usd"] == pytest.approx(sum(expected_usd(r) for r in stored[:3]), rel=1e-9)
    assert groups["ads"]["cost"]["usd"] == pytest.approx(expected_usd(stored[3]), rel=1e-9)
    assert groups["(none)"]["cost"]["usd"] is None
    # the prompt's first 40 tokens were cached: the system prompt (and the tools' start) are the cheap part
    share = report["cost"]["parts"]["of_every_dollar"]
    assert share["tools"] > share["new"] > 0 and sum(share.values()) == pytest.approx(1.0)

    text = CliRunner().invoke(main, ["report", "--db", db, "--prices", prices_file(tmp_path), "--by", "tenant"]).output
    assert "Cost at the given prices" in text and "By tenant" in text and "of every $1" in text
    page = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", "--db", db, "--prices", prices_file(tmp_path), "--by", "tenant",
                                       "--html", str(page)])
    assert result.exit_code == 0, result.output
    html = page.read_text()
    # the page's figures are the JSON report's, each cell saying which
    figures = dict(re.findall(r'data-figure="([^"]+)" data-value="([^"]*)"', html))
    assert float(figures["cost/usd"]) == pytest.approx(report["cost"]["usd"], rel=1e-12)
    assert float(figures["cost/parts/of_every_dollar/tools"]) == pytest.approx(share["tools"], rel=1e-12)
    i = next(i for i, g in enumerate(report["by"]["groups"]) if g["group"] == "search")
    assert float(figures[f"by/groups/{i}/cost/usd"]) == pytest.approx(groups["search"]["cost"]["usd"], rel=1e-12)

    result = CliRunner().invoke(main, ["audit", "--db", db, "--json", "--by", "client", "--prices", prices_file(tmp_path)])
    assert result.exit_code == 0, result.output
    audit = orjson.loads(result.output)
    by_client = {c["client"]: c for c in audit["clients"]}
    assert by_client["agent-a/1"]["cost"]["usd"] == pytest.approx(sum(expected_usd(r) for r in stored[:2]), rel=1e-9)
    assert by_client["agent-b/2"]["cost"]["priced"] == 2 and by_client["agent-b/2"]["cost"]["turns"] == 3
    session = next(iter(by_client["agent-a/1"]["session_detail"].values()))
    assert session["cost_usd"] == pytest.approx(expected_usd(stored[0]), rel=1e-9)
    result = CliRunner().invoke(main, ["audit", "--db", db, "--by", "tenant", "--prices", prices_file(tmp_path)])
    assert result.exit_code == 0 and "tenant search: 3 turns" in result.output, result.output
    tools = groups["search"]["cost"]["parts"]["of_every_dollar"]["tools"]
    assert f"the 6 tool definitions sent every turn (median) cost ${tools:.2f} of every $1" in result.output


def test_a_bad_prices_file_is_one_line(make_stack, tiktoken_tok, tmp_path):
    stack = make_stack(tiktoken_tok)
    assert stack.run(post(stack.url, body(0), {})) == 200
    stack.settle()
    bad = tmp_path / "bad.toml"
    bad.write_text('[prices."m"]\ninput = 1\n')
    for command in ("report", "audit"):
        result = CliRunner().invoke(main, [command, "--db", stack.cfg.db, "--prices", str(bad)])
        assert result.exit_code == 2
        assert result.output.strip().count("\n") == 0 and "needs output" in result.output


def test_tenant_from_key_never_keeps_the_key(make_stack, tiktoken_tok, caplog):
    caplog.set_level(logging.DEBUG)
    stack = make_stack(tiktoken_tok, tenant_from_key=True)
    sends = [{"Authorization": f"Bearer {KEY_A}"}, {"x-api-key": KEY_B}, {"Authorization": f"Bearer {KEY_A}"}, {}]
    for k, headers in enumerate(sends):
        assert stack.run(post(stack.url, body(k), {"User-Agent": "sdk/1", **headers})) == 200
    assert stack.upstream.sent[0].request_headers["Authorization"] == f"Bearer {KEY_A}"  # forwarded as sent
    stack.settle()
    db = stack.cfg.db
    assert wait_for(lambda: len(rows(db)) == len(sends))
    conn = sqlite3.connect(db)
    secret = bytes.fromhex(conn.execute("SELECT value FROM store_meta WHERE key = 'tenant_key_secret'").fetchone()[0])
    conn.close()

    def fingerprint(key: str) -> str:
        return "key:" + hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:16]

    assert [r["tenant"] for r in rows(db)] == [fingerprint(KEY_A), fingerprint(KEY_B), fingerprint(KEY_A), None]
    # the database, its write-ahead log and its shared memory, with every turn in them (read above)
    for path in Path(db).parent.iterdir():
        if path.is_file():
            data = path.read_bytes()
            for key in (KEY_A, KEY_B):
                assert key.encode() not in data and key[8:24].encode() not in data, path
    for key in (KEY_A, KEY_B):
        assert key not in caplog.text and key[8:24] not in caplog.text
