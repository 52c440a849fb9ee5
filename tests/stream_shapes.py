"""SSE chat streams of random shape, with the truth about them, and how an upstream might write them:
what the fault tests send through the proxy to check that the client gets every byte and the record
counts what was sent (``make_stream``, ``split_plan``), and one event alone (``delta_event``)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import orjson


WORDS = ["Hello", " world", ",", " café", " 日本語", " 🚀", " naïve", "\n", " tokens", " é", "!", " ü", " Ω", " 中"]


@dataclass
class Stream:
    """A stream's bytes and the truth about them."""

    body: bytes
    content: str
    text_events: int
    done: bool
    usage: int | None
    writes: list[bytes] = field(default_factory=list)


def delta_event(text: str, nl: bytes, *, event_line: bool = False, ident: int | None = None) -> bytes:
    obj = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    out = b""
    if event_line:
        out += b"event: message" + nl
    if ident is not None:
        out += b"id: %d" % ident + nl
    return out + b"data: " + orjson.dumps(obj) + nl + nl


def make_stream(rng: random.Random, *, pieces: int | None = None) -> Stream:
    """A chat stream with a random shape: CRLF or LF, ``: ping`` comments, ``event:``/``id:``/``retry:``
    lines, a role chunk, usage or none, [DONE] or none."""
    nl = rng.choice([b"\n", b"\r\n"])
    n = pieces if pieces is not None else rng.randint(1, 8)
    events: list[bytes] = []
    role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    events.append(b"data: " + orjson.dumps(role) + nl + nl)
    if rng.random() < 0.3:
        events.append(b"retry: 3000" + nl + nl)
    content = ""
    for i in range(n):
        if rng.random() < 0.3:
            events.append(b": ping" + nl + nl)
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        content += text
        events.append(delta_event(text, nl, event_line=rng.random() < 0.3, ident=i if rng.random() < 0.2 else None))
    usage = rng.choice([None, n + 1])
    final: dict = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    if usage is not None:
        final["usage"] = {"prompt_tokens": 3, "completion_tokens": usage, "total_tokens": usage + 3}
    events.append(b"data: " + orjson.dumps(final) + nl + nl)
    done = rng.random() < 0.85
    if done:
        events.append(b"data: [DONE]" + nl + nl)
    return Stream(b"".join(events), content, n, done, usage, writes=events)


def split_plan(rng: random.Random, stream: Stream, mode: str) -> list[bytes]:
    """How the upstream writes the body: one byte a write, random cuts (one inside a UTF-8 character
    when there is one), whole events merged several to a write, or all at once."""
    body = stream.body
    if mode == "bytes":
        return [body[i : i + 1] for i in range(len(body))]
    if mode == "merge":
        out, i = [], 0
        while i < len(stream.writes):
            k = rng.randint(2, 4)
            out.append(b"".join(stream.writes[i : i + k]))
            i += k
        return out
    if mode == "one":
        return [body]
    cuts = {rng.randint(1, len(body) - 1) for _ in range(rng.randint(1, 12))} if len(body) > 1 else set()
    inside = [i for i in range(1, len(body)) if 0x80 <= body[i] < 0xC0]
    if inside:
        cuts.add(rng.choice(inside))  # the next byte continues a multi-byte character
    edges = [0, *sorted(cuts), len(body)]
    return [body[a:b] for a, b in zip(edges, edges[1:]) if b > a]
