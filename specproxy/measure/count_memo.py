"""A memo of ``count(text)`` that holds digests, not texts: for what a chat client resends every turn.

Why: a chat client resends the whole conversation each turn, so a count that is not remembered costs
O(n²) over a conversation; remembered by the text itself, the memo would hold every conversation. This
one holds a 128-bit digest and a count per entry, however long the text.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from specproxy.measure.memo_key import memo_key

__all__ = ["CountMemo"]


class CountMemo:
    """``count(text)`` remembered for the texts a chat client sends again every turn.

    Keyed by a 128-bit digest of the text (``memo_key``), not the text: the memo holds ``maxsize`` digests and
    counts (~90 bytes each), never the conversations themselves, however long their messages. A
    digest costs a small fraction of tokenizing the same text (docs/performance.md, "Design figures"). Least
    recently used entries go first; ``hits`` and ``misses`` say how it does. Thread-safe.
    """

    def __init__(self, count: Callable[[str], int], maxsize: int) -> None:
        self._count = count
        self._maxsize = maxsize
        self._counts: dict[bytes, int] = {}  # insertion order is recency order
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __call__(self, text: str) -> int:
        key = memo_key(text.encode("utf-8", "surrogatepass"))
        with self._lock:
            n = self._counts.pop(key, None)
            if n is not None:
                self._counts[key] = n  # now the most recent
                self.hits += 1
                return n
        n = self._count(text)  # outside the lock: another thread may count the same text meanwhile
        with self._lock:
            self.misses += 1
            self._counts[key] = n
            while len(self._counts) > self._maxsize:
                del self._counts[next(iter(self._counts))]
        return n

    def __len__(self) -> int:
        return len(self._counts)
