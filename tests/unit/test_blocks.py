"""Chained block digests (``measure/blocks.py``) and the prefix tracker's use of them.

The reference is a plain computation: a block of any size is named by the tokens from the prompt's start
to that block's end, so two prompts' block ids must agree exactly where those token prefixes agree."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from specproxy.measure.blocks import BLOCK_TOKENS, block_digests, block_ids, split_digests
from specproxy.measure.openai import split_prompt
from specproxy.measure.prefix import PrefixTracker


def _ids(values) -> np.ndarray:
    return np.asarray(values, dtype=np.uint32)


def _hex(ids) -> list[str]:
    return split_digests(b"".join(block_digests(_ids(ids))).hex())


@pytest.mark.parametrize("block_size", [64, 128, 512])
def test_block_ids_agree_exactly_where_the_token_prefixes_do(block_size):
    rng = random.Random(7)
    base = [rng.randrange(100_000) for _ in range(3000)]
    prompts = [base, base[:2000], base[:1024], base[:1000] + [1, 2, 3] + base[1003:], base + [5] * 700,
               [9] + base[1:], base[:2047] + [0]]
    named = [block_ids(_hex(p), block_size) for p in prompts]
    for p, ids in zip(prompts, named):
        assert len(ids) == math.ceil(len(p) / block_size)  # one id per block, the last one partial
    for a, ia in zip(prompts, named):
        for b, ib in zip(prompts, named):
            for j in range(min(len(ia), len(ib))):
                end_a, end_b = min((j + 1) * block_size, len(a)), min((j + 1) * block_size, len(b))
                same = end_a == end_b and a[:end_a] == b[:end_b]
                assert (ia[j] == ib[j]) == same, (j, end_a, end_b)


def test_a_block_id_depends_on_every_block_before_it():
    a = [1] * 256 + [2] * 64
    b = [3] * 64 + [1] * 192 + [2] * 64  # the same last block after a different first one
    assert block_ids(_hex(a), 64)[-1] != block_ids(_hex(b), 64)[-1]
    assert _hex([]) == []


def test_known_blocks_are_reused_and_give_the_same_digests():
    rng = random.Random(3)
    a = [rng.randrange(50_000) for _ in range(700)]
    b = a[:650] + [rng.randrange(50_000) for _ in range(300)]
    known = block_digests(_ids(a))
    assert block_digests(_ids(b), known[:650 // BLOCK_TOKENS]) == block_digests(_ids(b))


def test_block_size_must_be_a_multiple_of_the_stored_block():
    with pytest.raises(ValueError):
        block_ids(["00" * 8], 100)


def _chat(turns: int) -> dict:
    messages = [{"role": "system", "content": "You review code. " * 40}]
    for k in range(turns):
        messages += [{"role": "user", "content": f"Look at file {k}: " + "lorem ipsum dolor " * 30},
                     {"role": "assistant", "content": f"File {k} is fine. " * 20}]
    messages.append({"role": "user", "content": "Next?"})
    return {"model": "m", "messages": messages}


def test_the_tracker_digests_every_prompt_as_the_plain_computation_does(tiktoken_tok, hf_tok):
    for tok in (tiktoken_tok, hf_tok):
        tracker = PrefixTracker()
        for turns in (1, 2, 3, 5):  # a session that grows: the shared blocks come from the previous turn
            parts = split_prompt(_chat(turns))
            text = tok.prompt_text(parts) if getattr(tok, "prompt_text", None) else None
            got = tracker.observe("s", tok, parts)
            if text is not None:
                ids = tok.encode(text)
            else:
                ids = [t for m in parts.system + parts.history + parts.new for t in tok.encode(m["content"])]
            assert got.blocks == b"".join(block_digests(_ids(ids))).hex()
            assert len(ids) == tok.count_prompt(parts).total  # the blocks cover the prompt as counted
        # a turn without a session (a completions prompt) gets digests too, and is not remembered
        parts = split_prompt({"model": "m", "prompt": "once upon a time " * 50})
        got = PrefixTracker().observe(None, tok, parts)
        assert got.blocks and got.reused is None


def test_without_a_tokenizer_there_are_no_digests():
    assert PrefixTracker().observe("s", None, split_prompt(_chat(1))).blocks is None
