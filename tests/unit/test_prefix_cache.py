"""The prefix cache predicted against reused (``analyze/prefix_cache.py``): the per-turn loss, the sums,
the TTFT fit and its interval, and how the audit and the report carry them."""

from __future__ import annotations

import numpy as np
import orjson

from specproxy.analyze.audit import build_audit, render_audit
from specproxy.analyze.prefix_cache import (cache_totals, lost_tokens, lost_ttft, prefix_cache_section, ttft_fit,
                                            uncached_tokens)
from test_audit_order import turns


def test_lost_is_predicted_less_reused_floored_and_null_when_either_is():
    assert lost_tokens(100, 40) == 60
    assert lost_tokens(100, 130) == 0  # the server reused more than predicted: no loss
    assert lost_tokens(None, 40) is None and lost_tokens(100, None) is None
    assert uncached_tokens(100, 30) == 70 and uncached_tokens(100, None) == 100 and uncached_tokens(10, 30) == 0


def test_totals_add_per_turn_losses_over_turns_with_both_counts():
    t = cache_totals([100, 50, None, 80], [40, 90, 10, None])
    # only the first two turns have both; the second reused more than predicted, which hides no loss
    assert t["turns"] == 2 and t["predicted_tokens"] == 150 and t["reused_tokens"] == 130
    assert t["lost_tokens"] == 60 and t["turns_with_loss"] == 1
    assert t["reused_share"] == 130 / 150 and t["lost_ttft_s"] is None
    empty = cache_totals([None], [3])
    assert empty["turns"] == 0 and empty["lost_tokens"] is None and empty["reused_share"] is None


def test_the_fit_recovers_an_exact_rate_and_costs_the_lost_tokens():
    x = np.array([1000.0, 2000.0, 4000.0, 8000.0])
    fit = ttft_fit(0.05 + 2e-5 * x, x)  # 20 ms per 1k uncached tokens
    assert fit["n"] == 4 and abs(fit["ms_per_1k_uncached"] - 20.0) < 1e-9
    assert abs(fit["ms_per_1k_lo"] - 20.0) < 1e-6 and abs(fit["ms_per_1k_hi"] - 20.0) < 1e-6  # no scatter
    assert abs(fit["intercept_s"] - 0.05) < 1e-9 and abs(fit["prefill_tps"] - 50000.0) < 1e-6
    cost = lost_ttft(5000, fit)
    assert abs(cost["s"] - 0.1) < 1e-9 and cost["lo"] <= cost["s"] <= cost["hi"]
    assert lost_ttft(None, fit) is None and lost_ttft(5, None) is None


def test_no_fit_without_enough_turns_or_spread_or_a_positive_rate():
    assert ttft_fit([0.1, 0.2], [100, 200]) is None  # two points
    assert ttft_fit([0.1, 0.2, 0.3], [100, 100, 100]) is None  # one token count
    assert ttft_fit([0.3, 0.2, 0.1], [100, 200, 300]) is None  # TTFT falls as the prompt grows
    assert ttft_fit([0.1, np.nan, 0.2, 0.3], [100, 200, np.nan, 300]) is None  # NaNs dropped: two left


def test_the_slopes_interval_covers_at_its_level():
    """Seeded simulations (deterministic): TTFT linear in uncached tokens with normal noise, constant or
    growing with the prompt (HC3's reason); the 95% interval covers the true slope in 93% to 98.5% of
    the fits (it runs a little conservative at small n: docs/statistics.md)."""
    for n, grows in ((8, False), (20, False), (20, True), (60, True)):
        rng = np.random.default_rng(n + grows)
        hits = fits = 0
        for _ in range(1500):
            x = rng.uniform(0, 8000, n)
            y = 0.05 + 2e-5 * x + rng.normal(0, 0.05 * (1 + x / 2000) if grows else 0.1, n)
            fit = ttft_fit(y, x)
            if fit is None:
                continue
            fits += 1
            hits += fit["ms_per_1k_lo"] <= 20.0 <= fit["ms_per_1k_hi"]
        assert 0.93 <= hits / fits <= 0.985, (n, grows, hits / fits)


def _row(rowid, session, prompt, reused, cached, ttft, client="agent/1"):
    diff = None if reused is None else {"messages_added": 2, "messages_removed": 0, "system_changed": False,
                                         "tools_changed": False}
    return {"rowid": rowid, "t_wall": float(rowid), "ttft_s": ttft, "streamed": 1, "prompt_tokens": prompt,
            "prompt_system_tokens": 100, "prompt_tools_tokens": 0, "prompt_history_tokens": prompt - 110,
            "prompt_new_tokens": 10, "outcome": "ok", "client": client, "session": session, "api": "chat",
            "usage_cached_tokens": cached, "prefix_reused_tokens": reused, "prefix_break_part": None,
            "turn_diff": None if diff is None else orjson.dumps(diff).decode(), "tools_defined": 0}


def _session_rows():
    # TTFT = 0.05 s + 20 ms per 1k uncached tokens, exactly; turn 3 lost 3000 of its 4000 predicted tokens
    rows = []
    for k, (prompt, reused, cached) in enumerate([(2000, None, 0), (4000, 2000, 2000), (6000, 4000, 1000),
                                                 (8000, 6000, 6000)]):
        rows.append(_row(k + 1, "s1", prompt, reused, cached, 0.05 + 2e-5 * (prompt - cached)))
    return rows


def test_the_audit_shows_predicted_reused_and_lost_per_turn_session_and_client():
    audit = build_audit(turns(_session_rows()))
    (client,) = audit["clients"]
    assert abs(client["prefill_fit"]["ms_per_1k_uncached"] - 20.0) < 1e-6
    pc = client["prefix_cache"]
    assert (pc["turns"], pc["predicted_tokens"], pc["reused_tokens"], pc["lost_tokens"]) == (3, 12000, 9000, 3000)
    assert abs(pc["lost_ttft_s"]["s"] - 0.06) < 1e-6  # 3000 tokens at 20 ms per 1k
    (session,) = client["session_detail"].values()
    assert session["prefix_cache"]["lost_tokens"] == 3000
    per_turn = session["per_turn"]
    assert [t["lost_tokens"] for t in per_turn] == [None, 0, 3000, 0]
    assert per_turn[0]["lost_ttft_s"] is None and abs(per_turn[2]["lost_ttft_s"]["s"] - 0.06) < 1e-6
    text = render_audit(audit)
    assert "predicted reusable 12,000, reused by the server 9,000 (75%), lost 3,000 tokens in 1 of 3 turns" in text
    assert "server cached 1,000, lost 3,000 predicted (~0.060 s of TTFT)" in text
    assert "TTFT grows 20.0 ms per 1k uncached prompt tokens" in text


def test_the_reports_section_over_all_turns_and_per_client():
    rows = _session_rows() + [_row(10 + k, "s2", p, r, c, 0.05 + 2e-5 * p, client="other/2")
                              for k, (p, r, c) in enumerate([(1000, None, None), (3000, 1000, None)])]
    ok = turns(rows)
    section = prefix_cache_section(ok)
    assert section["turns"] == 3 and section["lost_tokens"] == 3000 and section["predicted_turns"] == 4
    assert section["server_cached_turns"] == 4  # the other client's server said no cached count
    assert [c["client"] for c in section["by_client"]] == ["agent/1"]  # none of other/2's turns has both
    assert abs(section["fit"]["ms_per_1k_uncached"] - 20.0) < 1e-6


def test_a_turns_change_in_tokens_per_part_and_tools_by_name():
    from specproxy.analyze.turn_diff import readable_diff, render_diff

    prev = {"system": 100, "tools": 300, "history": 50, "new": 10, "prompt_tokens": 460, "diff": None,
            "tool_names": {"defined": ["read", "write", "grep"], "called": []}, "reused": None, "cached": None}
    cur = {"system": 120, "tools": 200, "history": 80, "new": 12, "prompt_tokens": 412,
           "diff": {"messages_added": 2, "messages_removed": 0, "system_changed": True, "tools_changed": True},
           "tool_names": {"defined": ["read", "edit", "write"], "called": ["edit"]}, "reused": 90, "cached": 40}
    d = readable_diff(prev, cur)
    assert d["parts_delta"] == {"system": 20, "tools": -100, "history": 30, "new": 2, "prompt": -48}
    assert d["tools_added"] == ["edit"] and d["tools_removed"] == ["grep"]
    assert d["lost_tokens"] == 50 and d["system_changed"] and d["messages_added"] == 2
    line = render_diff(d)
    assert "tokens system +20, tools -100, history +30, new +2 (prompt -48)" in line
    assert "tools added: edit" in line and "tools removed: grep" in line and "system prompt and tools changed" in line
    assert "predicted reusable 90, server reused 40, lost 50" in line
    first = readable_diff(None, prev)
    assert first["parts_delta"] is None and first["tools_added"] is None and first["lost_tokens"] is None
    assert render_diff(first).startswith("no previous turn of this session known")
    # without names (the request could not be read) the tools' changes are unknown, not none
    assert readable_diff({**prev, "tool_names": None}, cur)["tools_added"] is None


def test_audit_session_is_one_sessions_table():
    from specproxy.analyze.audit import find_session, render_session

    a = build_audit(turns(_session_rows()))
    s = find_session(a, "s")  # a unique start of the id
    assert s["session"] == "s1" and s["client"] == "agent/1" and find_session(a, "nope") is None
    changes = [t["change"] for t in s["per_turn"]]
    assert [c["parts_delta"]["history"] if c["parts_delta"] else None for c in changes] == [None, 2000, 2000, 2000]
    text = render_session(s)
    assert "session s1 of agent/1: 4 turns, prompt 2,000 -> 8,000 tokens" in text
    row3 = next(x for x in text.splitlines() if x.startswith("   3 "))
    assert row3.split()[:10] == ["3", "6,000", "+0", "+0", "+2,000", "+0", "+2/-0", "4,000", "1,000", "3,000"]
    assert "turn 3: tokens system +0, tools +0, history +2,000, new +0 (prompt +2,000)" in text
