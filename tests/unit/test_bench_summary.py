"""A benchmark's per-stream intervals over instances or rounds, and its progress display.

Per-stream: turns of one server instance share that instance's offset (a restart's), so an interval over
pooled turns leaves the restart-to-restart variance out; with several instances (or rounds) the interval
is over them, and the table says what it is over. Progress: on a terminal it says what runs, turns done
out of planned, elapsed and left, each named; off a terminal it writes nothing.
"""

from __future__ import annotations

import dataclasses
import io
import re

import numpy as np

from specproxy.analyze.bench import Round, render_bench, summarize_bench
from specproxy.analyze.stats import summarize
from specproxy.app.fake_upstream import make_record
from specproxy.app.progress import Quiet, RichProgress, make_progress


def rounds_with(offsets: dict[int, float], *, repeats: int = 1, turns: int = 20, seed: int = 1) -> list[Round]:
    """Rounds at concurrency 2, instance k's turns decoding at about offsets[k] tokens/s (1% noise)."""
    rng = np.random.default_rng(seed)
    out, t = [], 1000.0
    for k, speed in offsets.items():
        for repeat in range(1, repeats + 1):
            rnd = Round(arm="a", instance=k, level=2, repeat=repeat)
            for _ in range(turns):
                tps = float(speed * rng.normal(1.0, 0.01))
                rnd.records.append(make_record(t_request=t, decode_s=1.0, completion_tokens=int(tps) + 1,
                                               decode_tps=tps, ttft_s=0.1))
                t += 1.5
            rnd.sent = turns
            out.append(rnd)
    return out


def test_per_stream_interval_is_over_instances_and_wider_than_pooled_turns():
    rounds = rounds_with({1: 100.0, 2: 120.0, 3: 140.0})
    level = summarize_bench(rounds, restarts=True)["arms"][0]["levels"][0]
    ps = level["decode_tps"]
    pooled = summarize([r.decode_tps for rnd in rounds for r in rnd.records])
    assert ps["unit"] == "instances" and ps["n_units"] == 3 and ps["n"] == 60
    assert ps["median"] == pooled.median
    assert ps["ci_low"] < ps["median"] < ps["ci_high"]
    # the instances' spread (100..140) is in it; 60 pooled turns would give a few tokens/s either side
    assert ps["ci_high"] - ps["ci_low"] > 3 * (pooled.ci_high - pooled.ci_low)
    assert ps["ci_low"] < 110 and ps["ci_high"] > 130
    rows = [line for line in render_bench(summarize_bench(rounds, restarts=True)).splitlines()
            if line.strip()[:1].isdigit()]
    assert rows and rows[0].rstrip().endswith("3 instances")  # the table says what the intervals are over


def test_per_stream_interval_is_over_rounds_in_one_instance_and_over_turns_for_one_round():
    level = summarize_bench(rounds_with({1: 100.0}, repeats=3))["arms"][0]["levels"][0]
    assert (level["decode_tps"]["unit"], level["decode_tps"]["n_units"]) == ("rounds", 3)
    assert level["aggregate_tps"]["unit"] == "rounds"
    level = summarize_bench(rounds_with({1: 100.0}))["arms"][0]["levels"][0]
    assert (level["decode_tps"]["unit"], level["decode_tps"]["n_units"]) == ("turns", 20)
    text = render_bench(summarize_bench(rounds_with({1: 100.0})))
    assert "20 turns / 1 round" in text


def test_without_a_tokenizer_the_table_says_why_its_speeds_are_missing():
    rounds = rounds_with({1: 100.0})
    for rnd in rounds:
        rnd.records = [dataclasses.replace(r, completion_tokens=None, decode_tps=None) for r in rnd.records]
    summary = summarize_bench(rounds)
    summary["tokenizer"] = False
    assert "no tokenizer: tokens were not counted" in render_bench(summary)


def drawn(progress: RichProgress) -> str:
    progress._progress.refresh()
    return progress._progress.console.file.getvalue()


def terminal() -> RichProgress:
    from rich.console import Console

    return RichProgress(console=Console(force_terminal=True, file=io.StringIO(), width=200))


def test_progress_on_a_terminal_names_what_runs_turns_and_times():
    p = terminal()
    p.start(40, rounds=4, round_s=None)
    p.phase("a #1: concurrency 4, repeat 2/3")
    p.begin_round()
    p.advance(3)
    text = drawn(p)
    p.stop()
    assert "a #1: concurrency 4, repeat 2/3" in text
    assert "3/40 turns" in text
    assert re.search(r"elapsed \d+:\d\d:\d\d, left (\d+:\d\d:\d\d|-:--:--)", text), text


def test_progress_with_a_duration_counts_the_time_left_from_the_rounds():
    p = terminal()
    p.start(None, rounds=3, round_s=60.0)  # three rounds of a minute: no planned turn count
    p.phase("a #1: concurrency 1, repeat 1/3")
    p.begin_round()
    p.advance(5)
    text = drawn(p)
    p.stop()
    assert "5 turns" in text
    left = re.findall(r"left (\d+):(\d\d):(\d\d)", text)
    assert left, text
    h, m, s = map(int, left[-1])
    assert 170 <= h * 3600 + m * 60 + s <= 180  # the running round's minute (barely begun) and two more


def test_progress_off_a_terminal_writes_nothing(monkeypatch):
    err = io.StringIO()  # not a terminal
    monkeypatch.setattr("sys.stderr", err)
    p = make_progress()
    assert isinstance(p, Quiet)
    p.start(10, rounds=1)
    p.phase("a #1: concurrency 1, repeat 1/1")
    p.begin_round()
    p.advance(3)
    p.stop()
    assert err.getvalue() == ""
