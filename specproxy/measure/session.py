"""Who sent a turn and which conversation it extends, without keeping any of its text.

Why: auditing what a client costs means grouping its turns by client (an agent's ``User-Agent``) and by
conversation. A chat or agent client resends the whole conversation every turn, so every turn of one
conversation opens with the same first message; a digest of it (with the client and the model) names
the conversation. Only the digest is recorded. The system prompt and the tools are left out of it on
purpose: a client that changes them mid-conversation stays in one session, which is what lets
``specproxy audit`` say what that change cost.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import orjson

from specproxy.measure.openai import PromptParts

__all__ = ["MAX_CLIENT_CHARS", "client_of", "session_of"]

MAX_CLIENT_CHARS = 200


def client_of(headers: Sequence[tuple[bytes, bytes]], header: bytes = b"user-agent") -> str | None:
    """The first value of ``header`` (lower case; ``User-Agent`` unless Config ``client_header`` names
    another) among the request's raw headers, decoded, at most ``MAX_CLIENT_CHARS``."""
    for name, value in headers:
        if name.lower() == header:
            return value.decode("utf-8", "replace")[:MAX_CLIENT_CHARS] or None
    return None


def session_of(client: str | None, model: str | None, parts: PromptParts | None) -> str | None:
    """16 hex digits naming the conversation ``parts`` extends; None when it has no conversation."""
    if parts is None or not parts.conversation:
        return None
    first = parts.conversation[0]
    try:
        key = orjson.dumps([client, model, first], option=orjson.OPT_SORT_KEYS)
    except TypeError:  # not JSON-encodable (cannot come from a parsed body): no session
        return None
    return hashlib.blake2b(key, digest_size=8).hexdigest()
