"""``report --by KEY``: the turns per client, session, label, tenant or model, side by side, with their cost.

Why a table of its own: who gets what, and who spends what, are the questions an operator of shared
servers asks first (per team, per agent, per customer), and they are the same figures as the report's,
read per group. Each row's figures are decided where the report's are (medians of ``ttft_s`` and
``decode_tps`` over streamed turns that completed; sums of token counts; cost by ``analyze/cost.py``);
this module only groups them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from specproxy.analyze import cells
from specproxy.analyze.cost import (BY_KEYS, COST_COLUMNS, cost_summary, group_index, render_cost_lines,
                                    turn_costs, usd)
from specproxy.analyze.wording import plural
from specproxy.prices import Price
from specproxy.store.dataset import Turns

__all__ = ["BY_KEYS", "GROUP_COLUMNS", "by_group", "cost_section", "render_by", "render_cost"]

GROUP_COLUMNS = ("outcome", "streamed", "ttft_s", "decode_tps", "prompt_tokens", "completion_tokens",
                 "usage_prompt_tokens", "usage_cached_tokens", *COST_COLUMNS)
MAX_ROWS = 50  # the text's table; --json has every group


def _median(values: np.ndarray) -> float | None:
    values = values[np.isfinite(values)]
    return float(np.median(values)) if len(values) else None


def _total(values: np.ndarray) -> int | None:
    known = values[np.isfinite(values)]
    return int(known.sum()) if len(known) else None


def cost_section(turns: Turns, prices: Mapping[str, Price] | None) -> dict[str, Any] | None:
    """The report's cost over all of ``turns``: None without a price table."""
    if prices is None:
        return None
    return {"models_priced": sorted(prices), **cost_summary(turn_costs(turns, prices))}


def by_group(turns: Turns, key: str, prices: Mapping[str, Price] | None) -> dict[str, Any]:
    """Per value of ``key``: turns, completed turns, median TTFT and per-stream decode speed (streamed
    turns that completed), prompt and completion tokens (sums of the known counts), the share of the
    server's prompt tokens it said it had cached, and the cost (None without prices), the most turns first."""
    index, names = group_index(turns, key)
    costs = turn_costs(turns, prices) if prices is not None else None
    ok = turns.ok
    streamed = ok & (turns.num["streamed"] == 1)
    out = []
    for g, rows in cells.groups(index):  # each group's turns, in their order, from one pass
        usage = turns.num["usage_prompt_tokens"][rows]
        cached = turns.num["usage_cached_tokens"][rows]
        both = np.isfinite(usage) & np.isfinite(cached)
        timed = rows[streamed[rows]]
        out.append({
            "group": names[g], "turns": len(rows), "completed": int(ok[rows].sum()),
            "ttft_p50_s": _median(turns.num["ttft_s"][timed]),
            "decode_tps_p50": _median(turns.num["decode_tps"][timed]),
            "prompt_tokens": _total(turns.num["prompt_tokens"][rows]),
            "completion_tokens": _total(turns.num["completion_tokens"][rows]),
            "server_cached_share": (float(cached[both].sum() / usage[both].sum())
                                    if both.any() and usage[both].sum() > 0 else None),
            "cost": cost_summary(costs.select(rows)) if costs is not None else None,
        })
    out.sort(key=lambda g: (-g["turns"], str(g["group"])))
    return {"key": key, "groups": out}


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def render_by(section: dict[str, Any]) -> list[str]:
    """The ``by`` section as a table."""
    groups = section["groups"]
    priced = any(g["cost"] is not None for g in groups)
    lines = [f"By {section['key']} ({plural(len(groups), 'group')}; TTFT and decode speed: medians over streamed turns "
             "that completed)"]
    head = f"  {section['key']:<28} {'turns':>6} {'ok':>6} {'TTFT p50 s':>10} {'tok/s p50':>9} " \
           f"{'prompt tok':>11} {'output tok':>10} {'cached':>6}"
    if priced:
        head += f" {'cost':>10} {'per turn':>9} {'tools of $1':>11}"
    lines.append(head)
    for g in groups[:MAX_ROWS]:
        line = (f"  {str(g['group'])[:28]:<28} {g['turns']:>6} {g['completed']:>6} {_f(g['ttft_p50_s'], '{:.3f}'):>10} "
                f"{_f(g['decode_tps_p50'], '{:.1f}'):>9} {_f(g['prompt_tokens'], '{:,}'):>11} "
                f"{_f(g['completion_tokens'], '{:,}'):>10} {_f(g['server_cached_share'], '{:.0%}'):>6}")
        if priced:
            c = g["cost"]
            share = (c["parts"]["of_every_dollar"] or {}).get("tools")
            line += f" {usd(c['usd']):>10} {usd(c['usd_per_turn']):>9} {_f(share, '${:.2f}'):>11}"
        lines.append(line)
    if len(groups) > MAX_ROWS:
        lines.append(f"  ... {len(groups) - MAX_ROWS} more groups in --json")
    return lines


def render_cost(section: dict[str, Any]) -> list[str]:
    """The report's cost section as lines of text."""
    return [f"Cost at the given prices (USD; models priced: {', '.join(section['models_priced']) or 'none'})",
            *render_cost_lines(section)]
