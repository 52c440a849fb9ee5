"""Phase probes: requests that measure one phase of a turn, so that a prefill figure never passes for a
decode one.

* prefill: long prompts, ``max_tokens`` 1. A turn is then prefill plus one step, and prompt tokens /
  TTFT is the prefill speed, swept over prompt lengths (it falls as attention grows with the prompt).
* decode: a short prompt and a long output (``ignore_eos``, which llama.cpp, vLLM and SGLang accept,
  so the model cannot stop early): the per-stream decode speed, with TTFT a small part of the turn.

Every request begins with a fresh random word (``NONCE`` is replaced at each send), because servers
cache prompt prefixes: a prompt sent twice would be read from the cache the second time, and the
probe would time a cache hit instead of a prefill. A captured workload is sent as it was (its
prefixes are the users' own, cached or not as they would be).

A probe applied to a replayed workload (``--from`` with ``--phase``) sets each request's own API's
fields (``for_phase``): chat and completions take ``max_tokens``, ``stream_options`` (so the server
reports usage) and ``ignore_eos``; the Anthropic Messages API takes ``max_tokens`` and ``stream``
only; the Responses API ``max_output_tokens`` and ``stream``. A field of another API would be
ignored or refused, and the probe would not measure what it says.
"""

from __future__ import annotations

import random

import orjson

from specproxy.app.replay import CHAT, Request
from specproxy.errors import ConfigError
from specproxy.measure.apis import api_for

__all__ = ["NONCE", "decode_probe", "for_phase", "phase_fields", "prefill_probe"]

NONCE = b"@@specproxy-nonce@@"

_WORDS = ("river", "lantern", "quartz", "meadow", "signal", "harbor", "cedar", "pixel", "orbit", "velvet", "thunder",
          "maple", "circuit", "glacier", "saddle", "ember", "canyon", "violet", "anchor", "prism", "falcon", "marble")


def _chat(model: str | None, content: str, **fields: object) -> bytes:
    body: dict[str, object] = {"messages": [{"role": "user", "content": content}], **fields}
    if model:
        body = {"model": model, **body}
    return orjson.dumps(body).replace(b"NONCE", NONCE)


def _stream_fields() -> dict[str, object]:
    return {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0}


def prefill_probe(lengths: list[int], model: str | None, seed: int = 0) -> list[tuple[int, list[Request]]]:
    """One request per prompt length (``lengths`` in words), max_tokens 1, streamed."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        text = " ".join(rng.choice(_WORDS) for _ in range(n))
        body = _chat(model, f"NONCE {text}\nRepeat the first word.", max_tokens=1, **_stream_fields())
        out.append((n, [Request(CHAT, body, "", f"prefill probe, {n} words", fresh=True)]))
    return out


def decode_probe(max_tokens: int, model: str | None) -> list[Request]:
    """A short prompt that asks for a long answer, decoded to ``max_tokens`` (ignore_eos)."""
    body = _chat(model, "NONCE Tell a long story about a lighthouse keeper, in plain prose.", max_tokens=max_tokens,
                 ignore_eos=True, **_stream_fields())
    return [Request(CHAT, body, "", "decode probe", fresh=True)]


def phase_fields(phase: str, max_tokens: int, api: str = "chat") -> dict[str, object]:
    """The body fields a probe sets on a replayed request of ``api`` (a record's ``api`` name)."""
    limit = 1 if phase == "prefill" else max_tokens
    if api == "responses":
        return {"max_output_tokens": limit, "stream": True}
    if api == "messages":
        return {"max_tokens": limit, "stream": True}
    fields: dict[str, object] = {"max_tokens": limit, "stream": True, "stream_options": {"include_usage": True}}
    return fields if phase == "prefill" else {**fields, "ignore_eos": True}


def for_phase(req: Request, phase: str, max_tokens: int) -> Request:
    """``req`` with its API's probe fields set (re-serialised: no longer byte for byte the original). A
    chat body's ``max_completion_tokens`` (which servers read before ``max_tokens``) is dropped, so the
    probe's limit is the one that holds."""
    api = api_for(req.path)
    obj = req.json()
    if api is None or obj is None:
        raise ConfigError(f"{req.where}: the body is not a JSON object, so it cannot be changed for a phase probe")
    if api.name == "chat":
        obj.pop("max_completion_tokens", None)
    return Request(req.path, orjson.dumps({**obj, **phase_fields(phase, max_tokens, api.name)}), "", req.where)
