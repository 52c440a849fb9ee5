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
* **The date.** llama.cpp gives every template ``date_string`` (``"%d %b %Y"``, e.g. "26 Jul 2024") and
  ``datetime`` (``"%b %d %Y"``), today in the server's local time; ``strftime_now`` is local time in
  both llama.cpp and transformers. Without ``date_string`` a Llama-3.1 template prints its default,
  "26 Jul 2024". (vLLM passes no date: its Llama-3.1 prompts say "26 Jul 2024". With Llama 3's
  tokenizer every such date has the same count, so the counts agree with both servers.)

Which content a template accepts is found once per tokenizer by rendering two probes (``content_style``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

import orjson

__all__ = ["ContentStyle", "content_style", "date_inputs", "server_messages"]

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
