"""The APIs coding agents speak, through specproxy to the REAL llama-server, driven by the official SDKs.

Claude Code speaks the Anthropic Messages API (``/v1/messages?beta=true``), Codex CLI the OpenAI
Responses API (``/v1/responses``); the llama-server the test tier builds serves both, rendering each
through the same chat template as chat completions, and counts a body's prompt with
``/v1/messages/count_tokens`` and ``/v1/responses/input_tokens``. Each test sends the same request
straight to the server and through specproxy (the real proxy, ``make_stack``) with the official
``anthropic`` SDK or the ``openai`` SDK's Responses client, streamed and not, with tools and an agent's
history (tool calls and their results), and checks:

* the client gets the same answer both ways (``comparable`` masks what differs between any two
  requests, and says why);
* specproxy's ``prompt_tokens`` equals the server's count of the same body exactly, and its four parts
  add up to it;
* output: the model recites a tool call, which llama-server parses into a ``tool_use`` block (a
  ``function_call`` item); specproxy counts the arguments the client received, so the server's
  output count is that plus the JSON envelope it parsed away and the end-of-turn token (the same
  documented difference as chat's, ``test_real_counts.py``).
"""
from __future__ import annotations

import copy
import hashlib
import json

import anthropic
import openai
import pytest
from real.clientkit import Arrivals
from real.fixtures import TOOL_ARGS, TOOL_SENTENCE

pytestmark = pytest.mark.real

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = hashlib.blake2b(b"get_weather", digest_size=6).hexdigest()  # the tool's name as a record holds it


# ids, timestamps and the server's stopwatch differ between any two requests; how much of the prompt
# was cached depends on what ran before (the direct request warms the slot for the proxied one), so
# usage is compared apart, as the sum the server counted
MASKED = {"id", "call_id", "item_id", "created_at", "completed_at", "timings", "usage"}


def comparable(obj):
    if isinstance(obj, dict):
        return {k: "<masked>" if k in MASKED else comparable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [comparable(v) for v in obj]
    return obj




def messages_call(base_url: str, body: dict, *, stream: bool, beta: bool) -> tuple[list[dict], dict]:
    """One Messages request with the official SDK: (the events or the one message as dicts, usage)."""
    with anthropic.Anthropic(base_url=base_url, api_key="sk-test-not-a-key", max_retries=0,  # no environment proxies
                             http_client=anthropic.DefaultHttpxClient(trust_env=False, timeout=60.0)) as client:
        api = client.beta.messages if beta else client.messages  # beta: POST /v1/messages?beta=true
        if not stream:
            msg = api.create(**body).to_dict()
            return [msg], msg["usage"]
        events = [e.to_dict() for e in api.create(**body, stream=True)]
        usage = dict(events[0]["message"]["usage"])
        usage.update({k: v for k, v in events[-2]["usage"].items() if v is not None})  # message_delta
        return events, usage


def responses_call(base_url: str, body: dict, *, stream: bool) -> tuple[list[dict], dict]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-test-not-a-key", max_retries=0,
                       http_client=openai.DefaultHttpxClient(trust_env=False, timeout=60.0)) as client:
        if not stream:
            resp = client.responses.create(**body).to_dict()
            return [resp], resp["usage"]
        events = [e.to_dict() for e in client.responses.create(**body, stream=True)]
        return events, events[-1]["response"]["usage"]


def messages_body() -> dict:
    """As Claude Code sends one: system blocks, tools, a history with a tool call and its result."""
    return {
        "model": "tiny", "max_tokens": 64,
        "system": [{"type": "text", "text": "You are a terse agent."},
                   {"type": "text", "text": " Use tools.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "get_weather", "description": "Weather for a city, in °C.", "input_schema": SCHEMA},
                  {"name": "noop", "input_schema": {"type": "object", "properties": {}}}],
        "messages": [
            {"role": "user", "content": "What's the weather in Zürich? 日本語 🚀"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_0", "name": "get_weather", "input": {"city": "Zürich"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_0", "content": [{"type": "text", "text": '{"temp_c": 21}'}]},
                {"type": "text", "text": "And in Paris?"}]},
        ],
    }


def responses_body() -> dict:
    """As Codex CLI sends one: instructions, a developer message (rendered as system), function tools,
    input items with a call and its output, a message of several parts."""
    return {
        "model": "tiny", "max_output_tokens": 64,
        "instructions": "You are a terse agent. Use tools.",
        "tools": [{"type": "function", "name": "get_weather", "description": "Weather for a city, in °C.",
                   "parameters": SCHEMA, "strict": False},
                  {"type": "function", "name": "noop", "parameters": {"type": "object", "properties": {}}}],
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Zürich?"},
                                                            {"type": "input_text", "text": "日本語 🚀"}]},
            {"type": "function_call", "call_id": "call_0", "name": "get_weather", "arguments": '{"city":"Zürich"}'},
            {"type": "function_call_output", "call_id": "call_0", "output": '{"temp_c": 21}'},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "21 °C."}]},
            {"type": "message", "role": "user", "content": "And in Paris?"},
        ],
    }


def parts_add_up(rec) -> None:
    parts = (rec.prompt_system_tokens, rec.prompt_tools_tokens, rec.prompt_history_tokens, rec.prompt_new_tokens)
    assert sum(parts) == rec.prompt_tokens, parts
    assert min(parts) > 0, parts  # each part is there in these requests


@pytest.mark.parametrize(("stream", "beta"), [(False, False), (True, False), (True, True)],
                         ids=["json", "stream", "stream-beta"])
def test_anthropic_sdk_through_the_proxy(make_stack, counter, tool_server, tool_model, stream, beta):
    stack = make_stack(counter, upstream=tool_server.url, scrape_interval_s=0)
    arrivals = Arrivals(stack)
    body = messages_body()
    direct, _ = messages_call(tool_server.url, body, stream=stream, beta=beta)
    through, usage = messages_call(stack.url, body, stream=stream, beta=beta)
    (rec,) = arrivals.wait(1)

    assert comparable(through) == comparable(direct)
    assert rec.api == "messages" and rec.path == "/v1/messages" and rec.outcome == "ok" and rec.streamed is stream
    assert rec.client.startswith("Anthropic/Python")
    served = tool_server.post_json("/v1/messages/count_tokens", body)["input_tokens"]
    assert rec.prompt_tokens == served == usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert rec.usage_prompt_tokens == served and rec.usage_cached_tokens == usage["cache_read_input_tokens"]
    # llama-server says no cache writes (no cache_creation_input_tokens): null, never 0
    assert usage.get("cache_creation_input_tokens") is None and rec.usage_cache_write_tokens is None
    parts_add_up(rec)

    blocks = [e["content_block"] for e in through if e.get("type") == "content_block_start"] if stream \
        else through[0]["content"]
    assert [(b["type"], b["name"]) for b in blocks] == [("tool_use", "get_weather")]
    assert rec.finish_reason == "tool_use" and rec.saw_done is (True if stream else None)
    assert (rec.tools_defined, rec.tools_called) == (2, 1)  # the answer's call, read from the server's events
    assert json.loads(rec.tool_names)["called"] == [WEATHER]
    # delivered: streamed, the arguments' text as the server wrote it; whole, the tool's input is a JSON
    # object in the body, which the server writes compact (and specproxy counts as that JSON)
    delivered = TOOL_ARGS if stream else json.dumps(json.loads(TOOL_ARGS), separators=(",", ":"))
    assert rec.completion_tokens == rec.tool_args_tokens == counter.count(delivered)
    assert usage["output_tokens"] == rec.usage_completion_tokens == len(tool_model.token_ids)  # + envelope, eot
    assert rec.ttft_s is not None and rec.ttft_s <= rec.total_s


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_openai_responses_sdk_through_the_proxy(make_stack, counter, tool_server, tool_model, stream):
    stack = make_stack(counter, upstream=tool_server.url, scrape_interval_s=0)
    arrivals = Arrivals(stack)
    body = responses_body()
    direct, _ = responses_call(tool_server.url, body, stream=stream)
    through, usage = responses_call(stack.url, body, stream=stream)
    (rec,) = arrivals.wait(1)

    assert comparable(through) == comparable(direct)
    assert rec.api == "responses" and rec.outcome == "ok" and rec.streamed is stream
    assert rec.client.startswith("OpenAI/Python")
    served = tool_server.post_json("/v1/responses/input_tokens", body)["input_tokens"]
    assert rec.prompt_tokens == served == usage["input_tokens"] == rec.usage_prompt_tokens
    assert rec.usage_cached_tokens == usage["input_tokens_details"]["cached_tokens"]
    parts_add_up(rec)

    final = through[-1]["response"] if stream else through[0]
    calls = [(o["type"], o["name"], o["arguments"]) for o in final["output"]]
    assert calls == [("function_call", "get_weather", TOOL_ARGS)]
    assert rec.finish_reason == "completed" and rec.saw_done is (True if stream else None)
    assert (rec.tools_defined, rec.tools_called) == (2, 1)  # the answer's call, read from the server's events
    assert json.loads(rec.tool_names)["called"] == [WEATHER]
    assert rec.completion_tokens == rec.tool_args_tokens == counter.count(TOOL_ARGS)
    envelope = counter.count(TOOL_SENTENCE) - counter.count(TOOL_ARGS)
    assert usage["output_tokens"] == rec.usage_completion_tokens == rec.completion_tokens + envelope + 1


def test_text_answers_and_their_counts(make_stack, counter, llama_server, tiny_model):
    """Plain text answers over both APIs, streamed: the delivered text is counted exactly and the
    server's output count is that plus its end-of-turn token; every text event is a chunk. (How exact
    TTFT and decode time are is proved against scripted upstreams: this tiny model answers in
    milliseconds, often in one read.)"""
    stack = make_stack(counter, upstream=llama_server.url, scrape_interval_s=0)
    arrivals = Arrivals(stack)
    m = copy.deepcopy(messages_body())
    del m["tools"]
    m["messages"] = [{"role": "user", "content": "Say something."}]
    events, m_usage = messages_call(stack.url, m, stream=True, beta=False)
    r = {"model": "tiny", "instructions": "Be terse.", "input": "Say something."}
    revents, r_usage = responses_call(stack.url, r, stream=True)
    mrec, rrec = arrivals.wait(2)

    text = "".join(e["delta"]["text"] for e in events if e.get("type") == "content_block_delta")
    rtext = "".join(e["delta"] for e in revents if e.get("type") == "response.output_text.delta")
    assert text == rtext == tiny_model.sentence
    for rec, usage in ((mrec, m_usage), (rrec, r_usage)):
        assert rec.completion_tokens == rec.content_tokens == counter.count(tiny_model.sentence)
        assert rec.usage_completion_tokens == usage["output_tokens"] == rec.completion_tokens + 1
        assert rec.t_request < rec.t_first_token <= rec.t_last_token <= rec.t_done
    assert mrec.chunks == sum(e.get("type") == "content_block_delta" for e in events)
    assert rrec.chunks == sum(e.get("type") == "response.output_text.delta" for e in revents)
    assert mrec.prompt_tokens == llama_server.post_json("/v1/messages/count_tokens", m)["input_tokens"]
    assert rrec.prompt_tokens == llama_server.post_json("/v1/responses/input_tokens", r)["input_tokens"]
    assert mrec.finish_reason == "end_turn" and json.loads(rrec.server_timings)["predicted_n"] > 0
