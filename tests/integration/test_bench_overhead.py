"""``scripts/bench_overhead.py``, the benchmark issues 7 and 33 are judged by: its arithmetic, and a short real run.

The verdicts it prints decide whether a target is met, so the ratios are checked against hand-worked
rounds (each ratio is taken within its round, then the median over rounds: a round where nginx was slow
must not flatter specproxy in another round). The run is the real thing at a tiny scale: the
orchestrator starts its own upstream, load generator and ``specproxy serve`` on 127.0.0.1, measures
one window per path and writes its raw numbers; nothing here is timed.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # tests/ is on the path already (pgcluster)

from overhead_tables import (  # noqa: E402
    BASELINE, UNMEASURED, WITH_OTLP, WITH_SINK, WITH_SINK_OTLP, render_baseline, render_first_chunks, render_otlp, render_polls,
    render_shipper, render_sink, render_targets, render_threads, summarize)


def _run(path: str, rnd: int, *, cps: float, cpu: float | None, p50: float, p99: float) -> dict:
    return {
        "conns": 256, "path": path, "round": rnd, "chunks_per_s": cps, "cpu_us_per_chunk": cpu,
        "sched_us_per_chunk": cpu, "proxy_cpu_util": 0.1, "load_cpu_util": 0.1, "errors": 0, "turns": 10,
        "lat_us": {"p50": p50, "p99": p99, "p99.9": p99},
    }


def test_ratios_are_taken_within_each_round_and_the_verdicts_follow_the_targets():
    runs = []
    # specproxy/nginx per round: 9.6/8 = 1.2, 12/10 = 1.2, 11.2/8 = 1.4 -> median 1.2 (met: <= 1.2);
    # the ratio of the medians would be 11.2/8 = 1.4
    for rnd, (ng, sp) in enumerate([(8.0, 9.6), (10.0, 12.0), (8.0, 11.2)]):
        runs.append(_run("direct", rnd, cps=12800, cpu=None, p50=1000, p99=1400))
        runs.append(_run("nginx", rnd, cps=12800, cpu=ng, p50=1300, p99=1700))
        runs.append(_run("specproxy", rnd, cps=12672 if rnd == 2 else 12800, cpu=sp, p50=1400, p99=2400 + 100 * rnd))
    s = summarize(runs, [256], ["direct", "nginx", "specproxy"])
    sp = s[(256, "specproxy")]
    assert sp["cpu_x_nginx"] == (1.2, 1.2, 1.4)
    assert sp["added_p99"] == (1100, 1000, 1200)  # each round's p99 minus direct's in that round
    assert sp["x_direct"] == (1.0, 0.99, 1.0)
    verdicts = {line.split(" | ")[0].lstrip("| "): line.rsplit(" | ", 1)[1].rstrip(" |")
                for line in render_targets(s, [256]).splitlines()[2:]}
    assert verdicts["C=256: CPU per chunk ≤ 1.2× nginx (schedstat)"] == "met"
    assert verdicts["C=256: added p99 per chunk ≤ 1000 µs"] == "**not met**"
    assert verdicts["C=256: chunks/s ≥ 0.99× direct"] == "met"

    # just over the line: per round 12.5/10, 10.4/8, 12.4/10 -> median 1.25
    runs = [r for rnd, (ng, sp_) in enumerate([(10.0, 12.5), (8.0, 10.4), (10.0, 12.4)])
            for r in (_run("direct", rnd, cps=12800, cpu=None, p50=1000, p99=1400),
                      _run("nginx", rnd, cps=12800, cpu=ng, p50=1300, p99=1700),
                      _run("specproxy", rnd, cps=12800, cpu=sp_, p50=1400, p99=1900))]
    s = summarize(runs, [256], ["direct", "nginx", "specproxy"])
    assert s[(256, "specproxy")]["sched_x_nginx"][0] == 1.25
    lines = render_targets(s, [256]).splitlines()
    assert [ln for ln in lines if "(schedstat)" in ln][0].endswith("| **not met** |")
    assert [ln for ln in lines if "added p99" in ln][0].endswith("| met |")


def test_a_turns_first_chunk_is_summarized_apart_against_direct_in_the_same_round():
    runs = []
    for rnd, (d_first, sp_first) in enumerate([(900, 1500), (1000, 4000), (1100, 1400)]):
        direct = _run("direct", rnd, cps=12800, cpu=None, p50=1000, p99=1400)
        sp = _run("specproxy", rnd, cps=12800, cpu=10.0, p50=1200, p99=1900)
        direct["first_lat_us"] = {"p50": 500, "p99": d_first}
        sp["first_lat_us"] = {"p50": 650, "p99": sp_first}
        runs += [direct, sp]
    runs.append(_run("nginx", 0, cps=12800, cpu=9.0, p50=1100, p99=1500))  # an older run's: no first chunks
    s = summarize(runs, [256], ["direct", "nginx", "specproxy"])
    assert s[(256, "specproxy")]["first_added_p99"] == (600, 300, 3000)  # per round: 600, 3000, 300
    assert s[(256, "specproxy")]["first_added_p50"] == (150, 150, 150)
    assert s[(256, "nginx")]["first_added_p99"] is None
    table = render_first_chunks(s, [256], ["direct", "nginx", "specproxy"])
    assert table.splitlines()[-1] == "| 256 | specproxy | 150 | 600 (300–3000) | 200 | 500 |"
    assert "nginx |" not in table  # no figures, no row
    assert render_first_chunks(summarize(runs[-1:], [256], ["nginx"]), [256], ["nginx"]) is None


def test_a_short_run_measures_every_path(tmp_path):
    out = tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), "--concurrency", "4", "--rounds", "1",
         "--warmup", "0.3", "--measure", "0.8", "--tokens", "5-10", "--no-nginx", "--quiet-wait", "0",
         "--watch", "--with-unmeasured", "--json", str(out)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r["path"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"direct", "specproxy", UNMEASURED}
    for r in runs.values():
        assert r["chunks"] > 0 and r["errors"] == 0, r
        assert 0 < r["lat_us"]["p50"] <= r["lat_us"]["p99"]
        assert 0 < r["first_lat_us"]["p50"] <= r["first_lat_us"]["p99"] <= r["lat_max_us"]  # a subset of all chunks
    sp = runs["specproxy"]
    assert sp["cpu_us_per_chunk"] > 0 and sp["sched_us_per_chunk"] > 0
    # --watch: the live page's events were read and /_specproxy/metrics scraped while specproxy relayed
    assert sp["watch"]["scrapes"] >= 1 and sp["watch"]["pictures"] >= 1 and sp["watch"]["errors"] == [], sp["watch"]
    assert f"watched: {sp['watch']['pictures']} live-page pictures" in proc.stdout
    assert "watch" not in runs["direct"]
    # --with-unmeasured: the same streams on a path specproxy forwards unmeasured, checked to be so, and the ratio
    assert runs[UNMEASURED]["cpu_us_per_chunk"] > 0 and runs[UNMEASURED]["turns"] > 0
    assert re.search(rf"C=4: {UNMEASURED} recorded [1-9][0-9]* turns, none measured", proc.stderr), proc.stderr[-2000:]
    measuring = proc.stdout.split("Measuring's cost", 1)[1]
    assert re.search(r"^\| 4 \| [0-9.]+ \([0-9.]+–[0-9.]+\) \|", measuring.split("\n\n", 2)[1], re.M), measuring
    assert "| 4 | specproxy |" in proc.stdout
    assert "A turn's first chunk, against all chunks" in proc.stdout
    assert "MainThread" in sp["thread_names"].values(), sp["thread_names"]  # the busy threads, by name
    poll = json.loads(out.read_text())["meta"]["cadence_poll"]["4"]  # from specproxy's state line
    assert poll["poll_windows"] >= poll["poll_hits"] >= 0 and poll["cores"] >= 0, poll
    assert "specproxy's cadence poll (its state line" in proc.stdout
    # the interpreter is named with how it was built (the same Python costs ~15% more from a shared libpython)
    with open("/proc/self/maps") as f:  # this test's interpreter is the one that ran specproxy
        shared = any("libpython" in line for line in f)
    kind = "libpython shared" if shared else "libpython in the executable"
    assert json.loads(out.read_text())["meta"]["python"] == f"{platform.python_version()}, {kind}"
    assert f"Python {platform.python_version()}, {kind})" in proc.stdout


def test_the_cadence_poll_line_says_windows_catches_and_cores():
    line = render_polls({1: {"poll_windows": 1000, "poll_hits": 970, "poll_s": 4.1, "cores": 0.0412},
                         256: {"poll_windows": 0, "poll_hits": 0, "poll_s": 0.0, "cores": 0.0}})
    assert "C = 1: 1,000 windows, 97% caught their token, 4,100 µs polled per window; C = 256: none." in line


def test_specproxys_threads_are_told_apart_by_name(make_stack):
    """The benchmark splits specproxy's CPU by OS thread: each thread's name must reach the OS (Python
    before 3.14 leaves them all named after the process), and a name cut to Linux's 15 bytes is read back
    whole. Here the stack runs in this process, so its threads are this process's."""
    from overhead_procs import thread_names

    make_stack()
    names = thread_names(os.getpid())
    assert names[os.getpid()] == "MainThread"
    assert {"specproxy-measure", "specproxy-writer"} <= set(names.values()), names


def test_otlps_ratios_are_taken_within_each_round():
    """``--with-otlp``: each round's with/without ratio, then their median (min–max), per C."""
    runs = [_run("specproxy", 0, cps=100, cpu=20.0, p50=100, p99=1000),
            _run(WITH_OTLP, 0, cps=100, cpu=22.0, p50=110, p99=900),
            _run("specproxy", 1, cps=100, cpu=10.0, p50=100, p99=1000),
            _run(WITH_OTLP, 1, cps=99, cpu=10.5, p50=100, p99=1000),
            _run("specproxy", 2, cps=100, cpu=30.0, p50=100, p99=1000),
            _run(WITH_OTLP, 2, cps=100, cpu=30.0, p50=100, p99=1000)]
    table = render_otlp(runs, [256], 7)
    assert "it took 7 exports" in table
    assert "| 256 | 1.050 (1.000–1.100) | 1.000 (0.990–1.000) | 1.000 (1.000–1.100) | 1.000 (0.900–1.000) |" in table


def test_a_short_run_with_otlp_measures_both_specproxys(tmp_path):
    out = tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), "--concurrency", "4", "--rounds", "1",
         "--warmup", "0.3", "--measure", "0.8", "--tokens", "5-10", "--no-nginx", "--quiet-wait", "0",
         "--with-otlp", "--json", str(out)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r["path"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"direct", "specproxy", WITH_OTLP}
    assert runs[WITH_OTLP]["chunks"] > 0 and runs[WITH_OTLP]["errors"] == 0
    assert f"| 4 | {WITH_OTLP} |" in proc.stdout
    assert "OTLP's cost" in proc.stdout and "it took 0 exports" not in proc.stdout  # the receiver was sent to


def _sink_run(rnd: int, *, ship_s: float, turns: int, behind: dict) -> dict:
    r = _run(WITH_SINK, rnd, cps=100, cpu=10.0, p50=100, p99=1000)
    r.update(turns=turns, proxy_sched_s=0.4, threads_on_cpu_s={"11": ship_s, "12": 0.3},
             thread_names={"11": "specproxy-ship", "12": "MainThread"}, shipper=behind)
    return r


def test_the_shippers_cost_is_per_turn_and_its_lag_the_most_over_rounds():
    """``--with-sink``: the shipper thread's CPU (found by its name) per turn of each window, and as a share
    of the proxy's CPU, median over rounds; rows and seconds behind the most over rounds; over the proxy's
    life its CPU per turn PostgreSQL holds; a turn recorded but not in PostgreSQL is said."""
    runs = [_sink_run(0, ship_s=0.002, turns=100, behind={"sink_rows_behind": 30, "sink_seconds_behind": 0.4,
                                                           "sink_batches_failed": 0}),
            _sink_run(1, ship_s=0.006, turns=100, behind={"sink_rows_behind": 120, "sink_seconds_behind": 1.25,
                                                           "sink_batches_failed": 1})]
    deliveries = {"256": {WITH_SINK: {"recorded": 1000, "recorded_ok": 990, "in_pg": 998, "in_pg_ok": 990,
                                      "completed": 990, "ship_cpu_s": 0.0499}}}
    table = render_shipper(runs, [256], deliveries)
    assert ("| 256 | specproxy+sink | 40.0 (20.0–60.0) | 1.0% (0.5%–1.5%) | 120 | 1.25 | 1 | 50.0 "
            "| 990 → 1,000 (990) → 998 (990) **2 missing** |") in table, table
    deliveries["256"][WITH_SINK]["in_pg"] = 1000
    assert "→ 1,000 (990) all arrived |" in render_shipper(runs, [256], deliveries)


def test_the_sinks_ratios_and_targets_are_those_of_each_variant():
    """The sink's and the sink-and-OTLP's with/without ratios, each against specproxy in the same round,
    and issue 33's targets judged on the variant's own row."""
    runs = []
    for rnd, (sp, sink, both) in enumerate([(10.0, 11.0, 12.0), (20.0, 21.0, 30.0), (10.0, 10.0, 10.0)]):
        runs += [_run("direct", rnd, cps=100, cpu=None, p50=100, p99=1000),
                 _run("specproxy", rnd, cps=100, cpu=sp, p50=200, p99=1500),
                 _run(WITH_SINK, rnd, cps=100, cpu=sink, p50=200, p99=1500),
                 _run(WITH_SINK_OTLP, rnd, cps=100, cpu=both, p50=200, p99=3000)]
    text = render_sink(runs, [256])
    sink_part, both_part = text.split("\n\nThe cost of ", 1)
    assert sink_part.startswith("The cost of specproxy+sink (") and both_part.startswith("specproxy+sink+otlp (")
    assert "| 256 | 1.050 (1.000–1.100) | 1.000 (1.000–1.000) |" in sink_part
    assert ("| 256 | 1.200 (1.000–1.500) | 1.000 (1.000–1.000) | 1.000 (1.000–1.000) | 2.000 (2.000–2.000) |"
            in both_part)
    s = summarize(runs, [256], ["direct", "specproxy", WITH_SINK, WITH_SINK_OTLP])
    targets = render_targets(s, [256], WITH_SINK_OTLP)
    assert targets.startswith("| target (issue 33, specproxy+sink+otlp) |")
    assert "| C=256: added p99 per chunk ≤ 1000 µs | 2000 µs | **not met** |" in targets
    assert "| C=256: added p99 per chunk ≤ 1000 µs | 500 µs | met |" in render_targets(s, [256])


def test_a_short_run_with_a_sink_ships_every_turn(tmp_path):
    """``--with-sink --with-otlp``: a PostgreSQL started by the script, specproxy with the sink and with the
    sink and OTLP in the same rotation, every turn each recorded found in its database, the shipper's
    thread found by name and its gauges read after each window."""
    from pgcluster import pg_bin

    if pg_bin() is None:
        if os.environ.get("SPECPROXY_REQUIRE_POSTGRES") == "1":
            pytest.fail("PostgreSQL's binaries are not installed and SPECPROXY_REQUIRE_POSTGRES=1")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    out = tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), "--concurrency", "4", "--rounds", "1",
         "--warmup", "0.3", "--measure", "0.8", "--tokens", "5-10", "--no-nginx", "--quiet-wait", "0",
         "--with-sink", "--with-otlp", "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    runs = {r["path"]: r for r in got["runs"]}
    assert set(runs) == {"direct", "specproxy", WITH_OTLP, WITH_SINK, WITH_SINK_OTLP}
    for path in (WITH_SINK, WITH_SINK_OTLP):
        r, d = runs[path], got["meta"]["sink"]["4"][path]
        assert r["chunks"] > 0 and r["errors"] == 0, r
        assert "specproxy-ship" in r["thread_names"].values(), r["thread_names"]
        assert r["shipper"]["sink_batches_failed"] == 0 and r["shipper"]["sink_rows_set_aside"] == 0, r["shipper"]
        assert d["recorded"] == d["in_pg"] and d["recorded_ok"] == d["in_pg_ok"], d  # every turn arrived
        assert d["recorded_ok"] >= d["completed"] > 0 and d["ship_cpu_s"] > 0, d
        assert f"| 4 | {path} |" in proc.stdout
    assert proc.stdout.count(" all arrived |") == 2
    assert "| target (issue 33, specproxy+sink+otlp) |" in proc.stdout


def test_the_baselines_ratios_are_this_over_that_within_each_round_and_its_threads_are_shown():
    """``--specproxy-baseline``: each round's this/baseline ratio (this checkout's ``specproxy`` over the
    other checkout's), their median (min–max); the baseline's threads get their own rows."""
    runs = [_run("specproxy", 0, cps=100, cpu=18.0, p50=90, p99=1000),
            _run(BASELINE, 0, cps=100, cpu=20.0, p50=100, p99=1000),
            _run("specproxy", 1, cps=99, cpu=27.0, p50=100, p99=1200),
            _run(BASELINE, 1, cps=100, cpu=30.0, p50=100, p99=1000),
            _run("specproxy", 2, cps=100, cpu=10.0, p50=100, p99=1000),
            _run(BASELINE, 2, cps=100, cpu=10.0, p50=100, p99=1000)]
    table = render_baseline(runs, [256], "e7a1032")
    assert "the baseline's (e7a1032)" in table
    assert "| 256 | 0.900 (0.900–1.000) | 1.000 (0.990–1.000) | 1.000 (0.900–1.000) | 1.000 (1.000–1.200) |" in table
    for r in runs:
        r["threads"] = {"1": [1.0, 2.0]}
        r["thread_names"] = {"1": "MainThread"}
        r["chunks"] = 1000 + 200 * r["round"]  # 10 turns each: 100, 120 and 140 chunks a turn
    threads = render_threads(runs, 256)
    # per turn: 3.0 µs per chunk times the median round's 120 chunks per turn
    assert f"| {BASELINE} | MainThread | 1.0 | 2.0 | 3.0 | 360 |" in threads
    assert f"| {BASELINE} | (chunks per turn) | | | | 120 |" in threads


def test_a_short_run_with_a_baseline_runs_the_other_checkouts_specproxy(tmp_path):
    """The baseline is run by the other checkout's own interpreter: here a checkout whose .venv/bin/python
    runs this one's (a script: a symlinked venv interpreter would not find its venv), so the same
    specproxy runs twice, as two paths of every round."""
    other = tmp_path / "other"
    (other / ".venv" / "bin").mkdir(parents=True)
    python = other / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), "--concurrency", "4", "--rounds", "1",
         "--warmup", "0.3", "--measure", "0.8", "--tokens", "5-10", "--no-nginx", "--quiet-wait", "0",
         "--specproxy-baseline", str(other), "--json", str(out)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r["path"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"direct", "specproxy", BASELINE}
    assert runs[BASELINE]["chunks"] > 0 and runs[BASELINE]["errors"] == 0
    assert f"| 4 | {BASELINE} |" in proc.stdout and "against the baseline's" in proc.stdout
    # the baseline's interpreter is named too (asked of the other checkout's, here the same one)
    assert f", Python {platform.python_version()}, libpython" in proc.stdout


def test_the_loops_steps_are_per_turn_and_the_rest_is_what_they_leave():
    """``--loop-steps``' table: each step's time and calls over the turns ended; "the steps above" adds the
    top-level steps only (a nested one is inside its parent's time), and the rest is the thread's CPU less
    that."""
    from overhead_steps import STEPS, TURN_END, render_steps

    steps = {path: [0, 0] for _, path, _, _ in STEPS}
    steps[TURN_END] = [4_000_000, 100]  # 100 turns: 40 µs each, nested in TurnSink._collect
    steps["TurnSink._collect"] = [6_000_000, 35]
    steps["Lane.data_received"] = [7_000_000, 100]
    steps["read_head"] = [5_000_000, 100]
    table = render_steps({"steps": steps, "cpu_ns": 50_000_000}, 256, 27.5)
    assert "at C=256 (one extra window, 27.5 µs/chunk in all its threads" in table and "100 turns" in table
    assert "| … of which the exchange ended, its connection checked in (`Exchange.end`) | 40.0 | 1.00 |" in table
    assert "| the thread's ends heard (`TurnSink._collect`) | 60.0 | 0.35 |" in table
    assert "| the steps above | 130 | |" in table  # 60 + 70: read_head and Exchange.end are inside them
    assert "system calls | 370 | |" in table and "| **the loop's thread, all** | **500** | |" in table
    assert render_steps({"steps": {**steps, TURN_END: [0, 0]}, "cpu_ns": 0}, 4, None) == (
        "loop steps: no turn ended in the window")


def test_a_short_run_times_the_loops_steps(tmp_path):
    """``--loop-steps`` runs one more window with specproxy under ``overhead_steps.py``: every step is
    timed on the loop's thread, about once a turn for the steps every turn takes."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), "--concurrency", "4", "--rounds", "1",
         "--warmup", "0.3", "--measure", "0.8", "--tokens", "5-10", "--no-nginx", "--quiet-wait", "0",
         "--loop-steps"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "The event loop's turn, step by step, at C=4 (one extra window" in proc.stdout, proc.stdout[-3000:]
    rows = {line.split("(`")[1].split("`)")[0]: line.rsplit(" | ", 2)[1:]
            for line in proc.stdout.splitlines() if line.startswith("| ") and "(`" in line}
    for path in ("Lane.data_received", "read_head", "TurnRecorder.__init__", "UpstreamConn.send",
                 "Exchange.attach", "ThreadRelay.start", "Exchange.end", "Proxy._submit"):
        us, calls = float(rows[path][0]), float(rows[path][1].rstrip(" |"))
        assert us > 0 and 0.9 <= calls <= 1.1, (path, rows[path])  # (a request may come in two reads)
    total = next(line for line in proc.stdout.splitlines() if "the loop's thread, all" in line)
    above = next(line for line in proc.stdout.splitlines() if line.startswith("| the steps above |"))
    assert int(total.split("**")[3]) > int(above.split(" | ")[1]) > 0
