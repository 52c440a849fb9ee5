"""Roles as llama-server gives them to a template, against the REAL server: a ``developer`` message is a
``system`` one, and a template that does not read system messages gets the first one joined to the
next message. The tier's Llama-3.1 template prints any role it is given, and "developer" and "system"
are one token each in its vocabulary, so there the counts agree whatever the role; these templates
print only the roles they know, so a developer message rendered as its own role is left out and the
count is short by the whole message. Each server runs on the tiny model with the template
(``--chat-template-file``); specproxy counts with the models' tokenizer given the same template, and
every API's ``prompt_tokens`` must be the server's own count (chat ``usage``, ``/v1/responses/input_tokens``,
``/v1/messages/count_tokens``), for requests with multi-part messages; and a chat request's
``chat_template_kwargs`` reach the template (here an empty thinking block when thinking is off).
"""
from __future__ import annotations

import json
import shutil

import pytest
from real.clientkit import Arrivals, chat
from real.server import LlamaServer
from real.test_real_agent_apis import messages_call, responses_call

from specproxy.measure.tokens import load_tokenizer

pytestmark = pytest.mark.real

HEAD = "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
TAIL = ("{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        # Qwen3's shape: an empty thinking block when a request's chat_template_kwargs turn thinking off
        "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
        "{%- endif %}")
TEMPLATES = {
    # system, user and assistant printed; any other role (developer) left out
    "known-roles": ("{{- bos_token }}{%- for m in messages %}"
                    "{%- if m['role'] == 'system' or m['role'] == 'user' or m['role'] == 'assistant' %}" + HEAD + TAIL),
    # no system role at all: the server joins the first system message to the next message
    "no-system": ("{{- bos_token }}{%- for m in messages %}"
                  "{%- if m['role'] == 'user' or m['role'] == 'assistant' %}" + HEAD + TAIL),
}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def templated(request, llama_server_bin, tiny_model_path, hf_tokenizer_dir, tmp_path_factory):
    """(server, specproxy's tokenizer, template name): both on the same template."""
    name = request.param
    d = tmp_path_factory.mktemp(f"tok-{name}")
    shutil.copytree(hf_tokenizer_dir, d, dirs_exist_ok=True)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATES[name]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "template.jinja").write_text(TEMPLATES[name])
    with LlamaServer(llama_server_bin, tiny_model_path,
                     extra_args=["--jinja", "--chat-template-file", str(d / "template.jinja")]) as srv:
        yield srv, load_tokenizer(f"hf:{d}"), name


def text_parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def test_every_api_counts_roles_as_the_server_renders_them(make_stack, templated):
    server, tok, name = templated
    stack = make_stack(tok, upstream=server.url, scrape_interval_s=0)
    arrivals = Arrivals(stack)
    chat_body = {"messages": [{"role": "system", "content": "You are terse."},
                              {"role": "developer", "content": text_parts("Be brief.", "Use tools.")},
                              {"role": "user", "content": text_parts("What's the weather?", "In Zürich.")}]}
    responses_body = {"model": "tiny", "max_output_tokens": 4, "instructions": "You are terse.", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What's the weather?"},
                                                        {"type": "input_text", "text": "In Zürich."}]}]}
    messages_body = {"model": "tiny", "max_tokens": 4, "system": [{"type": "text", "text": "You are terse."}],
                     "messages": [{"role": "user", "content": text_parts("What's the weather?", "In Zürich.")}]}

    usage = chat(stack.url, **chat_body, max_tokens=4)["usage"]
    responses_call(stack.url, responses_body, stream=False)
    messages_call(stack.url, messages_body, stream=False, beta=False)
    thinking_off = chat(stack.url, **chat_body, max_tokens=4,
                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    rec_chat, rec_responses, rec_messages, rec_off = arrivals.wait(4)
    assert rec_off.prompt_tokens == thinking_off["usage"]["prompt_tokens"] > usage["prompt_tokens"]

    assert rec_chat.prompt_tokens == usage["prompt_tokens"] == rec_chat.usage_prompt_tokens
    served = server.post_json("/v1/responses/input_tokens", responses_body)["input_tokens"]
    assert rec_responses.prompt_tokens == served == rec_responses.usage_prompt_tokens
    served = server.post_json("/v1/messages/count_tokens", messages_body)["input_tokens"]
    assert rec_messages.prompt_tokens == served
    for rec in (rec_chat, rec_responses, rec_messages):
        parts = (rec.prompt_system_tokens, rec.prompt_tools_tokens, rec.prompt_history_tokens, rec.prompt_new_tokens)
        assert sum(parts) == rec.prompt_tokens, parts
    # the developer message is in the server's prompt as a system message (the template without a system
    # role drops it: only the first system message is joined to the next, and the developer's is the second)
    assert ("Be brief." in server.post_json("/apply-template", chat_body)["prompt"]) is (name != "no-system")
    assert tok.system_read is (name != "no-system")
