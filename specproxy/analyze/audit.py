"""``specproxy audit``: what each client costs, per turn and across its sessions, as a dict and as text.

Why: the clients people most want to audit are coding agents, which wrap every line a user types in
a system prompt, tool definitions and the whole conversation so far. The record already splits each
turn's prompt into those parts (counted through the chat template as the server renders it) and
names the client and the conversation (``client``, ``session``); the audit puts that together:

* per client, the median tokens per turn of each part and the share of the prompt the user's new
  input is (the rest is what the client sends again or injects);
* per session, how the prompt grows turn to turn, and the turns where the system prompt or the tool
  definitions changed (their token counts differ from the same session's previous turn: a change
  that keeps the count is not seen) or the history shrank (messages dropped or compacted): each
  such change invalidates a server's prefix cache from that part on;
* the server's own count of prompt tokens it took from its cache, beside the prompt;
* a prefill rate fitted per client (least squares of TTFT on the prompt tokens the server did not
  have cached, over streamed turns that completed), and what each part would cost at that rate.

Only counts are read: no text is stored, so the audit cannot say what changed, only where and how much.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from specproxy.store.dataset import Turns

__all__ = ["AUDIT_COLUMNS", "build_audit", "render_audit"]

PARTS = ("system", "tools", "history", "new")
AUDIT_COLUMNS = (
    "t_wall", "ttft_s", "streamed", "prompt_tokens", "usage_cached_tokens",
    *(f"prompt_{p}_tokens" for p in PARTS), "outcome", "client", "session", "api",
)
NO_CLIENT = "(no User-Agent)"
MIN_FIT_TURNS = 3  # a line through fewer points says nothing about a rate


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _fit(ttft: list[float], tokens: list[float]) -> dict[str, Any] | None:
    """TTFT = intercept + seconds_per_token * tokens, by least squares; None when it cannot be fitted."""
    if len(ttft) < MIN_FIT_TURNS or len(set(tokens)) < 2:
        return None
    slope, intercept = np.polyfit(np.asarray(tokens, float), np.asarray(ttft, float), 1)
    if slope <= 0:
        return None
    return {"n": len(ttft), "seconds_per_token": float(slope), "intercept_s": float(intercept),
            "prefill_tps": float(1.0 / slope)}


def _session(rows: list[dict]) -> dict[str, Any]:
    """One session's turns, oldest first: prompt growth and what changed turn to turn."""
    prompts = [r["prompt_tokens"] for r in rows]
    changes = []
    for k in range(1, len(rows)):
        prev, cur = rows[k - 1], rows[k]
        changed = [p for p in ("system", "tools") if cur[p] != prev[p]]
        if cur["history"] < prev["history"] + prev["new"]:  # last turn's conversation is not all in it
            changed.append("history shrank")
        if changed:
            changes.append({"turn": k + 1, "changed": changed,
                            **{p: [prev[p], cur[p]] for p in ("system", "tools", "history")}})
    growth = [b - a for a, b in zip(prompts, prompts[1:])]
    return {"turns": len(rows), "first_prompt_tokens": prompts[0], "last_prompt_tokens": prompts[-1],
            "median_growth_per_turn": _median(growth), "changes": changes}


def build_audit(turns: Turns, *, source: str = "") -> dict[str, Any]:
    """The audit of ``turns`` (``AUDIT_COLUMNS``), per client."""
    num, txt = turns.num, turns.txt
    by_client: dict[str, list[dict]] = defaultdict(list)
    for i in range(len(turns)):
        if txt["outcome"][i] != "ok" or np.isnan(num["prompt_tokens"][i]):
            continue
        row = {p: int(num[f"prompt_{p}_tokens"][i]) for p in PARTS}
        row.update(prompt_tokens=int(num["prompt_tokens"][i]), t_wall=float(num["t_wall"][i]),
                   ttft_s=float(num["ttft_s"][i]), streamed=bool(num["streamed"][i] == 1),
                   cached=None if np.isnan(num["usage_cached_tokens"][i]) else int(num["usage_cached_tokens"][i]),
                   session=txt["session"][i], api=txt["api"][i])
        by_client[txt["client"][i] or NO_CLIENT].append(row)
    clients = []
    for name, rows in sorted(by_client.items(), key=lambda kv: -len(kv[1])):
        clients.append(_client(name, rows))
    return {"source": source, "turns": sum(c["turns"] for c in clients), "clients": clients}


def _client(name: str, rows: list[dict]) -> dict[str, Any]:
    medians = {p: _median([r[p] for r in rows]) for p in (*PARTS, "prompt_tokens")}
    typed = [r["new"] / r["prompt_tokens"] for r in rows if r["prompt_tokens"]]
    sessions: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["session"] is not None:
            sessions[r["session"]].append(r)
    per_session = {s: _session(sorted(rs, key=lambda r: r["t_wall"])) for s, rs in sessions.items()}
    timed = [r for r in rows if r["streamed"] and not np.isnan(r["ttft_s"])]
    fit = _fit([r["ttft_s"] for r in timed], [r["prompt_tokens"] - (r["cached"] or 0) for r in timed])
    cached = [r["cached"] for r in rows if r["cached"] is not None]
    out: dict[str, Any] = {
        "client": name, "turns": len(rows), "apis": sorted({r["api"] for r in rows if r["api"]}),
        "sessions": len(sessions), "median_tokens": medians,
        "typed_share": {"median": _median(typed),
                        "overall": sum(r["new"] for r in rows) / max(sum(r["prompt_tokens"] for r in rows), 1)},
        "server_cached_tokens": {"n": len(cached), "median": _median(cached)},
        "median_ttft_s": _median([r["ttft_s"] for r in timed]),
        "prefill_fit": fit,
        "session_detail": per_session,
    }
    if fit is not None:
        out["part_cost_s"] = {p: (medians[p] or 0) * fit["seconds_per_token"] for p in PARTS}
    return out


def _n(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def render_audit(a: dict[str, Any]) -> str:
    lines = [f"specproxy audit: {a['source']}: {a['turns']} completed turns with prompt counts, "
             f"{len(a['clients'])} clients"]
    if not a["clients"]:
        lines.append("  no completed turns with prompt counts (start serve with --tokenizer)")
    for c in a["clients"]:
        m = c["median_tokens"]
        lines += ["", f"{c['client']}: {c['turns']} turns in {c['sessions']} sessions"
                  + (f" ({', '.join(c['apis'])})" if c["apis"] else "")]
        lines.append(f"  median tokens per turn: prompt {_n(m['prompt_tokens'])} = system {_n(m['system'])}"
                     f" + tools {_n(m['tools'])} + history {_n(m['history'])} + new {_n(m['new'])}")
        t = c["typed_share"]
        lines.append(f"  new input (what this turn added): {_n(t['median'], '{:.1%}')} of the prompt (median turn), "
                     f"{_n(t['overall'], '{:.1%}')} of all prompt tokens")
        sc = c["server_cached_tokens"]
        if sc["n"]:
            lines.append(f"  server's cached prompt tokens: median {_n(sc['median'])} over {sc['n']} turns")
        fit = c["prefill_fit"]
        if fit is not None:
            cost = c["part_cost_s"]
            lines.append(f"  fitted prefill: {fit['prefill_tps']:.0f} tok/s over {fit['n']} streamed turns "
                         f"(median TTFT {_n(c['median_ttft_s'], '{:.3f}')} s); at that rate, uncached: "
                         + ", ".join(f"{p} {cost[p]:.3f} s" for p in PARTS))
        for sid, s in sorted(c["session_detail"].items(), key=lambda kv: -kv[1]["turns"]):
            lines.append(f"  session {sid}: {s['turns']} turns, prompt {s['first_prompt_tokens']} -> "
                         f"{s['last_prompt_tokens']} tokens (median growth {_n(s['median_growth_per_turn'], '{:+.0f}')}"
                         " per turn)")
            for ch in s["changes"]:
                what = ", ".join(f"{p} {ch[p][0]} -> {ch[p][1]} tokens" if p in ch else p for p in ch["changed"])
                lines.append(f"    turn {ch['turn']}: {what} (a server's prefix cache is reusable only up to there)")
    return "\n".join(lines) + "\n"
