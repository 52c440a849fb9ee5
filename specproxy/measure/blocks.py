"""Chained digests of a prompt's token blocks: which blocks of a prompt a server's prefix cache could share
with an earlier one, kept without any text.

Why: a trace that other tools replay (the Mooncake format: ``export --format mooncake``) names each block
of ``block_size`` prompt tokens by an id that is equal for two prompts exactly when they hold the same
tokens up to the end of that block, which is what a prefix cache keys on. Those ids need the token ids,
which the measuring thread has (``prefix.py`` tokenizes every turn's prompt) and the database does not
keep. So each turn stores one digest per ``BLOCK_TOKENS`` tokens, chained: block i's digest is a digest
of block i-1's and block i's token ids, so it depends on every token from the prompt's start to block
i's end. A last block shorter than ``BLOCK_TOKENS`` gets a digest too (of its tokens), as a Mooncake
trace gives a partial last block an id. Any block size that is a multiple of ``BLOCK_TOKENS`` is then
read from the stored digests alone (``block_ids``): a block of ``m * BLOCK_TOKENS`` tokens ends where
the stored block ``(i + 1) * m - 1`` does (or at the prompt's end), and that digest covers everything
before it.

The cost: 16 hex digits per 64 prompt tokens (8 KB for a 32k-token prompt), and one BLAKE2b call per
64 tokens in the measuring thread; the blocks a session's previous turn had in common with this one are
taken from it, not hashed again. A digest is not text, but whoever holds a prompt can tell whether it
was sent (as with ``session``); the digests are kept with or without ``--store-text``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["BLOCK_TOKENS", "DIGEST_HEX", "block_digests", "block_ids", "split_digests"]

BLOCK_TOKENS = 64  # frozen: stored digests are of blocks this long; export block sizes are multiples of it
DIGEST_BYTES = 8
DIGEST_HEX = 2 * DIGEST_BYTES


def block_digests(ids: np.ndarray, known: Sequence[bytes] = ()) -> list[bytes]:
    """The chained digest of each ``BLOCK_TOKENS``-token block of ``ids`` (uint32 token ids; the last
    block may be shorter). ``known``: digests of an earlier prompt whose first ``len(known)`` full blocks
    are the same tokens as these (the caller guarantees it); they are reused, not recomputed."""
    n = len(ids)
    count = math.ceil(n / BLOCK_TOKENS)
    start = min(len(known), n // BLOCK_TOKENS)
    out = list(known[:start])
    prev = out[-1] if out else b""
    data = np.ascontiguousarray(ids[start * BLOCK_TOKENS:], dtype="<u4").tobytes()
    step = 4 * BLOCK_TOKENS
    blake2b = hashlib.blake2b
    for at in range(0, len(data), step):
        prev = blake2b(prev + data[at:at + step], digest_size=DIGEST_BYTES).digest()
        out.append(prev)
    return out


def split_digests(text: str | None) -> list[str]:
    """A stored ``prompt_block_digests`` as its digests (hex), [] for null."""
    if not text:
        return []
    return [text[i:i + DIGEST_HEX] for i in range(0, len(text), DIGEST_HEX)]


def block_ids(digests: Sequence[str], block_size: int) -> list[str]:
    """The digest naming each ``block_size``-token block (a multiple of ``BLOCK_TOKENS``), the last one
    partial when the prompt does not fill it: the stored digest at that block's end."""
    if block_size % BLOCK_TOKENS or block_size <= 0:
        raise ValueError(f"block size {block_size} is not a multiple of {BLOCK_TOKENS}")
    m = block_size // BLOCK_TOKENS
    n = len(digests)
    return [digests[min((j + 1) * m, n) - 1] for j in range(math.ceil(n / m))]
