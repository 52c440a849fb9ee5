"""`specproxy compare` on databases with a known truth: real speedups found, A/A and restart-confounded
comparisons reported as not distinguishable, with the warning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specproxy.store import Writer
from specproxy.testing import make_record

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specproxy.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def write_arm(w: Writer, rng, label: str, speed: float, instances: int, per_instance: int, t0: float,
              instance_sd: float = 0.0) -> None:
    t = t0
    for k in range(instances):
        effect = float(np.exp(rng.normal(0, instance_sd)))  # a restart moves every request of an instance
        iid = f"{label}-inst{k}"
        for _ in range(per_instance):
            tps = speed * effect * float(np.exp(rng.normal(0, 0.15)))  # 15% run-to-run noise
            tokens = 300
            decode = tokens / tps
            ttft = 0.5 * float(np.exp(rng.normal(0, 0.1)))
            w.put(make_record(label=label, instance_id=iid, t_wall=t, decode_tps=tps, decode_s=decode,
                              ttft_s=ttft, total_s=ttft + decode, completion_tokens=tokens, first_chunk_tokens=0))
            t += ttft + decode + 1.0


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ab") / "ab.db"
    w = Writer(path)
    rng = np.random.default_rng(42)
    write_arm(w, rng, "old", 50.0, 4, 15, 0.0, instance_sd=0.05)
    write_arm(w, rng, "new", 70.0, 4, 15, 10_000.0, instance_sd=0.05)  # truly 40% faster decode
    write_arm(w, rng, "same-a", 50.0, 1, 30, 20_000.0, instance_sd=0.15)  # one instance each,
    write_arm(w, rng, "same-b", 50.0, 1, 30, 30_000.0, instance_sd=0.15)  # identical configs
    w.close()
    return path


def rows(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return {r["metric"]: r for r in json.loads(proc.stdout)["rows"]}


def test_real_speedup_is_found_over_instances(db):
    r = rows(cli("compare", "old", "new", "--db", str(db), "--json"))
    d = r["decode_tps"]
    assert d["verdict"] == "faster" and 1.2 < d["estimate"] < 1.6 and d["ci_low"] > 1
    assert d["instances_a"] == 4 and d["instances_b"] == 4
    assert r["ttft_s"]["verdict"] == "not distinguishable"  # prefill did not change
    text = cli("compare", "old", "new", "--db", str(db)).stdout
    assert "faster" in text and "4 instances" in text


def test_restart_confounded_ab_is_not_called_faster(db):
    r = rows(cli("compare", "same-a", "same-b", "--db", str(db), "--json"))
    for metric in ("decode_tps", "ttft_s", "total_s", "aggregate_tps"):
        assert r[metric]["verdict"] == "not distinguishable"
        assert any("confounded" in w for w in r[metric]["warnings"])
    assert "confounded with that instance" in cli("compare", "same-a", "same-b", "--db", str(db)).stdout


def test_negative_control_is_not_distinguishable(db):
    r = rows(cli("compare", "old", "--negative-control", "--db", str(db), "--json"))
    assert all(row["verdict"] == "not distinguishable" for row in r.values())


def test_time_window_arms(db):
    r = rows(cli("compare", "@0..9000", "@10000..19000", "--db", str(db), "--json"))
    assert r["decode_tps"]["verdict"] == "faster"


@pytest.mark.parametrize("args, message", [
    (["compare", "old"], "needs two arms"),
    (["compare", "old", "nope"], "has no completed turns"),
    (["compare", "@yesterday", "old"], "@START..END"),
])
def test_compare_errors_are_one_line(db, args, message):
    proc = cli(*args, "--db", str(db))
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
