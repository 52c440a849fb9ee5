"""Whether two arms of ``compare`` ran the same workload, for the rows whose figure depends on it.

Why: TTFT grows with the prompt, a whole turn with the prompt and the answer, and aggregate throughput
(delivered tokens over busy time) with the answers' length and the mix of turns. Two time windows of one
setting, one of which happened to hold three 300-token answers, read "aggregate throughput 3.40x
[1.76, 6.56] faster": the setting did not change, the workload did. No interval can tell the two apart,
so where the arms' workloads differ materially these rows say so, and by how much, instead of a verdict
(their estimate and interval are still given). Decode speed (tokens per second while text streams) is
per token and keeps its verdict.

Below that, a difference of ``NOTE_RATIO`` (1.2x) or more in the mean tokens is said beside the verdict
(``notes``), and so is an arm without token counts (served without a tokenizer): then nobody can tell whether
the workloads differ.

"Differ materially", on the turns a row is over: the mean prompt or completion tokens per turn differ by
``RATIO_LIMIT`` (1.5x) or more either way, or the share of an API (chat, completions, Messages, Responses)
or of streamed turns by ``SHARE_LIMIT`` (20 points) or more. It is a statement about the two samples, not
a test: one setting's turns sampled twice differ that much by chance when few turns carry most tokens
(docs/statistics.md gives how often, per shape), and then the samples do differ, and the figure with them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specproxy.analyze.by_cell import finite_by_cell
from specproxy.store.dataset import Turns

__all__ = ["NOTE_RATIO", "RATIO_LIMIT", "SHARE_LIMIT", "WORKLOAD_COLUMNS", "Workload", "differences", "describe",
           "notes", "ROW_NEEDS"]

RATIO_LIMIT = 1.5
NOTE_RATIO = 1.2
SHARE_LIMIT = 0.2
WORKLOAD_COLUMNS = ("prompt_tokens", "completion_tokens", "api", "streamed")

# which workload features each row's figure depends on
ROW_NEEDS: dict[str, tuple[str, ...]] = {
    "ttft_s": ("prompt_tokens", "api"),
    "total_s": ("prompt_tokens", "completion_tokens", "api"),
    "total_s_non_streamed": ("prompt_tokens", "completion_tokens", "api"),
    "aggregate_tps": ("prompt_tokens", "completion_tokens", "api", "streamed"),
    # the SLO's TTFT and whole-turn bounds depend on the prompt and the answer, as those rows do
    "slo_share": ("prompt_tokens", "completion_tokens", "api", "streamed"),
}
_NAMES = {"prompt_tokens": "prompt tokens per turn", "completion_tokens": "completion tokens per turn"}


class Workload:
    """An arm's workload features (token means, API shares, streamed share), each computed on first use and
    kept: compare asks for the same arm's features once per row, and each is a pass over a column copied
    from a month's turns."""

    __slots__ = ("turns", "_got")

    def __init__(self, turns: Turns):
        self.turns, self._got = turns, {}

    def __len__(self) -> int:
        return len(self.turns)

    def _once(self, key: str, make):
        if key not in self._got:
            self._got[key] = make()
        return self._got[key]

    def mean(self, column: str) -> float | None:
        """The mean of a token column over the turns that have it."""
        def make():
            values, positions = self.turns.source(column)
            (x,) = finite_by_cell(values, positions, None, 1)  # one pass through the positions, no gathered copy
            self.turns.release(column)
            return float(x.mean()) if x.size else None
        return self._once(f"mean {column}", make)

    def shares(self, column: str) -> dict[str, float]:
        """Each value's share of the turns (by its text: None is "None"), in the order of the texts: from the
        column's codes counted, not a text object per turn sorted."""
        def make():
            n = len(self.turns)
            if not n:
                return {}
            codes, values = self.turns.codes(column)
            tally = np.bincount(codes + 1, minlength=1)  # NULL (-1) first
            counts: dict[str, int] = {}
            for c in np.flatnonzero(tally).tolist():
                name = str(None if c == 0 else values[c - 1])
                counts[name] = counts.get(name, 0) + int(tally[c])
            return {k: float(counts[k]) / n for k in sorted(counts)}
        return self._once(f"shares {column}", make)

    def streamed(self) -> float:
        return self._once("streamed", lambda: float(np.mean(self.turns.num["streamed"] == 1)))


def _workload(arm: Turns | Workload) -> Workload:
    return arm if isinstance(arm, Workload) else Workload(arm)


def _token_means(a: Workload, b: Workload, features: tuple[str, ...]) -> list[tuple[str, float | None, float | None]]:
    """(column, A's mean, B's mean) of each token count among ``features``: what both rules compare."""
    return [(col, a.mean(col), b.mean(col)) for col in ("prompt_tokens", "completion_tokens") if col in features]


def differences(a: Turns | Workload, b: Turns | Workload, features: tuple[str, ...]) -> list[dict[str, Any]]:
    """The material differences between the arms' workloads in ``features`` (ROW_NEEDS), each as a dict:
    ``feature``, ``a``, ``b`` and ``ratio`` (means) or ``difference`` (largest share difference)."""
    out: list[dict[str, Any]] = []
    if not len(a) or not len(b):
        return out
    a, b = _workload(a), _workload(b)
    for col, ma, mb in _token_means(a, b, features):
        if ma and mb and max(mb / ma, ma / mb) >= RATIO_LIMIT:
            out.append({"feature": col, "a": ma, "b": mb, "ratio": mb / ma})
    if "api" in features:
        sa, sb = a.shares("api"), b.shares("api")
        diff = max(abs(sa.get(k, 0.0) - sb.get(k, 0.0)) for k in set(sa) | set(sb))
        if diff >= SHARE_LIMIT:
            out.append({"feature": "api", "a": sa, "b": sb, "difference": diff})
    if "streamed" in features:
        sa, sb = a.streamed(), b.streamed()
        if abs(sa - sb) >= SHARE_LIMIT:
            out.append({"feature": "streamed", "a": sa, "b": sb, "difference": abs(sa - sb)})
    return out


def _mix(shares: dict[str, float]) -> str:
    return " ".join(f"{v * 100:.0f}% {k}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))


def describe(diff: dict[str, Any]) -> str:
    """One difference in words: "completion tokens per turn: mean 30 in A, 71 in B (2.35x)"."""
    f = diff["feature"]
    if f in _NAMES:
        return f"{_NAMES[f]}: mean {diff['a']:.0f} in A, {diff['b']:.0f} in B ({diff['ratio']:.2f}x)"
    if f == "api":
        return f"APIs: A {_mix(diff['a'])}, B {_mix(diff['b'])}"
    return f"streamed turns: {diff['a'] * 100:.0f}% of A's, {diff['b'] * 100:.0f}% of B's"


def notes(a: Turns | Workload, b: Turns | Workload, features: tuple[str, ...]) -> list[str]:
    """What a reader of the row should know of the workloads short of a material difference: token means
    ``NOTE_RATIO`` or more apart, or an arm whose turns have no token counts."""
    out: list[str] = []
    if not len(a) or not len(b):
        return out
    a, b = _workload(a), _workload(b)
    for col, ma, mb in _token_means(a, b, features):
        if ma is None or mb is None:
            missing = " and ".join(name for name, m in (("A", ma), ("B", mb)) if m is None)
            out.append(f"{_NAMES[col]} unknown in {missing} (served without a tokenizer): whether the workloads "
                       "differ cannot be told")
        elif ma and mb and NOTE_RATIO <= max(mb / ma, ma / mb) < RATIO_LIMIT:
            out.append(f"{_NAMES[col]}: mean {ma:.0f} in A, {mb:.0f} in B ({mb / ma:.2f}x), short of the "
                       f"{RATIO_LIMIT:g}x that withholds the verdict")
    return out
