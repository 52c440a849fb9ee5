"""Pure functions over the OpenAI-compatible API's JSON.

Why a module of its own: every inference server speaks a slightly different dialect of the same API
(``reasoning_content`` in vLLM and llama.cpp, ``reasoning`` elsewhere, ``usage`` on every chunk or only
the last, ``timings`` from llama.cpp), and the rest of specproxy should not care. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = [
    "TEXT_KINDS",
    "Delta",
    "completion_prompt",
    "function_tool",
    "PromptParts",
    "parse_json",
    "read_chunk",
    "read_full_response",
    "split_prompt",
]

# The kinds of delivered output text. Each is counted, and each is also stored apart.
TEXT_KINDS = ("content", "reasoning", "tool_args")


def parse_json(data: bytes | str) -> Any:
    """Parse JSON strictly; raises ``orjson.JSONDecodeError`` (a ``ValueError``) on anything odd.

    orjson refuses NaN, invalid UTF-8, lone surrogates and nesting past 1024 levels, which is what we
    want: such a body is forwarded untouched and the record is marked unparsable.
    """
    return orjson.loads(data)


@dataclass(slots=True)
class Delta:
    """What one stream event (or one whole non-streamed response) carried.

    ``texts`` maps ``(choice_index, kind)`` to the text of that kind; ``usage`` (in the chat shape:
    ``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``) and ``timings`` are
    the server's own accounting when present. ``done``: the event that says the response is complete
    (the other APIs' counterpart of ``[DONE]``); ``error``: an error event's type (never its message).
    """

    texts: dict[tuple[int, str], str] = field(default_factory=dict)
    usage: dict | None = None
    timings: dict | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    calls: list[str] | None = None

    def add(self, choice: int, kind: str, text: Any) -> None:
        if isinstance(text, str) and text:
            key = (choice, kind)
            self.texts[key] = self.texts.get(key, "") + text

    def call(self, name: Any) -> None:
        """The model called the tool ``name`` (ignored unless a non-empty string: a streamed call's later
        deltas carry no name, or a null one)."""
        if isinstance(name, str) and name:
            if self.calls is None:
                self.calls = [name]
            else:
                self.calls.append(name)


def _read_message(delta: Delta, idx: int, msg: dict) -> None:
    """A message (non-streamed) or a delta (streamed). A tool call's name is in its message, or in the
    first delta of the call (later deltas of the same ``index`` carry only arguments)."""
    # (each read only when there: ``add`` takes nothing but a non-empty string, and a chunk's delta
    # usually holds one text, so that skipping the calls is most of the cost of reading a chunk)
    text = msg.get("content")
    if text:
        delta.add(idx, "content", text)
    # vLLM / llama.cpp / DeepSeek say reasoning_content; OpenRouter and newer vLLM say reasoning
    text = msg.get("reasoning_content")
    if text:
        delta.add(idx, "reasoning", text)
    text = msg.get("reasoning")
    if text:
        delta.add(idx, "reasoning", text)
    calls = msg.get("tool_calls")
    if calls and isinstance(calls, list):
        for call in calls:
            if isinstance(call, dict):
                fn = call.get("function")
                if isinstance(fn, dict):
                    delta.add(idx, "tool_args", fn.get("arguments"))
                    delta.call(fn.get("name"))
    fn = msg.get("function_call")  # the legacy single-function form
    if fn and isinstance(fn, dict):
        delta.add(idx, "tool_args", fn.get("arguments"))
        delta.call(fn.get("name"))


def _read_choices(obj: dict, delta: Delta, key: str) -> None:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return
    for pos, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        idx = choice.get("index", pos)
        idx = idx if isinstance(idx, int) else pos
        msg = choice.get(key)
        if isinstance(msg, dict):
            _read_message(delta, idx, msg)
        text = choice.get("text")  # /v1/completions
        if text:
            delta.add(idx, "content", text)
        if choice.get("finish_reason"):
            delta.finish_reason = str(choice["finish_reason"])


def _read_accounting(obj: dict, delta: Delta) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        delta.usage = usage
    timings = obj.get("timings")  # llama.cpp's own per-request accounting
    if isinstance(timings, dict):
        delta.timings = timings


def function_tool(tool: Any, schema_key: str) -> dict:
    """Another API's tool definition as a chat ``function`` tool, the shape the server renders: its
    name, description and the JSON schema under ``schema_key`` (Messages ``input_schema``, Responses
    ``parameters``)."""
    tool = tool if isinstance(tool, dict) else {}
    name, description = tool.get("name"), tool.get("description")
    return {"type": "function", "function": {
        "name": name if isinstance(name, str) else "",
        "description": description if isinstance(description, str) else "",
        "parameters": tool[schema_key] if schema_key in tool else {},
    }}


def _another_tasks(obj: dict) -> bool:
    """The chunk closes a choice other than 0 only: in llama-server's stream of several completions
    prompts each prompt's task ends with its own usage and timings, and the turn is the first's (as the
    server's non-streamed usage is; ``completion_prompt``)."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(isinstance(c, dict) and isinstance(c.get("index"), int) and c["index"] != 0 for c in choices)


def read_chunk(obj: Any) -> Delta:
    """Read one streamed chunk (the JSON of one ``data:`` event)."""
    delta = Delta()
    if isinstance(obj, dict):
        _read_choices(obj, delta, "delta")
        # (most chunks have neither: whose task they close is looked at only when there is something to take)
        if ("usage" in obj or "timings" in obj) and not _another_tasks(obj):
            _read_accounting(obj, delta)
    return delta


def read_full_response(obj: Any) -> Delta:
    """Read a non-streamed response body."""
    delta = Delta()
    if isinstance(obj, dict):
        _read_choices(obj, delta, "message")
        _read_accounting(obj, delta)
    return delta


@dataclass(frozen=True, slots=True)
class PromptParts:
    """A chat request split into what the client injects and what the user said.

    ``system``: system/developer messages. ``tools``: the tool (or legacy function) definitions.
    ``history``: the conversation before this turn. ``new``: this turn's input: the trailing messages
    after the last assistant message (the newest user message; in an agent loop, the tool results).
    ``template_kwargs``: a chat request's ``chat_template_kwargs``, which servers give its template.
    ``prompt``: for /v1/completions, the text of the raw prompt (all of it counts as new);
    ``prompt_ids``: how many token ids the prompt gives as numbers; ``prompt_bos``: whether the server adds
    its beginning-of-text token (a prompt that opens with text); ``prompts``: how many prompts the
    request holds (``completion_prompt``).
    """

    system: tuple[dict, ...] = ()
    tools: tuple[Any, ...] = ()
    history: tuple[dict, ...] = ()
    new: tuple[dict, ...] = ()
    prompt: str | None = None
    template_kwargs: dict | None = None
    prompt_ids: int = 0
    prompt_bos: bool = True
    prompts: int = 1

    @property
    def conversation(self) -> list[dict]:
        return [*self.history, *self.new]


# apply_chat_template's own arguments: a chat_template_kwargs key of these names is not the template's
_RENDER_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                          "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                          "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _is_id(p: Any) -> bool:
    return isinstance(p, int) and not isinstance(p, bool)


def completion_prompt(prompt: Any) -> PromptParts:
    """A /v1/completions ``prompt`` as llama-server tokenizes it (``tokenize_input_prompts``): a string,
    or a list of strings and token ids that holds an id, is one prompt; any other list is several
    prompts (strings, or lists of strings and ids), each its own task. A prompt that opens with text
    gets the model's beginning-of-text token. With several, the turn is the first prompt and its
    answer (choice 0): what llama-server's ``usage`` counts (docs/metrics.md)."""
    prompts = 1
    if isinstance(prompt, list) and not any(_is_id(p) for p in prompt):
        prompts = len(prompt)
        prompt = prompt[0] if prompt else None
    pieces = prompt if isinstance(prompt, list) else [prompt]
    if not pieces or not all(isinstance(p, str) or _is_id(p) for p in pieces):
        raise ValueError("request has neither messages nor a prompt of text or token ids")
    return PromptParts(prompt="".join(p for p in pieces if isinstance(p, str)),
                       prompt_ids=sum(map(_is_id, pieces)), prompt_bos=isinstance(pieces[0], str), prompts=prompts)


def split_prompt(body: Any) -> PromptParts:
    """Split a chat or completions request body; raise ``ValueError`` when it is neither."""
    if not isinstance(body, dict):
        raise ValueError("request body is not a JSON object")
    if "messages" not in body:
        return completion_prompt(body.get("prompt"))
    messages = body["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages is not a list of objects")
    tools: list[Any] = []
    for key in ("tools", "functions"):
        value = body.get(key)
        if isinstance(value, list):
            tools.extend(value)
    system = [m for m in messages if m.get("role") in ("system", "developer")]
    rest = [m for m in messages if m.get("role") not in ("system", "developer")]
    last_assistant = max((i for i, m in enumerate(rest) if m.get("role") == "assistant"), default=-1)
    kwargs = body.get("chat_template_kwargs")
    kwargs = {k: v for k, v in kwargs.items() if k not in _RENDER_ARGS} if isinstance(kwargs, dict) else None
    return PromptParts(
        system=tuple(system),
        tools=tuple(tools),
        history=tuple(rest[: last_assistant + 1]),
        new=tuple(rest[last_assistant + 1 :]),
        template_kwargs=kwargs or None,
    )


def message_text(message: dict) -> str:
    """The text a message carries, for tokenizers without a chat template.

    Content parts (``[{"type": "text", "text": ...}]``) are joined; tool calls count as their JSON.
    """
    content = message.get("content")
    parts: list[str] = []
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
    for key in ("reasoning_content", "reasoning"):
        if isinstance(message.get(key), str):
            parts.append(message[key])
    if message.get("tool_calls"):
        parts.append(orjson.dumps(message["tool_calls"]).decode())
    return "\n".join(parts)
