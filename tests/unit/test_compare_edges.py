"""compare at its edges: the negative control's direction, an arm against itself, labels that cannot be
arms or do not exist, and arms whose server instances are unknown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specproxy.analyze.compare import COMPARE_COLUMNS, negative_control_report, parse_arm, render_compare
from specproxy.analyze.instances import CONFOUNDED_WARNING
from specproxy.app.fake_upstream import make_record
from specproxy.store.db import open_existing
from specproxy.store.sqlite_source import SQLiteSource
from specproxy.store.writer import Writer

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specproxy.app.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    """"split": 12 streamed turns without instance ids, half with TTFT and whole turn ~1 s, half ~3 s
    (random halves of it often differ); "known" and "unknown": 10 turns each, in one server instance
    and in none known (a server without /metrics)."""
    path = tmp_path_factory.mktemp("edges") / "edges.db"
    w = Writer(path)
    rng = np.random.default_rng(5)
    t = 0.0
    for i in range(12):
        ttft = (1.0 if i % 2 else 3.0) * float(rng.lognormal(0.0, 0.01))
        w.put(make_record(label="split", t_wall=t, ttft_s=ttft, decode_s=1.0, total_s=ttft + 1.0,
                          completion_tokens=50, first_chunk_tokens=0))
        t += 10.0
    for label, iid in (("known", "inst-1"), ("unknown", None)):
        for _ in range(10):
            w.put(make_record(label=label, instance_id=iid, t_wall=t, ttft_s=0.5 * float(rng.lognormal(0.0, 0.1)),
                              completion_tokens=50))
            t += 10.0
    for k in range(3):  # "three": 10 turns in each of 3 instances, the last 2.3x faster
        for _ in range(10):
            w.put(make_record(label="three", instance_id=f"three-{k}", t_wall=t, completion_tokens=300,
                              decode_s=300 / (50 * (2.3 if k == 2 else 1.0) * float(rng.lognormal(0.0, 0.15))),
                              first_chunk_tokens=0))
            t += 10.0
    w.close()
    return path


def test_the_negative_control_names_the_direction_of_a_time_right(db):
    """TTFT and whole turn are lower-is-better: a half whose median is higher is slower, not faster (it
    said "faster (B's ttft_s is lower)" of B/A 1.74)."""
    seen = 0
    for seed in range(20):
        with open_existing(str(db)) as conn:
            arm = parse_arm("split")
            r = negative_control_report(arm, SQLiteSource(conn).load(arm.window, COMPARE_COLUMNS), seed=seed)
        text = render_compare(r)
        for row in r["rows"]:
            if row["verdict"] not in ("faster", "slower"):
                continue
            seen += 1
            higher = row["estimate"] > 1
            assert row["verdict"] == ("faster" if higher == row["higher_is_better"] else "slower"), row
            if not row["higher_is_better"]:
                assert f"(B's {row['metric']} is {'higher' if higher else 'lower'})" in text
    assert seen >= 2  # the halves of this arm differ often enough to have verdicts to check


def test_an_arm_against_itself_is_refused_in_one_line(db):
    for arms in (("split", "split"), ("@0..100", "@0..100")):
        proc = cli("compare", *arms, "--db", str(db))
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "an arm against itself" in proc.stderr and "--negative-control" in proc.stderr


def test_an_unknown_label_lists_the_labels_there_are(db):
    for args in (("split", "nope"), ("nope", "--negative-control")):
        proc = cli("compare", *args, "--db", str(db))
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "'nope': no turn has this label (its labels are known, split, three, unknown;" in proc.stderr


def test_an_arm_with_unknown_instances_is_said_so_not_confounded(db):
    """Arm A ran on a server without /metrics, arm B in one instance: not "an A/B inside one server
    instance", which would say they shared it."""
    proc = cli("compare", "unknown", "known", "--db", str(db), "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    for row in r["rows"]:
        assert CONFOUNDED_WARNING not in row["warnings"]
        assert any("arm a's server instances are unknown" in w for w in row["warnings"]), row
    text = cli("compare", "unknown", "known", "--db", str(db)).stdout
    assert CONFOUNDED_WARNING not in text and text.count("server instances are unknown") == 1


@pytest.mark.parametrize("args", [
    ("serve", "--upstream", "http://127.0.0.1:9", "--label", "@new"),
    ("bench", "--upstream", "http://127.0.0.1:9", "--label", "a,@b"),
])
def test_a_label_beginning_with_at_is_refused(args, tmp_path):
    """compare reads "@..." as a time window, so such a label could never be named as an arm."""
    proc = cli(*args, "--db", str(tmp_path / "x.db"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "begins with '@'" in proc.stderr and "time window" in proc.stderr
    assert not (tmp_path / "x.db").exists()


def test_a_control_over_too_few_instances_says_so_instead_of_a_verdict(db):
    """3 instances split 1 against 2: the control called decode "slower" on 3 of 8 seeds when one instance
    ran 2.3x faster. It cannot be calibrated there (tests/unit/test_control_calibration.py)."""
    why = "3 instances: a negative control over instances needs at least 4 per arm"
    for seed in range(8):
        proc = cli("compare", "three", "--negative-control", "--db", str(db), "--json", "--seed", str(seed))
        assert proc.returncode == 0, proc.stderr
        for row in json.loads(proc.stdout)["rows"]:
            assert row["verdict"] == f"no interval ({why})" and row["ci_low"] is None, row
    text = cli("compare", "three", "--negative-control", "--db", str(db)).stdout
    assert text.count(f"no interval ({why})") == 3 and "faster" not in text and "slower" not in text
    assert "warning: this arm ran in 3 server instances, so a split by instance is 1 against 2" in text


@pytest.fixture(scope="module")
def windows_db(tmp_path_factory) -> Path:
    """One setting in two time windows: the same speeds, but window B held three 300-token answers among
    short ones, and longer prompts."""
    path = tmp_path_factory.mktemp("windows") / "windows.db"
    w = Writer(path)
    rng = np.random.default_rng(9)
    for t0, long_answers, prompt in ((0.0, 0, 400), (10_000.0, 3, 1200)):
        t = t0
        for i in range(20):
            tokens = 300 if i < long_answers else 30
            tps = 50 * float(rng.lognormal(0.0, 0.1))
            ttft = 0.2 * prompt / 400 * float(rng.lognormal(0.0, 0.1))
            w.put(make_record(label="one", t_wall=t, ttft_s=ttft, decode_s=tokens / tps, total_s=ttft + tokens / tps,
                              decode_tps=tps, completion_tokens=tokens, first_chunk_tokens=0, prompt_tokens=prompt,
                              api="chat"))
            t += ttft + tokens / tps + 5.0
    w.close()
    return path


def test_windows_whose_workloads_differ_get_no_verdict_on_rows_that_depend_on_it(windows_db):
    proc = cli("compare", "@0..9000", "@9000..20000", "--db", str(windows_db), "--json")
    assert proc.returncode == 0, proc.stderr
    r = {row["metric"]: row for row in json.loads(proc.stdout)["rows"]}
    assert r["aggregate_tps"]["verdict"].startswith("no verdict (workloads differ: prompt tokens 3.00x, completion "
                                                    "tokens 2.35x")
    assert r["aggregate_tps"]["estimate"] is not None and r["aggregate_tps"]["ci_low"] is not None
    assert [d["feature"] for d in r["aggregate_tps"]["workload_differs"]] == ["prompt_tokens", "completion_tokens"]
    assert r["ttft_s"]["verdict"] == "no verdict (workloads differ: prompt tokens 3.00x)"
    assert r["total_s"]["verdict"].startswith("no verdict (workloads differ")
    assert r["decode_tps"]["verdict"] in ("not distinguishable", "faster", "slower")  # per token: kept
    assert r["decode_tps"]["workload_differs"] == []
    text = cli("compare", "@0..9000", "@9000..20000", "--db", str(windows_db)).stdout
    assert ("warning: aggregate throughput (tok/s) depends on the workload, and the arms' differ: prompt tokens per "
            "turn: mean 400 in A, 1200 in B (3.00x); completion tokens per turn: mean 30 in A, 70 in B (2.35x)") in text


def test_labels_whose_workloads_agree_keep_their_verdicts(db):
    proc = cli("compare", "known", "unknown", "--db", str(db), "--json")
    for row in json.loads(proc.stdout)["rows"]:
        assert row["workload_differs"] == [] and not row["verdict"].startswith("no verdict"), row
