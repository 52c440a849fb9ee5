"""Counting a rendered chat prompt piece by piece, so that a conversation is tokenized once, not every turn.

Why: with a chat template, ``HFTokenizer.count_prompt`` renders the conversation four times a turn (whole,
without tools, without system, the history alone) and each render covers everything said so far, so a
conversation of n turns costs O(n²) tokenizing; counted by pieces, each piece once
(docs/performance.md, "Design figures", from ``scripts/bench_prompt_counts.py``).

How: a Hugging Face tokenizer cuts its input at its added tokens (``<|eot_id|>``, ``<|im_start|>``...)
before anything else, and normalizes, pre-tokenizes and tokenizes each piece between them on its own
(tokenizers' ``AddedVocabulary::extract_and_normalize``). A template puts such tokens around every
message, so the pieces of this turn's render are last turn's pieces plus a few new ones. The count of a
text is then the number of added tokens in it plus the sum of its pieces' counts, and each piece's count
is remembered (``CountMemo``, by digest): a piece is tokenized once, the turn it first appears.

That identity holds only for tokenizers that really treat pieces alone, and ``piece_splitter`` says which:
no added token that strips the whitespace beside it, matches only whole words or is matched after
normalization; a pre-tokenizer from the list of those that work split by split (not Metaspace with
``prepend_scheme: first``, which treats the input's first piece apart); special tokens not encoded as
text. Any other tokenizer counts whole texts, as before. And the identity is checked on real traffic:
the first ``VERIFY_FIRST`` texts and then one in ``VERIFY_EVERY`` are also counted whole; one
difference turns piece counting off for good (logged once), and the whole count is what is returned.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

import orjson

from specproxy.measure.count_memo import CountMemo

__all__ = ["VERIFY_EVERY", "VERIFY_FIRST", "PieceCounter", "piece_splitter"]

log = logging.getLogger("specproxy.measure.tokens")

VERIFY_FIRST = 8  # texts counted both ways before piece counting is trusted
VERIFY_EVERY = 50  # after those, one text in this many is counted both ways
_PIECES = 65_536  # pieces remembered: ~2 per message

# pre-tokenizers that split each piece they are given on its own, wherever it sits in the input
_PER_SPLIT_PRE_TOKENIZERS = frozenset({
    "Sequence", "Split", "ByteLevel", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit",
    "BertPreTokenizer", "CharDelimiterSplit", "UnicodeScripts", "Metaspace",
})


def _pre_tokenizer_ok(spec: Any) -> bool:
    if spec is None:
        return True
    if not isinstance(spec, dict) or spec.get("type") not in _PER_SPLIT_PRE_TOKENIZERS:
        return False
    if spec["type"] == "Metaspace" and spec.get("prepend_scheme", "always") not in ("always", "never"):
        return False  # "first": only the input's first piece gets the prefix
    return all(_pre_tokenizer_ok(p) for p in spec.get("pretokenizers", ()))


def piece_splitter(hf_tokenizer: Any) -> tuple[re.Pattern[str] | None, str]:
    """The pattern that finds ``hf_tokenizer``'s added tokens (leftmost, longest first, as tokenizers
    matches them), or None and why piece counting would not be exact for it."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, "not a fast (Rust) tokenizer"
    if getattr(backend, "encode_special_tokens", False) or getattr(hf_tokenizer, "split_special_tokens", False):
        return None, "special tokens are encoded as text"
    try:
        added = list(backend.get_added_tokens_decoder().values())
        pre = backend.pre_tokenizer
        pre_spec = orjson.loads(pre.__getstate__()) if pre is not None else None
    except Exception as exc:  # an older tokenizers, or a custom component
        return None, f"cannot read the tokenizer's configuration ({type(exc).__name__})"
    if not added:
        return None, "no added tokens to split at"
    for tok in added:
        if tok.lstrip or tok.rstrip or tok.single_word or tok.normalized:
            return None, f"added token {tok.content!r} strips, matches whole words or is normalized"
    if not _pre_tokenizer_ok(pre_spec):
        return None, "its pre-tokenizer treats the input's pieces differently by position"
    contents = sorted({t.content for t in added if t.content}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, contents))), "pieces"


class PieceCounter:
    """``count(text)``: the tokens of ``text`` (no special tokens added), piece by piece when exact."""

    def __init__(self, hf_tokenizer: Any, count_whole: Callable[[str], int]) -> None:
        self._count_whole = count_whole
        self._added, self.why = piece_splitter(hf_tokenizer)
        self._pieces = CountMemo(count_whole, _PIECES)
        self._lock = threading.Lock()
        self.texts = 0  # texts counted
        self.verified = 0  # of those, also counted whole
        self.mismatch: str | None = None  # what turned piece counting off

    @property
    def by_pieces(self) -> bool:
        return self._added is not None and self.mismatch is None

    def count(self, text: str) -> int:
        if not self.by_pieces:
            return self._count_whole(text)
        with self._lock:
            self.texts += 1
            check = self.texts <= VERIFY_FIRST or self.texts % VERIFY_EVERY == 0
        n = self._count_pieces(text)
        if check:
            whole = self._count_whole(text)
            with self._lock:
                self.verified += 1
            if whole != n:
                self._turn_off(f"{n} tokens by pieces, {whole} whole, for a text of {len(text)} characters")
                return whole
        return n

    def pieces(self, text: str) -> list[str]:
        """``text`` cut before and after each added token, whose tokenizations concatenate to the
        whole text's when counting by pieces is exact; else ``[text]``."""
        if not self.by_pieces:
            return [text]
        out = []
        start = 0
        for m in self._added.finditer(text):
            if m.start() > start:
                out.append(text[start:m.start()])
            out.append(m.group())
            start = m.end()
        if start < len(text):
            out.append(text[start:])
        return out

    def _count_pieces(self, text: str) -> int:
        n = 0
        start = 0
        count = self._pieces
        for m in self._added.finditer(text):
            if m.start() > start:
                n += count(text[start:m.start()])
            n += 1  # an added token is one token
            start = m.end()
        if start < len(text):
            n += count(text[start:])
        return n

    def _turn_off(self, what: str) -> None:
        with self._lock:
            if self.mismatch is not None:
                return
            self.mismatch = what
        log.warning("counting prompts piece by piece is off for this tokenizer (%s): whole texts from now on", what)
