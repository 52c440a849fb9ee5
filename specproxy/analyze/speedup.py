"""The whole-turn model: how much of an engine's decode speedup a user feels (docs/metrics.md).

Why: a turn is ``ttft_s`` (waiting for the first token: prefill, queueing, the client's injected
system prompt and tool definitions) plus ``decode_s`` (text streaming). Speculative decoding and
most engine work speed up only the decode part; with TTFT held fixed, a 2.58x decode speedup on a
turn that spends 6.1 of its 16.1 seconds before the first token is a 1.98x turn, and a 1.11x one
is 1.07x, which nobody can feel. These functions make that arithmetic explicit, in both forms:

* ``measured="before"``: the times were measured before the change (planning: "what would an s-
  times faster decode buy?"): ``(ttft + decode) / (ttft + decode / s)``.
* ``measured="after"``: the times were measured after a change that made decode s times faster
  (a before/after comparison read from the new runs): ``(ttft + decode * s) / (ttft + decode)``.

Both say the same thing: with before-times (t, d*s) and after-times (t, d), they are equal.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

__all__ = ["whole_turn_speedup", "required_decode_speedup", "ttft_share", "WindowSpeedup",
           "window_speedups", "DEFAULT_SPEEDUPS"]

DEFAULT_SPEEDUPS = (1.25, 1.5, 2.0, 3.0)


def _check_times(ttft_s: float, decode_s: float) -> tuple[float, float]:
    t, d = float(ttft_s), float(decode_s)
    for name, v in (("ttft_s", t), ("decode_s", d)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite time >= 0, got {v}")
    if t + d <= 0:
        raise ValueError("ttft_s + decode_s must be > 0: a turn that took no time has no speedup")
    return t, d


def _check_positive(name: str, v: float) -> float:
    v = float(v)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v}")
    return v


def whole_turn_speedup(ttft_s: float, decode_s: float, s: float, *,
                       measured: str = "before") -> float:
    """Whole-turn speedup for a decode speedup ``s``, TTFT held fixed (prefill unchanged).

    measured="before": (ttft + decode) / (ttft + decode / s), times from before the change.
    measured="after":  (ttft + decode * s) / (ttft + decode), times from after it.
    """
    t, d = _check_times(ttft_s, decode_s)
    s = _check_positive("s", s)
    if measured == "before":
        return (t + d) / (t + d / s)
    if measured == "after":
        return (t + d * s) / (t + d)
    raise ValueError(f'measured must be "before" or "after", got {measured!r}')


def required_decode_speedup(ttft_s: float, decode_s: float, target: float) -> float | None:
    """Decode speedup s that gives a whole-turn speedup of ``target`` (times from before).

    Inverse of the before-form: s = decode / ((ttft + decode) / target - ttft). None when no
    finite s reaches it: target >= (ttft + decode) / ttft, the turn with decode taking no time
    at all (also: a turn with no decode time cannot change, so any target but 1 is None).
    """
    t, d = _check_times(ttft_s, decode_s)
    target = _check_positive("target", target)
    if d == 0:
        return 1.0 if target == 1 else None
    room = (t + d) / target - t  # decode time the target leaves
    if room <= 0:
        return None
    return d / room


def ttft_share(ttft_s: float, decode_s: float) -> float:
    """Share of the turn spent before the first token: ttft / (ttft + decode).

    The larger it is, the more an engine-side decode gain is diluted: the whole-turn speedup
    can never exceed 1 / ttft_share, however fast decode gets.
    """
    t, d = _check_times(ttft_s, decode_s)
    return t / (t + d)


@dataclass(frozen=True)
class WindowSpeedup:
    """Whole-turn figures for a traffic window; every figure None when there are no turns."""
    n: int                      # turns with both ttft_s and decode_s
    ttft_s: float | None        # summed over the turns
    decode_s: float | None      # summed over the turns
    ttft_share: float | None
    max_speedup: float | None   # 1 / ttft_share: the ceiling for an infinitely fast decode
    speedups: dict[float, float | None]  # decode speedup s -> whole-turn speedup

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["speedups"] = {str(k): v for k, v in self.speedups.items()}
        return d


def _times(values: Iterable[Any]) -> np.ndarray:
    """Values as float64: an array as it is (``list()`` of a 10M-turn column made 10M Python floats first)."""
    return np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=float).reshape(-1)


def window_speedups(ttft_s: Iterable[Any], decode_s: Iterable[Any], *,
                    speedups: Iterable[float] = DEFAULT_SPEEDUPS,
                    measured: str = "before") -> WindowSpeedup:
    """TTFT share and whole-turn speedups for the turns of a traffic window.

    Choice: sums over turns, not medians. Sum(ttft) / (sum(ttft) + sum(decode)) is the share of
    all the time users spent in turns that came before the first token, and the speedup from
    sums is the exact ratio of total turn time before and after: the per-turn formula is linear
    in the times, so nothing is lost in aggregating. Medians of each column would pair the
    TTFT of one turn with the decode time of another and answer no question. Consequence: long
    turns weigh more than short ones (by their duration), as they do for the users waiting;
    to see a class of turn on its own, pass only its turns (e.g. one prompt bucket).

    Turns missing either time (None/NaN) are dropped whole; so are turns with no first token.
    ``measured`` as in ``whole_turn_speedup``: traffic times are normally "before" a change.
    """
    t, d = _times(ttft_s), _times(decode_s)
    if t.size != d.size:
        raise ValueError(f"{t.size} ttft_s values but {d.size} decode_s values")
    keep = ~(np.isnan(t) | np.isnan(d))
    if not keep.all():
        t, d = t[keep], d[keep]
    # NaN gone: min < 0 is a negative time or -inf, max == inf is +inf (two passes, no mask)
    if t.size and (min(t.min(), d.min()) < 0 or max(t.max(), d.max()) == math.inf):
        raise ValueError("times must be finite and >= 0")
    ss = [_check_positive("s", s) for s in speedups]
    total_t, total_d = float(t.sum()), float(d.sum())
    if t.size == 0 or total_t + total_d <= 0:
        return WindowSpeedup(int(t.size), None, None, None, None, {s: None for s in ss})
    share = ttft_share(total_t, total_d)
    return WindowSpeedup(
        n=int(t.size), ttft_s=total_t, decode_s=total_d, ttft_share=share,
        max_speedup=(1.0 / share) if share > 0 else math.inf,
        speedups={s: whole_turn_speedup(total_t, total_d, s, measured=measured) for s in ss})
