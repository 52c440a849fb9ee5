"""The OpenAI Responses API (``POST /v1/responses``, what Codex CLI speaks), read for measuring.

Why a module of its own: as for the Messages API (``anthropic.py``), a Responses turn is measured as
the chat turn a server renders it as: the request is translated into a chat-completions body
(``to_chat``) and split and counted by the chat code unchanged; the response's events are read into the
chat ``Delta`` shape (``StreamReader``, ``read_full_response``). Nothing here does I/O.

The translation is the one llama-server applies before rendering through the chat template (and
before counting with ``/v1/responses/input_tokens``), so ``prompt_tokens`` is the server's count:

* ``instructions`` becomes a system message, a string ``input`` one user message.
* ``input`` items: a message (``user``, ``system``, ``developer``) keeps its role, its ``input_text``
  parts become text parts (a string content is one part); an assistant ``message`` item's
  ``output_text`` parts likewise; a ``function_call`` becomes a tool call, a ``function_call_output``
  a ``tool`` message, a ``reasoning`` item the ``reasoning_content`` of an assistant message. Assistant
  items that follow one another (reasoning, then a message, then calls) merge into one assistant
  message. Items of kinds the server does not render (built-in tools' calls) are left out.
* Function tools become ``{"type": "function", "function": {name, description, parameters}}`` (a
  missing description is ``""``, a missing schema ``{}``: the shape llama-server renders every tool in);
  built-in tools (web search...) have no chat form and are left out, as the server leaves them out.

Output: ``response.output_text.delta`` (and ``refusal.delta``) is content, ``reasoning_text.delta`` and
``reasoning_summary_text.delta`` reasoning, ``function_call_arguments.delta`` tool arguments; the
``*.done`` events repeat what the deltas carried and are not counted again. Usage comes once, in the
terminal event (``response.completed``, ``response.failed`` or ``response.incomplete``). A tool call is
a ``function_call`` output item, named in the ``response.output_item.added`` that opens it (and again in
its ``.done``; the same name twice is one tool); built-in tools' calls are not the client's tools.
"""

from __future__ import annotations

from typing import Any

from specproxy.measure.openai import Delta, function_tool

__all__ = ["PATHS", "StreamReader", "chat_usage", "read_full_response", "to_chat"]

PATHS = frozenset({"/v1/responses", "/responses"})

_INPUT_ROLES = frozenset({"user", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text"})


def _text_parts(content: Any) -> list[dict]:
    if isinstance(content, str):
        return [{"text": content, "type": "text"}]
    out: list[dict] = []
    for part in content if isinstance(content, list) else ():
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append({"text": part["text"], "type": "text"})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append({"refusal": part["refusal"], "type": "refusal"})
        elif kind == "input_image" and "image_url" in part:
            out.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
    return out


def _strings(item: dict, *keys: str) -> bool:
    return all(isinstance(item.get(k), str) for k in keys)


def _assistant(messages: list[dict]) -> dict | None:
    """The assistant message an assistant item merges into: the last message, when it is one."""
    return messages[-1] if messages and messages[-1].get("role") == "assistant" else None


def _add_item(messages: list[dict], item: dict) -> None:
    kind = item.get("type")
    role = item.get("role")
    if role in _INPUT_ROLES and "content" in item and kind in (None, "message"):
        rest = {k: v for k, v in item.items() if k not in ("type", "status")}
        messages.append({**rest, "content": _text_parts(item["content"])})
    elif role == "assistant" and kind in (None, "message"):
        parts = _text_parts(item.get("content"))
        prev = _assistant(messages)
        if prev is not None:
            if not isinstance(prev.get("content"), list):
                prev["content"] = []
            prev["content"] = [*prev["content"], *parts]
        else:
            rest = {k: v for k, v in item.items() if k not in ("type", "status")}
            messages.append({**rest, "content": parts})
    elif kind == "function_call" and _strings(item, "arguments", "call_id", "name"):
        call = {"function": {"arguments": item["arguments"], "name": item["name"]}, "id": item["call_id"],
                "type": "function"}
        prev = _assistant(messages)
        if prev is not None:
            prev["tool_calls"] = [*(prev.get("tool_calls") or []), call]
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output" and _strings(item, "call_id"):
        output = item.get("output")
        if isinstance(output, list):
            output = _text_parts(output)
        if isinstance(output, (str, list)):
            messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
    elif kind == "reasoning":
        content = item.get("content")
        if isinstance(content, list) and content and isinstance(content[0], dict) and _strings(content[0], "text"):
            text = content[0]["text"]
            prev = _assistant(messages)
            if prev is not None:
                prev["reasoning_content"] = text
            else:
                messages.append({"role": "assistant", "content": [], "reasoning_content": text})



def to_chat(body: Any) -> dict:
    """The chat-completions body a Responses request is rendered as; ``ValueError`` when it is not one."""
    if not isinstance(body, dict):
        raise ValueError("request body is not a JSON object")
    value = body.get("input")
    messages: list[dict] = []
    if "instructions" in body:
        instructions = body["instructions"]
        messages.append({"role": "system", "content": instructions if isinstance(instructions, str) else ""})
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                _add_item(messages, item)
    else:
        raise ValueError("input is neither a string nor a list of items")
    chat: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list):
        functions = [function_tool(t, "parameters") for t in tools if isinstance(t, dict) and t.get("type") == "function"]
        if functions:
            chat["tools"] = functions
    return chat


def chat_usage(usage: dict) -> dict:
    """Responses usage in the chat shape the record reads."""
    out: dict[str, Any] = {}
    if "input_tokens" in usage:
        out["prompt_tokens"] = usage["input_tokens"]
    if "output_tokens" in usage:
        out["completion_tokens"] = usage["output_tokens"]
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):
        kept = {k: details[k] for k in ("cached_tokens", "cache_write_tokens") if k in details}
        if kept:
            out["prompt_tokens_details"] = kept
    return out


_DELTAS = {
    "response.output_text.delta": "content",
    "response.refusal.delta": "content",
    "response.reasoning_text.delta": "reasoning",
    "response.reasoning_summary_text.delta": "reasoning",
    "response.function_call_arguments.delta": "tool_args",
}
_TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete"})
_ITEM_EVENTS = frozenset({"response.output_item.added", "response.output_item.done"})


def _take_response(delta: Delta, response: Any) -> None:
    """The accounting of a whole response object (non-streamed, or a terminal event's)."""
    if not isinstance(response, dict):
        return
    if isinstance(response.get("usage"), dict):
        delta.usage = chat_usage(response["usage"])
    details = response.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    status = response.get("status")
    if reason or status:
        delta.finish_reason = str(reason or status)
    error = response.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        delta.error = f"response failed: {code if isinstance(code, str) else 'unknown'}"[:200]


class StreamReader:
    """Reads one turn's stream events (``read``: the JSON of one event -> ``Delta``)."""

    __slots__ = ()

    def read(self, obj: Any) -> Delta:
        delta = Delta()
        if not isinstance(obj, dict):
            return delta
        kind = obj.get("type")
        what = _DELTAS.get(kind)
        if what is not None:
            delta.add(0, what, obj.get("delta"))
        elif kind in _ITEM_EVENTS:
            item = obj.get("item")
            if isinstance(item, dict) and item.get("type") == "function_call":
                delta.call(item.get("name"))
        elif kind in _TERMINAL:
            _take_response(delta, obj.get("response"))
            delta.done = True
        elif kind == "error":
            code = obj.get("code")
            delta.error = f"error event in the stream: {code if isinstance(code, str) else 'unknown'}"[:200]
        if isinstance(obj.get("timings"), dict):  # llama.cpp's, on the terminal event
            delta.timings = obj["timings"]
        return delta


def read_full_response(obj: Any) -> Delta:
    """Read a non-streamed Responses response: its output items' text, reasoning and call arguments."""
    delta = Delta()
    if not isinstance(obj, dict):
        return delta
    output = obj.get("output")
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict):
                    delta.add(0, "content", part.get("text") if part.get("type") == "output_text" else part.get("refusal"))
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or ()  # the text, else its summary
            for part in parts if isinstance(parts, list) else ():
                if isinstance(part, dict):
                    delta.add(0, "reasoning", part.get("text"))
        elif kind == "function_call":
            delta.add(0, "tool_args", item.get("arguments"))
            delta.call(item.get("name"))
    _take_response(delta, obj)
    if isinstance(obj.get("timings"), dict):
        delta.timings = obj["timings"]
    return delta
