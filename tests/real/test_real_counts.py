"""specproxy's token counts against the REAL llama-server's own: completion tokens, prompt tokens by
pieces (system, tools, history, new), a growing chat, an agent's history, and the documented
differences between the two. Servers, models and the ``counter`` tokenizer are ``fixtures``'; the
request and helpers ``clientkit``'s. Why each bound is what it is: each test's docstring.
"""
from __future__ import annotations

import json
import re

import pytest
from real.clientkit import (
    SYSTEM,
    TOOLS,
    USER,
    chat,
    prompt_parts_add_up,
    proxy,
    sdk,
    streamed_text,
)
from real.fixtures import TOOL_ARGS, TOOL_SENTENCE
from real.server import LlamaServer

from specproxy.measure.openai import split_prompt
from specproxy.measure.tokens import load_tokenizer

pytestmark = pytest.mark.real


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


def test_tools_and_roles_counted_as_the_server_renders_them(make_stack, counter, llama_server):
    """Requests llama-server reshapes before rendering: tools not in the canonical shape (it
    re-serialises each as ``{type, function: {name, description, parameters}}``: a missing description
    is "", ``strict`` dropped) and ``developer`` messages (rendered as ``system``), with multi-part
    content. specproxy renders what the server renders, so its ``prompt_tokens`` is the server's
    ``usage.prompt_tokens`` for each raw request, and its render is the server's ``/apply-template``."""
    stack, arrivals = proxy(make_stack, llama_server, counter)
    params = {"type": "object", "properties": {}}
    variants = {
        "canonical": [{"type": "function", "function": {"name": "noop", "description": "", "parameters": params}}],
        "no description": [{"type": "function", "function": {"name": "noop", "parameters": params}}],
        "strict": [{"type": "function", "function": {"name": "noop", "description": "", "parameters": params,
                                                     "strict": True}}],
    }
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "developer", "content": [{"type": "text", "text": "Be brief."},
                                                  {"type": "text", "text": "Use tools."}]},
                {"role": "user", "content": [{"type": "text", "text": USER}, {"type": "text", "text": "Go."}]}]
    bodies = {name: {"messages": messages, "tools": tools} for name, tools in variants.items()}
    usages = [chat(stack.url, **body, max_tokens=1)["usage"]["prompt_tokens"] for body in bodies.values()]
    recs = arrivals.wait(len(bodies))

    for (name, body), rec, usage in zip(bodies.items(), recs, usages):
        assert rec.prompt_tokens == usage == server_prompt(llama_server, body)[1], name
        prompt_parts_add_up(rec)
    text, _ = server_prompt(llama_server, bodies["strict"])
    ours = counter.prompt_text(split_prompt(bodies["strict"]))
    if _server_day(text) == _server_day(ours):  # not across midnight
        assert ours == counter._tok.bos_token + text


def _first_choices_usage(url: str, body: dict) -> dict:
    """Choice 0's usage, by plain HTTP: streamed, llama-server ends each prompt's task with its usage and
    a ``data: null`` event (on which the openai SDK fails); whole, the answer's usage is the first's."""
    import urllib.request

    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as r:
        text = r.read().decode()
    if not body.get("stream"):
        return json.loads(text)["usage"]
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    (usage,) = [e["usage"] for e in events if e.get("usage") and e["choices"][0]["index"] == 0]
    assert any(e.get("usage") and e["choices"][0]["index"] == 1 for e in events)  # the other prompt's, apart
    return usage


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_completions_prompt_tokens_equal_the_servers(make_stack, counter, llama_server, stream):
    """``/v1/completions``: the server tokenizes the prompt with its beginning-of-text token (Llama 3's
    ``<|begin_of_text|>``), so ``prompt_tokens`` is the text's tokens plus one; a prompt of token ids
    gets none. A list of several prompts is one task per prompt and llama-server's ``usage`` is the
    first's, so the turn is the first prompt and its answer (choice 0): both counts are the usage's.
    Completion: an answer cut by ``max_tokens`` is counted as the server counts it; one the model ended
    is one token short, the end-of-turn token the server sampled and never sent (as chat's)."""
    stack, arrivals = proxy(make_stack, llama_server, counter)
    ids = counter.encode("Hello there")
    prompts = ["The quick", "The quick brown fox jumps over the lazy dog. " * 20, ids, ["Hello there", "General Kenobi"]]
    kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    usages = []
    with sdk(stack.url) as client:
        for prompt in prompts[:-1]:
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, **kw)
            usages.append(([c.to_dict() for c in answer][-1] if stream else answer.to_dict())["usage"])
    usages.append(_first_choices_usage(stack.url, {"model": "tiny", "prompt": prompts[-1], "max_tokens": 4,
                                                   "temperature": 0, **kw}))
    recs = arrivals.wait(len(usages))

    for prompt, rec, usage in zip(prompts, recs, usages):
        assert rec.api == "completions"
        assert rec.prompt_tokens == rec.prompt_new_tokens == usage["prompt_tokens"] == rec.usage_prompt_tokens, prompt
        assert rec.completion_tokens + (rec.finish_reason == "stop") == usage["completion_tokens"], prompt
        assert rec.finish_reason in ("stop", "length") and (rec.finish_reason == "stop" or rec.completion_tokens == 4)
    assert recs[0].prompt_tokens == counter.count("The quick") + 1 and recs[2].prompt_tokens == len(ids)


# ============================================================ 4. TTFT and decode time
