"""``specproxy audit`` on a recorded agent session: one client, four Messages turns, the system prompt
changed before the third. The figures are known exactly: with ``tiktoken`` (no chat template) each part
is the tokens of its own text, so every median and the change the audit reports can be computed here
from the requests themselves."""

from __future__ import annotations

import sqlite3

import aiohttp
import orjson
from click.testing import CliRunner

from specproxy.app.cli import main
from specproxy.app.fake_upstream import Script
from specproxy.measure.anthropic import to_chat
from waits import wait_for

TOOLS = [{"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
S1 = "You are a coding agent. Be careful with files."
S2 = "You are a coding agent. Be careful with files. Today is Tuesday; the repository is clean."


async def post(url: str, body: dict) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/messages?beta=true", json=body, headers={"User-Agent": "claude-cli/9.9"}) as r:
            await r.read()
            return r.status


def bodies() -> list[dict]:
    conv: list[dict] = []
    out = []
    for turn, system in enumerate([S1, S1, S2, S2]):
        conv = [*conv, {"role": "user", "content": f"Step {turn}: fix the bug in module {turn}."}]
        out.append({"model": "m", "max_tokens": 32, "system": system, "tools": TOOLS, "messages": conv})
        conv = [*conv, {"role": "assistant", "content": "Hello, world!"}]
    return out


def test_audit_reports_the_session_and_the_changed_system_prompt(make_stack, tiktoken_tok):
    stack = make_stack(tiktoken_tok)
    stack.upstream.script = Script(pieces=["Hello", ",", " world", "!"])
    for body in bodies():
        assert stack.run(post(stack.url, body)) == 200
    stack.settle()
    db = stack.cfg.db
    assert wait_for(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0] == 4)

    count = tiktoken_tok.count
    system = [count(s) for s in (S1, S1, S2, S2)]
    tools = count(orjson.dumps(to_chat(bodies()[0])["tools"]).decode())
    result = CliRunner().invoke(main, ["audit", "--db", str(db), "--json"])
    assert result.exit_code == 0, result.output
    audit = orjson.loads(result.output)
    (client,) = audit["clients"]
    assert client["client"] == "claude-cli/9.9" and client["turns"] == 4 and client["sessions"] == 1
    assert client["apis"] == ["messages"]
    assert client["median_tokens"]["system"] == (system[1] + system[2]) / 2
    assert client["median_tokens"]["tools"] == tools
    news = [count(b["messages"][-1]["content"]) for b in bodies()]
    (session,) = client["session_detail"].values()
    assert session["turns"] == 4
    (change,) = session["changes"]
    assert change["turn"] == 3 and change["changed"] == ["system"] and change["system"] == [system[0], system[2]]
    rows = sqlite3.connect(db).execute("SELECT prompt_new_tokens, prompt_tokens FROM turns ORDER BY t_request").fetchall()
    assert [r[0] for r in rows] == news
    assert client["typed_share"]["overall"] == sum(news) / sum(r[1] for r in rows)

    text = CliRunner().invoke(main, ["audit", "--db", str(db)]).output
    assert f"turn 3: system {system[0]} -> {system[2]} tokens" in text and "claude-cli/9.9: 4 turns in 1 sessions" in text
