"""The fake upstream's event shapes for the Anthropic Messages API and the OpenAI Responses API.

Why apart from ``fake_upstream.py``: the fake's script (what to send, when, split how) is the same for
every API; only the events that carry it differ. Each shape here turns the script's chunks into the
events a real server sends, in the order it sends them, with what carries no output (a message or
response start, block starts and stops, ``*.done`` events that repeat the text, pings) around them,
so that tests can prove such events are neither counted nor taken for the first token.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["MessagesShape", "ResponsesShape", "shape_for", "sse"]


def sse(obj: dict, nl: bytes = b"\n") -> bytes:
    """One event as both APIs send them: an ``event:`` line naming its type, then its JSON."""
    return b"event: " + obj["type"].encode() + nl + b"data: " + orjson.dumps(obj) + nl + nl


class MessagesShape:
    """Anthropic Messages: message_start, a content block per kind (thinking, text, tool_use), message_delta
    with the output count and the stop reason, message_stop."""

    name = "messages"
    _BLOCKS = {"reasoning": ({"type": "thinking", "thinking": ""}, "thinking_delta", "thinking"),
               "content": ({"type": "text", "text": ""}, "text_delta", "text"),
               "tool_args": ({"type": "tool_use", "id": "toolu_0", "name": "lookup", "input": {}},
                             "input_json_delta", "partial_json")}

    def __init__(self, model: str, tool_name: str = "lookup") -> None:
        self.model = model
        self.tool_name = tool_name  # the tool a tool_args block calls
        self.kind: str | None = None
        self.index = -1

    def start(self, prompt_tokens: int | None) -> list[dict]:
        """``prompt_tokens`` None: a server that reports no usage."""
        message = {"id": "msg_fake", "type": "message", "role": "assistant", "content": [], "model": self.model,
                   "stop_reason": None}
        if prompt_tokens is not None:  # half of it read from the cache, as after an earlier turn, and a
            # quarter written to it (the Messages API counts reads, writes and the rest apart)
            message["usage"] = {"input_tokens": prompt_tokens - prompt_tokens // 2 - prompt_tokens // 4,
                                "cache_read_input_tokens": prompt_tokens // 2,
                                "cache_creation_input_tokens": prompt_tokens // 4, "output_tokens": 1}
        return [{"type": "message_start", "message": message}]

    def text(self, kind: str, text: str) -> tuple[list[dict], dict]:
        """(events before this text's event, the event carrying the text)."""
        before = []
        block, delta_type, key = self._BLOCKS[kind]
        if kind != self.kind:
            if self.kind is not None:
                before.append({"type": "content_block_stop", "index": self.index})
            self.kind, self.index = kind, self.index + 1
            if kind == "tool_args":
                block = {**block, "name": self.tool_name}
            before.append({"type": "content_block_start", "index": self.index, "content_block": block})
        return before, {"type": "content_block_delta", "index": self.index, "delta": {"type": delta_type, key: text}}

    def ping(self) -> dict:
        return {"type": "ping"}

    def error(self) -> dict:
        return {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}

    def end(self, completion: int | None, texts: dict[str, str], prompt_tokens: int) -> list[dict]:
        out = [{"type": "content_block_stop", "index": self.index}] if self.kind is not None else []
        delta: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}}
        if completion is not None:
            delta["usage"] = {"output_tokens": completion}
        return [*out, delta, {"type": "message_stop"}]

    def whole(self, texts: dict[str, str], prompt_tokens: int, completion: int | None) -> dict:
        content: list[dict] = []
        if texts["reasoning"]:
            content.append({"type": "thinking", "thinking": texts["reasoning"], "signature": ""})
        if texts["content"]:
            content.append({"type": "text", "text": texts["content"]})
        if texts["tool_args"]:
            content.append({"type": "tool_use", "id": "toolu_0", "name": self.tool_name,
                            "input": orjson.loads(texts["tool_args"])})
        obj: dict[str, Any] = {"id": "msg_fake", "type": "message", "role": "assistant", "model": self.model,
                               "content": content, "stop_reason": "end_turn", "stop_sequence": None}
        if completion is not None:
            obj["usage"] = {"input_tokens": prompt_tokens, "output_tokens": completion}
        return obj


class ResponsesShape:
    """OpenAI Responses: response.created and in_progress, an output item per kind (reasoning, message,
    function call) opened with ``output_item.added``, deltas, the ``*.done`` events repeating the text,
    response.completed with usage."""

    name = "responses"
    _DELTAS = {"reasoning": "response.reasoning_text.delta", "content": "response.output_text.delta",
               "tool_args": "response.function_call_arguments.delta"}
    _ITEMS = {"reasoning": {"type": "reasoning", "id": "rs_0", "summary": []},
              "content": {"type": "message", "id": "msg_0", "role": "assistant", "content": []},
              "tool_args": {"type": "function_call", "id": "fc_0", "call_id": "call_0", "name": "lookup", "arguments": ""}}

    def __init__(self, model: str, tool_name: str = "lookup") -> None:
        self.model = model
        self.tool_name = tool_name  # the tool a function_call item calls
        self.kind: str | None = None
        self.index = -1

    def _response(self, status: str, usage: dict | None) -> dict:
        return {"id": "resp_fake", "object": "response", "status": status, "model": self.model, "output": [],
                "usage": usage}

    def start(self, prompt_tokens: int | None) -> list[dict]:
        return [{"type": "response.created", "response": self._response("in_progress", None)},
                {"type": "response.in_progress", "response": self._response("in_progress", None)}]

    def text(self, kind: str, text: str) -> tuple[list[dict], dict]:
        before = []
        if kind != self.kind:
            self.kind, self.index = kind, self.index + 1
            item = self._ITEMS[kind]
            if kind == "tool_args":
                item = {**item, "name": self.tool_name}
            before.append({"type": "response.output_item.added", "output_index": self.index, "item": item})
        return before, {"type": self._DELTAS[kind], "output_index": self.index, "item_id": "x", "delta": text}

    def ping(self) -> dict:
        return {"type": "response.in_progress", "response": self._response("in_progress", None)}

    def error(self) -> dict:
        return {"type": "error", "code": "server_error", "message": "The server had an error."}

    def end(self, completion: int | None, texts: dict[str, str], prompt_tokens: int) -> list[dict]:
        done = [{"type": "response.output_text.done", "output_index": 0, "item_id": "x", "text": texts["content"]},
                {"type": "response.function_call_arguments.done", "output_index": 0, "item_id": "x",
                 "arguments": texts["tool_args"]}]
        usage = None if completion is None else {
            "input_tokens": prompt_tokens, "output_tokens": completion, "total_tokens": prompt_tokens + completion,
            "input_tokens_details": {"cached_tokens": prompt_tokens // 2}}
        return [*done, {"type": "response.completed", "response": self._response("completed", usage)}]

    def whole(self, texts: dict[str, str], prompt_tokens: int, completion: int | None) -> dict:
        output: list[dict] = []
        if texts["reasoning"]:
            output.append({"type": "reasoning", "id": "rs_0", "summary": [],
                           "content": [{"type": "reasoning_text", "text": texts["reasoning"]}]})
        if texts["content"]:
            output.append({"type": "message", "id": "msg_0", "role": "assistant", "status": "completed",
                           "content": [{"type": "output_text", "text": texts["content"], "annotations": []}]})
        if texts["tool_args"]:
            output.append({"type": "function_call", "id": "fc_0", "call_id": "call_0", "name": self.tool_name,
                           "arguments": texts["tool_args"], "status": "completed"})
        usage = None if completion is None else {"input_tokens": prompt_tokens, "output_tokens": completion,
                                                 "total_tokens": prompt_tokens + completion}
        return {**self._response("completed", usage), "output": output}


def shape_for(path: str, model: str, tool_name: str = "lookup") -> MessagesShape | ResponsesShape | None:
    """The event shape of the API at ``path``; None for chat and completions (the fake's own).
    ``tool_name``: the tool the answer's call (when the script has one) calls."""
    if path == "/v1/messages":
        return MessagesShape(model, tool_name)
    if path in ("/v1/responses", "/responses"):
        return ResponsesShape(model, tool_name)
    return None
