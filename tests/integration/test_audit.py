"""``specproxy audit`` on a recorded agent session: one client, four Messages turns with three tools (one
called in the first answer, one in the last answer, one never), the system prompt changed before the
third. The figures are known exactly: with ``tiktoken`` (no chat template) each part is the tokens of its
own text, so every median, the change, the prefix break and the tools the audit reports can be computed
here from the requests and the scripted answers."""

from __future__ import annotations

import hashlib
import sqlite3

import aiohttp
import orjson
from click.testing import CliRunner

from specproxy.app.cli import main
from specproxy.app.fake_upstream import Script
from specproxy.measure.anthropic import to_chat
from specproxy.measure.openai import split_prompt
from waits import wait_for

TOOLS = [{"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}},
         {"name": "write_file", "description": "Write a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}},
         {"name": "delete_file", "description": "Delete a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
S1 = "You are a coding agent. Be careful with files."
S2 = "You are a coding agent. Be very careful with files. Today is Tuesday; the repository is clean."
SHARED = "You are a coding agent. Be"  # where S1 and S2 part: the tokens before " careful" / " very"
CALL = {"role": "assistant", "content": [{"type": "text", "text": "Reading."}, {"type": "tool_use", "id": "toolu_1",
                                                                              "name": "read_file", "input": {"path": "m.py"}}]}


async def post(url: str, body: dict, headers: dict | None = None) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/messages?beta=true", json=body,
                          headers=headers or {"User-Agent": "claude-cli/9.9"}) as r:
            await r.read()
            return r.status


def bodies() -> list[dict]:
    conv: list[dict] = []
    out = []
    for turn, system in enumerate([S1, S1, S2, S2]):
        conv = [*conv, {"role": "user", "content": f"Step {turn}: fix the bug in module {turn}."}]
        out.append({"model": "m", "max_tokens": 32, "system": system, "tools": TOOLS, "messages": conv})
        conv = [*conv, CALL if turn == 0 else {"role": "assistant", "content": "Hello, world!"}]
    return out


def answer(req: dict) -> Script:
    """The fake's answer to turn k (2k + 1 messages): the first calls read_file (as the history the
    later turns resend says), the last write_file (which no later turn resends), the others are text."""
    turn = len(req["messages"]) // 2
    if turn == 0:
        return Script(pieces=["Reading", "."], tool_args_pieces=['{"path":"m.py"}'], tool_name="read_file")
    if turn == 3:
        return Script(pieces=["Writing", "."], tool_args_pieces=['{"path":"m.py"}'], tool_name="write_file")
    return Script(pieces=["Hello", ",", " world", "!"])


def test_audit_reports_the_session_and_the_changed_system_prompt(make_stack, tiktoken_tok):
    stack = make_stack(tiktoken_tok)
    stack.upstream.script = answer
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
    assert f"turn 3: system {system[0]} -> {system[2]} tokens" in text
    assert "claude-cli/9.9: 4 turns in 1 session (" in text

    # the prefix-cache break, per turn: only appended (all of the previous prompt reusable) but for turn 3,
    # whose system prompt parts from the previous one after SHARED's tokens
    enc = tiktoken_tok.encode
    assert enc(S1)[:count(SHARED)] == enc(S2)[:count(SHARED)] and enc(S1)[count(SHARED)] != enc(S2)[count(SHARED)]
    stored = sqlite3.connect(db).execute(
        "SELECT prefix_reused_tokens, prefix_break_part, turn_diff, tools_defined, tools_called, tool_names "
        "FROM turns ORDER BY t_request").fetchall()
    prompts = [r[1] for r in rows]
    assert [r[0] for r in stored] == [None, prompts[0], count(SHARED), prompts[2]]
    assert [r[1] for r in stored] == [None, None, "system", None]
    lengths = [len(split_prompt(to_chat(b)).conversation) for b in bodies()]
    assert [orjson.loads(r[2]) if r[2] else None for r in stored] == [None] + [
        {"messages_added": b - a, "messages_removed": 0, "system_changed": k == 2, "tools_changed": False}
        for k, (a, b) in enumerate(zip(lengths, lengths[1:]), start=1)]
    per_turn = session["per_turn"]
    assert [t["reused_tokens"] for t in per_turn] == [r[0] for r in stored]
    assert text.count("prefix intact") == 2
    assert (f"turn 3 changed the system prompt at token {count(SHARED):,}: only {count(SHARED):,} of {prompts[2]:,} "
            "tokens reusable") in text

    # tools: three defined every turn; read_file called in the first answer, write_file in the last (seen
    # on that turn, from its answer), delete_file never; no text stored, so the names are digests
    names = ("read_file", "write_file", "delete_file")
    digest = {n: hashlib.blake2b(n.encode(), digest_size=6).hexdigest() for n in names}
    assert [r[3] for r in stored] == [3, 3, 3, 3] and [r[4] for r in stored] == [1, 0, 0, 1]
    called = [orjson.loads(r[5]) for r in stored]
    assert [c["defined"] for c in called] == [list(digest.values())] * 4
    assert [c["called"] for c in called] == [[digest["read_file"]], [], [], [digest["write_file"]]]
    assert session["tools"] == {"defined": 3, "never_called": [digest["delete_file"]]}
    assert [t["tools_called_so_far"] for t in per_turn] == [1, 1, 1, 2]
    assert "1 of 3 tools were never called in 4 turns" in text
    assert "tools: 3 defined, 0 called in this answer, 1 so far" in text
    assert not any(n in text or n in result.output for n in names)


def test_a_configured_header_names_the_client(make_stack, tiktoken_tok):
    """Several clients behind one User-Agent (an SDK) are told apart by a header of the user's choosing."""
    stack = make_stack(tiktoken_tok, client_header="X-Client-Name")
    stack.upstream.script = Script(pieces=["Hello"])
    body = bodies()[0]
    for team in ("team-a", "team-b"):
        assert stack.run(post(stack.url, body, {"User-Agent": "sdk/1", "X-Client-Name": team})) == 200
    stack.settle()
    db = stack.cfg.db
    assert wait_for(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0] == 2)
    clients = sqlite3.connect(db).execute("SELECT client FROM turns ORDER BY t_request").fetchall()
    assert [c for (c,) in clients] == ["team-a", "team-b"]
    audit = orjson.loads(CliRunner().invoke(main, ["audit", "--db", str(db), "--json"]).output)
    assert sorted(c["client"] for c in audit["clients"]) == ["team-a", "team-b"]



def test_a_turn_after_a_restart_is_the_first_seen_not_a_shrunk_history(make_stack, tiktoken_tok):
    """Two turns through one proxy, then the same second request again, byte for byte, through a new
    proxy on the same database (a restart): the new proxy has no record of the session's previous
    turn, so the audit says so; it does not call a repeat a history that shrank (issue #31). And the
    median turn's line adds up: its parts are one turn's."""
    first, second = bodies()[:2]
    stack = make_stack(tiktoken_tok)
    stack.upstream.script = answer
    for body in (first, second):
        assert stack.run(post(stack.url, body)) == 200
    stack.settle()
    db = stack.cfg.db
    assert wait_for(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0] == 2)
    restarted = make_stack(tiktoken_tok)
    assert restarted.cfg.db == db
    restarted.upstream.script = answer
    assert restarted.run(post(restarted.url, second)) == 200
    restarted.settle()
    assert wait_for(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0] == 3)

    audit = orjson.loads(CliRunner().invoke(main, ["audit", "--db", db, "--json"]).output)
    (client,) = audit["clients"]
    (session,) = client["session_detail"].values()
    (change,) = session["changes"]
    assert change["turn"] == 3 and change["changed"] == ["first turn seen of this session"]
    text = CliRunner().invoke(main, ["audit", "--db", db]).output
    assert "shrank" not in text and "turn 3: first turn seen of this session (no record of the turn before" in text
    assert "turn 3: " in text and "(first turn seen of this session: no prefix comparison)" in text
    line = next(x for x in text.splitlines() if "the median turn: prompt" in x)
    total, parts = line.split("prompt ")[1].split(" = ")
    assert int(total.replace(",", "")) == sum(int(p.split()[-1].replace(",", "")) for p in parts.split(" + "))
    mid = client["median_turn"]
    assert mid["prompt_tokens"] == sum(mid[p] for p in ("system", "tools", "history", "new"))
    assert "1 client\n" in text.splitlines()[0] + "\n" and "3 completed turns" in text


async def post_chat(url: str, body: dict) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=body, headers={"User-Agent": "loop-agent/1"}) as r:
            await r.read()
            return r.status


def test_predicted_against_reused_from_llama_cpps_cache_n(make_stack, tiktoken_tok):
    """Three turns of one chat session, each only appending, on a server that says its cached count in
    llama.cpp's ``timings.cache_n`` alone (no usage): the second turn's cache held everything predicted,
    the third's had been evicted (cache_n 0). The audit and the report show predicted, reused and lost
    per turn, per session and per client; the lost part is the third turn's whole prediction."""
    stack = make_stack(tiktoken_tok)
    predicted: list[int] = []  # turn 2's (all of it reused), known once turn 1 is stored
    stack.upstream.script = lambda req: Script(pieces=["Fine", "."], usage="none", timings=True,
                                               cache_n=predicted[0] if len(req["messages"]) == 4 else 0)
    conv = [{"role": "system", "content": S1}]
    db = stack.cfg.db
    for k in range(3):
        conv = [*conv, {"role": "user", "content": f"Step {k}: fix module {k}."}]
        if k == 1:  # the prediction for turn 2 is turn 1's whole prompt (tiktoken, no template: it only appended)
            predicted.append(sqlite3.connect(db).execute("SELECT prompt_tokens FROM turns").fetchone()[0])
        assert stack.run(post_chat(stack.url, {"model": "m", "stream": True, "messages": conv})) == 200
        stack.settle()
        assert wait_for(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0] == k + 1)
        conv = [*conv, {"role": "assistant", "content": "Fine."}]
    stored = sqlite3.connect(db).execute(
        "SELECT prefix_reused_tokens, usage_cached_tokens, usage_prompt_tokens FROM turns ORDER BY rowid").fetchall()
    assert [r[1] for r in stored] == [0, predicted[0], 0] and all(r[2] is None for r in stored)
    assert stored[1][0] == predicted[0] and stored[2][0] > 0
    lost3 = stored[2][0]

    audit = orjson.loads(CliRunner().invoke(main, ["audit", "--db", str(db), "--json"]).output)
    (client,) = audit["clients"]
    (session,) = client["session_detail"].values()
    assert [t["lost_tokens"] for t in session["per_turn"]] == [None, 0, lost3]
    for totals in (session["prefix_cache"], client["prefix_cache"]):
        assert (totals["turns"], totals["predicted_tokens"], totals["reused_tokens"], totals["lost_tokens"]) == (
            2, predicted[0] + lost3, predicted[0], lost3)
    report = orjson.loads(CliRunner().invoke(main, ["report", "--db", str(db), "--json"]).output)
    pc = report["prefix_cache"]
    assert (pc["turns"], pc["lost_tokens"], pc["turns_with_loss"]) == (2, lost3, 1)
    assert [c["client"] for c in pc["by_client"]] == ["loop-agent/1"]
    text = CliRunner().invoke(main, ["report", "--db", str(db)]).output
    assert f"lost {lost3:,} tokens in 1 of 2 turns" in text
    assert f"server cached 0, lost {lost3:,} predicted" in CliRunner().invoke(main, ["audit", "--db", str(db)]).output
    (sid,) = client["session_detail"]
    one = orjson.loads(CliRunner().invoke(main, ["audit", "--db", str(db), "--json", "--session", sid[:6]]).output)
    assert one["session"] == sid and [t["change"]["lost_tokens"] for t in one["per_turn"]] == [None, 0, lost3]
    assert [t["change"]["messages_added"] for t in one["per_turn"]] == [None, 2, 2]
    assert one["per_turn"][2]["change"]["parts_delta"]["system"] == 0
    table = CliRunner().invoke(main, ["audit", "--db", str(db), "--session", sid]).output
    assert f"session {sid} of loop-agent/1: 3 turns" in table and any(x.split()[:3] == ["turn", "prompt", "d"] for x in table.splitlines())
    assert "turn 3: tokens system +0, tools +0" in table and f"lost {lost3:,}" in table
    bad = CliRunner().invoke(main, ["audit", "--db", str(db), "--session", "zz"])
    assert bad.exit_code == 2 and "no session 'zz'" in bad.output and "Traceback" not in bad.output
