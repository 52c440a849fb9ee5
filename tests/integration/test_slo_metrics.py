"""``specproxy_slo_turns`` on a real ``specproxy serve``'s ``/_specproxy/metrics``: with ``--slo`` (one
objective for every turn, and one of its own for the label ``batch``), turns that meet it and turns that
miss it (a slow first token, a slow decode, an error answer, a slow batch turn) are counted per objective
and result exactly as the records in its database say, judged here by the rule written out again in
plain Python (docs/metrics.md, "Goodput under an SLO"). Issue 34. Every wait is for an event, bounded.
"""

from __future__ import annotations

import sqlite3
import urllib.request
from collections import Counter

import orjson
from prometheus_client.parser import text_string_to_metric_families

from faultkit import wait_until
from serveproc import LoopThread, ServeProcess
from specproxy.app.fake_upstream import FakeUpstream, Script

CHAT = "/v1/chat/completions"
SLO = "ttft=500ms,tpot=60ms; batch: e2e=300ms"
OBJECTIVE = {"ttft_s": 0.5, "tpot_s": 0.06}  # what SLO says, for turns without the label batch
BATCH = {"e2e_s": 0.3}
PIECES = ["one", " two", " three", " four"]
# what the scripted server does for each kind of request (the prompt names the kind)
SCRIPTS = {
    "fast": Script(pieces=PIECES, interval_s=0.01),
    "slow-start": Script(pieces=PIECES, interval_s=0.01, ttft_s=0.8),
    "slow-decode": Script(pieces=PIECES, interval_s=0.15),
    "error": Script(status=500),
    "batch-fast": Script(pieces=PIECES, interval_s=0.01),
    "batch-slow": Script(pieces=PIECES, interval_s=0.15),
}
SENT = ["fast", "slow-start", "fast", "slow-decode", "error", "fast", "batch-fast", "batch-slow", "slow-start"]


def script_for(request: dict) -> Script:
    return SCRIPTS[request["messages"][-1]["content"]]


def chat(url: str, kind: str) -> None:
    body = orjson.dumps({"model": "m", "stream": True, "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": kind}]})
    headers = {"Content-Type": "application/json"}
    if kind.startswith("batch"):
        headers["X-Specproxy-Label"] = "batch"
    req = urllib.request.Request(url + CHAT, body, headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        assert kind == "error" and exc.code == 500
        exc.read()


def judged(row: dict, bounds: dict[str, float]) -> bool | None:
    """The rule, written out again: None not judged, else whether the turn met every bound given."""
    if row["outcome"] in ("client_abort", "shutdown"):
        return None
    if row["outcome"] != "ok":
        return False
    figures = {"ttft_s": row["ttft_s"], "tpot_s": 1 / row["decode_tps"] if row["decode_tps"] else None,
               "e2e_s": row["total_s"]}
    if any(figures[f] is not None and figures[f] > b for f, b in bounds.items()):
        return False
    return None if any(figures[f] is None for f in bounds) else True


def expected(rows: list[dict]) -> Counter:
    out: Counter = Counter()
    for row in rows:
        label = "batch" if row["label"] == "batch" else ""
        bounds = BATCH if label else OBJECTIVE
        for objective, only in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("e2e", "e2e_s"), ("all", None)):
            if only is not None and only not in bounds:
                continue
            result = judged(row, bounds if only is None else {only: bounds[only]})
            if result is not None:
                out[(row["outcome"], objective, label, "true" if result else "false")] += 1
    return out


def scraped(url: str) -> Counter:
    page = urllib.request.urlopen(url + "/_specproxy/metrics", timeout=30).read().decode()
    out: Counter = Counter()
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == "specproxy_slo_turns_total":
                assert (s.labels["gen_ai_request_model"], s.labels["api"]) == ("m", "chat")
                out[(s.labels["outcome"], s.labels["objective"], s.labels["slo_label"], s.labels["met"])] += int(s.value)
    return out


def stored(db) -> list[dict]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT outcome, ttft_s, decode_tps, total_s, label FROM turns "
                                              "WHERE measured = 1")]
    except sqlite3.OperationalError:  # not made yet
        return []
    finally:
        conn.close()


def test_the_slo_counts_on_metrics_are_the_stored_turns_judged(tmp_path):
    lt = LoopThread()
    up = FakeUpstream(script_for)
    lt.run(up.start())
    db = tmp_path / "s.db"
    proc = ServeProcess(tmp_path, up.url, db, "--slo", SLO, "--tokenizer", "tiktoken:o200k_base")
    try:
        for kind in SENT:
            chat(proc.url, kind)
        wait_until(lambda: len(stored(db)) == len(SENT), 60, 0.05, "every turn in the database")
        rows = stored(db)
        want = expected(rows)
        assert scraped(proc.url) == want
        # the case the test is about: some turns met it and some did not, by each objective and by the label's
        results = {(objective, label, met) for (_, objective, label, met) in want}
        for objective in ("ttft", "tpot", "all"):
            assert {(objective, "", "true"), (objective, "", "false")} <= results, want
        assert {("e2e", "batch", "true"), ("e2e", "batch", "false")} <= results, want
        assert sum(n for (outcome, objective, _, met), n in want.items()
                   if outcome != "ok" and objective == "all" and met == "false") == 1  # the error answer
    finally:
        proc.stop()
        lt.run(up.close())
        lt.close()
