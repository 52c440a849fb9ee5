"""Shared by the real-client tests (``test_real_clients``, ``test_real_counts``, ``test_real_timing``):
the request they send, and how they wait for and compare what comes back."""

from __future__ import annotations

import copy
import threading
import time

import openai

from real.server import LlamaServer

SYSTEM = "You are terse.  Answer in one sentence."
USER = "What's the weather in Zürich? 日本語 🚀\n\nThanks"

# Canonical shape: exactly the keys, in the order, llama-server re-serialises a tool in before it
# renders its chat template (see test_llama_infra.llama_server_tools).
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city, in °C.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "noop", "description": "", "parameters": {"type": "object", "properties": {}}}},
]

FUNCTIONS_PY = '''\
def get_weather(city: str) -> str:
    """Weather for a city."""
    return f"sunny in {city}"
'''

WAIT_S = 30.0  # every wait on an event is bounded by this


class Arrivals:
    """The records the proxy hands to its sinks, with a bounded wait on their arrival.

    Why not ``LiveStack.settle()``: the openai SDK returns as soon as it has read ``[DONE]``, which
    can be before the proxy's handler has handed the turn to its measuring thread, and ``settle``
    only waits for turns already handed over; a condition on the sink itself has no such gap.
    """

    def __init__(self, stack) -> None:
        self._cond = threading.Condition()
        self.records: list = []
        stack.service.extra_sinks.append(self._sink)

    def _sink(self, record) -> None:
        with self._cond:
            self.records.append(record)
            self._cond.notify_all()

    def wait(self, n: int, timeout: float = WAIT_S) -> list:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.records) >= n, timeout)
            got = list(self.records)
        assert ok, f"only {len(got)} of {n} turns were recorded within {timeout:g} s"
        return got[:n]


def wait_for(cond, what: str, timeout: float = WAIT_S) -> None:
    """Poll a condition another thread makes true, until a deadline (never a bare sleep)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.01)


def proxy(make_stack, server: LlamaServer, counter, **cfg):
    stack = make_stack(counter, upstream=server.url, **{"scrape_interval_s": 0, **cfg})
    return stack, Arrivals(stack)


def sdk(base_url: str) -> openai.OpenAI:
    # no retries (a retried request would hide a failure), no environment proxies (127.0.0.1 only)
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-test-not-a-key", max_retries=0,
                         timeout=60.0, http_client=openai.DefaultHttpxClient(trust_env=False, timeout=60.0))


def chat(base_url: str, **kw):
    """One chat completion with the official SDK; a stream is read to its end."""
    with sdk(base_url) as client:
        resp = client.chat.completions.create(model="tiny", **kw)
        return [c.to_dict() for c in resp] if kw.get("stream") else resp.to_dict()


EXCLUDED = "<excluded>"


def comparable(obj: dict) -> dict:
    """A response (or one stream chunk) with what legitimately differs between two requests masked.

    Masked, each with why (the key itself stays, so its presence is still compared):

    * ``id``, ``created``: every completion gets a new id and its own timestamp;
    * ``tool_calls[].id``: llama-server draws a random id for every tool call;
    * ``timings``: the server's own stopwatch (prefill and decode milliseconds vary run to run);
    * ``usage.prompt_tokens_details.cached_tokens``: how much of the prompt was already in the slot's
      KV cache depends on what ran before (the first of the two requests warms it for the second).

    Everything else must be identical: model, object, system_fingerprint, every choice's index,
    role, content, tool-call type/name/arguments, finish_reason, and usage's prompt, completion
    and total token counts.
    """
    d = copy.deepcopy(obj)
    for key in ("id", "created", "timings"):
        if key in d:
            d[key] = EXCLUDED
    for choice in d.get("choices") or []:
        for part in ("message", "delta"):
            for call in (choice.get(part) or {}).get("tool_calls") or []:
                if "id" in call:
                    call["id"] = EXCLUDED
    details = (d.get("usage") or {}).get("prompt_tokens_details")
    if isinstance(details, dict) and "cached_tokens" in details:
        details["cached_tokens"] = EXCLUDED
    return d


def streamed_text(chunks: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(tool name, arguments)]) assembled from stream chunks the way a client does."""
    content, calls = "", {}
    for c in chunks:
        for choice in c.get("choices") or []:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name, args = calls.get(call["index"], ("", ""))
                fn = call.get("function") or {}
                calls[call["index"]] = (name + (fn.get("name") or ""), args + (fn.get("arguments") or ""))
    return content, [calls[i] for i in sorted(calls)]


def metric(server: LlamaServer, name: str) -> float:
    for line in server.metrics_text().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} missing from {server.url}/metrics")


def prompt_parts_add_up(rec) -> None:
    parts = (rec.prompt_system_tokens, rec.prompt_tools_tokens, rec.prompt_history_tokens, rec.prompt_new_tokens)
    assert sum(parts) == rec.prompt_tokens, parts


# ============================================================ 1. the openai SDK, with and without
