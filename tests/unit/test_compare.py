"""`specproxy compare` on databases with a known truth: real speedups found, A/A and restart-confounded
comparisons reported as not distinguishable, with the warning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specproxy.analyze.instances import CONFOUNDED_WARNING, SEPARATE_INSTANCES_WARNING
from specproxy.store.writer import Writer
from specproxy.app.fake_upstream import make_record, make_whole_record

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specproxy.app.cli", *args], capture_output=True, text=True,
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
    """Each arm in its own single instance: the precise warning, never beside "inside one instance"
    (which is for both arms in the same instance and would contradict it), each warning once."""
    r = rows(cli("compare", "same-a", "same-b", "--db", str(db), "--json"))
    for metric in ("decode_tps", "ttft_s", "total_s", "aggregate_tps"):
        assert r[metric]["verdict"] == "not distinguishable"
        assert SEPARATE_INSTANCES_WARNING in r[metric]["warnings"]
        assert CONFOUNDED_WARNING not in r[metric]["warnings"]
    text = cli("compare", "same-a", "same-b", "--db", str(db)).stdout
    warnings = [line for line in text.splitlines() if line.strip().startswith("warning:")]
    assert f"warning: {SEPARATE_INSTANCES_WARNING}" in text and CONFOUNDED_WARNING not in text
    assert len(warnings) == len(set(warnings))


def test_instance_counts_are_pluralised(db):
    text = cli("compare", "same-a", "same-b", "--db", str(db)).stdout
    assert "(30 turns, 1 instance) against A=same-a (30 turns, 1 instance)" in text and "1 instances" not in text
    control = cli("compare", "same-a", "--negative-control", "--db", str(db)).stdout
    assert "(30 turns, 1 server instance)" in control and "1 server instances" not in control


def test_negative_control_is_not_distinguishable(db):
    r = rows(cli("compare", "old", "--negative-control", "--db", str(db), "--json"))
    assert all(row["verdict"] == "not distinguishable" for row in r.values())


def test_time_window_arms(db):
    r = rows(cli("compare", "@0..9000", "@10000..19000", "--db", str(db), "--json"))
    assert r["decode_tps"]["verdict"] == "faster"


@pytest.mark.parametrize("args, message", [
    (["compare", "old"], "needs two arms"),
    (["compare", "old", "nope"], "no turn has this label (its labels are new, old, same-a, same-b;"),
    (["compare", "@yesterday", "old"], "@START..END"),
    (["compare", "old", "new", "--level", "1.5"], "--level must be between 0.5 and 1"),
    (["compare", "old", "new", "--level", "0.5"], "--level must be between 0.5 and 1"),
    (["compare", "old", "--negative-control", "--level", "nan"], "--level must be between 0.5 and 1"),
])
def test_compare_errors_are_one_line(db, args, message):
    proc = cli(*args, "--db", str(db))
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def write_mixed_arm(w: Writer, rng, label: str, streamed: int, whole: int, t0: float) -> None:
    """Streamed turns (TTFT ~0.05 s) in one instance, non-streamed ones (~0.27 s whole) in another,
    as when two clients of one arm, a streaming chat and a non-streaming agent, hit two servers."""
    t = t0
    for i in range(streamed + whole):
        noise = float(np.exp(rng.normal(0, 0.1)))
        if i < streamed:
            rec = make_record(label=label, instance_id=f"{label}-s", t_wall=t, ttft_s=0.05 * noise,
                              decode_s=0.22 * noise, completion_tokens=46, first_chunk_tokens=2)
        else:
            rec = make_whole_record(label=label, instance_id=f"{label}-n", t_wall=t, total_s=0.27 * noise,
                                    completion_tokens=46)
        w.put(rec)
        t += 1.0


@pytest.fixture(scope="module")
def mixed_db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mixed") / "mixed.db"
    w = Writer(path)
    rng = np.random.default_rng(11)
    write_mixed_arm(w, rng, "mix", 10, 10, 0.0)
    write_mixed_arm(w, rng, "mix2", 10, 10, 1000.0)
    write_mixed_arm(w, rng, "streamy", 20, 0, 2000.0)
    w.close()
    return path


def test_negative_control_never_splits_streamed_against_non_streamed(mixed_db):
    proc = cli("compare", "mix", "--negative-control", "--db", str(mixed_db), "--json")
    r = rows(proc)
    for metric in ("ttft_s", "total_s", "decode_tps"):
        row = r[metric]
        assert 0.67 < row["estimate"] < 1.5, row  # A against A: a streamed half against a non-streamed one was 5x
        assert row["n_a"] + row["n_b"] == 10 and row["population"] == "streamed"
    ns = r["total_s_non_streamed"]
    assert ns["population"] == "non_streamed" and ns["n_a"] + ns["n_b"] == 10 and 0.67 < ns["estimate"] < 1.5
    assert all(row["verdict"] == "not distinguishable" for row in r.values())
    head = json.loads(proc.stdout)
    assert (head["streamed_a"], head["non_streamed_a"]) == (10, 10)
    text = cli("compare", "mix", "--negative-control", "--db", str(mixed_db)).stdout
    assert "within each kind (20 turns: 10 streamed, 10 non-streamed; 2 server instances)" in text


def test_compare_stream_rows_are_over_streamed_turns(mixed_db):
    """B streams everything at A's speed: its TTFT is A's streamed TTFT, not a third of A's mixed one."""
    proc = cli("compare", "mix", "streamy", "--db", str(mixed_db), "--json")
    r = rows(proc)
    for metric in ("ttft_s", "total_s", "decode_tps"):
        assert 0.8 < r[metric]["estimate"] < 1.25, r[metric]
        assert (r[metric]["n_a"], r[metric]["n_b"]) == (10, 20) and r[metric]["population"] == "streamed"
    assert "total_s_non_streamed" not in r  # B has none to compare A's with
    assert r["aggregate_tps"]["population"] == "all" and r["aggregate_tps"]["n_a"] == 20
    head = json.loads(proc.stdout)
    assert (head["streamed_a"], head["non_streamed_a"], head["streamed_b"], head["non_streamed_b"]) == (10, 10, 20, 0)
    text = cli("compare", "mix", "streamy", "--db", str(mixed_db)).stdout
    assert "A=mix (20 turns: 10 streamed, 10 non-streamed; 2 instances)" in text and "TTFT, streamed (s)" in text


def test_compare_whole_responses_within_the_non_streamed_kind(mixed_db):
    r = rows(cli("compare", "mix", "mix2", "--db", str(mixed_db), "--json"))
    assert (r["total_s"]["n_a"], r["total_s"]["n_b"]) == (10, 10)  # streamed against streamed
    ns = r["total_s_non_streamed"]
    assert ns["population"] == "non_streamed" and (ns["n_a"], ns["n_b"]) == (10, 10)
    assert 0.8 < ns["estimate"] < 1.25 and 0.8 < r["total_s"]["estimate"] < 1.25


def write_closed_loop_arm(w: Writer, rng, label: str, conn_ids, t0: float, clients: int = 4, n: int = 60) -> None:
    """``clients`` closed-loop clients sending turns back to back (a think time between), each on its own
    connection: turn i goes to client i % clients. ``conn_ids(client, i)``: the conn_id recorded."""
    next_start = t0 + rng.uniform(0.0, 0.2, clients)
    for i in range(n):
        c = i % clients
        tokens = max(1, round(300 * float(rng.lognormal(0.0, 0.4))))
        total = 0.5 * float(rng.lognormal(0.0, 0.3)) + tokens / (50 * float(rng.lognormal(0.0, 0.15)))
        w.put(make_record(label=label, t_wall=float(next_start[c]), total_s=total, completion_tokens=tokens,
                          conn_id=conn_ids(c, i)))
        next_start[c] += total + float(rng.exponential(0.5))


@pytest.fixture(scope="module")
def lanes_db(tmp_path_factory) -> Path:
    """The same two arms of 4 closed-loop clients three times: each client on one kept-alive connection
    (its turns share a conn_id), a connection per request, and no conn_id (rows recorded before it)."""
    path = tmp_path_factory.mktemp("lanes") / "lanes.db"
    w = Writer(path)
    for prefix, conn_ids in (("kept", lambda c, i: 100 + c), ("per-request", lambda c, i: 1000 + i),
                             ("unknown", lambda c, i: None)):
        rng = np.random.default_rng(11)
        write_closed_loop_arm(w, rng, f"{prefix}-a", conn_ids, 0.0)
        write_closed_loop_arm(w, rng, f"{prefix}-b", conn_ids, 10_000.0)
    w.close()
    return path


def test_client_connections_change_the_aggregate_interval(lanes_db):
    """With each client's turns on one connection, the aggregate row replays each arm's schedule over
    its lanes (the spread of the mean concurrency as sampling gives it) instead of the per-turn
    jackknife (on average too wide at concurrency 4 on smooth shapes, docs/statistics.md). A connection
    per request carries no chain of turns: the interval is the jackknife's, as with no conn_id."""
    agg = {prefix: rows(cli("compare", f"{prefix}-a", f"{prefix}-b", "--db", str(lanes_db), "--json"))["aggregate_tps"]
           for prefix in ("kept", "per-request", "unknown")}
    assert agg["kept"]["estimate"] == agg["unknown"]["estimate"] == agg["per-request"]["estimate"]
    assert "lanes (schedule replay)" in agg["kept"]["method"]
    for other in ("per-request", "unknown"):
        assert "turns (jackknife)" in agg[other]["method"] and "lanes" not in agg[other]["method"]
        assert (agg[other]["ci_low"], agg[other]["ci_high"]) == (agg["unknown"]["ci_low"], agg["unknown"]["ci_high"])
    width = {p: agg[p]["ci_high"] / agg[p]["ci_low"] for p in agg}
    assert width["kept"] != pytest.approx(width["unknown"], rel=0.01)
    again = rows(cli("compare", "kept-a", "kept-b", "--db", str(lanes_db), "--json"))["aggregate_tps"]
    assert (again["ci_low"], again["ci_high"]) == (agg["kept"]["ci_low"], agg["kept"]["ci_high"])  # seeded


@pytest.fixture(scope="module")
def lumpy_db(tmp_path_factory) -> Path:
    """Eight turns per arm, one after another: arm a has seven short turns and one long one that carries
    two thirds of its tokens, arm b eight short ones (its sample missed the long kind)."""
    path = tmp_path_factory.mktemp("lumpy") / "lumpy.db"
    w = Writer(path)
    rng = np.random.default_rng(8)
    for label, t0, long_turns in (("lumpy-a", 0.0, 1), ("lumpy-b", 1000.0, 0)):
        t = t0
        for i in range(8):
            tokens, ttft, decode = ((900, 2.5, 27.5) if i < long_turns
                                    else (60, 0.2, 1.1 * float(rng.lognormal(0.0, 0.02))))
            w.put(make_record(label=label, t_wall=t, ttft_s=ttft, decode_s=decode, total_s=ttft + decode,
                              completion_tokens=tokens))
            t += ttft + decode + 0.5
    w.close()
    return path


def test_few_turns_carrying_most_tokens_get_no_interval(lumpy_db):
    """The aggregate is a ratio of sums, and here one turn carries half of both arms' tokens: 16 turns
    weigh as 3.75, 1.9 per arm. The row says why it cannot compare, in both outputs, instead of an
    interval that cannot see the long turns arm b never had."""
    why = "no interval (a few turns carry most of the tokens: 1.9 effective turns per arm, 5 needed)"
    agg = rows(cli("compare", "lumpy-a", "lumpy-b", "--db", str(lumpy_db), "--json"))["aggregate_tps"]
    assert agg["verdict"] == why and agg["ci_low"] is None and agg["ci_high"] is None
    assert agg["estimate"] > 1.2  # the extreme estimate the interval would have rested on
    text = cli("compare", "lumpy-a", "lumpy-b", "--db", str(lumpy_db)).stdout
    line = next(line for line in text.splitlines() if line.strip().startswith("aggregate throughput"))
    assert line.endswith(why) and " - " in line


def intervals(path: Path, *args: str) -> dict[str, tuple[float, float]]:
    """Each row's interval at 95% and 99%, from compare itself (the command line is checked once, below)."""
    from specproxy.analyze.compare import COMPARE_COLUMNS, compare, negative_control_report, parse_arm
    from specproxy.store.db import open_existing
    from specproxy.store.sqlite_source import SQLiteSource

    out = {}
    for level in ("0.95", "0.99"):
        with open_existing(str(path)) as conn:
            if args[1] == "--negative-control":
                a = parse_arm(args[0])
                r = negative_control_report(a, SQLiteSource(conn).load(a.window, COMPARE_COLUMNS), level=float(level))
            else:
                a, b = parse_arm(args[0]), parse_arm(args[1])
                r = compare(a, b, *(SQLiteSource(conn).load(arm.window, COMPARE_COLUMNS) for arm in (a, b)),
                            level=float(level))
        assert r["level"] == float(level) and all(row["level"] == float(level) for row in r["rows"])
        out[level] = {row["metric"]: (row["ci_low"], row["ci_high"], row["method"]) for row in r["rows"]}
    return out


@pytest.mark.parametrize("arms", [
    ("old", "new"),  # both arms over instances: t over the instances' bootstrap
    ("kept-a", "kept-b"),  # request level: the median's calibrated percentile tail; the aggregate's lane replay
    ("unknown-a", "unknown-b"),  # the aggregate's jackknife over turns
    ("old", "--negative-control"),
])
def test_a_99_percent_interval_holds_the_95_percent_one_in_every_row(db, lanes_db, arms):
    """--level reaches every row and every rule under it: each row's 99% interval contains its 95% one,
    wider on both sides, by the same method."""
    path = db if arms[0] == "old" else lanes_db
    got = intervals(path, *arms)
    assert got["0.95"].keys() == got["0.99"].keys()
    for metric, (lo95, hi95, method) in got["0.95"].items():
        lo99, hi99, method99 = got["0.99"][metric]
        assert lo95 is not None, metric
        assert lo99 < lo95 and hi99 > hi95, (metric, (lo95, hi95), (lo99, hi99))
        assert method99 == method
    if arms == ("old", "new"):  # the command line carries --level to the same place, and says it
        proc = cli("compare", *arms, "--db", str(path), "--json", "--level", "0.99")
        assert {row["metric"]: (row["ci_low"], row["ci_high"], row["method"])
                for row in json.loads(proc.stdout)["rows"]} == got["0.99"]
        text = cli("compare", *arms, "--db", str(path), "--level", "0.99").stdout
        assert "99% CI" in text and "95% CI" not in text
