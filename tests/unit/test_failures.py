"""A measuring step that fails leaves its figure null (never 0), is counted and is logged once per cause,
rate-limited, without the turn's text."""

from __future__ import annotations

import json
import logging
import shutil
import time

import pytest

from specproxy.app.fake_upstream import LLAMA3_STYLE_TEMPLATE
from specproxy.measure.build import build_record
from specproxy.measure.failures import FAILURES, Failures
from specproxy.measure.openai import split_prompt
from specproxy.measure.tokens import load_tokenizer
from specproxy.measure.turn_recorder import TurnRecorder

SECRET = "sk-secret-0123456789"
CHAT = {"model": "m", "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": f"first question {SECRET}"},
    {"role": "assistant", "content": "first answer"},
    {"role": "user", "content": "the new question?"},
]}
SSE = b'data: {"choices":[{"index":0,"delta":{"content":"hello there"}}]}\n\ndata: [DONE]\n\n'


def test_a_cause_is_logged_at_its_first_failure_then_at_most_once_per_interval(caplog):
    now = [100.0]
    failures = Failures(log_every_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="specproxy.measure"):
        for _ in range(3):
            failures.note("step a failed", KeyError(SECRET))
        failures.note("step b failed")
        now[0] += 59.0
        failures.note("step a failed", KeyError(SECRET))
        now[0] += 1.0
        failures.note("step a failed", KeyError(SECRET))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # a's first, b's first, a again a minute after its first
    assert lines[0].startswith("measuring: step a failed (KeyError);") and "1 so far" in lines[0]
    assert lines[2].startswith("measuring: step a failed (KeyError);") and "5 so far" in lines[2]
    assert not any(SECRET in line for line in lines)  # the type is kept, never the message
    assert failures.counts() == {"step a failed (KeyError)": 5, "step b failed": 1}
    assert failures.total() == 6


class _PromptRaises:
    """A tokenizer whose prompt count raises with the prompt's text in its message (as tokenizers do)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name

    def count(self, text):
        return self.inner.count(text)

    def token_ends(self, text):
        return self.inner.token_ends(text)

    def count_prompt(self, parts):
        raise ValueError(f"cannot count {parts.new[0]['content']!r}")


def test_a_prompt_count_that_raises_leaves_the_prompt_null_counted_and_logged_without_text(tiktoken_tok, caplog):
    b = TurnRecorder(method="POST", path="/v1/chat/completions", body=json.dumps(CHAT).encode(),
                      t_wall=time.time(), t_request=1.0)
    b.on_headers(1.1, 200, "text/event-stream")
    b.on_bytes(SSE, 1.2, 1.2)
    b.finish(1.3)
    before = FAILURES.counts().get("counting the prompt failed, its figures null (ValueError)", 0)
    with caplog.at_level(logging.WARNING, logger="specproxy.measure"):
        rec = build_record(b, _PromptRaises(tiktoken_tok))
    assert rec.prompt_tokens is None and rec.prompt_new_tokens is None
    assert rec.completion_tokens == tiktoken_tok.count("hello there") and rec.outcome == "ok"
    assert FAILURES.counts()["counting the prompt failed, its figures null (ValueError)"] == before + 1
    assert SECRET not in caplog.text and "the new question" not in caplog.text


@pytest.fixture(scope="module")
def fragile_template_tok(hf_dir, tmp_path_factory):
    """The suite's Llama-3 tokenizer with a template that raises on a conversation ending with the
    assistant without a generation prompt: the history's render, one of those that split the parts."""
    d = tmp_path_factory.mktemp("hf-fragile")
    shutil.copy(hf_dir / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if messages and messages[-1]['role'] == 'assistant' and not add_generation_prompt %}"
                               "{{ raise_exception('ends with the assistant') }}{% endif %}" + LLAMA3_STYLE_TEMPLATE)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(f"hf:{d}")


def test_a_template_render_that_fails_is_counted_when_the_parts_fall_back_to_plain_text(fragile_template_tok, hf_tok,
                                                                                        caplog):
    key = "a chat template render failed, the prompt's parts counted as plain text (TemplateError)"
    before = FAILURES.counts().get(key, 0)
    with caplog.at_level(logging.WARNING, logger="specproxy.measure"):
        counts = fragile_template_tok.count_prompt(split_prompt(CHAT))
    assert FAILURES.counts()[key] == before + 1
    assert SECRET not in caplog.text
    # the whole render still counts: the total is the template's, the parts plain text around it
    assert counts.total == hf_tok.count_prompt(split_prompt(CHAT)).total
    assert counts.total == counts.system + counts.tools + counts.history + counts.new
    assert counts.history == hf_tok.count(CHAT["messages"][1]["content"]) + hf_tok.count("first answer")
