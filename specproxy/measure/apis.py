"""Which API a measured path speaks, and how each is read: the one table the builder consults.

Why: specproxy measures chat completions, completions, the Anthropic Messages API and the OpenAI
Responses API with the same record fields and the same accuracy. Each API is written once, in its own
module (``openai.py``, ``anthropic.py``, ``responses.py``); every one is reduced to the chat shape
(a ``PromptParts`` for the request, ``Delta`` per event or body for the response), so splitting,
counting, timing and the record are one implementation for all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specproxy.measure import anthropic, responses
from specproxy.measure.openai import Delta, PromptParts, read_full_response, split_prompt

__all__ = ["API_NAMES", "Api", "api_for", "is_measured"]


@dataclass(frozen=True, slots=True)
class Api:
    """``name``: the record's ``api``. ``split``: request body -> PromptParts (``ValueError`` when it is
    not this API's). ``stream_reader``: a reader of one turn's events (``None``: the chat stream, read by
    ``fast_texts.py``). ``read_full``: a non-streamed body -> Delta."""

    name: str
    split: Callable[[Any], PromptParts]
    stream_reader: Callable[[], Callable[[Any], Delta]] | None
    read_full: Callable[[Any], Delta]


CHAT = Api("chat", split_prompt, None, read_full_response)
COMPLETIONS = Api("completions", split_prompt, None, read_full_response)
MESSAGES = Api("messages", lambda body: split_prompt(anthropic.to_chat(body)),
               lambda: anthropic.StreamReader().read, anthropic.read_full_response)
RESPONSES = Api("responses", lambda body: split_prompt(responses.to_chat(body)),
                lambda: responses.StreamReader().read, responses.read_full_response)

# Both spellings of each: a client whose base URL has no /v1 (the server's root) calls /chat/completions
# (or /responses), and servers such as llama-server answer it.
_BY_PATH = {
    "/v1/chat/completions": CHAT, "/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS, "/completions": COMPLETIONS,
    **dict.fromkeys(anthropic.PATHS, MESSAGES),
    **dict.fromkeys(responses.PATHS, RESPONSES),
}
API_NAMES = ("chat", "completions", "messages", "responses")


def api_for(path: str) -> Api | None:
    """The API a request path (without its query string) speaks, or None when it is not measured."""
    return _BY_PATH.get(path)


def is_measured(method: str, path: str) -> bool:
    """Only generation endpoints are measured; everything else is forwarded and recorded as an unmeasured
    row (method, path, status, timings), kept out of every figure."""
    return method == "POST" and path in _BY_PATH
