"""Prompts synthesised from a Mooncake trace's hash ids: the same id is the same text, token for token.

Why token-exact: a server's prefix cache reuses the leading tokens two prompts share, so a replay makes it
see the production run's reuse only when two requests with the same first k hash ids share exactly their
first k blocks of tokens, and no more. Text that is merely "about block_size tokens" would drift across a
block's edge, and two blocks of different ids could share a first token by chance.

How: a pool of words that are one token each for the model's tokenizer with a space before them
(" cat", " ore"...; found by encoding every two- and three-letter word once), so that a sequence of them
tokenizes into exactly those tokens (a tokenizer's pre-tokenizer splits at the spaces). A block is
``block_size`` words chosen by a generator seeded with the block's id; its first two words spell the id
in base len(pool), least significant first, so two different ids differ at the block's first token (at
its second when they are equal modulo the pool's size). A partial block is the first words of the full
one. The tokens after the last hash id's blocks, when ``input_length`` asks for more, are words no block
has (seeded by the request), as are the warm-up's. Every block is checked once against the tokenizer:
one that does not encode to its length is a ConfigError naming the tokenizer.
"""

from __future__ import annotations

import itertools
import random
import string
from typing import Any

from specproxy.errors import ConfigError

__all__ = ["BlockText"]

MIN_POOL = 256


class BlockText:
    """Token-exact text blocks for one tokenizer (``encode``) and block size."""

    def __init__(self, tok: Any, block_size: int, seed: int = 0) -> None:
        self._encode = tok.encode
        self.block_size = block_size
        self.seed = seed
        words = ["".join(c) for n in (2, 3) for c in itertools.product(string.ascii_lowercase, repeat=n)]
        self.pool = [" " + w for w in words if len(self._encode(" " + w)) == 1]
        if len(self.pool) < MIN_POOL:
            raise ConfigError(f"the tokenizer ({getattr(tok, 'name', 'given')}) has only {len(self.pool)} "
                              "two- and three-letter words of one token: cannot synthesise exact blocks with it")
        self._blocks: dict[Any, list[str]] = {}

    def _words(self, key: Any, n: int, digits: int | None) -> list[str]:
        rng = random.Random(f"{self.seed}:{key}")
        size = len(self.pool)
        head = [] if digits is None else [self.pool[digits % size], self.pool[(digits // size) % size]]
        return (head + [self.pool[rng.randrange(size)] for _ in range(n)])[:n]

    def block(self, hash_id: int) -> list[str]:
        """The words of block ``hash_id`` (``block_size`` of them, each one token), checked once."""
        words = self._blocks.get(hash_id)
        if words is None:
            words = self._words(("block", hash_id), self.block_size, hash_id)
            self._check(words)
            self._blocks[hash_id] = words
        return words

    def filler(self, key: Any, n: int) -> list[str]:
        """``n`` words of no block (a request's own tokens past its blocks, the warm-up's)."""
        words = self._words(("filler", key), n, None)
        self._check(words)
        return words

    def _check(self, words: list[str]) -> None:
        got = len(self._encode("".join(words)))
        if got != len(words):
            raise ConfigError(f"a synthesised block of {len(words)} one-token words encodes to {got} tokens with "
                              "this tokenizer: cannot synthesise exact blocks with it")

    def prompt(self, hash_ids: list[int] | tuple[int, ...], input_length: int, key: Any) -> str:
        """The text of ``input_length`` tokens whose ``block_size`` blocks are ``hash_ids``' blocks (the last
        one cut to what is left), then words of no block up to ``input_length`` (``key``: the request's)."""
        words: list[str] = []
        for h in hash_ids:
            if len(words) >= input_length:
                break
            words += self.block(h)[:input_length - len(words)]
        if len(words) < input_length:
            words += self.filler(key, input_length - len(words))
        return "".join(words)
