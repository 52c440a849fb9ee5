"""Which match of a key in a JSON body is the body's one key, found without parsing the body.

Why: a body too large to parse (``request_body.model_only``), or a whole answer read for one object
(``texts.object_of_key``), is searched byte-wise for ``"key":``. In valid JSON a quote not escaped by a
backslash delimits a string, so a match whose opening quote follows an even run of backslashes is a key;
one after an odd run is text inside a string. The rule for both searches is here, once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["sole_key"]


def _escaped(body: bytes, i: int) -> bool:
    """Whether the quote at ``body[i]`` is escaped: an odd run of backslashes before it."""
    slashes = 0
    while i > 0 and body[i - 1] == 0x5C:
        slashes += 1
        i -= 1
    return slashes % 2 == 1


def sole_key(body: bytes, matches: Iterable[re.Match[bytes]]) -> re.Match[bytes] | None:
    """The one match (each starting at its key's opening quote) that is a key, not text inside a string;
    None when there is none or more than one (two keys of one name: which one is meant is not known)."""
    found = None
    for m in matches:
        if _escaped(body, m.start()):
            continue
        if found is not None:
            return None
        found = m
    return found
