"""The prefix cache, predicted against what the server reused: the one place these figures are decided.

Why: specproxy predicts, from the session's previous turn, how many leading prompt tokens a server's
prefix cache could reuse (``prefix_reused_tokens``); the server says how many it did reuse
(``usage_cached_tokens``). The difference is what the cache lost (an evicted entry, a turn sent to
another replica, a cache too small for the session), which neither figure shows alone. And a lost
token is prefilled again: its cost in TTFT comes from the turns' own TTFT against the prompt tokens the
server had to prefill, fitted here with an interval, so that "lost 12k tokens" also says "about 0.8 s
of waiting".

* ``lost`` per turn: ``predicted - reused`` floored at 0 (a server may reuse more than the prediction:
  a prefix shared with another session's turn, or a cache kept across the proxy's restart; that is no
  loss), null when either is null.
* The fit (``ttft_fit``): least squares of TTFT on uncached prompt tokens (``prompt_tokens`` less the
  server's cached count; all of the prompt when the server said none), over streamed turns that
  completed; the slope in ms per 1k uncached tokens, with a Student t interval on n - 2 degrees of
  freedom from the HC3 standard error (heteroscedasticity-consistent: TTFT scatters more at long
  prompts and under load; the plain OLS error assumes it does not). docs/statistics.md, "The TTFT fit".
* The cost of the lost tokens (``lost_ttft_s``): the slope times the lost tokens, its interval the
  slope's interval times them (the lost tokens are counted, not estimated).

Sums per session and per client are over the turns where both counts are known (``turns``): a sum
over more turns for one figure than the other would compare different things.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from specproxy.analyze.by_cell import text_cells, text_values
from specproxy.analyze.cells import groups
from specproxy.analyze.tdist import t_ppf

__all__ = ["MIN_FIT_TURNS", "PREFIX_CACHE_COLUMNS", "cache_totals", "fit_of", "lost_tokens", "lost_ttft",
           "prefix_cache_section", "render_lines",
           "ttft_fit", "uncached_tokens"]

MIN_FIT_TURNS = 3  # a line through fewer points says nothing about a rate (and n - 2 degrees of freedom)
LEVEL = 0.95
_t_ppf = functools.lru_cache(maxsize=512)(t_ppf)  # one quantile per (level, n): a report fits many clients
PREFIX_CACHE_COLUMNS = ("ttft_s", "streamed", "prompt_tokens", "usage_cached_tokens", "prefix_reused_tokens",
                        "outcome", "client")


def lost_tokens(predicted: int | None, reused: int | None) -> int | None:
    """Predicted reusable less what the server reused, floored at 0; None when either is unknown."""
    if predicted is None or reused is None:
        return None
    return max(predicted - reused, 0)


def uncached_tokens(prompt: float, cached: float | None) -> float:
    """The prompt tokens the server prefilled: the prompt less its cached count (all of it when the server
    said none: no reuse is assumed, not made up)."""
    if cached is None or (isinstance(cached, float) and math.isnan(cached)):
        return prompt
    return max(prompt - cached, 0.0)


def ttft_fit(ttft: list[float] | np.ndarray, uncached: list[float] | np.ndarray,
             level: float = LEVEL) -> dict[str, Any] | None:
    """TTFT = intercept + slope * uncached tokens, by least squares, with the slope's interval; None when
    it cannot be fitted (fewer than 3 turns, one distinct token count) or TTFT does not grow with the
    uncached tokens (slope <= 0: no prefill rate can be read off it)."""
    y = np.asarray(ttft, float)
    x = np.asarray(uncached, float)
    keep = np.isfinite(x) & np.isfinite(y)
    if not keep.all():
        x, y = x[keep], y[keep]
    n = len(x)
    if n < MIN_FIT_TURNS or np.ptp(x) == 0:
        return None
    # the operations of the textbook formulas, each into one of three buffers (a month's turns: 80 MB
    # each, where a temporary per operation held ten at once); x and y are read, never written
    x_mean, y_mean = x.mean(), y.mean()  # each found once, used twice
    xc = x - x_mean
    sxx = float(xc @ xc)
    work = y - y_mean
    slope = float(xc @ work) / sxx
    if slope <= 0:
        return None
    intercept = float(y_mean - slope * x_mean)
    resid = np.subtract(y, intercept, out=work)  # y - intercept - slope * x
    lev = np.multiply(x, slope)
    resid -= lev
    xc2 = np.multiply(xc, xc, out=xc)
    np.divide(xc2, sxx, out=lev)
    np.add(1.0 / n, lev, out=lev)  # each turn's leverage
    np.minimum(lev, 1.0 - 1e-12, out=lev)
    np.subtract(1.0, lev, out=lev)
    np.divide(resid, lev, out=resid)
    np.square(resid, out=resid)
    var = float(np.sum(np.multiply(xc2, resid, out=resid))) / (sxx * sxx)  # HC3
    half = _t_ppf(0.5 + level / 2, n - 2) * math.sqrt(var) if n > 2 else math.inf
    ms = 1e6  # seconds per token -> ms per 1k tokens
    return {"n": n, "ms_per_1k_uncached": slope * ms, "ms_per_1k_lo": (slope - half) * ms,
            "ms_per_1k_hi": (slope + half) * ms, "intercept_s": intercept, "seconds_per_token": slope,
            "prefill_tps": 1.0 / slope, "level": level}


def lost_ttft(lost: float | None, fit: dict[str, Any] | None) -> dict[str, float] | None:
    """What ``lost`` tokens cost in TTFT at the fitted rate: seconds, with the slope's interval scaled."""
    if lost is None or fit is None:
        return None
    per = lost / 1e6  # ms per 1k tokens -> seconds per lost token
    return {"s": fit["ms_per_1k_uncached"] * per, "lo": fit["ms_per_1k_lo"] * per, "hi": fit["ms_per_1k_hi"] * per}


def cache_totals(predicted, reused, fit: dict[str, Any] | None = None) -> dict[str, Any]:
    """Sums over the turns where both counts are known (``predicted``, ``reused``: sequences of counts,
    None or NaN where unknown): predicted reusable, reused by the server, lost (the per-turn losses added:
    a turn that reused more than predicted does not hide another's loss), the share of the predicted that
    the server reused, and what the lost part costs at ``fit``. Over arrays: a month's turns at once."""
    p = np.asarray(predicted, dtype=float)
    r = np.asarray(reused, dtype=float)
    both = np.isfinite(p) & np.isfinite(r)
    p, r = p[both], r[both]
    turns = int(both.sum())
    pred, used = int(p.sum()), int(r.sum())
    lost = int(np.maximum(p - r, 0.0).sum())  # lost_tokens per turn, added
    return {"turns": turns, "predicted_tokens": pred if turns else None, "reused_tokens": used if turns else None,
            "lost_tokens": lost if turns else None, "turns_with_loss": int((p > r).sum()),
            "reused_share": min(used, pred) / pred if turns and pred > 0 else None,
            "lost_ttft_s": lost_ttft(lost if turns else None, fit)}


def fit_of(ttft: np.ndarray, streamed: np.ndarray, prompt: np.ndarray, cached: np.ndarray) -> dict[str, Any] | None:
    """The fit over the streamed turns (a non-streamed turn's TTFT is its whole response time) of columns."""
    timed = (streamed == 1) & np.isfinite(ttft) & np.isfinite(prompt)
    unc = np.nan_to_num(cached)
    np.subtract(prompt, unc, out=unc)
    np.maximum(unc, 0.0, out=unc)
    np.copyto(unc, prompt, where=~np.isfinite(cached))  # the server said nothing: all of the prompt
    return ttft_fit(ttft[timed], unc[timed])


def prefix_cache_section(ok) -> dict[str, Any]:
    """The report's section over completed turns (``ok``, a ``Turns`` with ``PREFIX_CACHE_COLUMNS``): the
    totals over all of them at one fit, and per client, each at its own fit (clients differ in prompt
    shape and may go to different servers)."""
    cached = ok.num["usage_cached_tokens"]  # read once for the fit and the totals (a month's column is a copy)
    fit = fit_of(ok.num["ttft_s"], ok.num["streamed"], ok.num["prompt_tokens"], cached)
    predicted = ok.num["prefix_reused_tokens"]
    out = {"fit": fit, **cache_totals(predicted, cached, fit), "predicted_turns": int(np.isfinite(predicted).sum()),
           "server_cached_turns": int(np.isfinite(cached).sum())}
    del predicted, cached  # a month's columns: not held through the clients' tables
    names = sorted(c for c in text_values(ok, "client") if c is not None)
    per_client = []
    for i, at in groups(text_cells(ok, "client", {name: i for i, name in enumerate(names)})):  # a pass, not one per client
        name = names[i]
        mine = ok.select(at).num  # the client's rows only, read from the loaded columns
        cfit = fit_of(mine["ttft_s"], mine["streamed"], mine["prompt_tokens"], mine["usage_cached_tokens"])
        totals = cache_totals(mine["prefix_reused_tokens"], mine["usage_cached_tokens"], cfit)
        if totals["turns"]:
            per_client.append({"client": name, "fit": cfit, **totals})
    out["by_client"] = sorted(per_client, key=lambda c: -(c["lost_tokens"] or 0))
    return out


def render_lines(s: dict[str, Any], indent: str = "  ", head: str = "") -> list[str]:
    """Text lines of one totals dict (``cache_totals``, with its ``fit`` when there is one), the first
    after ``head``."""
    if not s["turns"]:
        return [f"{indent}{head}no turn has both the prediction and the server's cached count"]
    share = "-" if s["reused_share"] is None else f"{s['reused_share']:.0%}"
    line = (f"{indent}{head}predicted reusable {s['predicted_tokens']:,}, reused by the server {s['reused_tokens']:,} ({share}), "
            f"lost {s['lost_tokens']:,} tokens in {s['turns_with_loss']} of {s['turns']} turns")
    cost = s.get("lost_ttft_s")
    if cost is not None:
        line += f"; the lost part cost {cost['s']:.3f} s of TTFT [{cost['lo']:.3f}, {cost['hi']:.3f}]"
    lines = [line]
    fit = s.get("fit")
    if fit is not None:
        lines.append(f"{indent}  (TTFT grows {fit['ms_per_1k_uncached']:.1f} ms per 1k uncached prompt tokens "
                     f"[{fit['ms_per_1k_lo']:.1f}, {fit['ms_per_1k_hi']:.1f}], fitted over {fit['n']} streamed turns)")
    return lines
