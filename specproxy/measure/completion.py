"""What a turn's texts and usage say, once ``build_record`` has read them: completion tokens per kind (and the
first chunk's), the content class, and the prompt tokens the server reused from its cache.

Apart from ``build.py`` so that the build keeps to the turn's life (bytes in, one Record out) and these
rules, each decided once, can be read on their own.
"""

from __future__ import annotations

from specproxy.measure.content import classify
from specproxy.measure.texts import Texts
from specproxy.measure.tokens import Tokenizer, count_with_first

__all__ = ["cache_write_tokens", "cached_tokens", "content_class_of", "count_completion", "int_or_none"]


def count_completion(texts: Texts, tok: Tokenizer, first_only: bool = False) -> dict[str, int] | None:
    """Encode each (choice, kind) text once (choice 0's alone when ``first_only``); map tokens to the first
    chunk by character offsets."""
    if not texts.texts:
        return None
    out = {"content": 0, "reasoning": 0, "tool_args": 0, "first": 0}
    for key, text in texts.texts.items():
        if first_only and key[0] != 0:
            continue
        n, first = count_with_first(tok, text, texts.first_lens.get(key, 0))
        out[key[1]] += n
        out["first"] += first
    out["completion"] = out["content"] + out["reasoning"] + out["tool_args"]
    return out


def content_class_of(texts: Texts) -> str | None:
    """Prose or code, read from every choice's content and tool-call arguments together."""
    by_kind: dict[str, str] = {}
    for (_, kind), text in texts.texts.items():
        by_kind[kind] = by_kind.get(kind, "") + text
    return classify(by_kind.get("content", ""), by_kind.get("tool_args", ""))


def int_or_none(value) -> int | None:
    """A JSON integer, or None for anything else (a bool is not a count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def cached_tokens(usage: dict, timings: dict | None) -> int | None:
    """The server's own count of prompt tokens it reused from its cache: every API's usage is read into
    the chat shape (``prompt_tokens_details.cached_tokens``); llama.cpp says it in its ``timings``
    (``cache_n``) when its usage does not."""
    details = usage.get("prompt_tokens_details")
    cached = int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
    if cached is None and isinstance(timings, dict):
        cached = int_or_none(timings.get("cache_n"))
    return cached


def cache_write_tokens(usage: dict) -> int | None:
    """The server's own count of prompt tokens it wrote to its cache (a cache write, priced apart from a
    read by the APIs that charge for caching), kept apart from ``cached_tokens`` (reads). Every API's usage
    is read into the chat shape: ``prompt_tokens_details.cache_write_tokens`` (the Messages API's
    ``cache_creation_input_tokens``, Responses' ``input_tokens_details.cache_write_tokens``, and chat's own
    where a server sends one); None where the server says nothing (vLLM, llama.cpp and OpenAI do not)."""
    details = usage.get("prompt_tokens_details")
    return int_or_none(details.get("cache_write_tokens")) if isinstance(details, dict) else None
