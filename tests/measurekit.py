"""A streamed chat turn handed to ``TurnRecorder`` as the proxy hands it, the chat stream's readers
over a list of reads, and a count of the JSON parses made meanwhile: how the tests of the native stream
reader feed it and see what it parsed."""

from __future__ import annotations

from itertools import accumulate

import orjson
import pytest

from specproxy.measure import fast_texts
from specproxy.measure.apis import CHAT
from specproxy.measure.turn_recorder import TurnRecorder
from specproxy.measure.texts import Texts

needs_native = pytest.mark.skipif(not fast_texts.C_BUILT, reason="specproxy.frames._scanc is not built")


def read_native(reads: list[bytes], times: list[float]) -> Texts | None:
    """``reads`` (payloads) read by the chat stream's native reader: None when it leaves them to the reference."""
    return fast_texts.read_chat_stream(b"".join(reads), list(accumulate(map(len, reads))), times)


def read_chat(reads: list[bytes], times: list[float]) -> Texts:
    """``reads`` (payloads) read as the builder reads a chat stream (``Api.read_stream``)."""
    return CHAT.read_stream(b"".join(reads), list(accumulate(map(len, reads))), times)


def builder(reads: list[bytes], chunked: bool, times: list[float] | None = None) -> TurnRecorder:
    """A finished turn whose response was ``reads`` (read i at time ``1.0 + i``, or ``times[i]``: nondecreasing,
    from 1.0), chunked-framed or not."""
    body = b'{"model":"m","stream":true,"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]}'
    b = TurnRecorder(method="POST", path="/v1/chat/completions", body=body, t_wall=1.0, t_request=0.5)
    b.on_headers(0.6, 200, "text/event-stream", chunked=chunked)
    if times is None:
        times = [1.0 + i for i in range(len(reads))]
    for i, r in enumerate(reads):
        b.on_bytes(r, times[i], times[i] + 0.001 * (i % 3))
    b.finish((times[-1] if times else 0.0) + 2.0)
    return b


def counting_loads(monkeypatch) -> list:
    """Every ``orjson.loads`` argument from now on (the test's monkeypatch undoes it), in order."""
    calls: list = []
    real = orjson.loads

    def loads(data):
        calls.append(data)
        return real(data)

    monkeypatch.setattr(orjson, "loads", loads)
    return calls

