"""Issue 3: specproxy in front of the REAL llama-server, driven by REAL clients.

Everything here crosses real sockets on 127.0.0.1: the official ``openai`` SDK and Simon Willison's
``llm`` CLI talk to specproxy (the real proxy, on a background loop: ``make_stack``), which forwards
to a real ``llama-server`` running the tiny reciting models of ``tiny_model.py``. The same request
is also sent straight to the server, and the two answers are compared.

Models:

* the shared ``llama_server`` recites ``TINY_SENTENCE`` and ends its turn (``<|eot_id|>``);
* ``tool_server`` runs a model built the same way that recites ``TOOL_SENTENCE``, a Llama-3.1 JSON
  tool call, so llama-server's own tool-call parser turns it into a real ``tool_calls`` answer when
  the request has tools (a bigram model needs distinct tokens: the spacing of that JSON is one
  whose tokens are all different); it is generated once and cached like the fixtures' models;
* the looping model and its draft drive speculative decoding (``--spec-type draft-simple -md``,
  ``ngram-mod``).

Servers started here run one compute thread (see ``timing_servers`` for why).

What is measured against what, and why the bounds are what they are, is in each test's docstring.
"""
from __future__ import annotations

import copy
import json
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from real.fixtures import TinyModel, _cached_model
from real.server import LlamaServer

from specproxy.store.dataset import load_turns
from specproxy.measure.openai import split_prompt
from specproxy.analyze.report import build_report, render_text
from specproxy.measure.tokens import load_tokenizer

pytestmark = pytest.mark.real

# The model writes this; llama-server parses it into tool_calls=[get_weather({"city": "Paris"})].
TOOL_SENTENCE = '{"name":"get_weather","parameters":{"city": "Paris"}}'
# What the client receives as the call's arguments: llama-server re-serialises the parsed object.
TOOL_ARGS = '{"city": "Paris"}'

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


# --------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tool_model(llama_assets_dir: Path) -> TinyModel:
    return _cached_model(llama_assets_dir, sentence=TOOL_SENTENCE, end_with_eot=True, seed=0)


@pytest.fixture(scope="module")
def tool_server(llama_server_bin: Path, tool_model: TinyModel):
    with LlamaServer(llama_server_bin, tool_model.path, threads=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def counter(hf_tokenizer_dir: Path):
    """specproxy's own tokenizer adapter on the models' tokenizer (``--tokenizer hf:DIR``)."""
    return load_tokenizer(f"hf:{hf_tokenizer_dir}")


# ---------------------------------------------------------------------------------------- helpers
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
SDK_CASES = [
    pytest.param("content", False, None, id="content-json"),
    pytest.param("content", True, True, id="content-stream-include_usage"),
    pytest.param("content", True, None, id="content-stream-no-usage"),
    pytest.param("tool_call", False, None, id="toolcall-json"),
    pytest.param("tool_call", True, True, id="toolcall-stream-include_usage"),
]


@pytest.mark.parametrize(("which", "stream", "include_usage"), SDK_CASES)
def test_openai_sdk_output_is_identical_through_the_proxy(request, make_stack, counter, tiny_model, tool_model,
                                                         which, stream, include_usage):
    """The official SDK gets the same answer through specproxy as straight from llama-server.

    Same request (system prompt, two tools, a non-ASCII user message) sent direct and through the
    proxy; everything in the parsed responses is compared except what ``comparable`` masks (and
    says why). For streams the whole chunk sequence is compared, chunk by chunk, including the
    final ``usage`` chunk that only ``stream_options.include_usage`` asks for. The model on
    ``tool_call`` answers with a real tool call parsed by llama-server, so tool calls are compared
    on the wire too. The record the proxy made must agree with what the client saw.
    """
    server = request.getfixturevalue("llama_server" if which == "content" else "tool_server")
    stack, arrivals = proxy(make_stack, server, counter)
    kw: dict = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                "tools": TOOLS}
    if stream:
        kw["stream"] = True
        if include_usage is not None:
            kw["stream_options"] = {"include_usage": include_usage}

    direct = chat(server.url, **kw)
    proxied = chat(stack.url, **kw)
    (rec,) = arrivals.wait(1)

    if stream:
        for chunks in (direct, proxied):
            assert len({c["id"] for c in chunks}) == 1  # one completion id per stream, both ways
        assert [comparable(c) for c in proxied] == [comparable(c) for c in direct]
        content, calls = streamed_text(proxied)
        usage = proxied[-1].get("usage")
        assert (usage is not None) == bool(include_usage)
        finish = [ch["finish_reason"] for c in proxied for ch in c["choices"] if ch.get("finish_reason")]
    else:
        assert comparable(proxied) == comparable(direct)
        msg = proxied["choices"][0]["message"]
        content = msg.get("content") or ""
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
        usage = proxied["usage"]
        finish = [proxied["choices"][0]["finish_reason"]]

    # what was compared is the real thing, not two empty answers
    model = tiny_model if which == "content" else tool_model
    if which == "content":
        assert content == model.sentence and calls == [] and finish == ["stop"]
    else:
        assert content == "" and calls == [("get_weather", TOOL_ARGS)] and finish == ["tool_calls"]

    assert rec.outcome == "ok" and rec.status == 200 and rec.streamed is stream
    assert rec.saw_done is (True if stream else None)
    assert rec.finish_reason == finish[-1]
    if usage is not None:
        assert usage["completion_tokens"] == len(model.token_ids)
        assert (rec.usage_completion_tokens, rec.usage_prompt_tokens) == (usage["completion_tokens"],
                                                                           usage["prompt_tokens"])
    else:
        assert rec.usage_completion_tokens is None and rec.usage_prompt_tokens is None
    assert rec.server_timings is not None  # llama-server sends timings with or without usage


# ============================================================ 2. the llm CLI, with and without
LLM_CASES = [
    pytest.param("content", ["-s", SYSTEM, "Say something."], id="system-stream"),
    pytest.param("content", ["--no-stream", "-s", SYSTEM, "Say something."], id="system-no-stream"),
    pytest.param("content", ["-s", SYSTEM, "--functions", "{fns}", "What's the weather in Paris?"], id="functions"),
    pytest.param("tool_call", ["-s", SYSTEM, "--functions", "{fns}", "--td", "--cl", "2",
                               "What's the weather in Paris?"], id="functions-tool-chain"),
]


def run_llm(home: Path, model_id: str, args: list[str]) -> tuple[int, bytes, bytes]:
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and not k.startswith(("LLM_", "OPENAI_"))}
    env["LLM_USER_PATH"] = str(home)
    p = subprocess.run([sys.executable, "-m", "llm", "-m", model_id, "--no-log", *args], env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize(("which", "args"), LLM_CASES)
def test_llm_cli_output_is_byte_identical_through_the_proxy(request, make_stack, counter, tmp_path, tiny_model,
                                                            tool_model, which, args):
    """``llm`` (PyPI ``llm``) run as a subprocess prints the same bytes through specproxy as direct.

    ``extra-openai-models.yaml`` in a temporary ``LLM_USER_PATH`` declares two OpenAI-compatible
    models with the same ``model_name``: one whose ``api_base`` is the proxy, one the server. Prompts
    with ``-s`` system text, streamed and not, and with ``--functions`` (a Python file defining a
    tool; in this llm version ``--functions`` takes a code block or a file path). On the tool-call
    model llm really runs its tool chain: the model calls ``get_weather``, llm executes it and sends
    the result back, until ``--cl 2`` stops it; that chain is a multi-turn agent history through the
    proxy. Exit code, stdout and stderr must be byte-identical, and every request llm made through
    the proxy must be recorded with token counts that match the server's own.
    """
    server = request.getfixturevalue("llama_server" if which == "content" else "tool_server")
    model = tiny_model if which == "content" else tool_model
    stack, arrivals = proxy(make_stack, server, counter)
    fns = tmp_path / "functions.py"
    fns.write_text(FUNCTIONS_PY)
    args = [a.replace("{fns}", str(fns)) for a in args]
    home = tmp_path / "llm-home"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        "- model_id: tiny-via-proxy\n  model_name: tiny\n"
        f"  api_base: \"{stack.url}/v1\"\n  supports_tools: true\n"
        "- model_id: tiny-direct\n  model_name: tiny\n"
        f"  api_base: \"{server.url}/v1\"\n  supports_tools: true\n")

    predicted_before = metric(server, "llamacpp:tokens_predicted_total")
    via_proxy = run_llm(home, "tiny-via-proxy", args)
    # every answer of these models is the whole recitation: the server's own count of requests
    served = (metric(server, "llamacpp:tokens_predicted_total") - predicted_before) / len(model.token_ids)
    direct = run_llm(home, "tiny-direct", args)
    assert via_proxy == direct

    rc, out, err = via_proxy
    functions = "--functions" in args
    if which == "content":
        assert (rc, out, err) == (0, model.sentence.encode() + b"\n", b"")
        expected_requests = 1
    else:
        # llm executes get_weather, sends the result, the model calls it again... until the chain limit
        assert rc == 1 and out == b"" and b"Chain limit of 2 exceeded" in err
        executed = err.count(b"Tool call: get_weather({'city': 'Paris'})")
        assert executed == 1 and err.count(b"sunny in Paris") == executed
        expected_requests = 2  # the first answer, and the one to the tool's result

    assert served == expected_requests
    records = arrivals.wait(expected_requests)
    for i, rec in enumerate(records):
        assert rec.outcome == "ok" and rec.status == 200
        assert rec.streamed is ("--no-stream" not in args)
        assert rec.prompt_tokens == rec.usage_prompt_tokens  # exact, tool-call history included
        prompt_parts_add_up(rec)
        assert rec.prompt_system_tokens > 0 and rec.prompt_new_tokens > 0
        assert (rec.prompt_tools_tokens > 0) is functions
        assert (rec.prompt_history_tokens > 0) is (i > 0)  # the chain re-sends the call and its result
        if which == "content":
            assert rec.completion_tokens == rec.usage_completion_tokens - 1  # the <|eot_id|>
        else:
            assert rec.completion_tokens == rec.tool_args_tokens == counter.count(TOOL_ARGS)


# ============================================================ 3. token accounting
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_token_counts_equal_the_servers_own(make_stack, counter, llama_server, tiny_model, stream):
    """specproxy's counts equal llama-server's ``usage``, the end-of-turn token explicitly allowed for.

    Request: system prompt, two tools in the canonical shape, and a multi-turn history (user,
    assistant, user). specproxy counts with ``hf:{hf_tokenizer_dir}``.

    * ``prompt_tokens == usage.prompt_tokens`` exactly (specproxy renders the same chat template over
      the same messages and tools), and its four parts add up to it, none of them empty.
    * Turn ended by the model (``finish_reason == "stop"``): ``usage.completion_tokens ==
      completion_tokens + 1``: the server counts the ``<|eot_id|>`` it sampled, which ends the turn
      and is never sent as text. Cut by ``max_tokens`` (``"length"``): no end-of-turn token was
      sampled, so the two are equal.
    """
    stack, arrivals = proxy(make_stack, llama_server, counter)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Say something."},
                {"role": "assistant", "content": tiny_model.sentence},
                {"role": "user", "content": USER}]
    kw = {"messages": messages, "tools": TOOLS}
    if stream:
        kw |= {"stream": True, "stream_options": {"include_usage": True}}
    answers = [chat(stack.url, **kw), chat(stack.url, **kw, max_tokens=4)]
    stop, length = arrivals.wait(2)

    for rec, answer in zip((stop, length), answers):
        usage = answer[-1]["usage"] if stream else answer["usage"]
        assert (rec.usage_prompt_tokens, rec.usage_completion_tokens) == (usage["prompt_tokens"],
                                                                           usage["completion_tokens"])
        assert rec.prompt_tokens == usage["prompt_tokens"]
        prompt_parts_add_up(rec)
        assert min(rec.prompt_system_tokens, rec.prompt_tools_tokens, rec.prompt_history_tokens,
                   rec.prompt_new_tokens) > 0

    assert stop.finish_reason == "stop"
    assert stop.completion_tokens == stop.content_tokens == counter.count(tiny_model.sentence)
    assert stop.usage_completion_tokens == stop.completion_tokens + 1 == len(tiny_model.token_ids)
    assert length.finish_reason == "length"
    assert length.usage_completion_tokens == length.completion_tokens == 4


def test_a_growing_chat_counted_by_pieces_equals_the_servers_prompt_tokens(make_stack, hf_tokenizer_dir,
                                                                          llama_server, tiny_model, monkeypatch):
    """Eight turns of one chat, each resending the whole conversation, as chat clients do: specproxy's
    ``prompt_tokens`` equals llama-server's ``usage.prompt_tokens`` on every turn with the template's
    renders counted piece by piece between the tokenizer's added tokens (``prompt_pieces.py``), its
    checks against whole counts switched off, so that what is compared is the piece count alone."""
    from specproxy.measure import prompt_pieces

    monkeypatch.setattr(prompt_pieces, "VERIFY_FIRST", 0)
    monkeypatch.setattr(prompt_pieces, "VERIFY_EVERY", 10**9)
    tok = load_tokenizer(f"hf:{hf_tokenizer_dir}")
    assert tok.rendered.by_pieces, tok.rendered.why
    stack, arrivals = proxy(make_stack, llama_server, tok)
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(8):
        messages.append({"role": "user", "content": f"{USER} ({turn})" + " more" * turn})
        answer = chat(stack.url, messages=messages, tools=TOOLS, stream=True,
                      stream_options={"include_usage": True}, max_tokens=8)
        (rec,) = arrivals.wait(turn + 1)[turn:]
        assert rec.prompt_tokens == answer[-1]["usage"]["prompt_tokens"], turn
        prompt_parts_add_up(rec)
        assert (rec.prompt_history_tokens > 0) is (turn > 0)
        messages.append({"role": "assistant", "content": streamed_text(answer)[0]})
    assert tok.rendered.verified == 0 and tok.rendered.mismatch is None
    assert tok.rendered._pieces.hits > tok.rendered._pieces.misses  # the conversation was not re-tokenized


def test_agent_history_prompt_tokens_and_the_tool_call_envelope(make_stack, counter, tool_server, tool_model):
    """An agent loop's history (assistant tool calls with JSON-string arguments, tool results).

    * ``prompt_tokens == usage.prompt_tokens`` exactly. The OpenAI API carries tool-call arguments
      as a JSON string; llama-server (like vLLM) parses them into an object before rendering, and
      the Llama-3.1 template writes ``arguments | tojson``: rendering the string as-is would count 2
      tokens too many per call in the history (quotes and escapes). specproxy parses them too.
    * Completion: an exact, documented difference. The model generated ``TOOL_SENTENCE`` + ``<|eot_id|>``
      (``usage.completion_tokens``); the client received the tool call as structure: the name as a
      field and only ``TOOL_ARGS`` as text. specproxy counts delivered text (docs/metrics.md: content,
      reasoning and tool-call arguments), so ``usage.completion_tokens - completion_tokens`` is the
      end-of-turn token plus the JSON envelope the server parsed away
      (``count(TOOL_SENTENCE) - count(TOOL_ARGS)``).
    """
    stack, arrivals = proxy(make_stack, tool_server, counter)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    for n in range(2):
        call = {"id": f"call_{n}", "type": "function", "function": {"name": "get_weather", "arguments": TOOL_ARGS}}
        history += [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{n}", "content": json.dumps({"temp_c": 21 + n})}]
    answer = chat(stack.url, messages=history, tools=TOOLS, stream=True, stream_options={"include_usage": True})
    (rec,) = arrivals.wait(1)

    assert streamed_text(answer)[1] == [("get_weather", TOOL_ARGS)]
    usage = answer[-1]["usage"]
    assert rec.prompt_tokens == usage["prompt_tokens"]
    prompt_parts_add_up(rec)
    assert rec.prompt_history_tokens > 0 and rec.prompt_tools_tokens > 0
    # what the argument parsing fixes: the template fed the JSON strings as-is counts 2 more per call
    as_strings = counter._tok.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert counter.count(as_strings) == usage["prompt_tokens"] + 2 * 2

    assert rec.finish_reason == "tool_calls"
    assert rec.completion_tokens == rec.tool_args_tokens == counter.count(TOOL_ARGS) and rec.content_tokens == 0
    assert usage["completion_tokens"] == len(tool_model.token_ids) == counter.count(TOOL_SENTENCE) + 1
    envelope = counter.count(TOOL_SENTENCE) - counter.count(TOOL_ARGS)
    assert usage["completion_tokens"] - rec.completion_tokens == 1 + envelope == 8


def parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def agent_bodies() -> dict[str, dict]:
    """Requests as coding agents send them: content as arrays of text parts for every role (system,
    user, assistant, tool results), assistant tool calls with no content, parts whose text has edge
    whitespace (the template trims the joined string, not each part)."""
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": TOOL_ARGS}}
    system = {"role": "system", "content": parts(SYSTEM, "Tools are cheap; use them.\n")}
    first = {"role": "user", "content": parts("  What's the weather?", USER)}
    loop = [first,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": parts('{"temp_c": 21}', "(cached)")},
            {"role": "assistant", "content": parts("It is 21 °C.", "Anything else?")},
            {"role": "user", "content": parts("And tomorrow?")},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": [{"type": "text", "text": '{"temp_c": 19}'}]}]
    return {
        "arrays-tools-agent-loop": {"messages": [system, *loop], "tools": TOOLS},
        "arrays-no-tools": {"messages": [system, first, {"role": "assistant", "content": parts("Sunny.")},
                                         {"role": "user", "content": parts("Thanks,", "bye")}]},
        "strings-and-arrays-mixed": {"messages": [{"role": "system", "content": SYSTEM}, *loop[:3],
                                                  {"role": "user", "content": "Plain string again."}],
                                     "tools": TOOLS},
    }


def server_prompt(server: LlamaServer, body: dict) -> tuple[str, int]:
    """llama-server's own render of ``body`` (``/apply-template``) and its token count (``/tokenize``):
    the server renders without the template's BOS text and adds the BOS token (``add_special``)."""
    text = server.post_json("/apply-template", body)["prompt"]
    tokens = server.post_json("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
    return text, len(tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_prompt_tokens_equal_the_servers_apply_template_and_tokenize(make_stack, counter, llama_server, stream):
    """Agent requests with content arrays, tools, tool calls and tool results: specproxy's
    ``prompt_tokens`` equals llama-server's own count of the same body, exactly.

    The truth is the server's: ``/apply-template`` of the body, ``/tokenize`` of that text, and the
    ``usage.prompt_tokens`` of the same body's completion; the three must agree with each other and
    with specproxy's record, and the record's four parts must add up to it. specproxy's rendered text
    must be the server's character for character: content arrays joined with "\n" (not printed as
    the list's repr), tool-call arguments as objects, and the server's date in "Today Date: ...".
    The date is read from both sides in the same test: if the day turns between specproxy's render
    and the server's, the texts are compared again (and must then agree).
    """
    stack, arrivals = proxy(make_stack, llama_server, counter)
    bodies = agent_bodies()
    for i, (name, body) in enumerate(bodies.items()):
        kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        answer = chat(stack.url, **body, max_tokens=1, **kw)
        usage = answer[-1]["usage"] if stream else answer["usage"]
        (rec,) = arrivals.wait(i + 1)[i:]
        text, n = server_prompt(llama_server, body)
        assert rec.prompt_tokens == n == usage["prompt_tokens"] == rec.usage_prompt_tokens, name
        prompt_parts_add_up(rec)
        for _ in range(2):  # twice at most: once more if the day turned between the two renders
            ours = counter.prompt_text(split_prompt(body))
            if counter._tok.bos_token + text == ours or _server_day(text) == _server_day(ours):
                break
            text, _ = server_prompt(llama_server, body)
        assert ours == counter._tok.bos_token + text, name
        assert "'type'" not in text and "26 Jul 2024" not in text
        assert rec.prompt_system_tokens > 0 and rec.prompt_new_tokens > 0
        assert (rec.prompt_tools_tokens > 0) is ("tools" in body)
        assert rec.prompt_history_tokens > 0


def _server_day(prompt: str) -> str | None:
    """The "Today Date: ..." a Llama-3.1 prompt carries."""
    m = re.search(r"Today Date: ([^\n]*)\n", prompt)
    return m.group(1) if m else None


def test_documented_prompt_differences(make_stack, counter, llama_server):
    """An exact difference between what specproxy renders and what llama-server renders: tools not
    in the canonical shape.

    llama-server re-serialises every tool as ``{type, function: {name, description, parameters}}``
    before rendering: a missing description becomes "", any other key (``strict``) is dropped.
    specproxy renders the tools the client sent (servers differ here: vLLM renders its own pydantic
    dump of them). Exactly: specproxy's count of the request with its tools canonicalised equals the
    server's ``usage.prompt_tokens`` for the raw request, and for the raw request specproxy is off by
    the tokens of the line the canonicalisation adds or drops; with Llama 3.1's template (tools
    rendered with ``tojson(indent=4)``): 5 too few for a missing description, 6 too many for
    ``"strict": true``.

    The date is not a difference: specproxy gives the template the ``date_string`` llama-server gives
    it (``test_prompt_tokens_equal_the_servers_apply_template_and_tokenize`` compares the texts).
    """
    stack, arrivals = proxy(make_stack, llama_server, counter)
    params = {"type": "object", "properties": {}}
    canonical = [{"type": "function", "function": {"name": "noop", "description": "", "parameters": params}}]
    variants = {  # raw tools -> canonical count minus specproxy's count of the raw request
        "no description": ([{"type": "function", "function": {"name": "noop", "parameters": params}}], 5),
        "strict": ([{"type": "function", "function": {"name": "noop", "description": "", "parameters": params,
                                                      "strict": True}}], -6),
    }
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    usages = [chat(stack.url, messages=messages, tools=tools, max_tokens=1)["usage"]["prompt_tokens"]
              for tools in [canonical, *(raw for raw, _ in variants.values())]]
    canon_rec, *raw_recs = arrivals.wait(1 + len(variants))

    assert usages == [canon_rec.prompt_tokens] * len(usages)  # the server saw the same prompt each time
    for (name, (raw, missing)), rec in zip(variants.items(), raw_recs):
        assert counter.count_prompt(split_prompt({"messages": messages, "tools": raw})).total == rec.prompt_tokens
        assert usages[0] - rec.prompt_tokens == missing, name


# ============================================================ 4. TTFT and decode time
@pytest.fixture(scope="module")
def timing_servers(llama_server_bin: Path, tiny_model_path: Path, looping_model_path: Path):
    """(reciting, looping) servers with one compute thread each.

    Why one thread: the models are tiny, so a second thread buys nothing, and llama.cpp's worker
    threads meet at a barrier every step: on a 2-vCPU machine shared with other jobs, one
    descheduled worker stalls the step (64 tokens took 1.5-4.4 s with two threads and 0.1-0.13 s
    with one, on the same loaded machine). Timing comparisons need the server to be steady.
    """
    with LlamaServer(llama_server_bin, tiny_model_path, threads=1) as tiny, \
            LlamaServer(llama_server_bin, looping_model_path, threads=1) as looping:
        yield tiny, looping


def timed_turns(make_stack, counter, server: LlamaServer, n: int, **kw) -> list:
    """``n`` streamed turns with prompts of 30 to 30+60(n-1) words, one at a time, each measured
    before the next starts."""
    stack, arrivals = proxy(make_stack, server, counter)
    for i in range(n):
        words = " ".join(f"word{i}x{j}" for j in range(30 + 60 * i))  # new from the start: no cache reuse
        chat(stack.url, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": words}],
             stream=True, stream_options={"include_usage": True}, **kw)
        arrivals.wait(i + 1)
    return arrivals.wait(n)


def test_ttft_and_decode_time_agree_with_the_servers_timings(make_stack, counter, timing_servers):
    """specproxy's ``ttft_s`` and ``decode_s`` against llama-server's own ``timings`` of the same turns.

    What llama-server measures: ``prompt_ms`` from the slot starting on the prompt to the first
    token being sampled; ``predicted_ms`` from that first token to the last token sampled
    (``predicted_n`` tokens, so ``predicted_n - 1`` decoding steps). What specproxy measures:
    ``ttft_s`` from having read the request to the arrival of the first chunk with text; ``decode_s``
    from there to the arrival of the last chunk with text. Both clocks are CLOCK_MONOTONIC on one
    machine, so the durations compare.

    TTFT, every turn: ``ttft_s >= prompt_ms/1000``, no tolerance: the server's interval nests inside
    the proxy's (the request reaches the server after the proxy read it, the first token leaves the
    server after it was sampled). The excess is the server's work outside ``prompt_ms`` (HTTP parse,
    chat template, tokenising: a few ms for these prompts) plus two loopback hops and the wake-ups
    of the threads involved: 6-13 ms per turn (median 6-7 ms) measured on a 2-vCPU machine with
    load average 3 from other test runs; with two server threads instead of one, medians 10-14 ms
    and single turns up to ~280 ms. Bound: median excess <= 30 ms; any single turn <= 1 s (a
    sanity bound: one turn can meet a long stall on a shared machine).

    Decode: the first text chunk carries the token sampled at the start of ``predicted_ms``, and the
    first and last text chunks cross the same path, so only the difference of their delivery delays
    separates the two durations, each delay a few scheduler wake-ups (measured: within +-3 ms, one
    turn in 30 off by 21 ms, medians within 1 ms; with two server threads on the loaded machine,
    single turns up to ~130 ms off, which the medians absorb).

    * Cut by ``max_tokens`` (looping model, 64 tokens): the last text token is the last one sampled,
      so ``decode_s ~ predicted_ms/1000``.
    * Ended by the model (``finish_reason == "stop"``): the last token sampled is ``<|eot_id|>``, one
      step after the last text token, and it is never sent. With steps of equal length,
      ``decode_s ~ predicted_ms/1000 * (n-2)/(n-1)`` (n-2 of the n-1 steps lie between the first and
      the last text token).

    Bounds: median error over the turns of each kind <= 10 ms (cut turns decode for 100-210 ms;
    medians measured within 3 ms even with two CPU burners added). Per turn, sanity only:
    ``decode_s <= predicted_ms/1000 + 1 s`` (the last text cannot arrive long after the server's
    last sample), and for cut turns ``decode_s >= predicted_ms/4000``: decode time cannot vanish (a
    proxy that buffered the stream, or timed chunks when it parsed them rather than when they
    arrived, fails here), but a starved proxy process reads several chunks in one go and then
    measures short: with two CPU burners on top of other jobs one turn measured 70 of 142 ms.

    The servers run one compute thread (see ``timing_servers``), and each turn is measured before
    the next starts, so the proxy's measuring thread never competes with a stream it is timing.
    """
    n_turns = 5
    tiny, looping = timing_servers
    stops = timed_turns(make_stack, counter, tiny, n_turns)
    cuts = timed_turns(make_stack, counter, looping, n_turns, max_tokens=64)

    ttft_excess, errors = [], {"stop": [], "length": []}
    for rec in stops + cuts:
        t = json.loads(rec.server_timings)
        prompt_s, predicted_s, n = t["prompt_ms"] / 1000, t["predicted_ms"] / 1000, t["predicted_n"]
        assert rec.outcome == "ok" and rec.chunks == t["predicted_n"] - (rec.finish_reason == "stop")
        assert rec.t_request <= rec.t_upstream_headers <= rec.t_first_token <= rec.t_last_token <= rec.t_done
        assert prompt_s <= rec.ttft_s <= prompt_s + 1.0, (rec.ttft_s, t)
        ttft_excess.append(rec.ttft_s - prompt_s)
        assert rec.decode_s <= predicted_s + 1.0, (rec.decode_s, t)
        if rec.finish_reason == "length":
            assert n == 64 and rec.decode_s >= predicted_s / 4, (rec.decode_s, t)
            errors["length"].append(rec.decode_s - predicted_s)
        else:
            assert rec.finish_reason == "stop" and n == rec.completion_tokens + 1
            errors["stop"].append(rec.decode_s - predicted_s * (n - 2) / (n - 1))
    assert statistics.median(ttft_excess) <= 0.030, ttft_excess
    for kind, errs in errors.items():
        assert len(errs) == n_turns
        assert abs(statistics.median(errs)) <= 0.010, (kind, errs)


# ============================================================ 5. speculative decoding
@pytest.mark.parametrize("spec", ["draft-simple", "ngram-mod"])
def test_speculative_decoding_counters_match_the_servers_accounting(make_stack, counter, llama_server_bin,
                                                                    looping_model_path, draft_model_path, spec):
    """Speculative decoding on: the server's acceptance shows up in the turn, the counters and the report.

    A dedicated llama-server (looping model; ``--spec-type draft-simple -md draft.gguf`` or
    ``ngram-mod``), the proxy in front with scraping every 50 ms, four turns one after the other
    (each a lone turn, so ``turn_counters`` holds exactly its own counter deltas; the next turn
    starts only once the join was written).

    * The turn's ``server_timings`` has ``draft_n_accepted > 0``.
    * Its ``turn_counters`` row: ``accepted_tokens == draft_n_accepted``, ``draft_tokens ==
      draft_n``, ``generated_tokens == predicted_n``, ``mal == 1 + accepted/drafts > 1``: the MAL
      from the counters is the server's own ``draft_n_accepted`` accounting.
    * draft-simple drafts before every verification pass, so ``drafts + accepted == predicted_n - 1``
      (the first token comes from the prefill): the counters' MAL is exactly tokens per forward
      pass. ngram-mod drafts only when its n-gram table matches, so there ``drafts + accepted <=
      predicted_n - 1`` and the counters' MAL is the mean length of the passes that drafted
      (documented: it overstates tokens per forward pass when some passes draft nothing).
    * ``tokens_per_chunk`` does NOT show the MAL on llama.cpp (an exact, documented difference):
      llama-server sends one SSE event per generated token, accepted drafts included, so ``chunks
      == predicted_n`` and ``tokens_per_chunk = completion_tokens / predicted_n <= 1 < mal``. (It is
      below 1 because the looping text re-tokenises at each "dog.The" seam into one token fewer
      than the model generated: ``completion_tokens == predicted_n - seams``.)
    * The report puts both side by side: per-turn MAL from the counters and the same turns' tokens
      per chunk, on one line of ``render_text``.
    """
    extra = ["--spec-type", spec] + (["-md", str(draft_model_path)] if spec == "draft-simple" else [])
    with LlamaServer(llama_server_bin, looping_model_path, extra_args=extra, threads=1) as srv:
        # store_text: the delivered text is needed to count the re-tokenisation seams below
        stack, arrivals = proxy(make_stack, srv, counter, scrape_interval_s=0.05, store_text=True)
        watch = stack.service.watch
        wait_for(lambda: watch.instance_id is not None, "the first scrape")
        n_turns = 4
        for i in range(n_turns):
            chat(stack.url, messages=[{"role": "user", "content": f"Recite, please ({i})."}], max_tokens=60,
                 temperature=0, stream=True, stream_options={"include_usage": True})
            arrivals.wait(i + 1)
            wait_for(lambda: watch.joined >= i + 1, f"turn {i} joined with its counter deltas")
        records = arrivals.wait(n_turns)
        stack.run(stack.service.stop())  # drains the measurements and the writer's queue
    conn = sqlite3.connect(stack.cfg.db)
    rows = {r[0]: r for r in conn.execute(
        "SELECT turn_id, generated_tokens, drafts, draft_tokens, accepted_tokens, mal FROM turn_counters")}
    assert set(rows) == {rec.id for rec in records}

    mals, tpcs = [], []
    for rec in records:
        t = json.loads(rec.server_timings)
        _, generated, drafts, draft_tokens, accepted, mal = rows[rec.id]
        assert rec.outcome == "ok" and rec.concurrency == 1 and rec.finish_reason == "length"
        assert t["draft_n_accepted"] > 0
        assert (accepted, draft_tokens, generated) == (t["draft_n_accepted"], t["draft_n"], t["predicted_n"])
        assert t["predicted_n"] == 60
        assert drafts > 0 and mal == pytest.approx(1 + accepted / drafts) and mal > 1
        if spec == "draft-simple":
            assert drafts + accepted == t["predicted_n"] - 1
        else:
            assert drafts + accepted <= t["predicted_n"] - 1
        assert rec.chunks == t["predicted_n"] == rec.usage_completion_tokens
        seams = rec.response_text.count(".The")
        assert seams == 5  # 60 tokens of an 11-token sentence: five times "dog." then "The"
        assert rec.completion_tokens == counter.count(rec.response_text) == t["predicted_n"] - seams
        assert rec.tokens_per_chunk == pytest.approx(rec.completion_tokens / rec.chunks)
        assert rec.tokens_per_chunk <= 1 < mal
        mals.append(mal)
        tpcs.append(rec.tokens_per_chunk)

    report = build_report(load_turns(conn), source="spec", conn=conn)
    lone = report["server"]["lone_turns"]
    assert lone["joined"] == n_turns
    assert lone["mal"]["median"] == pytest.approx(statistics.median(mals))
    assert lone["tokens_per_chunk"]["median"] == pytest.approx(statistics.median(tpcs))
    assert report["user"]["tokens_per_chunk"]["median"] == pytest.approx(statistics.median(tpcs))
    # one instance, one restart-free window from before the first turn to after the last: the
    # window's counters are exactly the sum of the turns' (a false restart would split and lose some)
    assert len(report["server"]["instances"]) == 1 and report["server"]["window"]["segments"] == 1
    assert report["server"]["window"]["accepted_tokens"] == sum(rows[r.id][4] for r in records)
    assert report["server"]["window"]["drafts"] == sum(rows[r.id][2] for r in records)
    text = render_text(report)
    assert (f"per-turn MAL median {statistics.median(mals):.2f} beside tokens per chunk median "
            f"{statistics.median(tpcs):.2f}") in text
    assert f"MAL {report['server']['window']['mal']:.2f} (counters" in text
    conn.close()


# ============================================================ 6. a restart during a run
def test_server_restart_shows_as_two_instances(make_stack, counter, llama_server_bin, tiny_model_path):
    """``LlamaServer.restart()`` mid-run: the turns before and after carry two instance ids.

    The proxy scrapes every 50 ms; llama-server's ``/metrics`` names its start time, so the new
    process is a new instance. Turns before the restart carry the first id; the turn sent the
    moment the new process is healthy must succeed (the proxy's pooled connection to the dead
    process must not turn into a 502) and carries whichever instance the watch knew when it
    started (stamping lags a restart by up to one scrape interval); turns after the watch saw the
    new instance carry the second id. The report counts two instances, the text says so, and the
    instances table has both.
    """
    with LlamaServer(llama_server_bin, tiny_model_path, threads=1) as srv:
        stack, arrivals = proxy(make_stack, srv, counter, scrape_interval_s=0.05)
        watch = stack.service.watch
        wait_for(lambda: watch.instance_id is not None, "the first scrape")
        first = watch.instance_id
        msgs = [{"role": "user", "content": "Say something."}]
        for _ in range(2):
            chat(stack.url, messages=msgs, stream=True)
        srv.restart()
        chat(stack.url, messages=msgs, stream=True)  # the first turn on the new process
        wait_for(lambda: watch.instance_id not in (None, first), "the watch to see the new instance")
        second = watch.instance_id
        for _ in range(2):
            chat(stack.url, messages=msgs, stream=True)
        records = arrivals.wait(5)
        stack.run(stack.service.stop())

    records.sort(key=lambda r: r.t_request)
    assert [r.outcome for r in records] == ["ok"] * 5
    ids = [r.instance_id for r in records]
    assert ids[:2] == [first, first] and ids[2] in (first, second) and ids[3:] == [second, second]
    conn = sqlite3.connect(stack.cfg.db)
    report = build_report(load_turns(conn), source="restart", conn=conn)
    assert sorted(report["server"]["instances"]) == sorted([first, second])
    assert sorted(report["server"]["turn_instances"]) == sorted([first, second])
    assert report["server"]["window"]["segments"] == 2
    assert "2 server instances" in render_text(report)
    assert conn.execute("SELECT count(*) FROM instances").fetchone()[0] == 2
    conn.close()
