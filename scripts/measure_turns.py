"""The turns ``bench_measure.py`` builds (its docstring says what they are), made with whichever specproxy
the running interpreter imports.

Why apart: ``measure_vs.py`` builds the very same turns with another checkout's package, run by that
checkout's interpreter (``bench_measure.py --baseline``), so the turns are defined once, here, and this
module imports nothing of specproxy but the recorder (``recorder_class``).
"""

from __future__ import annotations

import random
import time

import orjson

SESSIONS = 8  # the turns' conversations: each turn after a session's first is compared with its previous
READS: dict[int, list[bytes]] = {}  # each turn's reads as made (make_turns): a build consumes its turn's


def recorder_class() -> type:
    """What the forwarding path records a turn in: ``TurnRecorder``; before issue 33, ``RecordBuilder``
    (a baseline checkout's package may be that old)."""
    try:
        from specproxy.measure.turn_recorder import TurnRecorder
    except ImportError:
        from specproxy.measure.builder import RecordBuilder
        return RecordBuilder
    return TurnRecorder


PROSE = """\
Speculative decoding speeds up inference by letting a small draft model propose several tokens that the
large model then verifies in one forward pass. When the draft is right, the server emits more than one
token per step; when it is wrong, it falls back to a single token. The effect on latency depends on the
acceptance rate, which varies with the kind of text: code and structured output are often predictable,
while creative writing is not.

To measure it honestly you need the time each token reached the client, not just the total. A proxy in
front of the server can stamp every read as it crosses the socket, then count tokens with the model's own
tokenizer once the turn is over. The résumé of the results: first-token latency, decode rate, tokens per
chunk — and whether the speed-up you paid for is real. Ça dépend du modèle, naturellement.

Here is a short list:
- "draft" acceptance: 62%
- tokens/s: 48.5 → 91.2
- 日本語のテキストも同じように数えられます。
"""

HEAD = (
    b'{"id":"chatcmpl-5f0c8e2a9b7d4c1e8a6f3b2d1c0e9f8a","object":"chat.completion.chunk",'
    b'"created":1700000000,"model":"bench-model","system_fingerprint":"fp_bench","choices":[{"index":0,'
)
SYSTEM = ("You are a careful assistant. Answer briefly and cite the measurement you rely on. " * 60)[:4000]


def _event(choice_rest: bytes, t_send: int | None, extra: bytes = b"") -> bytes:
    """``data: {...,"choices":[{"index":0,<choice_rest>]<extra>[,"t_send":N]}`` and the blank line."""
    tail = b"}" if t_send is None else b',"t_send":%d}' % t_send
    return b"data: " + HEAD + choice_rest + b"]" + extra + tail + b"\n\n"


def make_turn(pieces: list[str], t_send: bool, rng: random.Random, session: int = 0):
    """One relayed turn: ``pieces`` streamed as content chunks, a chunked frame per read; its prompt is
    ``session``'s (the same system prompt, a user message per session, as bench_overhead's load sends)."""
    clock = [1_700_000_000_000_000_000]

    def stamp() -> int | None:
        clock[0] += rng.randrange(10**6, 10**8)  # ns between chunks
        return clock[0] if t_send else None

    events = [_event(b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}', stamp())]
    for piece in pieces:
        content = orjson.dumps(piece)  # as engines write it: raw UTF-8, escapes for quotes and controls
        events.append(_event(b'"delta":{"content":' + content + b'},"logprobs":null,"finish_reason":null}', stamp()))
    n = len(pieces)
    usage = b',"usage":{"prompt_tokens":1000,"completion_tokens":%d,"total_tokens":%d}' % (n, 1000 + n)
    events.append(_event(b'"delta":{},"logprobs":null,"finish_reason":"length"}', stamp(), usage))
    events.append(b"data: [DONE]\n\n")
    body = orjson.dumps({"model": "bench-model", "stream": True, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"question {session}: explain speculative decoding."}]})
    b = recorder_class()(method="POST", path="/v1/chat/completions", body=body, t_wall=time.time(), t_request=0.0)
    b.on_headers(0.01, 200, "text/event-stream", chunked=True)
    t = 0.05
    for ev in events:
        t += 0.02
        b.on_bytes(b"%x\r\n%b\r\n" % (len(ev), ev), t, t + 0.00002)
    b.on_bytes(b"0\r\n\r\n", t + 0.001, t + 0.00102)
    b.finish(t + 0.002)
    return b


def make_turns(tok, n: int, chunks: int, t_send: bool) -> list:
    """``n`` turns of ``chunks`` content chunks each (``t_send``: the shape whose chunks carry it), the
    same for every package given the same tokenizer; each turn's reads also kept in ``READS``."""
    enc = tok._enc
    tokens = enc.encode(PROSE * 4)
    rng = random.Random(7 + t_send)
    turns = []
    for i in range(n):
        start = rng.randrange(0, len(tokens) - chunks)
        # a token a chunk, as an engine streams; bytes that end inside a character wait for the next
        pieces, pending = [], b""
        for tid in tokens[start : start + chunks]:
            pending += enc.decode_single_token_bytes(tid)
            try:
                pieces.append(pending.decode())
                pending = b""
            except UnicodeDecodeError:
                continue
        turns.append(make_turn(pieces, t_send, rng, i % SESSIONS))
        READS[id(turns[-1])] = list(turns[-1].reads)
    return turns
