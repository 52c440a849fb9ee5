"""``serve/slo_counts.py``: the turns the proxy judged against ``--slo``, counted by the one rule
(``measure/slo_rule.py``'s ``met``) whether a scrape judges them or, unscraped, a thread of their own once
``FOLD_AT`` have waited (the loop never judges, and the waiting turns stay bounded)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np

from specproxy.config import parse_slo
from specproxy.measure.slo_rule import met
from specproxy.serve import slo_counts
from specproxy.serve.slo_counts import FOLD_AT, SloCounts

LABELS = ("gen_ai_request_model", "gen_ai_operation_name", "api", "outcome")
SLO = parse_slo("ttft=1s,tpot=20ms; batch: e2e=5s")


def turns(n: int) -> list[SimpleNamespace]:
    rng = np.random.default_rng(34)
    return [SimpleNamespace(outcome="ok" if k % 5 else "upstream_error", ttft_s=float(rng.uniform(0, 2)),
                            decode_tps=float(rng.uniform(20, 100)) if k % 7 else None, total_s=float(rng.uniform(1, 9)),
                            label="batch" if k % 3 == 0 else ("other" if k % 3 == 1 else None))
            for k in range(n)]


def by_rule(rs: list[SimpleNamespace], figure: str | None) -> tuple[int, int]:
    """(met, not met) of ``rs`` by ``met`` itself."""
    m = met(SLO, np.array([r.outcome for r in rs], dtype=object), np.array([r.ttft_s for r in rs]),
            np.array([np.nan if r.decode_tps is None else r.decode_tps for r in rs]), np.array([r.total_s for r in rs]),
            np.array([r.label for r in rs], dtype=object), figure=figure)
    return int((m == 1.0).sum()), int((m == 0.0).sum())


def totals(counts: dict) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for key, n in counts.items():
        out[(key[-3], key[-1])] = out.get((key[-3], key[-1]), 0) + n
    return out


def test_the_counts_are_the_rule_per_objective_and_only_named_labels_are_series():
    rs = turns(300)
    c = SloCounts(SLO, LABELS)
    for r in rs:
        c.add(("m", "chat", "chat", r.outcome), r)
    samples = c.family().samples
    assert {s.labels["slo_label"] for s in samples} == {"", "batch"}  # "other" is judged by the default, as ""
    got = totals(c.counts)
    for objective, figure in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("e2e", "e2e_s"), ("all", None)):
        assert (got.get((objective, "true"), 0), got.get((objective, "false"), 0)) == by_rule(rs, figure)
    assert got[("all", "true")] and got[("all", "false")]


def test_unscraped_a_thread_judges_them_once_fold_at_have_waited(monkeypatch):
    seen: list[str] = []
    real = slo_counts.SloCounts._judge

    def judge(self):
        seen.append(threading.current_thread().name)
        real(self)

    monkeypatch.setattr(slo_counts.SloCounts, "_judge", judge)
    rs = turns(FOLD_AT)
    c = SloCounts(SLO, LABELS)
    for r in rs[:-1]:
        c.add(("m", "chat", "chat", r.outcome), r)
    assert not seen and not c.counts  # waiting, not judged
    c.add(("m", "chat", "chat", rs[-1].outcome), rs[-1])
    assert c._lock.acquire(timeout=60)  # the thread released it: the batch is judged
    c._lock.release()
    assert seen == ["specproxy-slo"] and not c._waiting
    assert (totals(c.counts)[("all", "true")], totals(c.counts)[("all", "false")]) == by_rule(rs, None)
