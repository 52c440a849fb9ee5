"""specproxy in front of the REAL llama-server, driven by REAL clients: their output is identical.

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

The token counts and prompt pieces are checked against the server's own in ``test_real_counts``, the
timings and speculative-decoding counters in ``test_real_timing``; shared helpers are in ``clientkit``,
the models and servers in ``fixtures``. What is measured against what, and why the bounds are what
they are, is in each test's docstring.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from real.clientkit import (
    FUNCTIONS_PY,
    SYSTEM,
    TOOLS,
    USER,
    chat,
    comparable,
    metric,
    prompt_parts_add_up,
    proxy,
    streamed_text,
)
from real.fixtures import TOOL_ARGS

pytestmark = pytest.mark.real


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
    # the tools this answer called, read from the answer llama-server wrote (the request resends none)
    assert (rec.tools_defined, rec.tools_called) == (len(TOOLS), len(calls))
    assert json.loads(rec.tool_names)["called"] == [hashlib.blake2b(n.encode(), digest_size=6).hexdigest()
                                                    for n, _ in calls]
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
