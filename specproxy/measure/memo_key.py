"""The key a text is remembered by in the measuring thread's memos: 128 bits of its SHA-256.

Why one function: the prompt-count memo (``count_memo.py``) and the prefix tracker (``prefix.py``) key
what they remember by a digest of the text rather than the text (they hold digests, never
conversations), and a chat client resends the same long system prompt and history every turn, so each
turn hashes kilobytes of them several times. Why SHA-256: OpenSSL's runs on the CPU's SHA extensions
where it has them; on this project's machine 4 KB took ~5.3 µs against ~10-12 µs for ``hashlib``'s
BLAKE2b (which these memos used before; docs/performance.md, "Design figures"). The keys live in memory
only: nothing stored is one of them (the stored digests, ``blocks.py`` and ``session.py``, are
BLAKE2b and stay so).
"""

from __future__ import annotations

from hashlib import sha256

__all__ = ["memo_key"]


def memo_key(data: bytes) -> bytes:
    """16 bytes naming ``data``: two texts with the same key are taken to be the same text."""
    return sha256(data).digest()[:16]
