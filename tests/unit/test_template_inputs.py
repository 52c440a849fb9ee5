"""What a server hands its chat template: content arrays joined as servers join them, the date it passes.

The truth for each rule is what llama.cpp's server does (``template_inputs``' docstring says what and
why); the live comparison with llama-server is in the real tier
(``tests/real/test_real_counts.py::test_prompt_tokens_equal_the_servers_apply_template_and_tokenize``).
"""

from __future__ import annotations

import datetime as real_datetime
import json
import shutil
from pathlib import Path

import pytest

from specproxy.measure import template_inputs
from specproxy.measure.openai import split_prompt
from specproxy.measure.template_inputs import content_style, date_inputs, server_messages
from specproxy.measure.tokens import load_tokenizer

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def agent_turn(content) -> dict:
    """An agent's request, every message's content made by ``content`` from its texts."""
    call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    return {"messages": [
        {"role": "system", "content": content("You are a coding agent.", "Be brief.\n")},
        {"role": "user", "content": content("Fix the bug", "in a.py  ")},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": content("def f():\n    return 1", "# end")},
        {"role": "user", "content": content("Now run the tests.")},
    ], "tools": TOOLS}


def joined(*texts: str) -> str:
    return "\n".join(texts)


def with_template(hf_dir: Path, tmp_path: Path, template: str) -> Path:
    """A copy of the suite's Llama-3 tokenizer directory with another chat template."""
    d = tmp_path / "templated"
    shutil.copytree(hf_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


# A template that reads typed content itself and takes strings too (the shape of Qwen's and others').
READS_PARTS = (
    "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{%- if m['content'] is string %}{{ m['content'] }}"
    "{%- else %}{%- for p in m['content'] %}{%- if p['type'] == 'text' %}[{{ p['text'] }}]{%- endif %}"
    "{%- endfor %}{%- endif %}<|eot_id|>{%- endfor %}"
)
# One that takes parts only (a string would be iterated character by character, with no text).
PARTS_ONLY = (
    "{%- for m in messages %}{{ m['role'] }}: {%- for p in m['content'] %}{{ p['text'] }}{%- endfor %}\n"
    "{%- endfor %}"
)
# A Llama-3.1-style system header: llama.cpp passes date_string; strftime_now is the clock's.
DATED = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\nToday Date: {{ date_string }}\n"
    "{% if datetime is defined %}Also: {{ datetime }}\n{% endif %}"
    "Year: {{ strftime_now('%Y') }}<|eot_id|>"
    "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{- m['content'] | trim }}<|eot_id|>{%- endfor %}"
)


def test_content_arrays_count_as_their_text_joined_with_newlines(hf_tok):
    """A string-content template (Llama 3's shape: ``content | trim``) given content arrays renders the
    text parts joined with "\\n", as llama.cpp and vLLM join them, for every role: system, user and
    tool results; not the array's Python repr. Counts and every part of the split are those of the
    same request with the joined strings."""
    as_arrays = split_prompt(agent_turn(parts))
    as_strings = split_prompt(agent_turn(joined))
    counts = hf_tok.count_prompt(as_arrays)
    assert counts == hf_tok.count_prompt(as_strings)
    assert hf_tok.content_style == "string"
    text = hf_tok.prompt_text(as_arrays)
    assert text == hf_tok.prompt_text(as_strings)
    assert "'type'" not in text and "Fix the bug\nin a.py<|eot_id|>" in text
    assert "def f():\n    return 1\n# end" in text and "You are a coding agent.\nBe brief." in text
    assert counts.total == hf_tok.count(text)


def test_non_text_parts_are_left_out_of_the_join():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    (m,) = server_messages([{"role": "user", "content": [image, *parts("a", "b"), image]}], "string")
    assert m["content"] == "a\nb"


def test_content_becomes_what_the_template_takes():
    """string: arrays joined; typed: strings become one text part; both: as sent. Null or absent
    content is "" (llama.cpp and vLLM give templates a string, never None); tool-call arguments are
    parsed; messages that need nothing are the caller's own objects, untouched."""
    plain = {"role": "user", "content": "hi"}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    msgs = [plain, {"role": "user", "content": parts("a", "b")}, {"role": "assistant", "tool_calls": [call]},
            {"role": "assistant", "content": None}, {"role": "user", "content": []}]
    before = json.dumps(msgs)
    s = server_messages(msgs, "string")
    assert s[0] is plain
    assert [m["content"] for m in s] == ["hi", "a\nb", "", "", ""]
    assert s[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    t = server_messages(msgs, "typed")
    assert [m["content"] for m in t] == [parts("hi"), parts("a", "b"), parts(""), parts(""), parts("")]
    b = server_messages(msgs, "both")
    assert [m["content"] for m in b] == ["hi", parts("a", "b"), "", "", ""]
    assert json.dumps(msgs) == before  # the request itself is never edited


@pytest.mark.parametrize(("template", "style"), [
    (None, "string"),
    (READS_PARTS, "both"),
    (PARTS_ONLY, "typed"),
], ids=["llama3-string", "reads-parts", "parts-only"])
def test_the_content_a_template_takes_is_found_by_rendering(hf_dir, tmp_path, template, style):
    d = with_template(hf_dir, tmp_path, template) if template else hf_dir
    tok = load_tokenizer(f"hf:{d}")
    assert tok.content_style == style
    # and what each is given renders the text once, with no array printed
    text = tok.prompt_text(split_prompt({"messages": [{"role": "user", "content": parts("one", "two")}]}))
    assert "'type'" not in text and text.count("one") == 1 and text.count("two") == 1


def test_content_style_of_a_template_that_fails_on_arrays_is_string():
    def render(messages):
        content = messages[0]["content"]
        if not isinstance(content, str):
            raise TypeError("can only concatenate str")
        return "<s>" + content

    assert content_style(render) == "string"


class _FixedClock(real_datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2031, 2, 3, 23, 59, 59)


def test_templates_get_the_date_llama_server_passes(hf_dir, tmp_path, monkeypatch):
    """``date_string`` "%d %b %Y" and ``datetime`` "%b %d %Y", today in local time, as llama-server
    passes them; not the template's own default ("26 Jul 2024") that a bare render prints. The clock
    is fixed so that the test cannot meet midnight."""
    monkeypatch.setattr(template_inputs, "datetime", _FixedClock)
    tok = load_tokenizer(f"hf:{with_template(hf_dir, tmp_path, DATED)}")
    parts_ = split_prompt({"messages": [{"role": "user", "content": "hi"}]})
    years = {real_datetime.datetime.now().year}  # strftime_now: transformers' own, the real clock
    total = tok.count_prompt(parts_).total
    years.add(real_datetime.datetime.now().year)  # a new year may begin during the test
    expected = {("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday Date: 03 Feb 2031\n"
                 f"Also: Feb 03 2031\nYear: {y}<|eot_id|><|start_header_id|>user<|end_header_id|>hi<|eot_id|>")
                for y in years}
    assert total in {tok.count(e) for e in expected}
    assert date_inputs() == {"date_string": "03 Feb 2031", "datetime": "Feb 03 2031"}
    assert tok.prompt_text(parts_) in expected


def test_date_inputs_use_the_given_moment():
    moment = real_datetime.datetime(2024, 7, 9, 0, 0, 1)
    assert date_inputs(moment) == {"date_string": "09 Jul 2024", "datetime": "Jul 09 2024"}


def test_arrays_and_strings_share_the_piece_memo(hf_dir):
    """Content normalised before rendering keys the memo: a conversation resent with its content as
    arrays after being sent as strings tokenizes no new piece."""
    tok = load_tokenizer(f"hf:{hf_dir}")
    assert tok.rendered.by_pieces
    tok.count_prompt(split_prompt(agent_turn(joined)))
    misses = tok.rendered._pieces.misses
    tok.count_prompt(split_prompt(agent_turn(parts)))
    assert tok.rendered._pieces.misses == misses


# GPT-OSS's template renders the developer role itself (its source has "<|channel|>"); this one prints roles.
CHANNEL = (
    "{%- for m in messages %}<|start|>{{ m['role'] }}<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{%- endfor %}"
)
# A template that never reads a system message (llama.cpp: supports_system_role false), Gemma's shape.
NO_SYSTEM = (
    "{{- bos_token }}{%- for m in messages %}{%- if m['role'] != 'system' %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{- m['content'] | trim }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
)


def test_a_developer_message_is_rendered_as_a_system_message(hf_tok):
    """llama.cpp gives every template a ``developer`` message as ``system`` (common/chat.cpp
    ``map_developer_role_to_system``): the same render, and the same count, as the system message."""
    def body(role):
        return {"messages": [{"role": "system", "content": "You are terse."},
                             {"role": role, "content": parts("Be brief.", "Use tools.")},
                             {"role": "user", "content": "Hi"}]}

    dev, sys_ = split_prompt(body("developer")), split_prompt(body("system"))
    text = hf_tok.prompt_text(dev)
    assert text == hf_tok.prompt_text(sys_) and "developer" not in text
    assert hf_tok.count_prompt(dev) == hf_tok.count_prompt(sys_)


def test_gpt_oss_templates_keep_the_developer_role(hf_dir, tmp_path):
    tok = load_tokenizer(f"hf:{with_template(hf_dir, tmp_path, CHANNEL)}")
    text = tok.prompt_text(split_prompt({"messages": [{"role": "developer", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi"}]}))
    assert "<|start|>developer<|channel|>" in text


def test_a_template_that_does_not_read_system_gets_it_joined_to_the_next_message(hf_dir, tmp_path):
    """llama.cpp's ``system_message_not_supported``: the first system message's content, "\\n", then the
    next message's; alone, it is dropped."""
    tok = load_tokenizer(f"hf:{with_template(hf_dir, tmp_path, NO_SYSTEM)}")
    assert tok.system_read is False
    text = tok.prompt_text(split_prompt({"messages": [{"role": "developer", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi"}]}))
    assert "<|start_header_id|>user<|end_header_id|>Be brief.\nHi<|eot_id|>" in text
    counts = tok.count_prompt(split_prompt({"messages": [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Hi"}]}))
    assert counts.total == tok.count(text) and counts.system > 0
    assert load_tokenizer(f"hf:{hf_dir}").system_read is True


def test_tools_are_rendered_in_the_shape_llama_server_renders_them(hf_tok):
    """A missing description is "", a missing schema {}, other keys (``strict``) dropped: the request
    counts as its canonical tools do."""
    def body(fn):
        return {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": fn}]}

    canonical = hf_tok.count_prompt(split_prompt(body({"name": "noop", "description": "", "parameters": {}})))
    for raw in ({"name": "noop"}, {"name": "noop", "description": "", "parameters": {}, "strict": True}):
        assert hf_tok.count_prompt(split_prompt(body(raw))) == canonical, raw


# Qwen3's shape: an empty thinking block when the request turns thinking off (chat_template_kwargs).
THINKING = (
    "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)


def test_a_requests_chat_template_kwargs_reach_the_template(hf_dir, tmp_path):
    """Servers give the template a request's ``chat_template_kwargs`` (llama.cpp after its date variables,
    so they win); keys that are the renderer's own arguments are not the template's."""
    tok = load_tokenizer(f"hf:{with_template(hf_dir, tmp_path, THINKING)}")
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    off = {**body, "chat_template_kwargs": {"enable_thinking": False, "tokenize": True, "date_string": "x"}}
    plain, thinking_off = split_prompt(body), split_prompt(off)
    assert "<think>" not in tok.prompt_text(plain) and "<think>\n\n</think>" in tok.prompt_text(thinking_off)
    assert tok.count_prompt(thinking_off).total == tok.count(tok.prompt_text(thinking_off))
    assert tok.count_prompt(thinking_off).total > tok.count_prompt(plain).total
