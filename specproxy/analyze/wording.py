"""How counts are said in the text renderings, in one place so that every section words them alike."""

from __future__ import annotations

__all__ = ["plural"]


def plural(n: int | None, noun: str) -> str:
    """"1 instance", "2 instances", "instances unknown" (no count: e.g. turns without an instance id)."""
    if n is None:
        return f"{noun}s unknown"
    return f"{n} {noun}" + ("" if n == 1 else "s")
