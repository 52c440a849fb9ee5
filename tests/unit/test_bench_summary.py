"""A benchmark's per-stream intervals over instances or rounds, and its progress display.

Per-stream: turns of one server instance share that instance's offset (a restart's), so an interval over
pooled turns leaves the restart-to-restart variance out; with several instances the interval is over
them. Turns of one round share that round's drift within the instance, so with one instance and at
least 3 rounds the interval is over rounds (run-to-run drift, with no restart in it, which the output
says); below 3 rounds a t interval on 1 df is too wide to read, and it is over turns. The table says
what each is over. TTFT prints with 3 significant digits, so a small bound never reads as 0.000.
Progress: on a terminal it says what runs, turns done out of planned, elapsed and left, each named;
off a terminal it writes nothing.
"""

from __future__ import annotations

import dataclasses
import io
import re

import numpy as np

from specproxy.analyze.bench import ONE_INSTANCE_NOTE, Round, render_bench, summarize_bench
from specproxy.analyze.summary import summarize
from specproxy.app.fake_upstream import make_record
from specproxy.app.progress import Quiet, RichProgress, make_progress


def rounds_with(offsets: dict[int, float], *, repeats: int = 1, turns: int = 20, seed: int = 1,
                drift: tuple[float, ...] = (1.0,), ttft_s: float = 0.1) -> list[Round]:
    """Rounds at concurrency 2, instance k's turns decoding at about offsets[k] tokens/s (1% noise),
    times ``drift[repeat - 1]`` (cycled): rounds of one instance that differ."""
    rng = np.random.default_rng(seed)
    out, t = [], 1000.0
    for k, speed in offsets.items():
        for repeat in range(1, repeats + 1):
            rnd = Round(arm="a", instance=k, level=2, repeat=repeat)
            for _ in range(turns):
                tps = float(speed * drift[(repeat - 1) % len(drift)] * rng.normal(1.0, 0.01))
                rnd.records.append(make_record(t_request=t, decode_s=1.0, completion_tokens=int(tps) + 1,
                                               decode_tps=tps, ttft_s=ttft_s * float(rng.uniform(0.5, 2.0))))
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


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()[:1].isdigit()]


def test_per_stream_interval_over_rounds_of_one_instance_is_wider_than_pooled_turns_and_says_no_restart():
    """Rounds of one instance that differ (run-to-run drift of 100, 120, 140 tokens/s): the interval over
    the 3 rounds has that drift in it, as the instances' one has theirs; and since no restart is in it,
    the output says so in one line, and --json in a field."""
    rounds = rounds_with({1: 100.0}, repeats=3, drift=(1.0, 1.2, 1.4))
    summary = summarize_bench(rounds)
    ps = summary["arms"][0]["levels"][0]["decode_tps"]
    pooled = summarize([r.decode_tps for rnd in rounds for r in rnd.records])
    assert (ps["unit"], ps["n_units"], ps["n"]) == ("rounds", 3, 60)
    assert ps["median"] == pooled.median
    assert ps["ci_high"] - ps["ci_low"] > 3 * (pooled.ci_high - pooled.ci_low)
    assert ps["ci_low"] < 110 and ps["ci_high"] > 130
    assert summary["restart_variance_note"] == ONE_INSTANCE_NOTE
    text = render_bench(summary)
    assert text.count(ONE_INSTANCE_NOTE) == 1 and table_rows(text)[0].rstrip().endswith("3 rounds"), text
    # several instances: restart variance is in the intervals, and nothing is said
    several = summarize_bench(rounds_with({1: 100.0, 2: 110.0}, repeats=3), restarts=True)
    assert several["restart_variance_note"] is None
    assert "restart-to-restart variance is not" not in render_bench(several)


def test_two_rounds_of_one_instance_fall_back_to_the_interval_over_turns_and_say_so():
    """Over 2 rounds the t quantile has 1 df (12.7): the interval would span a factor of several however
    closely the rounds agree. The per-stream figures take the median's interval over the pooled turns
    instead, and the table says so; the aggregate stays over its 2 rounds."""
    rounds = rounds_with({1: 100.0}, repeats=2, drift=(1.0, 1.02))
    level = summarize_bench(rounds)["arms"][0]["levels"][0]
    pooled = summarize([r.decode_tps for rnd in rounds for r in rnd.records])
    ps = level["decode_tps"]
    assert (ps["unit"], ps["n_units"]) == ("turns", 40) and ps["note"] == "fewer than 3 rounds"
    assert (ps["ci_low"], ps["ci_high"]) == (pooled.ci_low, pooled.ci_high)
    assert level["ttft_s"]["unit"] == "turns"
    assert (level["aggregate_tps"]["unit"], level["aggregate_tps"]["n"]) == ("rounds", 2)
    row = table_rows(render_bench(summarize_bench(rounds)))[0]
    assert row.rstrip().endswith("40 turns (fewer than 3 rounds) / 2 rounds"), row


def test_ttft_prints_with_three_significant_digits_never_a_zero_that_was_not_measured():
    """TTFTs of a fraction of a millisecond: each figure and bound keeps 3 significant digits."""
    text = render_bench(summarize_bench(rounds_with({1: 100.0}, repeats=3, ttft_s=0.0004)))
    row = table_rows(text)[0]
    ttft = re.search(r"(\S+) \[(\S+), (\S+)\]\s+\S+ \[", row[row.index("]") + 1:])
    assert ttft, row
    for figure in ttft.groups():
        assert float(figure) > 0 and len(figure.lstrip("0.")) == 3, row
    probe = [Round(arm="a", instance=1, level=1, repeat=1, prompt_len=256,
                   records=[make_record(ttft_s=0.0002 * (i + 1), completion_tokens=1, decode_tps=None)
                            for i in range(10)])]
    prefill = table_rows(render_bench(summarize_bench(probe, phase="prefill")))[0]
    assert " 0.000 " not in prefill and "0.00110 [" in prefill, prefill


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
