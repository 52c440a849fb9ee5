"""What changed between two turns of a session, readable: tokens per prompt part, tools added and removed
by name, and what the prefix cache predicted against what the server reused.

Why: ``turn_diff`` (recorded by the measuring thread from digests) says *that* the system prompt or the
tools changed and how many messages came and went; a user asking why a cache broke or a prompt grew wants
*how much* (the parts' token counts, turn against turn) and *which* tools (``tool_names``: names with
``--store-text``, else name digests). One function decides a turn's readable diff from the two rows, so
``audit --session`` and the live page cannot say it two ways.
"""

from __future__ import annotations

from typing import Any

import orjson

from specproxy.analyze.prefix_cache import lost_tokens, lost_ttft

__all__ = ["PARTS", "readable_diff", "recent_changes", "render_diff"]

PARTS = ("system", "tools", "history", "new")


def _tools(row: dict[str, Any] | None) -> list[str] | None:
    names = (row or {}).get("tool_names")
    defined = names.get("defined") if isinstance(names, dict) else None
    return list(defined) if isinstance(defined, list) else None


def readable_diff(prev: dict[str, Any] | None, cur: dict[str, Any], fit: dict[str, Any] | None = None) -> dict[str, Any]:
    """Turn ``cur`` against ``prev`` (the same session's previous turn, None when it is not known): each row
    holds the parts' tokens (``system``, ``tools``, ``history``, ``new``: None when not counted),
    ``prompt_tokens``, ``diff`` (the recorded ``turn_diff``, parsed), ``tool_names`` (parsed),
    ``reused`` (``prefix_reused_tokens``) and ``cached`` (``usage_cached_tokens``).

    ``parts_delta``: each part's tokens now less before (None without the previous turn or a count);
    ``tools_added`` / ``tools_removed``: defined names (or digests) that came or went (None without both
    lists); the recorded diff's fields; the prefix cache's predicted, reused and lost tokens and the lost
    part's TTFT at ``fit``."""
    delta = None
    if prev is not None:
        delta = {p: (cur[p] - prev[p]) if cur.get(p) is not None and prev.get(p) is not None else None for p in PARTS}
        if cur.get("prompt_tokens") is not None and prev.get("prompt_tokens") is not None:
            delta["prompt"] = cur["prompt_tokens"] - prev["prompt_tokens"]
        else:
            delta["prompt"] = None
    before, now = _tools(prev), _tools(cur)
    added = removed = None
    if before is not None and now is not None:
        added = [t for t in now if t not in before]
        removed = [t for t in before if t not in now]
    diff = cur.get("diff") or {}
    lost = lost_tokens(cur.get("reused"), cur.get("cached"))
    return {"parts": {p: cur.get(p) for p in PARTS}, "prompt_tokens": cur.get("prompt_tokens"),
            "parts_delta": delta, "tools_added": added, "tools_removed": removed,
            "messages_added": diff.get("messages_added"), "messages_removed": diff.get("messages_removed"),
            "system_changed": diff.get("system_changed"), "tools_changed": diff.get("tools_changed"),
            "recorded_diff": bool(cur.get("diff")), "previous_known": prev is not None,
            "predicted_reusable": cur.get("reused"), "server_reused": cur.get("cached"),
            "lost_tokens": lost, "lost_ttft_s": lost_ttft(lost, fit)}


def _signed(n: int | None) -> str:
    return "?" if n is None else f"{n:+,}"


def render_diff(d: dict[str, Any]) -> str:
    """One line: the parts' token changes, the tools that came and went, the messages, the cache."""
    out = []
    delta = d["parts_delta"]
    if delta is not None:
        out.append("tokens " + ", ".join(f"{p} {_signed(delta[p])}" for p in PARTS)
                   + f" (prompt {_signed(delta['prompt'])})")
    else:
        out.append("no previous turn of this session known: no token changes")
    if d["messages_added"] is not None:
        out.append(f"messages +{d['messages_added']} -{d['messages_removed']}")
    changed = [w for w, k in (("system prompt", "system_changed"), ("tools", "tools_changed")) if d[k]]
    if changed:
        out.append(" and ".join(changed) + " changed")
    if d["tools_added"]:
        out.append("tools added: " + ", ".join(d["tools_added"]))
    if d["tools_removed"]:
        out.append("tools removed: " + ", ".join(d["tools_removed"]))
    cache = []
    if d["predicted_reusable"] is not None:
        cache.append(f"predicted reusable {d['predicted_reusable']:,}")
    if d["server_reused"] is not None:
        cache.append(f"server reused {d['server_reused']:,}")
    if d["lost_tokens"] is not None:
        cost = d["lost_ttft_s"]
        cache.append(f"lost {d['lost_tokens']:,}" + (f" (~{cost['s']:.3f} s TTFT)" if cost and d["lost_tokens"] else ""))
    if cache:
        out.append(", ".join(cache))
    return "; ".join(out)


def _parsed(value: Any) -> Any:
    if isinstance(value, str) and value:
        try:
            return orjson.loads(value)
        except ValueError:
            return None
    return None


def _row(rec: dict[str, Any]) -> dict[str, Any]:
    """A stored record (its fields by name, as the store gives them) in the form ``readable_diff`` reads."""
    return {"system": rec.get("prompt_system_tokens"), "tools": rec.get("prompt_tools_tokens"),
            "history": rec.get("prompt_history_tokens"), "new": rec.get("prompt_new_tokens"),
            "prompt_tokens": rec.get("prompt_tokens"), "diff": _parsed(rec.get("turn_diff")),
            "tool_names": _parsed(rec.get("tool_names")), "reused": rec.get("prefix_reused_tokens"),
            "cached": rec.get("usage_cached_tokens")}


def recent_changes(records: list[dict[str, Any]], fit: dict[str, Any] | None = None) -> list[dict[str, Any] | None]:
    """Each of ``records`` (stored turns, oldest first) against the latest earlier one of its session among
    them (None for a turn without a session, or one that did not complete): what the live page shows when
    a turn is clicked. A session's previous turn older than the records is unknown here: the token
    changes are then null, the recorded diff's fields still said."""
    last: dict[str, dict[str, Any]] = {}
    out: list[dict[str, Any] | None] = []
    for rec in records:
        session = rec.get("session")
        if session is None or rec.get("outcome") != "ok" or rec.get("measured") is False or rec.get("measured") == 0:
            out.append(None)
            continue
        row = _row(rec)
        out.append(readable_diff(last.get(session), row, fit))
        last[session] = row
    return out
