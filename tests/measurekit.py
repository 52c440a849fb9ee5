"""A streamed chat turn handed to ``RecordBuilder`` as the proxy hands it, and a count of the JSON parses
made meanwhile: how the tests of the fast stream parse feed it and see what it parsed."""

from __future__ import annotations

import orjson

from specproxy.measure.builder import RecordBuilder


def builder(reads: list[bytes], chunked: bool, scan: str = "c", times: list[float] | None = None) -> RecordBuilder:
    """A finished turn whose response was ``reads`` (read i at time ``1.0 + i``, or ``times[i]``: nondecreasing,
    from 1.0), chunked-framed or not, to be measured with Config ``scan``'s scans."""
    body = b'{"model":"m","stream":true,"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]}'
    b = RecordBuilder(method="POST", path="/v1/chat/completions", body=body, t_wall=1.0, t_request=0.5,
                      c_scans=scan == "c")
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

