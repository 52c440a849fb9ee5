"""``specproxy audit``: what each client costs, per turn and across its sessions, as a dict and as text.

Why: the clients people most want to audit are coding agents, which wrap every line a user types in
a system prompt, tool definitions and the whole conversation so far. The record already splits each
turn's prompt into those parts (counted through the chat template as the server renders it) and
names the client and the conversation (``client``, ``session``); the audit puts that together:

* per client, the median tokens per turn of each part and the share of the prompt the user's new
  input is (the rest is what the client sends again or injects);
* per session, how the prompt grows turn to turn, and what changed turn to turn (``turn_diff``:
  messages added or removed, the system prompt or the tools changed, found by digests); rows from
  before that field fall back to the parts' token counts (a change that keeps the count is not seen);
* per turn, the prefix-cache break: how many leading tokens it shares with the session's previous
  turn (``prefix_reused_tokens``), the part the first differing token falls in, and beside it the
  server's own count of prompt tokens it took from its cache;
* per session, the tools defined and those never called (by name digest unless text is stored): a
  tool counts as called when any turn's answer called it (each row's ``tool_names["called"]`` is read
  from its own response, so a call in the session's last answer counts; rows recorded before that
  hold the calls their request resent, calls made earlier in the same session, and count the same);
* a prefill rate fitted per client (least squares of TTFT on the prompt tokens the server did not
  have cached, over streamed turns that completed), and what each part would cost at that rate;
* the prefix cache side by side, per turn, per session and per client: predicted reusable, reused by
  the server, lost, and what the lost part cost in TTFT at the client's fitted rate (decided in
  ``analyze/prefix_cache.py``, the one place: the fit is the same one).
* with a price table, what the client's turns cost in dollars, per session and per turn, and what each
  prompt part costs of every dollar (``analyze/cost.py`` decides every figure of it).

``--by`` groups by another of the record's names instead of the client: the session, the label, the
tenant or the model.

Only counts and digests are read: no text is stored, so the audit says where and how much changed,
not what.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import orjson

from specproxy.analyze.cells import groups
from specproxy.analyze.cost import COST_COLUMNS, cost_summary, group_index, render_cost_lines, turn_costs, usd
from specproxy.prices import Price
from specproxy.analyze.deferred import figures_in_parallel, later, resolved
from specproxy.analyze.order_stats import order_statistics
from specproxy.analyze.prefix_cache import cache_totals, fit_of, lost_tokens, lost_ttft, render_lines
from specproxy.analyze.summary import median
from specproxy.analyze.turn_diff import readable_diff, render_diff
from specproxy.store.dataset import Turns

__all__ = ["AUDIT_COLUMNS", "audit_columns", "build_audit", "find_session", "render_audit", "render_session"]

PARTS = ("system", "tools", "history", "new")
AUDIT_COLUMNS = (
    "t_wall", "ttft_s", "streamed", "prompt_tokens", "usage_cached_tokens",
    *(f"prompt_{p}_tokens" for p in PARTS), "outcome", "client", "session", "api",
    "prefix_reused_tokens", "prefix_break_part", "turn_diff", "tools_defined", "tools_called", "tool_names",
)
NO_CLIENT = "(no User-Agent)"
NO_GROUP = "(none)"


def audit_columns(by: str = "client") -> tuple[str, ...]:
    """The columns ``build_audit`` reads, grouped ``by`` one of the record's names."""
    return tuple(dict.fromkeys((*AUDIT_COLUMNS, *COST_COLUMNS, by)))


def _median(values: list[float] | np.ndarray) -> float | None:
    """``numpy.median``, None of nothing; of an array of finite values from its order statistics (the same
    value: a count's median over float64 is the one over its ints)."""
    if not len(values):
        return None
    x = np.asarray(values, dtype=float)
    return median(x) if np.isfinite(x).all() else float(np.median(values))


FIRST_SEEN = "first turn seen of this session"


def _changed(prev: dict, cur: dict) -> list[str]:
    """What changed from ``prev`` to ``cur``: from the recorded diff. Without one the proxy had no record
    of the session's previous turn (it restarted, or forgot the session; rows from before the field):
    that is said, with what the part counts show for sure. A turn that repeats the previous one (a
    retry, a regenerated answer) has the same history, not the previous history and new input, so
    only a history shorter than the previous turn's is one that shrank."""
    diff = cur["diff"]
    if diff is not None:
        changed = [p for p in ("system", "tools") if diff.get(f"{p}_changed")]
        if diff.get("messages_removed"):
            changed.append("messages removed")
        return changed
    changed = [FIRST_SEEN, *(p for p in ("system", "tools") if cur[p] != prev[p])]
    if cur["history"] < prev["history"]:
        changed.append("history shrank")
    return changed


def _session(rows: list[dict], fit: dict[str, Any] | None = None) -> dict[str, Any]:
    """One session's turns, oldest first: prompt growth, what changed turn to turn, where each turn's
    prompt stopped being the previous one's, the prefix cache predicted against reused (its lost part
    costed at the client's ``fit``), and which defined tools were never called."""
    prompts = [r["prompt_tokens"] for r in rows]
    changes, per_turn = [], []
    defined: dict[str, None] = {}
    called: set[str] = set()
    for k, cur in enumerate(rows):
        if cur["tool_names"] is not None:
            defined.update(dict.fromkeys(cur["tool_names"].get("defined", ())))
            called.update(cur["tool_names"].get("called", ()))
        lost = lost_tokens(cur["reused"], cur["cached"])
        # against the turn before it here only when that turn is the one its prefix comparison saw (a
        # first-seen turn after a restart has no recorded diff: its token changes are still shown)
        change = readable_diff(rows[k - 1] if k else None, cur, fit)
        per_turn.append({"turn": k + 1, "prompt_tokens": cur["prompt_tokens"], "reused_tokens": cur["reused"],
                         "break_part": cur["break_part"], "server_cached_tokens": cur["cached"],
                         "lost_tokens": lost, "lost_ttft_s": lost_ttft(lost, fit), "ttft_s": cur["ttft_s"],
                         "diff": cur["diff"], "tools_defined": cur["tools_defined"],
                         "tools_called": cur["tools_called"], "tools_called_so_far": len(called),
                         "change": change, "cost_usd": cur["cost_usd"]})
        if k == 0:
            continue
        prev = rows[k - 1]
        changed = _changed(prev, cur)
        if changed:
            changes.append({"turn": k + 1, "changed": changed,
                            **{p: [prev[p], cur[p]] for p in ("system", "tools", "history")},
                            "reused_tokens": cur["reused"], "break_part": cur["break_part"],
                            "prompt_tokens": cur["prompt_tokens"]})
    growth = [b - a for a, b in zip(prompts, prompts[1:])]
    priced = [r["cost_usd"] for r in rows if r["cost_usd"] is not None]
    return {"turns": len(rows), "first_prompt_tokens": prompts[0], "last_prompt_tokens": prompts[-1],
            "cost_usd": sum(priced) if priced else None, "priced_turns": len(priced),
            "median_growth_per_turn": _median(growth), "changes": changes, "per_turn": per_turn,
            "prefix_cache": cache_totals([r["reused"] for r in rows], [r["cached"] for r in rows], fit),
            "tools": {"defined": len(defined), "never_called": [t for t in defined if t not in called]}}


def _json_or_none(value: Any) -> Any:
    return orjson.loads(value) if isinstance(value, str) and value else None


def _counted(values: np.ndarray) -> np.ndarray:
    """A prompt part's counts of completed turns with a prompt count: a turn counted has its parts counted
    too (one split makes both), so a NULL among them is an error, as ``int()`` of it was."""
    if np.isnan(values).any():
        raise ValueError("cannot convert float NaN to integer: a completed turn's prompt part was not counted")
    return values


def _ints(values: np.ndarray) -> list[int | None]:
    """A count column as Python ints, None where NULL: the per-turn rows of sessions."""
    missing = np.isnan(values)
    ints = np.where(missing, 0, values).astype(np.int64).tolist()
    return [None if m else v for v, m in zip(ints, missing.tolist())]


def build_audit(turns: Turns, *, source: str = "", by: str = "client",
                prices: Mapping[str, Price] | None = None) -> dict[str, Any]:
    """The audit of ``turns`` (``audit_columns(by)``), per client (or per ``by``); with ``prices``, in
    dollars too.

    From columns, a group at a time: the completed turns with a prompt count are grouped in one pass
    (``cells.groups`` of the group index), each group's figures read from its rows' columns; only the
    turns of a session become per-turn rows, all in one pass (a month of turns as Python dicts took
    minutes and ~11 GB). Groups are ordered by their turns, most first, a tie by which came first."""
    costs = turn_costs(turns, prices) if prices is not None else None
    index, names = group_index(turns, by, NO_CLIENT if by == "client" else NO_GROUP)
    done = np.flatnonzero(turns.is_("outcome", "ok") & ~np.isnan(turns.num["prompt_tokens"]))
    found = sorted(((g, done[at]) for g, at in groups(index[done])), key=lambda ga: (-len(ga[1]), ga[1][0]))
    # the group's cost is over all its turns in the window (aborted ones too), as the rule prices them
    everyone = dict(groups(index)) if costs is not None else {}
    sessions_of = _session_rows(turns, done, None if costs is None else costs.usd)
    del index, done
    clients = []
    with figures_in_parallel():  # a large group's medians on the other core while its next columns are gathered
        for g, rows in found:
            group = _client(names[g], turns.select(rows), sessions_of(rows))
            group["cost"] = cost_summary(costs.select(everyone[g])) if costs is not None else None
            clients.append(group)
        for c in clients:  # the figures that may be on the pool, not every session's per-turn detail
            for k in DEFERRED:
                if k in c:
                    c[k] = resolved(c[k])
    return {"source": source, "by": by, "priced": prices is not None,
            "turns": sum(c["turns"] for c in clients), "clients": clients, "groups": clients}


# a group's medians go to the figures pool from this many turns; below, the hand-off costs more than the
# median (``--by session``: thousands of groups of a few turns)
PARALLEL_MIN = 1 << 16
DEFERRED = ("median_tokens", "median_turn", "typed_share", "server_cached_tokens", "median_ttft_s",
            "median_tools_defined", "part_cost_s")


def _now(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _median_turn(prompt: np.ndarray, parts: dict[str, np.ndarray]) -> dict[str, int]:
    """The parts of the turn whose prompt is the median (the lower of the middle two): one turn's parts,
    which add up to its prompt, where the parts' own medians need not. The turn a stable sort by prompt
    puts there, found without sorting: the k-th smallest prompt, and of the turns with that prompt, in
    their order, the one k falls on past the smaller ones."""
    k = (len(prompt) - 1) // 2
    v = order_statistics(prompt, [k])[k]
    at = int(np.flatnonzero(prompt == v)[k - int(np.count_nonzero(prompt < v))])
    return {"prompt_tokens": int(v), **{p: int(parts[p][at]) for p in PARTS}}


def _session_rows(turns: Turns, done: np.ndarray,
                  usd: np.ndarray | None) -> Callable[[np.ndarray], dict[str, list[dict]]]:
    """The completed turns of ``done`` (positions) that have a session, as per-turn rows, made in one pass
    over their columns; returns, for a group's positions, its rows per session: sessions in the order
    they first come, each's turns in the order the proxy measured them (rowid: the writer stores records
    in that order), which is the order its prefix comparison ran in, so each turn's diff is against the
    turn before it here; by start time, two turns of one session in flight at once (two conversations
    that open alike) could swap, and the first-seen one would read as a restart."""
    at = done[~turns.is_("session", None)[done]]
    if not len(at):
        return lambda rows: {}
    s = turns.select(at)
    num, txt = s.num, s.txt
    cols = {p: num[f"prompt_{p}_tokens"].astype(np.int64).tolist() for p in PARTS}
    cols.update(prompt_tokens=num["prompt_tokens"].astype(np.int64).tolist(),
                rowid=num["rowid"].astype(np.int64).tolist(), ttft_s=num["ttft_s"].astype(float).tolist(),
                cached=_ints(num["usage_cached_tokens"]), reused=_ints(num["prefix_reused_tokens"]),
                break_part=txt["prefix_break_part"].tolist(), diff=[_json_or_none(v) for v in txt["turn_diff"].tolist()],
                tools_defined=_ints(num["tools_defined"]), tools_called=_ints(num["tools_called"]),
                tool_names=[_json_or_none(v) for v in txt["tool_names"].tolist()],
                cost_usd=[None] * len(s) if usd is None else [None if u != u else u for u in usd[at].tolist()])
    keys = list(cols)
    rows_of = [dict(zip(keys, values)) for values in zip(*cols.values())]
    session_of = txt["session"].tolist()
    del cols, s, num, txt
    slot = np.full(len(turns), -1, dtype=np.int64)  # a turn's row, -1: none
    slot[at] = np.arange(len(at))

    def of(rows: np.ndarray) -> dict[str, list[dict]]:
        sessions: dict[str, list[dict]] = defaultdict(list)
        mine = slot[rows]
        for i in mine[mine >= 0].tolist():
            sessions[session_of[i]].append(rows_of[i])
        return {sid: sorted(rs, key=lambda r: r["rowid"]) for sid, rs in sessions.items()}

    return of


def _client(name: str, mine: Turns, sessions: dict[str, list[dict]]) -> dict[str, Any]:
    """One group's figures from its turns' columns (``mine``: the group's completed turns with a prompt
    count, in the order loaded; ``sessions``: those of them in a session, as rows per session). The
    counts are the record's INTEGER columns: their float64 values are the ints the per-turn lists held,
    so medians are the same, and sums are taken as int64 (exact, as Python's were); each list's values,
    where order matters (the fit's means), in the same order."""
    soon = later if len(mine) >= PARALLEL_MIN else _now
    num = mine.num
    prompt = num["prompt_tokens"]
    parts = {p: _counted(num[f"prompt_{p}_tokens"]) for p in PARTS}
    medians = {p: soon(_median, parts[p]) for p in PARTS}
    medians["prompt_tokens"] = soon(_median, prompt)
    new = parts["new"]
    counted = prompt != 0
    typed = soon(_median, new[counted] / prompt[counted])
    overall = int(new.astype(np.int64).sum()) / max(int(prompt.astype(np.int64).sum()), 1)
    median_turn = soon(_median_turn, prompt, parts)
    del parts, new, counted
    ttft, streamed, cached = num["ttft_s"], num["streamed"], num["usage_cached_tokens"]
    fit = fit_of(ttft, streamed, prompt, cached)
    median_ttft = soon(_median, ttft[(streamed == 1) & ~np.isnan(ttft)])
    del prompt, streamed
    per_session = {sid: _session(rs, fit) for sid, rs in sessions.items()}
    tools = num["tools_defined"]
    out: dict[str, Any] = {
        "client": name, "group": name, "turns": len(mine), "apis": sorted(a for a in mine.distinct("api") if a),
        "sessions": len(per_session), "median_tokens": medians, "median_turn": median_turn,
        "typed_share": {"median": typed, "overall": overall},
        "server_cached_tokens": {"n": int(np.count_nonzero(~np.isnan(cached))),
                                 "median": soon(_median, cached[~np.isnan(cached)])},
        "median_ttft_s": median_ttft,
        "median_tools_defined": soon(_median, tools[~np.isnan(tools)]),
        "prefill_fit": fit,
        "prefix_cache": cache_totals(num["prefix_reused_tokens"], cached, fit),
        "session_detail": per_session,
    }
    if fit is not None:
        out["part_cost_s"] = soon(_part_cost_s, medians, fit)
    return out


def _part_cost_s(medians: dict[str, Any], fit: dict[str, Any]) -> dict[str, float]:
    """What each part's median costs at the fitted rate (``medians``: figures asked for before this one,
    so running or done, never queued behind it)."""
    medians = resolved(medians)
    return {p: (medians[p] or 0) * fit["seconds_per_token"] for p in PARTS}


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _n(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


_PART_NAMES = {"system": "the system prompt", "tools": "the tools", "history": "the history", "new": "the new input"}


def _turn_line(t: dict[str, Any]) -> str:
    """One turn of a session: what changed, where its prompt broke from the previous turn's, and what
    the server said it had cached."""
    cached = "" if t["server_cached_tokens"] is None else f"; server cached {t['server_cached_tokens']:,}"
    if t["lost_tokens"]:
        cost = t["lost_ttft_s"]
        cached += f", lost {t['lost_tokens']:,} predicted" + (f" (~{cost['s']:.3f} s of TTFT)" if cost else "")
    if t["turn"] == 1 or t["reused_tokens"] is None:
        head = f"turn {t['turn']}: {t['prompt_tokens']:,} tokens"
        if t["turn"] > 1:
            head += f" ({FIRST_SEEN}: no prefix comparison)" if t["diff"] is None else " (no prefix comparison)"
    else:
        if t["break_part"]:
            head = (f"turn {t['turn']} changed {_PART_NAMES.get(t['break_part'], t['break_part'])} at token "
                    f"{t['reused_tokens']:,}: only {t['reused_tokens']:,} of {t['prompt_tokens']:,} tokens reusable")
        else:
            head = f"turn {t['turn']} prefix intact: {t['reused_tokens']:,} of {t['prompt_tokens']:,} tokens reusable"
    diff = t["diff"]
    if diff is not None:
        said = [f"+{_plural(diff['messages_added'], 'message')}" if diff.get("messages_added") else "",
                f"-{_plural(diff['messages_removed'], 'message')}" if diff.get("messages_removed") else "",
                "system prompt changed" if diff.get("system_changed") else "",
                "tools changed" if diff.get("tools_changed") else ""]
        head += "; " + (", ".join(x for x in said if x) or "nothing changed")
    if t["tools_defined"]:
        head += (f"; tools: {t['tools_defined']} defined, {_n(t['tools_called'])} called in this answer, "
                 f"{t['tools_called_so_far']} so far")
    return head + cached + ("" if t.get("cost_usd") is None else f"; {usd(t['cost_usd'])}")


def render_audit(a: dict[str, Any]) -> str:
    by = a.get("by", "client")
    lines = [f"specproxy audit: {a['source']}: {_plural(a['turns'], 'completed turn')} with prompt counts, "
             f"{_plural(len(a['clients']), by)}"]
    if not a["clients"]:
        lines.append("  no completed turns with prompt counts (start serve with --tokenizer)")
    for c in a["clients"]:
        m = c["median_turn"]
        lines += ["", (f"{by} " if by != "client" else "") + f"{c['client']}: {_plural(c['turns'], 'turn')} in "
                  f"{_plural(c['sessions'], 'session')}" + (f" ({', '.join(c['apis'])})" if c["apis"] else "")]
        if c.get("cost") is not None:
            lines.append("  cost at the given prices (over all its turns in the window):")
            lines.extend(render_cost_lines(c["cost"], indent="    "))
            share = c["cost"]["parts"]["of_every_dollar"]
            if share and c.get("median_tools_defined"):
                lines.append(f"    -> the {c['median_tools_defined']:.0f} tool definitions sent every turn (median) cost "
                             f"${share['tools']:.2f} of every $1")
        lines.append(f"  the median turn: prompt {m['prompt_tokens']:,} = system {m['system']:,}"
                     f" + tools {m['tools']:,} + history {m['history']:,} + new {m['new']:,}")
        t = c["typed_share"]
        lines.append(f"  new input (what this turn added): {_n(t['median'], '{:.1%}')} of the prompt "
                     "(median over turns), "
                     f"{_n(t['overall'], '{:.1%}')} of all prompt tokens")
        sc = c["server_cached_tokens"]
        if sc["n"]:
            lines.append(f"  server's cached prompt tokens: median {_n(sc['median'])} over {_plural(sc['n'], 'turn')}")
        if c["prefix_cache"]["turns"]:
            lines.append("  prefix cache:")
            lines += render_lines({**c["prefix_cache"], "fit": c["prefill_fit"]}, "    ")
        fit = c["prefill_fit"]
        if fit is not None:
            cost = c["part_cost_s"]
            lines.append(f"  fitted prefill: {fit['prefill_tps']:.0f} tok/s over {_plural(fit['n'], 'streamed turn')} "
                         f"(median TTFT {_n(c['median_ttft_s'], '{:.3f}')} s); at that rate, uncached: "
                         + ", ".join(f"{p} {cost[p]:.3f} s" for p in PARTS))
        for sid, s in sorted(c["session_detail"].items(), key=lambda kv: -kv[1]["turns"]):
            growth = s["median_growth_per_turn"]
            lines.append(f"  session {sid}: {_plural(s['turns'], 'turn')}, prompt {s['first_prompt_tokens']} -> "
                         f"{s['last_prompt_tokens']} tokens"
                         + (f" (median growth {growth:+.0f} per turn)" if growth is not None else "")
                         + (f", cost {usd(s['cost_usd'])} over {_plural(s['priced_turns'], 'priced turn')}"
                            if s.get("cost_usd") is not None else ""))
            for ch in s["changes"]:
                first_seen = FIRST_SEEN in ch["changed"]
                what = ", ".join(f"{p} {ch[p][0]} -> {ch[p][1]} tokens" if p in ch else p
                                 for p in ch["changed"] if p != FIRST_SEEN)
                if first_seen:
                    lines.append(f"    turn {ch['turn']}: {FIRST_SEEN} (no record of the turn before it: the proxy "
                                 "restarted or had forgotten the session)" + (f"; counts show {what}" if what else ""))
                else:
                    lines.append(f"    turn {ch['turn']}: {what} (a server's prefix cache is reusable only up to there)")
            if s["prefix_cache"]["turns"]:
                lines += render_lines(s["prefix_cache"], "    ", "prefix cache: ")
            for t in s["per_turn"]:
                lines.append("    " + _turn_line(t))
            tools = s["tools"]
            if tools["defined"]:
                were = "tool was" if tools["defined"] == 1 else "tools were"
                lines.append(f"    {len(tools['never_called'])} of {tools['defined']} {were} never called in "
                             f"{_plural(s['turns'], 'turn')}")
    return "\n".join(lines) + "\n"


def find_session(a: dict[str, Any], session: str) -> dict[str, Any] | None:
    """One session of an audit (``build_audit``), with its client; a unique prefix of its id will do."""
    found = [(c["client"], sid, detail) for c in a["clients"] for sid, detail in c["session_detail"].items()
             if sid == session or sid.startswith(session)]
    exact = [f for f in found if f[1] == session]
    if len(exact) == 1 or len(found) == 1:
        client, sid, detail = (exact or found)[0]
        return {"source": a["source"], "client": client, "session": sid, **detail}
    return None


def render_session(s: dict[str, Any]) -> str:
    """``audit --session``: a turn-by-turn table of one session, then each turn's change in words."""
    lines = [f"specproxy audit: session {s['session']} of {s['client']}: {_plural(s['turns'], 'turn')}, "
             f"prompt {s['first_prompt_tokens']:,} -> {s['last_prompt_tokens']:,} tokens"]
    if s["prefix_cache"]["turns"]:
        lines += render_lines(s["prefix_cache"], "", "prefix cache: ")
    head = (f"{'turn':>4} {'prompt':>8} {'d system':>9} {'d tools':>8} {'d history':>10} {'d new':>7} "
            f"{'msgs':>7} {'predicted':>10} {'reused':>8} {'lost':>7} {'TTFT s':>7}  changed")
    lines += ["", head]
    for t in s["per_turn"]:
        c = t["change"]
        d = c["parts_delta"] or {}
        msgs = "" if c["messages_added"] is None else f"+{c['messages_added']}/-{c['messages_removed']}"
        what = [w for w, k in (("system", "system_changed"), ("tools", "tools_changed")) if c[k]]
        what += [f"+{x}" for x in c["tools_added"] or ()] + [f"-{x}" for x in c["tools_removed"] or ()]
        if t["turn"] > 1 and not c["recorded_diff"]:
            what.append(FIRST_SEEN)
        ttft = t["ttft_s"]
        lines.append(f"{t['turn']:>4} {t['prompt_tokens']:>8,} {_d(d.get('system')):>9} {_d(d.get('tools')):>8} "
                     f"{_d(d.get('history')):>10} {_d(d.get('new')):>7} {msgs:>7} {_n(c['predicted_reusable'], '{:,.0f}'):>10} "
                     f"{_n(c['server_reused'], '{:,.0f}'):>8} {_n(c['lost_tokens'], '{:,.0f}'):>7} "
                     f"{_n(None if ttft is None or ttft != ttft else ttft, '{:.3f}'):>7}  {', '.join(what)}")
    lines.append("")
    for t in s["per_turn"]:
        lines.append(f"turn {t['turn']}: {render_diff(t['change'])}")
    return "\n".join(lines) + "\n"


def _d(v: int | None) -> str:
    return "-" if v is None else f"{v:+,}"
