"""Goodput under an SLO through the real command line and the running proxy, against the fake upstream.

A bench sweep whose server gets slower with concurrency prints, per level, the share of turns that met
``--slo`` and the highest concurrency whose share stays at or above ``--slo-target``; ``report --slo``
(text, ``--json``, ``--html``) and ``compare --slo`` judge the same stored turns afterwards (the SLO is
decided when read, not stored); serve's live page shows the SLO table with ``report --json``'s figures;
a bad objective is one line everywhere.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sqlite3
import subprocess

import aiohttp
import orjson

from benchkit import BODIES, SPECPROXY, one_line_error, specproxy, upstream_thread
from specproxy.app.fake_upstream import Script
from specproxy.config import parse_slo
from specproxy.view.live import LivePages
from waits import wait_for

__all__ = ["upstream_thread"]  # a fixture the tests take by name

PER_ROUND = 8  # bodies in the workload: each round sends them once (at least one per stream)
SLOW_S = 2.5  # a slow turn's TTFT, far over the objective's 1 s; a fast one's is 0 (and well under, loaded)


def slows_with_concurrency(slow_per_level: dict[int, int]):
    """The n-th round's first ``slow_per_level[n]`` turns (of PER_ROUND) wait SLOW_S before their first
    token: rounds run one after the other, so the request's index says its round."""
    seen = itertools.count()

    def script(_request: dict) -> Script:
        i = next(seen)
        slow = (i % PER_ROUND) < slow_per_level.get(i // PER_ROUND, 0)
        return Script(pieces=["a", " b", " c"] * 4, ttft_s=SLOW_S if slow else 0.0)

    return script


def sweep(tmp_path, up, db, label: str, levels: str, *extra: str) -> subprocess.CompletedProcess:
    work = tmp_path / f"{label}.jsonl"
    work.write_bytes(b"\n".join([BODIES[0]] * PER_ROUND) + b"\n")
    return specproxy("bench", "--upstream", up.url, "--from", str(work), "--db", str(db), "--concurrency", levels,
                     "--repeats", "1", "--warmup", "0", "--tokenizer", "tiktoken:o200k_base", "--label", label,
                     *extra)


def test_a_bench_sweep_prints_each_levels_share_and_the_capacity(tmp_path, upstream_thread):
    # levels 1, 2, 4, 8: none slow, none, 2 of 8, all 8
    up = upstream_thread(slows_with_concurrency({2: 2, 3: 8}))
    db = tmp_path / "s.db"
    proc = sweep(tmp_path, up, db, "sweep", "1,2,4,8", "--slo", "ttft=1s", "--slo-target", "0.6")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "SLO ttft=1s:" in out
    assert "100.0% [67.6, 100.0]" in out  # 8 of 8, Wilson's 95% interval
    assert "75.0% [40.9, 92.9]" in out  # 6 of 8
    assert "0.0% [0.0, 32.4]" in out  # none of 8
    # the share holds 0.6 up to 4 (0.75) and falls at 8; its lower bound holds it up to 2 (0.676), not at 4
    assert ("highest concurrency whose share met stays at or above 60%: concurrency 4 (by the share); "
            "concurrency 2 (by its 95% lower bound") in out

    proc = sweep(tmp_path, upstream_thread(slows_with_concurrency({2: 2, 3: 8})), tmp_path / "j.db", "sweep",
                 "1,2,4,8", "--slo", "ttft=1s", "--slo-target", "0.6", "--json")
    s = json.loads(proc.stdout)
    assert s["slo"]["ttft_s"] == 1.0 and s["slo_target"] == 0.6
    arm = s["arms"][0]
    assert [lv["slo"]["met"] for lv in arm["levels"]] == [8, 8, 6, 0]
    assert [lv["slo"]["n"] for lv in arm["levels"]] == [8, 8, 8, 8]
    assert arm["slo_capacity"] == {"target": 0.6, "point": 4, "confident": 2}
    first = arm["levels"][0]
    assert math.isclose(first["slo"]["goodput_tps"]["mean"], first["aggregate_tps"]["mean"], rel_tol=1e-9)
    assert arm["levels"][3]["slo"]["goodput_tps"]["mean"] == 0.0

    # the same stored turns, judged afterwards by report: the objective is not in the database
    conn = sqlite3.connect(db)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
    conn.close()
    assert not any("slo" in c for c in columns)
    r = json.loads(specproxy("report", "--db", str(db), "--slo", "ttft=1s", "--json", "--no-cache").stdout)
    overall = r["slo"]["overall"]
    assert (overall["n"], overall["met"], overall["not_judged"]) == (32, 22, 0)
    assert sum(row["met"] for row in r["slo"]["by_concurrency"]) == 22
    assert overall["goodput_tps"] < overall["aggregate_tps"]
    stricter = json.loads(specproxy("report", "--db", str(db), "--slo", "ttft=1s,e2e=100ms", "--json").stdout)
    assert stricter["slo"]["overall"]["met"] <= 22
    text = specproxy("report", "--db", str(db), "--slo", "ttft=1s").stdout
    assert "SLO ttft=1s: turns that met it" in text and "goodput tok/s" in text

    html = tmp_path / "r.html"
    proc = specproxy("report", "--db", str(db), "--slo", "ttft=1s", "--html", str(html), "--json", "--no-cache")
    assert proc.returncode == 0, proc.stderr
    page = html.read_text()
    shown = re.search(r'data-figure="slo/overall/share" data-value="([^"]*)"', page).group(1)
    assert float(shown) == json.loads(proc.stdout)["slo"]["overall"]["share"] == 22 / 32


def test_compare_gives_the_share_row_for_two_arms(tmp_path, upstream_thread):
    db = tmp_path / "c.db"
    assert sweep(tmp_path, upstream_thread(slows_with_concurrency({})), db, "fast", "1").returncode == 0
    assert sweep(tmp_path, upstream_thread(slows_with_concurrency({0: 4})), db, "slow", "1").returncode == 0
    proc = specproxy("compare", "fast", "slow", "--db", str(db), "--slo", "ttft=1s", "--json")
    assert proc.returncode == 0, proc.stderr
    row = next(x for x in json.loads(proc.stdout)["rows"] if x["metric"] == "slo_share")
    assert (row["a_median"], row["b_median"], row["n_a"], row["n_b"]) == (1.0, 0.5, 8, 8)
    assert row["estimate"] == 0.5 and row["objective"]["text"] == "ttft=1s"
    text = specproxy("compare", "fast", "slow", "--db", str(db), "--slo", "ttft=1s").stdout
    assert "share that met the SLO" in text and "SLO ttft=1s: the share of turns that met it" in text
    # the slow arm's label given an objective of its own: its slow turns (2.5 s) meet 5 s
    own = json.loads(specproxy("compare", "fast", "slow", "--db", str(db), "--slo", "ttft=1s; slow: ttft=5s",
                               "--json").stdout)
    row = next(x for x in own["rows"] if x["metric"] == "slo_share")
    assert (row["a_median"], row["b_median"]) == (1.0, 1.0)
    assert row["objective"]["by_label"]["slow"]["ttft_s"] == 5.0
    # one arm split in halves: the share row too, by the negative control's rule
    control = json.loads(specproxy("compare", "slow", "--negative-control", "--db", str(db), "--slo", "ttft=1s",
                                   "--json").stdout)
    row = next(x for x in control["rows"] if x["metric"] == "slo_share")
    assert row["n_a"] + row["n_b"] == 8 and row["objective"]["text"] == "ttft=1s"
    plain = json.loads(specproxy("compare", "fast", "slow", "--db", str(db), "--json").stdout)
    assert all(x["metric"] != "slo_share" for x in plain["rows"])


def test_a_bad_objective_is_one_line_everywhere(tmp_path, upstream_thread):
    up = upstream_thread()
    db = tmp_path / "e.db"
    assert sweep(tmp_path, up, db, "x", "1").returncode == 0
    one_line_error(specproxy("report", "--db", str(db), "--slo", "ttft=2"), "not a positive time with a unit")
    one_line_error(specproxy("report", "--db", str(db), "--slo", "itl=5ms"), "NAME one of ttft, tpot, e2e")
    one_line_error(specproxy("compare", "x", "y", "--db", str(db), "--slo", "ttft=1"), "with a unit")
    one_line_error(sweep(tmp_path, up, db, "x", "1", "--slo-target", "0.9"), "--slo-target needs an SLO")
    one_line_error(sweep(tmp_path, up, db, "x", "1", "--slo", "ttft=1s", "--slo-target", "1.5"),
                   "a share of turns between 0 and 1")
    one_line_error(sweep(tmp_path, up, db, "x", "1", "--slo", "ttft=1s,ttft=2s"), "ttft is given twice")
    one_line_error(specproxy("serve", "--upstream", up.url, "--db", str(tmp_path / "n.db"), "--port", "0",
                             "--slo", "e2e=30"), "slo 'e2e=30'")
    conf = tmp_path / "c.toml"
    conf.write_text('slo = "tpot=fast"\n')
    one_line_error(specproxy("bench", "--config", str(conf), "--upstream", up.url, "--from", str(tmp_path / "x.jsonl")),
                   "slo 'tpot=fast'")


def test_the_live_page_shows_the_slo_table_with_the_reports_figures(make_stack, tiktoken_tok):
    token = "t0ken-for-the-slo-page-test"
    stack = make_stack(tiktoken_tok, admin_token=token)
    stack.service.admin.pages = LivePages(stack.cfg.db, slo=parse_slo("ttft=1s,tpot=200ms"))  # serve --slo's
    turns = itertools.count()
    # every third turn slow to its first token; 50 ms between tokens (well inside 200 ms, and a decode long
    # enough that its first and last token never share a read: the tpot is always there to judge)
    stack.upstream.script = lambda _req: Script(pieces=["a", " b", " c"] * 4, interval_s=0.05,
                                                ttft_s=SLOW_S if next(turns) % 3 == 0 else 0.0)

    async def traffic() -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(6):
                async with session.post(stack.url + "/v1/chat/completions", json={
                        "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
                    await r.read()

    async def get_page() -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(stack.url + f"/_specproxy/?token={token}") as r:
                assert r.status == 200
                return await r.text()

    stack.run(traffic())
    stack.settle()
    assert wait_for(lambda: stack.service.writer.written >= 6), "the writer did not commit the turns"
    page = stack.run(get_page())
    since = re.search(r'data-window-since="([^"]+)"', page).group(1)
    out = subprocess.run([*SPECPROXY, "report", "--db", stack.cfg.db, "--json", "--no-cache", "--since", since,
                          "--slo", "ttft=1s,tpot=200ms"], capture_output=True, text=True, timeout=60, check=True)
    report = orjson.loads(out.stdout)
    figures = re.findall(r'data-figure="(slo/[^"]+)" data-value="([^"]*)"', page)
    assert len(figures) >= 12
    for path, shown in figures:
        want = report
        for part in path.split("/"):
            want = want[int(part)] if isinstance(want, list) else want[part]
        if want is None:
            assert shown == "", path
        else:
            assert math.isclose(float(shown), float(want), rel_tol=1e-12), (path, shown, want)
    assert (report["slo"]["overall"]["n"], report["slo"]["overall"]["met"]) == (6, 4)
    assert "SLO ttft=1s,tpot=200ms: turns that met it" in page
    # each of the newest turns carries its own judgement, by the rule, from its stored figures
    marks = dict(re.findall(r'data-turn-id="([0-9a-f]+)" data-slo-met="([a-z ]+)"', page))
    conn = sqlite3.connect(stack.cfg.db)
    stored = conn.execute("SELECT id, outcome, ttft_s, decode_tps FROM turns").fetchall()
    conn.close()
    assert set(marks) == {row[0] for row in stored}
    for turn_id, outcome, ttft, tps in stored:
        assert outcome == "ok" and tps
        assert marks[turn_id] == ("met" if ttft <= 1.0 and 1.0 / tps <= 0.2 else "not met"), (ttft, tps)
    assert page.count('class="slo-missed"') == 2 and "missed the SLO" in page
