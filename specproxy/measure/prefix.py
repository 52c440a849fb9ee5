"""Where each turn's prompt stops being the previous turn's: prefix-cache breaks and turn-to-turn diffs.

Why: a server's prefix cache reuses the leading tokens a prompt shares with one it saw before. An agent
that resends its conversation unchanged, only appending, keeps that reuse; one that edits its system
prompt, reorders its tools or compacts its history throws it away from the first changed token on. Part
counts alone cannot show that (a system prompt edited to the same length counts the same), so the
measuring thread compares token ids.

How, cheaply and without keeping text: a prompt is a list of segments each tokenized on its own, whose
token ids concatenate to the prompt's (the messages and the tool definitions when prompts count as
plain text; with a chat template, the render cut at the tokenizer's added tokens, the identity
``prompt_pieces.py`` relies on and verifies, or the whole render when that identity does not hold).
Per session (an LRU, bounded by sessions and by tokens held) the previous turn's segments are kept as
digests and token ids, never text: a segment whose digest was there last turn reuses its ids, so only
new segments are tokenized; the first differing token is found by comparing the two id arrays. The
token ids of recent segments are also shared across sessions (an LRU bounded by tokens): an agent's
system prompt and tool definitions open every one of its sessions, and are tokenized once.
The turn-to-turn diff compares digests of the system messages, the tools and each message. The same
token ids give every turn's chained block digests (``blocks.py``; for a turn without a session too),
which ``export --format mooncake`` turns into a trace's hash ids.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from specproxy.measure.blocks import BLOCK_TOKENS, block_digests
from specproxy.measure.memo_key import memo_key
from specproxy.measure.openai import PromptParts, message_text
from specproxy.measure.tokens import completion_text

__all__ = ["PrefixTracker", "TurnPrefix", "tool_names"]

MAX_SESSIONS = 256
MAX_TOKENS = 4_000_000  # token ids held over all remembered sessions (4 bytes each: 16 MB at most)
MAX_SHARED_TOKENS = 1_000_000  # token ids of recent segments shared across sessions (4 MB at most)


@dataclass(frozen=True, slots=True)
class TurnPrefix:
    """``reused``: leading tokens shared with the session's previous turn (None on its first turn).
    ``part``: the part the first differing token falls in (None when the turn only appended, or the
    parts are not in render order). ``diff``: what changed, as ``Record.turn_diff`` says. ``blocks``:
    the chained digests of the prompt's token blocks, as ``Record.prompt_block_digests`` says (None
    without a tokenizer)."""

    reused: int | None = None
    part: str | None = None
    diff: dict[str, Any] | None = None
    blocks: str | None = None


@dataclass(slots=True)
class _Turn:
    segments: list[tuple[bytes, str | None, bytes]]  # (digest, part, uint32 token ids)
    system: bytes
    tools: bytes
    messages: list[bytes]
    tokens: int
    digests: list[bytes]  # chained digests of its token blocks (blocks.py)


def _json_digest(value: Any) -> bytes:
    try:
        return memo_key(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
    except TypeError:  # not JSON-encodable (a parsed body always is)
        return memo_key(repr(value).encode())


def _segments(tok: Any, parts: PromptParts) -> list[tuple[str, str | None]]:
    """The prompt as (text, part) segments whose separate tokenizations concatenate to its tokens."""
    render = getattr(tok, "prompt_text", None)
    text = render(parts) if render is not None else None
    if text is not None:
        pieces = getattr(getattr(tok, "rendered", None), "pieces", None)
        return [(p, None) for p in (pieces(text) if pieces is not None else [text])]
    if parts.prompt is not None:
        return [(completion_text(tok, parts), "new")]
    segs = [(message_text(m), "system") for m in parts.system]
    if parts.tools:
        segs.append((orjson.dumps(list(parts.tools)).decode(), "tools"))
    segs += [(message_text(m), "history") for m in parts.history]
    segs += [(message_text(m), "new") for m in parts.new]
    return segs


class PrefixTracker:
    """Remembers each session's previous turn (bounded) and compares the next one with it."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, max_tokens: int = MAX_TOKENS,
                 max_shared_tokens: int = MAX_SHARED_TOKENS) -> None:
        self._turns: OrderedDict[str, _Turn] = OrderedDict()
        self._shared: OrderedDict[bytes, bytes] = OrderedDict()  # segment digest -> its token ids
        self._shared_held = 0
        self._max_shared = max_shared_tokens
        self.encoded = 0  # segments tokenized (not found in the session's previous turn or shared)
        self._max_sessions = max_sessions
        self._max_tokens = max_tokens
        self._held = 0
        self._lock = threading.Lock()

    def observe(self, session: str | None, tok: Any, parts: PromptParts | None) -> TurnPrefix:
        """This turn compared with the session's previous one, which it then replaces; and its prompt's
        block digests (also for a turn without a session, which is not remembered). CPU work."""
        if parts is None or (session is None and tok is None):
            return TurnPrefix()
        prev = None
        if session is not None:
            with self._lock:
                prev = self._turns.pop(session, None)
                if prev is not None:
                    self._held -= prev.tokens
        known = {d: ids for d, _, ids in prev.segments} if prev is not None else {}
        segments = []
        encode = getattr(tok, "encode", None)
        if encode is not None:
            for text, part in _segments(tok, parts):
                d = memo_key(text.encode("utf-8", "surrogatepass"))
                ids = known.get(d)
                if ids is None:
                    ids = self._shared_ids(d)
                if ids is None:
                    ids = np.asarray(encode(text), dtype=np.uint32).tobytes()
                    self.encoded += 1
                    self._share(d, ids)
                segments.append((d, part, ids))
        cur = _Turn(segments, _json_digest(list(parts.system)), _json_digest(list(parts.tools)),
                    [_json_digest(m) for m in parts.conversation], sum(len(s[2]) for s in segments) // 4, [])
        result = TurnPrefix() if prev is None else self._compare(prev, cur, encode is not None)
        if encode is not None:
            # the blocks wholly inside the prefix shared with the previous turn are its blocks: not hashed again
            same = (result.reused or 0) // BLOCK_TOKENS if prev is not None else 0
            cur.digests = block_digests(np.frombuffer(b"".join(s[2] for s in segments), dtype=np.uint32),
                                        prev.digests[:same] if prev is not None else ())
            result = TurnPrefix(result.reused, result.part, result.diff, b"".join(cur.digests).hex())
        if session is None:
            return result
        with self._lock:
            self._turns[session] = cur
            self._held += cur.tokens
            while self._turns and (len(self._turns) > self._max_sessions or self._held > self._max_tokens):
                _, old = self._turns.popitem(last=False)
                self._held -= old.tokens
        return result

    def _shared_ids(self, digest: bytes) -> bytes | None:
        with self._lock:
            ids = self._shared.get(digest)
            if ids is not None:
                self._shared.move_to_end(digest)
            return ids

    def _share(self, digest: bytes, ids: bytes) -> None:
        n = len(ids) // 4
        if n > self._max_shared:
            return
        with self._lock:
            self._shared[digest] = ids
            self._shared_held += n
            while self._shared_held > self._max_shared:
                _, old = self._shared.popitem(last=False)
                self._shared_held -= len(old) // 4

    @staticmethod
    def _compare(prev: _Turn, cur: _Turn, counted: bool) -> TurnPrefix:
        common = 0
        for a, b in zip(prev.messages, cur.messages):
            if a != b:
                break
            common += 1
        diff = {"messages_added": len(cur.messages) - common, "messages_removed": len(prev.messages) - common,
                "system_changed": prev.system != cur.system, "tools_changed": prev.tools != cur.tools}
        if not counted:
            return TurnPrefix(diff=diff)
        prev_ids = b"".join(s[2] for s in prev.segments)
        cur_ids = b"".join(s[2] for s in cur.segments)
        prev_n, cur_n = len(prev_ids) // 4, len(cur_ids) // 4  # tokens
        if prev_ids.startswith(cur_ids) or cur_ids.startswith(prev_ids):
            reused = min(prev_n, cur_n)  # the usual turn: one prompt extends the other (one memcmp, no arrays)
        else:
            n = min(prev_n, cur_n)
            differ = np.flatnonzero(np.frombuffer(prev_ids, dtype=np.uint32, count=n)
                                    != np.frombuffer(cur_ids, dtype=np.uint32, count=n))
            reused = int(differ[0]) if len(differ) else n
        part = None
        if reused < prev_n:  # not only appended: say where the break is
            at = 0
            for _, seg_part, ids in (cur.segments if reused < cur_n else prev.segments):
                at += len(ids) // 4
                if reused < at:
                    part = seg_part
                    break
        return TurnPrefix(reused, part, diff)


def _tool_name(tool: Any) -> str | None:
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function")
    name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
    return name if isinstance(name, str) else None


def tool_names(parts: PromptParts | None, called: list[str] | None,
               store_text: bool) -> tuple[int | None, int | None, str | None]:
    """``(tools_defined, tools_called, tool_names)`` of a turn: the tools its request defines (``None``
    when the request was not read), and the distinct tools its delivered output called (``called``, from
    the response's reader; ``None`` when the response was not read). Names are client text: kept only
    with ``store_text``, else 12 hex digits of each name's digest. In ``tool_names``, ``defined`` is there
    when the request was read and ``called`` when the response was; ``None`` when neither has a name."""
    n_defined = len(parts.tools) if parts is not None else None
    n_called = len(called) if called is not None else None
    defined = [n for n in map(_tool_name, parts.tools) if n is not None] if parts is not None else []
    if not defined and not called:
        return n_defined, n_called, None

    def shown(names: list[str]) -> list[str]:
        return names if store_text else [hashlib.blake2b(n.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
                                         for n in names]

    names: dict[str, list[str]] = {}
    if parts is not None:
        names["defined"] = shown(defined)
    if called is not None:
        names["called"] = shown(called)
    return n_defined, n_called, orjson.dumps(names).decode()
