"""Which API a measured path speaks, and how each is read: the one table ``build_record`` consults.

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
from specproxy.measure.fast_texts import read_chat_stream
from specproxy.measure.openai import Delta, PromptParts, read_chunk, read_full_response, split_prompt
from specproxy.measure.texts import Texts, stream_texts_reference

__all__ = ["API_NAMES", "Api", "api_for", "is_measured"]


@dataclass(frozen=True, slots=True)
class Api:
    """``name``: the record's ``api``. ``split``: request body -> PromptParts (``ValueError`` when it is
    not this API's). ``reader``: a new reader of one turn's stream events (the JSON of one event ->
    Delta). ``read_full``: a non-streamed body -> Delta. ``native``: the API's native stream reader
    (the chat stream's, ``fast_texts.read_chat_stream``), held equal to the reference; None when it has
    none or it is not built."""

    name: str
    split: Callable[[Any], PromptParts]
    reader: Callable[[], Callable[[Any], Delta]]
    read_full: Callable[[Any], Delta]
    native: Callable[[bytes, list[int], list[float]], Texts | None] | None = None

    def read_stream(self, buf: bytes, ends: list[int], times: list[float]) -> Texts:
        """What a streamed answer delivered, and when: ``buf`` is its payload (framing and encoding
        removed), read i ending at ``ends[i]`` and timed ``times[i]``. The native reader where there is
        one and the stream has its shape; otherwise the reference."""
        if self.native is not None:
            texts = self.native(buf, ends, times)
            if texts is not None:
                return texts
        return self.read_stream_reference(buf, ends, times)

    def read_stream_reference(self, buf: bytes, ends: list[int], times: list[float]) -> Texts:
        """``read_stream`` by the reference alone: the SSE decoder (``frames/sse.py``), then this API's
        reader for every event."""
        reads = map(buf.__getitem__, map(slice, [0, *ends[:-1]], ends))  # one read's copy at a time
        return stream_texts_reference(reads, times, self.reader())


def _chat_reader() -> Callable[[Any], Delta]:
    return read_chunk  # a chat chunk says all it carries: the reader keeps nothing between events


CHAT = Api("chat", split_prompt, _chat_reader, read_full_response, read_chat_stream)
COMPLETIONS = Api("completions", split_prompt, _chat_reader, read_full_response, read_chat_stream)
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
