"""The audit reads a session's turns in the order the proxy measured them (rowid), the order its prefix
comparison ran in. Two conversations that open with the same message share a session; run at once, the
one that started later can be measured first: it is the session's first seen turn (no diff), the other
gets its diff against it. Read by start time, the first-seen turn came second and was reported as a
restart ("first turn seen of this session ... the proxy restarted") although nothing restarted."""

from __future__ import annotations

import numpy as np
import orjson

from specproxy.analyze.audit import AUDIT_COLUMNS, FIRST_SEEN, build_audit, render_audit
from specproxy.store.dataset import Turns

TEXT = {"outcome", "client", "session", "api", "prefix_break_part", "turn_diff", "tool_names"}


def turns(rows: list[dict]) -> Turns:
    num = {"rowid": np.array([r["rowid"] for r in rows], dtype=np.int64)}
    txt = {}
    for col in AUDIT_COLUMNS:
        values = [r.get(col) for r in rows]
        if col in TEXT:
            txt[col] = np.array(values, dtype=object)
        else:
            num[col] = np.array([np.nan if v is None else float(v) for v in values])
    return Turns(num, txt)


def row(rowid: int, t_wall: float, diff: dict | None) -> dict:
    return {"rowid": rowid, "t_wall": t_wall, "ttft_s": 0.2, "streamed": 1, "prompt_tokens": 110,
            "prompt_system_tokens": 50, "prompt_tools_tokens": 50, "prompt_history_tokens": 0, "prompt_new_tokens": 10,
            "outcome": "ok", "client": "agent/1", "session": "s1", "api": "chat",
            "prefix_reused_tokens": None if diff is None else 110, "prefix_break_part": None,
            "turn_diff": None if diff is None else orjson.dumps(diff).decode(), "tools_defined": 0}


def test_two_alike_conversations_at_once_are_not_read_as_a_restart():
    diff = {"messages_added": 0, "messages_removed": 0, "system_changed": False, "tools_changed": False}
    # started first (t_wall 10.000), measured second: its diff is against the other
    later_measured = row(2, 10.000, diff)
    # started a millisecond later, measured first: the session's first seen turn
    first_measured = row(1, 10.001, None)
    audit = build_audit(turns([later_measured, first_measured]))
    (session,) = audit["clients"][0]["session_detail"].values()
    assert [t["diff"] is None for t in session["per_turn"]] == [True, False]
    assert not any(FIRST_SEEN in ch["changed"] for ch in session["changes"])
    assert FIRST_SEEN not in render_audit(audit)
