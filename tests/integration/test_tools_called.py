"""The tools a turn's answer called are read from that answer, in every API, streamed and not.

Through the real proxy to the fake upstream speaking each API (chat completions, Messages, Responses):
a two-turn conversation whose request defines two tools; the first answer is text, the second (the
session's last) calls ``lookup``. The second turn's record has the call (``tools_called`` 1, ``lookup``
in ``tool_names["called"]``) and the first none; ``specproxy audit`` then says only the other tool was
never called. No later turn resends the call, so only the response can show it.
"""

from __future__ import annotations

import hashlib
import sqlite3

import aiohttp
import orjson
import pytest
from click.testing import CliRunner

from specproxy.app.cli import main
from specproxy.app.fake_upstream import Script
from waits import wait_for

PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages?beta=true", "responses": "/v1/responses"}
ARGS = ['{"q":', '"x"}']  # compact JSON: a non-streamed Messages tool input is counted as that


def digest(name: str) -> str:
    return hashlib.blake2b(name.encode(), digest_size=6).hexdigest()


def body_for(api: str, stream: bool, turn: int) -> dict:
    """Turn 0: the question; turn 1: the question, the first answer and a follow-up (same session)."""
    convo = [{"role": "user", "content": "Find x."}]
    if turn:
        convo += [{"role": "assistant", "content": "Let me look."}, {"role": "user", "content": "Go on."}]
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    if api == "chat":
        tools = [{"type": "function", "function": {"name": n, "parameters": schema}} for n in ("lookup", "other")]
        return {"model": "m", "stream": stream, "messages": convo, "tools": tools}
    if api == "messages":
        tools = [{"name": n, "input_schema": schema} for n in ("lookup", "other")]
        return {"model": "m", "max_tokens": 64, "stream": stream, "messages": convo, "tools": tools}
    tools = [{"type": "function", "name": n, "parameters": schema} for n in ("lookup", "other")]
    return {"model": "m", "stream": stream, "input": convo, "tools": tools}


async def post(url: str, path: str, body: dict) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, headers={"User-Agent": "agent-t/1"}) as r:
            await r.read()
            return r.status


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_the_last_answers_call_is_seen_on_its_turn_and_in_the_audit(make_stack, tiktoken_tok, api, stream):
    stack = make_stack(tiktoken_tok)
    scripts = [Script(pieces=["Let", " me", " look", "."]),
               Script(pieces=["Looking", "."], tool_args_pieces=ARGS, tool_name="lookup", tokens_per_chunk=1)]
    for turn, script in enumerate(scripts):
        stack.upstream.script = script
        assert stack.run(post(stack.url, PATHS[api], body_for(api, stream, turn))) == 200
        stack.settle()
    first, last = stack.records
    assert first.api == last.api == api and first.streamed is last.streamed is stream
    assert first.session == last.session is not None
    assert (first.tools_defined, first.tools_called) == (2, 0)
    assert orjson.loads(first.tool_names) == {"defined": [digest("lookup"), digest("other")], "called": []}
    assert (last.tools_defined, last.tools_called) == (2, 1)
    assert orjson.loads(last.tool_names) == {"defined": [digest("lookup"), digest("other")], "called": [digest("lookup")]}
    assert last.tool_args_tokens == tiktoken_tok.count("".join(ARGS))  # the call's arguments, counted

    db = stack.cfg.db
    assert wait_for(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0] == 2)
    result = CliRunner().invoke(main, ["audit", "--db", str(db), "--json"])
    assert result.exit_code == 0, result.output
    (client,) = orjson.loads(result.output)["clients"]
    (session,) = client["session_detail"].values()
    assert session["tools"] == {"defined": 2, "never_called": [digest("other")]}
    assert [(t["tools_called"], t["tools_called_so_far"]) for t in session["per_turn"]] == [(0, 0), (1, 1)]
    text = CliRunner().invoke(main, ["audit", "--db", str(db)]).output
    assert "tools: 2 defined, 1 called in this answer, 1 so far" in text
    assert "1 of 2 tools were never called in 2 turns" in text


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_with_stored_text_the_names_are_kept(make_stack, tiktoken_tok, api):
    """``--store-text``: the names themselves, of the tools defined and of the one the answer called."""
    stack = make_stack(tiktoken_tok, store_text=True)
    stack.upstream.script = Script(pieces=["Ok."], tool_args_pieces=ARGS, tool_name="other")
    assert stack.run(post(stack.url, PATHS[api], body_for(api, True, 0))) == 200
    stack.settle()
    (rec,) = stack.records
    assert rec.tools_called == 1 and orjson.loads(rec.tool_names) == {"defined": ["lookup", "other"],
                                                                      "called": ["other"]}
    db = stack.cfg.db
    assert wait_for(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM turns").fetchone()[0] == 1)
    assert sqlite3.connect(db).execute("SELECT tools_called, tool_names FROM turns").fetchone() == (1, rec.tool_names)
