"""What an inference server hands its chat template, so that specproxy renders the prompt the server renders.

Why: ``prompt_tokens`` is only the server's own count if the text rendered is the server's text, and
servers do not give the template the request's messages as they came, nor only the messages:

* **Content arrays.** The OpenAI API lets a message's ``content`` be an array of parts
  (``[{"type": "text", "text": "..."}]``, what many clients and agents send, for every role: system,
  user, assistant, tool results). A template written for string content (Llama 3's
  ``message['content'] | trim``) given the array prints its Python repr. llama.cpp and vLLM both look
  at what the template accepts: to a template that takes only strings they give the text parts joined
  with ``"\\n"``; one that reads the parts itself gets them as they are. ``null`` or absent content
  becomes ``""``. Parts that are not text (images, audio) are left out of the join: llama.cpp puts a
  media marker there and counts the image's own tokens, which specproxy cannot know, so a prompt with
  media is counted without them (an undercount by exactly the media's tokens).
* **Tool-call arguments.** The API carries them as a JSON *string*; templates expect an object
  (Llama 3.1's renders ``arguments | tojson``: a string would come out quoted and escaped). Both
  servers parse the string first; arguments that are not a JSON object are left as they came.
* **Roles.** llama.cpp (``common/chat.cpp``, its ``workaround`` namespace) gives every template a
  ``developer`` message as a ``system`` one, except GPT-OSS's (whose template source has ``<|channel|>``
  and renders the developer role itself); and to a template that does not read a system message's
  content (the probe below) it gives the first system message joined to the next message's content with
  ``"\\n"`` (or drops it when it is the only message).
* **Tools.** llama.cpp re-serialises each chat tool as ``{type: "function", function: {name,
  description, parameters}}`` before rendering: a missing description becomes ``""``, a missing schema
  ``{}``, any other key (``strict``) is dropped.
* **The date.** llama.cpp gives every template ``date_string`` (``"%d %b %Y"``, e.g. "26 Jul 2024") and
  ``datetime`` (``"%b %d %Y"``), today in the server's local time; ``strftime_now`` is local time in
  both llama.cpp and transformers. Without ``date_string`` a Llama-3.1 template prints its default,
  "26 Jul 2024". (vLLM passes no date: its Llama-3.1 prompts say "26 Jul 2024". With Llama 3's
  tokenizer every such date has the same count, so the counts agree with both servers.)

Which content a template accepts, and whether it reads a system message, is found once per tokenizer
by rendering probes (``content_style``, ``reads_system``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

import orjson

__all__ = ["ContentStyle", "content_style", "date_inputs", "reads_system", "server_messages", "server_tools"]

# "string": the template takes string content only (text parts are joined for it); "typed": parts only
# (a string becomes one text part); "both": content is given as it came.
ContentStyle = Literal["string", "typed", "both"]

_PROBE = "specproxy-probe-7f3a"
# a text part printed rather than read: its repr (``'type': 'text'``) or its JSON (``"type": "text"``)
_PRINTED_PART = re.compile(r"""['"]type['"]\s*:\s*['"]text['"]""")


def date_inputs(now: datetime | None = None) -> dict[str, str]:
    """The date variables llama.cpp gives every chat template: today, in local time as the server's."""
    now = now or datetime.now()
    return {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}


def content_style(render: Callable[[list[dict]], str]) -> ContentStyle:
    """Which content the template behind ``render`` (messages -> text) accepts, found as servers find it:
    a user message with string content and the same text as one text part, each rendered; a template
    that reads the parts renders both alike, one that prints the array does not, or fails on it."""

    def attempt(content: Any) -> str | None:
        try:
            return render([{"role": "user", "content": content}])
        except Exception:  # a template that cannot take this kind of content raises
            return None

    as_string = attempt(_PROBE)
    as_parts = attempt([{"type": "text", "text": _PROBE}])
    takes_strings = as_string is not None and _PROBE in as_string
    reads_parts = as_parts is not None and (
        as_parts == as_string or (_PROBE in as_parts and _PRINTED_PART.search(as_parts) is None))
    if reads_parts:
        return "both" if takes_strings else "typed"
    return "string"


def reads_system(render: Callable[[list[dict]], str]) -> bool:
    """Whether the template behind ``render`` reads a system message's content (llama.cpp's
    ``supports_system_role``): a system probe and a user message rendered, the probe's text in the
    output. A template that raises on a system message does not."""
    try:
        return _PROBE in render([{"role": "system", "content": _PROBE}, {"role": "user", "content": "x"}])
    except Exception:  # e.g. raise_exception('System role not supported')
        return False


def server_tools(tools: list | None) -> list | None:
    """Chat tools as llama.cpp renders them: ``{type, function: {name, description, parameters}}`` and
    nothing else. A tool not in the function shape is passed on as it is (the server refuses it)."""
    if not tools:
        return tools
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or "name" not in fn:
            out.append(tool)
            continue
        out.append({"type": "function", "function": {
            "name": fn["name"], "description": fn.get("description", ""), "parameters": fn.get("parameters", {})}})
    return out


def server_roles(messages: list[dict], *, developer_as_system: bool, system_read: bool) -> list[dict]:
    """The roles llama.cpp gives a template: ``developer`` as ``system`` (unless the template renders it
    itself); when the template does not read system messages, the first one joined to the next."""
    if developer_as_system and any(m.get("role") == "developer" for m in messages):
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    if not system_read and messages and messages[0].get("role") == "system":
        first, rest = messages[0], messages[1:]
        if rest and isinstance(first.get("content"), str) and isinstance(rest[0].get("content"), str):
            rest = [{**rest[0], "content": first["content"] + "\n" + rest[0]["content"]}, *rest[1:]]
        messages = rest
    return messages


def server_messages(messages: list[dict], style: ContentStyle) -> list[dict]:
    """``messages`` as a server hands them to a template of ``style``: content made what the template
    takes, tool-call arguments parsed. Messages that need nothing are passed on as they are."""
    out = []
    for m in messages:
        content = m.get("content")
        fixed = _content(content, style)
        if fixed is not content or "content" not in m:
            m = {**m, "content": fixed}
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m = {**m, "tool_calls": [_parsed_call(c) for c in calls]}
        out.append(m)
    return out


def _content(content: Any, style: ContentStyle) -> Any:
    if content is None or (isinstance(content, list) and not content):
        content = ""
    if isinstance(content, list):
        if style == "string":
            return "\n".join(p["text"] for p in content if _is_text_part(p))
        return content
    if isinstance(content, str) and style == "typed":
        return [{"type": "text", "text": content}]
    return content


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _parsed_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = orjson.loads(fn["arguments"])
    except ValueError:
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**fn, "arguments": args}}
