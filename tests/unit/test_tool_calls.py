"""The tools a turn's answer called (``tools_called``, ``tool_names["called"]``), read from the answer.

Each API's reader decides what a call is (chat ``tool_calls[].function.name`` and the legacy
``function_call``, Messages ``tool_use`` blocks, Responses ``function_call`` items); the record holds
the distinct names, first call first. The chat stream is read by the fast path (C and Python scans)
and the reference; a read boundary anywhere, even inside a tool's name, and chunked framing change
nothing, and a run of plain content chunks read by a template never swallows the call after it.
"""

from __future__ import annotations

import hashlib

import orjson
import pytest

from specproxy.measure.build import build_record
from specproxy.measure.turn_recorder import TurnRecorder

TOOLS = {"chat": [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("lookup", "grep", "edit")],
         "messages": [{"name": n, "input_schema": {}} for n in ("lookup", "grep", "edit")],
         "responses": [{"type": "function", "name": n, "parameters": {}} for n in ("lookup", "grep", "edit")]}
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def request(api: str) -> bytes:
    if api == "chat":
        return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS[api]})
    if api == "messages":
        return orjson.dumps({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}],
                             "tools": TOOLS[api]})
    return orjson.dumps({"model": "m", "input": "hi", "tools": TOOLS[api]})


def build(api: str, reads: list[bytes], *, streamed: bool, chunked: bool = False, fast: bool = True,
          store_text: bool = True, body: bytes | None = None):
    b = TurnRecorder(method="POST", path=PATHS[api], body=request(api) if body is None else body, t_wall=1.0,
                      t_request=0.5, store_text=store_text)
    b.on_headers(0.6, 200, "text/event-stream" if streamed else "application/json", chunked=chunked)
    for i, r in enumerate(reads):
        b.on_bytes(r, 1.0 + i, 1.0 + i)
    b.finish(2.0 + len(reads))
    return build_record(b, None, fast=fast)


def called(rec) -> list[str] | None:
    return orjson.loads(rec.tool_names).get("called") if rec.tool_names else None


def sse(events: list[dict], done: bool = True) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + (b"data: [DONE]\n\n" if done else b"")


def chat_chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def call_delta(index: int, args: str, name: str | None = None) -> dict:
    """A tool call's delta as OpenAI and llama-server stream it: the first one names it, the rest don't."""
    call: dict = {"index": index, "function": {"arguments": args}}
    if name is not None:
        call.update(id=f"call_{index}", type="function", function={"name": name, "arguments": args})
    return {"tool_calls": [call]}


# plain content chunks (a template's run), then three calls: lookup, grep, lookup again (one tool, twice)
CHAT_STREAM = sse([chat_chunk({"role": "assistant", "content": ""}),
                   *(chat_chunk({"content": f" w{i}"}) for i in range(12)),
                   chat_chunk(call_delta(0, "", "lookup")), chat_chunk(call_delta(0, '{"q":')),
                   chat_chunk(call_delta(0, '"x"}')),
                   chat_chunk(call_delta(1, '{"p":"y"}', "grep")),
                   chat_chunk(call_delta(2, "", "lookup")), chat_chunk(call_delta(2, "{}")),
                   chat_chunk({}, "tool_calls")])


def frames(reads: list[bytes]) -> list[bytes]:
    """Each read one HTTP/1.1 chunk, the last chunk after them."""
    return [b"%x\r\n%b\r\n" % (len(r), r) for r in reads if r] + [b"0\r\n\r\n"]


def test_a_streamed_chat_answers_calls_wherever_the_reads_are_cut():
    """Cut in two at every byte of the calls (inside each name too) and here and there in the content
    before them, plain and chunked: the distinct tools, in order."""
    ref = build("chat", [CHAT_STREAM], streamed=True, fast=False)
    assert (ref.tools_defined, ref.tools_called, called(ref)) == (3, 2, ["lookup", "grep"])
    assert ref.chunks == 12 + 4  # the chunks with text: content, and the calls' non-empty arguments
    names = [CHAT_STREAM.index(b'"lookup"') + 1, CHAT_STREAM.index(b'"grep"') + 1]
    assert all(CHAT_STREAM[n - 1] == 34 for n in names)
    calls = CHAT_STREAM.index(b"tool_calls") - 60
    for cut in [*range(0, calls, 11), *range(calls, len(CHAT_STREAM) + 1)]:
        reads = [CHAT_STREAM[:cut], CHAT_STREAM[cut:]]
        for chunked in (False, True):
            rec = build("chat", frames(reads) if chunked else reads, streamed=True, chunked=chunked)
            assert (rec.tools_called, rec.tool_names) == (ref.tools_called, ref.tool_names), (cut, chunked)
    # a read per byte of each name
    for at in names:
        reads = [CHAT_STREAM[:at], *(CHAT_STREAM[i : i + 1] for i in range(at, at + 6)), CHAT_STREAM[at + 6 :]]
        assert called(build("chat", reads, streamed=True)) == ["lookup", "grep"]
        assert called(build("chat", frames(reads), streamed=True, chunked=True)) == ["lookup", "grep"]


def test_a_whole_chat_answer_and_the_legacy_function_call():
    body = orjson.dumps({"choices": [
        {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "grep", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "edit", "arguments": "{}"}}]}},
        {"index": 1, "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "grep", "arguments": "{}"}}]}}]})
    rec = build("chat", [body[:7], body[7:]], streamed=False)
    assert rec.tools_called == 2 and called(rec) == ["grep", "edit"]
    legacy = orjson.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": None,
                                                                "function_call": {"name": "edit", "arguments": "{}"}}}]})
    assert called(build("chat", [legacy], streamed=False)) == ["edit"]
    stream = sse([chat_chunk({"function_call": {"name": "edit", "arguments": ""}}),
                  chat_chunk({"function_call": {"arguments": "{}"}}), chat_chunk({}, "function_call")])
    for fast in (True, False):
        assert called(build("chat", [stream], streamed=True, fast=fast)) == ["edit"]


MESSAGES_STREAM = b"".join(
    b"event: %b\ndata: %b\n\n" % (e["type"].encode(), orjson.dumps(e)) for e in [
        {"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant", "content": []}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me see."}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2,
         "content_block": {"type": "tool_use", "id": "t", "name": "grep", "input": {}}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '{"p":1}'}},
        {"type": "content_block_stop", "index": 2},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
        {"type": "message_stop"}])

RESPONSES_STREAM = b"".join(
    b"event: %b\ndata: %b\n\n" % (e["type"].encode(), orjson.dumps(e)) for e in [
        {"type": "response.created", "response": {"id": "r", "status": "in_progress", "output": []}},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {"type": "web_search_call", "id": "ws", "status": "in_progress"}},
        {"type": "response.output_item.added", "output_index": 1,
         "item": {"type": "function_call", "id": "fc", "call_id": "c", "name": "edit", "arguments": ""}},
        {"type": "response.function_call_arguments.delta", "output_index": 1, "item_id": "fc", "delta": "{}"},
        {"type": "response.output_item.done", "output_index": 1,
         "item": {"type": "function_call", "id": "fc", "call_id": "c", "name": "edit", "arguments": "{}"}},
        {"type": "response.output_item.added", "output_index": 2,
         "item": {"type": "function_call", "id": "fc2", "call_id": "c2", "name": "lookup", "arguments": ""}},
        {"type": "response.function_call_arguments.delta", "output_index": 2, "item_id": "fc2", "delta": "{}"},
        {"type": "response.completed", "response": {"id": "r", "status": "completed", "output": []}}])


@pytest.mark.parametrize(("api", "stream", "expect"), [("messages", MESSAGES_STREAM, ["grep"]),
                                                         ("responses", RESPONSES_STREAM, ["edit", "lookup"])])
def test_agent_api_streams(api, stream, expect):
    """Only the client's tools are calls: a Messages ``server_tool_use`` and a Responses built-in tool's
    item are not; a Responses call named again in its ``output_item.done`` is one tool."""
    for cut in range(0, len(stream) + 1, 7):
        rec = build(api, [stream[:cut], stream[cut:]], streamed=True)
        assert (rec.tools_defined, rec.tools_called, called(rec)) == (3, len(expect), expect), cut


def test_agent_api_whole_answers():
    messages = orjson.dumps({"type": "message", "role": "assistant", "stop_reason": "tool_use", "content": [
        {"type": "text", "text": "Sure."}, {"type": "tool_use", "id": "a", "name": "lookup", "input": {"q": 1}},
        {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}},
        {"type": "tool_use", "id": "b", "name": "edit"}]})  # no input: still a call
    rec = build("messages", [messages], streamed=False)
    assert (rec.tools_called, called(rec)) == (2, ["lookup", "edit"])
    responses = orjson.dumps({"id": "r", "status": "completed", "output": [
        {"type": "reasoning", "id": "rs", "summary": []},
        {"type": "function_call", "id": "f", "call_id": "c", "name": "grep", "arguments": "{}"},
        {"type": "web_search_call", "id": "w", "status": "completed"}]})
    rec = build("responses", [responses], streamed=False)
    assert (rec.tools_called, called(rec)) == (1, ["grep"])


def test_no_call_is_zero_and_an_unread_answer_is_unknown():
    """An answer with no call: 0 (and ``called`` empty). No response, or a body that could not be read:
    null, with the tools defined still there. A request not read: ``defined`` is left out, not empty."""
    text = build("chat", [sse([chat_chunk({"content": "hi"})])], streamed=True)
    assert (text.tools_defined, text.tools_called, called(text)) == (3, 0, [])
    cut = build("chat", [b'{"choices": [{"message": {"tool_calls": [{"function": {"name": "gr'], streamed=False)
    assert cut.tools_called is None and orjson.loads(cut.tool_names) == {"defined": ["lookup", "grep", "edit"]}
    b = TurnRecorder(method="POST", path=PATHS["chat"], body=request("chat"), t_wall=1.0, t_request=0.5)
    b.fail(1.0, "upstream_unreachable", 502, "connection refused")
    failed = build_record(b, None)
    assert (failed.tools_defined, failed.tools_called) == (3, None)
    unread = build("chat", [CHAT_STREAM], streamed=True, body=b"{not json")
    assert (unread.tools_defined, unread.tools_called) == (None, 2)
    assert orjson.loads(unread.tool_names) == {"called": ["lookup", "grep"]}
    none = build("chat", [sse([chat_chunk({"content": "hi"})])], streamed=True,
                 body=orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    assert (none.tools_defined, none.tools_called, none.tool_names) == (0, 0, None)


def test_without_stored_text_the_names_are_digests():
    rec = build("chat", [CHAT_STREAM], streamed=True, store_text=False)
    digest = {n: hashlib.blake2b(n.encode(), digest_size=6).hexdigest() for n in ("lookup", "grep", "edit")}
    assert orjson.loads(rec.tool_names) == {"defined": list(digest.values()),
                                            "called": [digest["lookup"], digest["grep"]]}
