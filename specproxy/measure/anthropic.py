"""The Anthropic Messages API (``POST /v1/messages``, what Claude Code speaks), read for measuring.

Why a module of its own: a Messages turn carries the same things a chat turn does (a system prompt,
tools, a conversation, output text, thinking and tool input) in other shapes, and the rest of
specproxy should measure it exactly as it measures chat. So the request is translated into the chat
body an OpenAI-compatible server renders through its chat template (``to_chat``), and then split and
counted by the chat code unchanged; the response's events are read into the chat ``Delta`` shape
(``StreamReader``, ``read_full_response``). Nothing here does I/O.

The translation is the one llama-server applies before rendering (its ``/v1/messages`` and
``/v1/messages/count_tokens`` render the translated body through the same template as chat), so
``prompt_tokens`` is the server's count of the same body:

* ``system`` (a string, or text blocks joined with no separator) becomes one system message.
* A message with string content is passed as it is. A content array becomes: the text blocks as the
  message's content parts, ``thinking`` blocks as its ``reasoning_content``, ``tool_use`` blocks as
  ``tool_calls`` (the input as JSON arguments), and each ``tool_result`` block a ``tool`` message after
  it (text results joined with no separator). A message left with neither text nor calls is dropped.
* Tools become ``{"type": "function", "function": {name, description, parameters}}`` with the
  ``input_schema`` as the parameters.
* Claude Code's system prompt starts with an ``x-anthropic-billing-header`` whose ``cch=`` stamp changes
  every request (which defeats any server's prefix cache); llama-server replaces the stamp's five
  characters with ``fffff`` before rendering, and so does this translation.

Output: ``text_delta`` is content, ``thinking_delta`` reasoning, ``input_json_delta`` tool input;
``message_start``, ``content_block_start``/``stop``, ``signature_delta`` and ``ping`` carry no output.
A tool call is a ``tool_use`` block (its name in the ``content_block_start`` that opens it, streamed);
the server's own tools (``server_tool_use``) are not the client's tools and are not calls here.
Usage comes in ``message_start`` (input and cache counts) and ``message_delta`` (output, cumulative);
the server's prompt is ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens``.
"""

from __future__ import annotations

from typing import Any

import orjson

from specproxy.measure.openai import Delta, function_tool

__all__ = ["PATHS", "StreamReader", "chat_usage", "read_full_response", "to_chat"]

PATHS = frozenset({"/v1/messages"})  # the SDKs and Claude Code add /v1 to any base URL

_BILLING = "x-anthropic-billing-header:"
_STAMP = 5  # characters of the cch= stamp


def _unstamped(text: str) -> str:
    """The system text with Claude Code's per-request ``cch=`` stamp made constant, as llama-server does."""
    if not text.startswith(_BILLING):
        return text
    at = text.find("cch=", len(_BILLING))
    if at < 0:
        return text
    start = at + 4
    if start + _STAMP < len(text) and text[start + _STAMP] == ";":
        return text[:start] + "f" * _STAMP + text[start + _STAMP :]
    return text


def _system_text(system: Any) -> str | None:
    if isinstance(system, str):
        return _unstamped(system)
    if isinstance(system, list):
        return "".join(_unstamped(b["text"]) for b in system
                       if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str))
    return None


def _tool_result(block: dict) -> dict:
    content = block.get("content")
    call_id = block.get("tool_use_id")
    call_id = call_id if isinstance(call_id, str) else ""
    if isinstance(content, list):
        texts = [c.get("text") for c in content if isinstance(c, dict) and c.get("type") == "text"]
        content = "".join(t for t in texts if isinstance(t, str))
    elif not isinstance(content, str):
        content = ""
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _messages(message: dict) -> list[dict]:
    """One Messages message as the chat messages it becomes."""
    content = message.get("content")
    role = message.get("role")
    if "content" not in message:
        return [] if role == "assistant" else [message]
    if not isinstance(content, list):
        return [message]
    parts: list[Any] = []
    calls: list[dict] = []
    reasoning = ""
    results: list[dict] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append(block)
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning += block["thinking"]
        elif kind == "tool_use":
            args = block.get("input")
            calls.append({"id": block.get("id") if isinstance(block.get("id"), str) else "", "type": "function",
                          "function": {"name": block.get("name") if isinstance(block.get("name"), str) else "",
                                       "arguments": orjson.dumps(args if args is not None else {}).decode()}})
        elif kind == "tool_result":
            results.append(_tool_result(block))
    out: list[dict] = []
    if parts or calls or reasoning:
        msg: dict[str, Any] = {"role": role, "content": parts or ""}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    out.extend(results)
    return out



def to_chat(body: Any) -> dict:
    """The chat-completions body a Messages request is rendered as; ``ValueError`` when it is not one."""
    if not isinstance(body, dict):
        raise ValueError("request body is not a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages is not a list of objects")
    out: list[dict] = []
    system = _system_text(body.get("system"))
    if system is not None:
        out.append({"role": "system", "content": system})
    for message in messages:
        out.extend(_messages(message))
    chat: dict[str, Any] = {"messages": out}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [function_tool(t, "input_schema") for t in tools]
    return chat


def chat_usage(usage: dict) -> dict:
    """Messages usage in the chat shape the record reads: the prompt is every input token, cached or not."""
    def n(key: str) -> int:
        value = usage.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    out: dict[str, Any] = {}
    if any(k in usage for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")):
        out["prompt_tokens"] = n("input_tokens") + n("cache_read_input_tokens") + n("cache_creation_input_tokens")
    if "output_tokens" in usage:
        out["completion_tokens"] = usage["output_tokens"]
    details: dict[str, Any] = {}
    if "cache_read_input_tokens" in usage:  # reads and writes apart: a write is no reuse (and priced apart)
        details["cached_tokens"] = usage["cache_read_input_tokens"]
    if "cache_creation_input_tokens" in usage:
        details["cache_write_tokens"] = usage["cache_creation_input_tokens"]
    if details:
        out["prompt_tokens_details"] = details
    return out


_DELTA_KINDS = {"text_delta": ("content", "text"), "thinking_delta": ("reasoning", "thinking"),
                "input_json_delta": ("tool_args", "partial_json")}
_BLOCK_KINDS = {"text": ("content", "text"), "thinking": ("reasoning", "thinking")}


class StreamReader:
    """Reads one turn's stream events in order (``read``: the JSON of one event -> ``Delta``). It keeps
    the usage seen so far, since ``message_start`` and ``message_delta`` each carry part of it."""

    __slots__ = ("_usage",)

    def __init__(self) -> None:
        self._usage: dict = {}

    def read(self, obj: Any) -> Delta:
        delta = Delta()
        if not isinstance(obj, dict):
            return delta
        kind = obj.get("type")
        if kind == "content_block_delta":
            d = obj.get("delta")
            if isinstance(d, dict):
                what = _DELTA_KINDS.get(d.get("type"))
                if what is not None:
                    delta.add(0, what[0], d.get(what[1]))
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if isinstance(block, dict):  # a start block's text is usually empty; a tool's input is {}
                what = _BLOCK_KINDS.get(block.get("type"))
                if what is not None:
                    delta.add(0, what[0], block.get(what[1]))
                elif block.get("type") == "tool_use":  # the call's name; its input follows in deltas
                    delta.call(block.get("name"))
        elif kind == "message_start":
            message = obj.get("message")
            if isinstance(message, dict):
                self._take_usage(delta, message.get("usage"))
        elif kind == "message_delta":
            d = obj.get("delta")
            if isinstance(d, dict) and d.get("stop_reason"):
                delta.finish_reason = str(d["stop_reason"])
            self._take_usage(delta, obj.get("usage"))
        elif kind == "message_stop":
            delta.done = True
        elif kind == "error":
            delta.error = _error_type(obj)
        return delta

    def _take_usage(self, delta: Delta, usage: Any) -> None:
        if isinstance(usage, dict):
            self._usage.update(usage)
            delta.usage = chat_usage(self._usage)


def _error_type(obj: dict) -> str:
    """The error's type only: its message may quote the request."""
    err = obj.get("error")
    kind = err.get("type") if isinstance(err, dict) else None
    return f"error event in the stream: {kind if isinstance(kind, str) else 'unknown'}"[:200]


def read_full_response(obj: Any) -> Delta:
    """Read a non-streamed Messages response (a tool's input counts as its JSON)."""
    delta = Delta()
    if not isinstance(obj, dict):
        return delta
    if obj.get("type") == "error":
        delta.error = _error_type(obj)
        return delta
    content = obj.get("content")
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        what = _BLOCK_KINDS.get(kind)
        if what is not None:
            delta.add(0, what[0], block.get(what[1]))
        elif kind == "tool_use":
            delta.call(block.get("name"))
            if block.get("input") is not None:
                delta.add(0, "tool_args", orjson.dumps(block["input"]).decode())
    if obj.get("stop_reason"):
        delta.finish_reason = str(obj["stop_reason"])
    if isinstance(obj.get("usage"), dict):
        delta.usage = chat_usage(obj["usage"])
    return delta
