"""Proof that the real-llama.cpp test infrastructure works.

These tests pin down the llama-server behaviour specproxy relies on (stream
shape, usage accounting, speculative-decoding counters, tokenizer parity), so
a llama.cpp upgrade that changes any of it fails here first, with a clear
message, rather than somewhere inside a proxy test.
"""
from __future__ import annotations

import re
import time

import pytest

from real.server import LlamaServer

pytestmark = pytest.mark.real

USER = [{"role": "user", "content": "Say something."}]


def _text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, re.M)
    assert m, f"metric {name} missing from /metrics:\n{text}"
    return float(m.group(1))


# --------------------------------------------------------------------- basics
def test_server_starts_and_recites_greedy(llama_server, tiny_model):
    r = llama_server.post_json("/v1/chat/completions", {"messages": USER, "temperature": 0})
    choice = r["choices"][0]
    assert choice["message"]["content"] == tiny_model.sentence
    assert choice["finish_reason"] == "stop"
    # The trap: completion_tokens counts the end-of-turn token, which is not in the text.
    assert r["usage"]["completion_tokens"] == len(tiny_model.token_ids)
    assert r["usage"]["completion_tokens"] == len(tiny_model.token_ids[:-1]) + 1


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}])
def test_recites_under_default_sampling(llama_server, tiny_model, sampling):
    for _ in range(3):
        r = llama_server.post_json("/v1/chat/completions", {"messages": USER, **sampling})
        assert r["choices"][0]["message"]["content"] == tiny_model.sentence


def test_max_tokens_truncates(llama_server, tiny_model):
    r = llama_server.post_json("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "temperature": 0})
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 3
    assert tiny_model.sentence.startswith(r["choices"][0]["message"]["content"])


def test_tokenize_endpoint_agrees_with_generator(llama_server, tiny_model):
    toks = llama_server.post_json("/tokenize", {"content": tiny_model.sentence})["tokens"]
    assert toks == tiny_model.token_ids[:-1]


# ------------------------------------------------------------------ streaming
def test_stream_final_chunk_has_usage_and_timings(llama_server, tiny_model):
    chunks = llama_server.stream_chat({"messages": USER, "stream_options": {"include_usage": True}})
    assert _text(chunks) == tiny_model.sentence
    final = chunks[-1]
    assert final["choices"] == []
    assert final["object"] == "chat.completion.chunk"
    assert final["usage"]["completion_tokens"] == len(tiny_model.token_ids)
    assert final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + final["usage"]["completion_tokens"]
    t = final["timings"]
    for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n"):
        assert key in t, key
    assert t["predicted_n"] == len(tiny_model.token_ids)
    assert t["prompt_n"] + t["cache_n"] == final["usage"]["prompt_tokens"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_stream_without_include_usage_has_timings_but_no_usage(llama_server):
    chunks = llama_server.stream_chat({"messages": USER})
    assert not any("usage" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "timings" in chunks[-1]


# ------------------------------------------------------------- spec decoding
SPEC_COUNTERS = ("llamacpp:spec_decode_num_drafts_total", "llamacpp:spec_decode_num_draft_tokens_total",
                 "llamacpp:spec_decode_num_accepted_tokens_total")


@pytest.mark.parametrize("spec", ["ngram-mod", "draft-simple"])
def test_speculative_decoding_counters(llama_server_bin, looping_model_path, draft_model_path, tiny_model, spec):
    extra = ["--spec-type", spec] + (["-md", str(draft_model_path)] if spec == "draft-simple" else [])
    with LlamaServer(llama_server_bin, looping_model_path, extra_args=extra) as srv:
        chunks = srv.stream_chat({"messages": USER, "max_tokens": 120, "temperature": 0,
                                  "stream_options": {"include_usage": True}})
        text = _text(chunks)
        assert text.startswith(tiny_model.sentence * 2)
        t = chunks[-1]["timings"]
        assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
        assert chunks[-1]["usage"]["completion_tokens"] == 120
        metrics = srv.metrics_text()
        for name in SPEC_COUNTERS:
            assert _metric(metrics, name) > 0, name
        assert _metric(metrics, "llamacpp:spec_decode_num_draft_tokens_total") == t["draft_n"]
        assert _metric(metrics, "llamacpp:spec_decode_num_accepted_tokens_total") == t["draft_n_accepted"]
        assert _metric(metrics, "llamacpp:requests_processing") == 0


def test_draft_model_needs_spec_type(llama_server_bin, looping_model_path, draft_model_path):
    """``-md`` alone loads the draft but never drafts in this llama.cpp (a config trap)."""
    with LlamaServer(llama_server_bin, looping_model_path, extra_args=["-md", str(draft_model_path)]) as srv:
        chunks = srv.stream_chat({"messages": USER, "max_tokens": 40, "temperature": 0})
        assert "draft_n" not in chunks[-1]["timings"]
        assert _metric(srv.metrics_text(), "llamacpp:spec_decode_num_draft_tokens_total") == 0


# --------------------------------------------------------- tokenizer parity
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city, in °C — \"quoted\" & <tagged>.",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
CHAT = [{"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "What's the weather in Zürich? 日本語 🚀\n\nThanks"}]


def llama_server_tools(tools: list[dict]) -> list[dict]:
    """Re-shape tools the way llama-server does before rendering its template.

    llama.cpp parses each tool into (name, description, parameters) and
    re-serializes it: keys ordered type/function/name/description/parameters,
    a missing description becomes "", a missing parameters becomes {}, any
    other key (e.g. "strict") is dropped.  A proxy must do the same to count
    prompt tokens exactly.
    """
    out = []
    for t in tools:
        f = t["function"]
        out.append({"type": "function", "function": {"name": f["name"], "description": f.get("description", ""),
                                                      "parameters": f.get("parameters", {})}})
    return out


@pytest.fixture(scope="module")
def tiny_hf_tok(hf_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))


def _server_date(srv_text: str) -> str:
    """The date llama-server put in the prompt.

    llama-server passes ``date_string`` = the local date as "%d %b %Y" to every
    template (the Llama-3.1 template's own default is "26 Jul 2024").  We read
    it back rather than calling strftime so the test cannot flake at midnight.
    """
    m = re.search(r"Today Date: (\d{2} [A-Z][a-z]{2} \d{4})\n", srv_text)
    assert m, srv_text[:300]
    return m.group(1)


@pytest.mark.parametrize("with_tools", [False, True])
def test_hf_tokenizer_matches_server_prompt_tokens(llama_server, tiny_hf_tok, with_tools):
    kw = {"tools": llama_server_tools(TOOLS)} if with_tools else {}
    srv_text = llama_server.post_json("/apply-template", {"messages": CHAT, **kw})["prompt"]
    date = _server_date(srv_text)
    assert date in (time.strftime("%d %b %Y"), time.strftime("%d %b %Y", time.localtime(time.time() - 60)))
    hf_ids = tiny_hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        date_string=date, **kw)["input_ids"]
    payload = {"messages": CHAT, "max_tokens": 1, "temperature": 0, **({"tools": TOOLS} if with_tools else {})}
    r = llama_server.post_json("/v1/chat/completions", payload)
    assert r["usage"]["prompt_tokens"] == len(hf_ids)
    # Exact text too: llama.cpp strips the template's leading BOS *text* and adds
    # the BOS *token* instead; HF keeps the text and tokenizes it to the same id.
    hf_text = tiny_hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, date_string=date, **kw)
    assert tiny_hf_tok.bos_token + srv_text == hf_text
    assert hf_ids[0] == tiny_hf_tok.bos_token_id and hf_ids[1] != tiny_hf_tok.bos_token_id


def test_unnormalized_tools_differ_from_server(llama_server, tiny_hf_tok):
    """Documents why llama_server_tools() exists: raw tools render differently."""
    srv = llama_server.post_json("/apply-template", {"messages": CHAT, "tools": TOOLS})["prompt"]
    raw = tiny_hf_tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                     date_string=_server_date(srv))
    assert tiny_hf_tok.bos_token + srv != raw
    assert '"description": ""' in srv and '"description": ""' not in raw


@pytest.mark.parametrize("text", ["The quick brown fox", " leading space", "日本語 🚀 123456 don't\n\n\tx",
                                  "<|eot_id|> special in text"])
def test_hf_tokenizer_matches_server_tokenize(llama_server, tiny_hf_tok, text):
    srv = llama_server.post_json("/tokenize", {"content": text, "add_special": True, "parse_special": True})
    assert srv["tokens"] == tiny_hf_tok(text).input_ids


# ------------------------------------------------------------------ lifecycle
def test_restart_keeps_url_and_resets_metrics(llama_server_bin, tiny_model):
    with LlamaServer(llama_server_bin, tiny_model.path) as srv:
        url = srv.url
        srv.post_json("/v1/chat/completions", {"messages": USER})
        assert _metric(srv.metrics_text(), "llamacpp:tokens_predicted_total") == len(tiny_model.token_ids)
        srv.restart()
        assert srv.url == url
        assert _metric(srv.metrics_text(), "llamacpp:tokens_predicted_total") == 0
        assert srv.get_json("/health")["status"] == "ok"
    assert srv.proc is None


def test_startup_failure_surfaces_server_log(llama_server_bin, tmp_path):
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    srv = LlamaServer(llama_server_bin, bogus, startup_deadline_s=30)
    with pytest.raises(Exception) as ei:
        srv.start()
    assert "exited with code" in str(ei.value) and "load" in str(ei.value).lower()
    assert srv.proc is None
    srv.cleanup_log()  # failed starts keep their log for debugging; this one was intended
