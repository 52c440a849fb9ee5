"""What a turn cost at the user's prices: the one rule (``turn_costs``), and its sums per group and per
prompt part (``cost_summary``, ``cost_by``).

Why here, once: ``report``, ``audit`` and the HTML report all show cost, and a cost is a claim about
money; decided in one place from the record's stored counts, it cannot differ between them. The rule
(docs/metrics.md, "Cost", says it for users):

* A turn is priced at its model's prices (``prices.Price``, from the user's table: none by default) when
  the server answered it (outcome ``ok``, or cut short after it began answering: ``client_abort``,
  ``client_stalled``, ``shutdown``: the prompt was processed and the tokens delivered were generated).
* Its prompt is ``prompt_tokens`` (specproxy's count, which the prompt parts split), else the server's
  ``usage_prompt_tokens``. Of it, ``usage_cached_tokens`` (clipped to the prompt) are priced as cached
  input and, where the record has it, ``usage_cache_write_tokens`` (the Messages API's cache writes) as
  cache writes; the rest as input. A record without a cache-write count prices none as writes.
* Its output is ``completion_tokens``, else the server's ``usage_completion_tokens``; of it,
  ``reasoning_tokens`` (specproxy's, so only with its own output count) are priced as reasoning.
* A count is needed only where the table prices it apart: a missing cached count nulls the cost only
  when ``cached_input`` differs from ``input``, a missing reasoning count only when ``reasoning``
  differs from ``output``. Otherwise a missing count, or no price for the model, leaves the cost null
  (never 0), and the reason is counted.

What each prompt part costs: the prompt is read in the order the parts are counted (system prompt, tool
definitions, history, new input), the server's cache covers its start, so the cached tokens are the
first ones, the cache writes the next, and the uncached the rest; each part is priced by the share of
each it holds. A chat template may render the tools before the system prompt: where the cache ends
inside those two, their split is then approximate; their sum is not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from specproxy.analyze.cells import groups
from specproxy.prices import Price
from specproxy.store.dataset import NUMERIC, Turns

__all__ = ["BY_KEYS", "CACHE_WRITE_COLUMN", "COST_COLUMNS", "KINDS", "PARTS", "PRICED_OUTCOMES", "TurnCosts",
           "cost_by", "cost_summary", "group_index", "group_names", "render_cost_lines", "turn_costs", "usd"]

PARTS = ("system", "tools", "history", "new")
KINDS = ("input", "cached_input", "cache_write", "output", "reasoning")
# the Messages API's cache writes: priced apart only where the record keeps them
CACHE_WRITE_COLUMN = "usage_cache_write_tokens"
CACHE_WRITE = (CACHE_WRITE_COLUMN,) if CACHE_WRITE_COLUMN in NUMERIC else ()
PRICED_OUTCOMES = ("ok", "client_abort", "client_stalled", "shutdown")
COST_COLUMNS = ("model", "outcome", "prompt_tokens", "usage_prompt_tokens", "usage_cached_tokens", *CACHE_WRITE,
                "completion_tokens", "usage_completion_tokens", "reasoning_tokens",
                *(f"prompt_{p}_tokens" for p in PARTS))
# what ``--by`` groups by: the record's own names for them
BY_KEYS = ("client", "session", "label", "tenant", "model")
NO_GROUP = "(none)"
PER_MILLION = 1e-6


@dataclass
class TurnCosts:
    """Per turn, in USD: ``usd`` the whole cost, ``kinds`` its parts by price (``KINDS``), ``parts`` the
    prompt's cost by prompt part (``PARTS``; NaN where the prompt was not split); NaN where the turn is not
    priced, and ``why`` then says why (None where it is)."""

    usd: np.ndarray
    kinds: dict[str, np.ndarray]
    parts: dict[str, np.ndarray]
    why: np.ndarray

    def select(self, mask: np.ndarray) -> TurnCosts:
        return TurnCosts(self.usd[mask], {k: v[mask] for k, v in self.kinds.items()},
                         {k: v[mask] for k, v in self.parts.items()}, self.why[mask])


def _overlap(lo: np.ndarray, hi: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Tokens of [lo, hi) that fall in [a, b)."""
    return np.clip(np.minimum(hi, b) - np.maximum(lo, a), 0, None)


def turn_costs(turns: Turns, prices: Mapping[str, Price]) -> TurnCosts:
    """The cost of each of ``turns`` (loaded with ``COST_COLUMNS``) at ``prices`` (by model), by the rule above."""
    num = turns.num
    n = len(turns)
    price = {k: np.full(n, np.nan) for k in KINDS}
    for name, p in prices.items():
        rows = turns.is_("model", name)
        for k in KINDS:
            price[k][rows] = getattr(p, k)
    ours = num["prompt_tokens"]
    prompt = np.where(np.isfinite(ours), ours, num["usage_prompt_tokens"])
    cached_raw = num["usage_cached_tokens"]
    cached = np.clip(np.nan_to_num(cached_raw), 0, np.nan_to_num(prompt))
    writes = np.zeros(n) if not CACHE_WRITE else np.clip(np.nan_to_num(num[CACHE_WRITE_COLUMN]), 0,
                                                         np.nan_to_num(prompt) - cached)
    uncached = prompt - cached - writes
    out_ours = num["completion_tokens"]
    output = np.where(np.isfinite(out_ours), out_ours, num["usage_completion_tokens"])
    reasoning_raw = np.where(np.isfinite(out_ours), num["reasoning_tokens"], np.nan)
    reasoning = np.clip(np.nan_to_num(reasoning_raw), 0, np.nan_to_num(output))

    why = np.full(n, None, dtype=object)
    checks = (
        (~turns.lookup("outcome", dict.fromkeys(PRICED_OUTCOMES, True), False), "no answer (the upstream failed or was never reached)"),
        (~np.isfinite(price["input"]), "no price for its model"),
        (~np.isfinite(prompt), "no prompt count"),
        (~np.isfinite(output), "no output count"),
        (~np.isfinite(cached_raw) & (price["cached_input"] != price["input"]), "no cached-token count from the server"),
        (~np.isfinite(reasoning_raw) & (price["reasoning"] != price["output"]), "no reasoning-token count"),
    )
    for bad, reason in checks:
        why[bad & (why == None)] = reason  # noqa: E711 - elementwise on an object array
    priced = why == None  # noqa: E711

    kinds = {
        "input": uncached * price["input"],
        "cached_input": cached * price["cached_input"],
        "cache_write": writes * price["cache_write"],
        "output": (output - reasoning) * price["output"],
        "reasoning": reasoning * price["reasoning"],
    }
    kinds = {k: np.where(priced, v * PER_MILLION, np.nan) for k, v in kinds.items()}
    usd = np.where(priced, sum(kinds.values()), np.nan)

    # the prompt's parts along it: cached tokens first, then cache writes, then uncached
    part_counts = [num[f"prompt_{p}_tokens"] for p in PARTS]
    split = priced & np.isfinite(ours) & np.logical_and.reduce([np.isfinite(c) for c in part_counts])
    edges = np.cumsum([np.zeros(n), *[np.nan_to_num(c) for c in part_counts]], axis=0)
    parts = {}
    for k, name in enumerate(PARTS):
        lo, hi = edges[k], edges[k + 1]
        usd_part = (_overlap(lo, hi, 0, cached) * price["cached_input"]
                    + _overlap(lo, hi, cached, cached + writes) * price["cache_write"]
                    + _overlap(lo, hi, cached + writes, np.inf) * price["input"]) * PER_MILLION
        parts[name] = np.where(split, usd_part, np.nan)
    return TurnCosts(usd, kinds, parts, why)


def _sum(values: np.ndarray) -> float:
    return float(np.nansum(values))


def cost_summary(costs: TurnCosts) -> dict[str, Any]:
    """The sums over ``costs``' turns: the total, by price, per priced turn, what each prompt part costs of
    every dollar (over the turns whose prompt was split), and why the others were not priced."""
    priced = np.isfinite(costs.usd)
    k = int(priced.sum())
    total = _sum(costs.usd)
    split = priced & np.logical_and.reduce([np.isfinite(v) for v in costs.parts.values()])
    split_usd = _sum(costs.usd[split])
    part_usd = {p: _sum(v[split]) for p, v in costs.parts.items()}
    output_usd = _sum(costs.kinds["output"][split] + costs.kinds["reasoning"][split])
    return {
        "turns": len(costs.usd), "priced": k, "usd": total if k else None,
        "usd_per_turn": total / k if k else None,
        "kinds": {kind: _sum(v) if k else None for kind, v in costs.kinds.items()},
        "parts": {"turns": int(split.sum()), "usd": part_usd if split.any() else None,
                  "of_every_dollar": ({**{p: u / split_usd for p, u in part_usd.items()},
                                       "output": output_usd / split_usd} if split_usd > 0 else None)},
        "unpriced": dict(Counter(costs.why[~priced].tolist()).most_common()),  # reasons: str, counted in C
    }


def group_index(turns: Turns, key: str, none: str = NO_GROUP) -> tuple[np.ndarray, list]:
    """Each turn's group by ``key`` as an index into the returned names: its value, ``none`` where the
    record has none (one group with a value that reads so). From the column's codes: no pass over objects,
    and ``cells.groups`` of the index gives every group's turns at once."""
    codes, values = turns.codes(key)
    names: dict[Any, int] = {}
    per_code = np.array([names.setdefault(v, len(names)) for v in (*values, none)], dtype=np.int64)
    return per_code[codes], list(names)  # code -1 (NULL) is the last entry


def group_names(turns: Turns, key: str) -> np.ndarray:
    """``key``'s value per turn, ``(none)`` where the record has none."""
    index, names = group_index(turns, key)
    return np.array(names, dtype=object)[index]


def cost_by(turns: Turns, costs: TurnCosts, key: str) -> list[dict[str, Any]]:
    """``cost_summary`` per value of ``key`` (one of ``BY_KEYS``), the costliest first."""
    index, names = group_index(turns, key)
    out = [{"group": names[g], **cost_summary(costs.select(rows))} for g, rows in groups(index)]
    return sorted(out, key=lambda g: (-(g["usd"] or 0.0), -g["turns"], g["group"]))


def usd(value: float | None) -> str:
    """Dollars as a person reads them: cents for large sums, more digits for a turn's fractions."""
    if value is None:
        return "-"
    return f"${value:,.2f}" if abs(value) >= 10 else f"${value:.4f}"


_KIND_NAMES = {"input": "input", "cached_input": "cached input", "cache_write": "cache writes", "output": "output",
               "reasoning": "reasoning"}
_PART_NAMES = {"system": "system prompt", "tools": "tool definitions", "history": "history", "new": "new input",
               "output": "output"}


def _unpriced(s: dict[str, Any]) -> str:
    return "; ".join(f"{n} {why}" for why, n in s["unpriced"].items())


def render_cost_lines(s: dict[str, Any], indent: str = "  ") -> list[str]:
    """``cost_summary``'s figures as lines of text."""
    head = f"{s['priced']} of {s['turns']} turns priced"
    if s["unpriced"]:
        head += f" (not priced: {_unpriced(s)})"
    if not s["priced"]:
        return [indent + head]
    kinds = " + ".join(f"{_KIND_NAMES[k]} {usd(v)}" for k, v in s["kinds"].items() if v)
    lines = [indent + head, f"{indent}total {usd(s['usd'])}" + (f" = {kinds}" if kinds else "")
             + f"; {usd(s['usd_per_turn'])} per turn"]
    share = s["parts"]["of_every_dollar"]
    if share:
        lines.append(f"{indent}of every $1 (over the {s['parts']['turns']} priced turns whose prompt was split): "
                     + ", ".join(f"{_PART_NAMES[p]} ${v:.2f}" for p, v in share.items()))
    return lines
