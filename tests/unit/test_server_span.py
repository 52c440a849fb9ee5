"""The server's own counters in the report are read over a span fixed by the turns: the last scrape at or
before the first turn's start to the first at or after the last turn's end, never past --until. So the
same report gives the same figures whenever it runs, idle time around the turns does not dilute the
rates (or the server's running requests), and a scrape interval coarse against the window is said
instead of a diluted rate."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from specproxy.store.source import Window
from specproxy.store.sqlite_source import SQLiteSource
from specproxy.analyze.report_data import build_report
from specproxy.analyze.report import render_text
from specproxy.app.fake_upstream import make_record
from specproxy.store import rows
from specproxy.store.dataset import load_turns
from specproxy.store.writer import Writer

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0  # a wall time: the turns' and the scrapes'


def turn_times(first: float, lanes: int = 2, per_lane: int = 8, each: float = 2.0) -> list[tuple[float, float]]:
    """Back-to-back turns of ``each`` seconds on ``lanes`` lanes from ``first``: (start, end) each."""
    return [(first + i * each, first + (i + 1) * each) for _ in range(lanes) for i in range(per_lane)]


TOKENS = 200  # per turn


def write_turns(w: Writer, label: str, times) -> None:
    for start, end in times:
        w.put(make_record(label=label, t_wall=start, ttft_s=0.2, decode_s=end - start - 0.2, total_s=end - start,
                          completion_tokens=TOKENS, concurrency=2, instance_id="inst-1"))


def write_scrapes(w: Writer, times, every: float, t_from: float, t_to: float) -> None:
    """llama.cpp-like scrapes every ``every`` s in [t_from, t_to]: tokens credited when a turn finishes,
    the running gauge is the turns in flight."""
    t = t_from
    while t <= t_to + 1e-9:
        done = sum(TOKENS for _, end in times if end <= t)
        running = sum(1 for start, end in times if start <= t < end)
        w.put(rows.scrape((t, t - T0, "inst-1", "llamacpp", running, 0, float(done), 0.0, None, None, None, None,
                           None, "[]", None)))
        t += every


def report(path: Path, **window) -> dict:
    conn = sqlite3.connect(path)
    try:
        return build_report(SQLiteSource(conn).load(Window(**window), server=True, context=True), source="test")
    finally:
        conn.close()


@pytest.fixture
def fine(tmp_path) -> tuple[Path, list]:
    """16 turns (two lanes of 8 back to back, 16 s) from T0 + 60.5, scraped every second up to the second
    after their end, as when `report` runs just after them."""
    path = tmp_path / "fine.db"
    times = turn_times(T0 + 60.5)
    w = Writer(path)
    write_turns(w, "B", times)
    write_scrapes(w, times, 1.0, T0, T0 + 78.0)
    w.close()
    return path, times


def later(path: Path, times, until: float) -> None:
    """serve kept scraping an idle server after the turns."""
    w = Writer(path)
    write_scrapes(w, times, 1.0, T0 + 79.0, until)
    w.close()


def test_the_same_report_gives_the_same_counters_whenever_it_runs(fine):
    """It read the scrapes 60 s around the turns: 80.3 tok/s just after them, 29.7 thirty seconds later."""
    path, times = fine
    first = report(path, label="B")["server"]
    later(path, times, T0 + 200.0)
    again = report(path, label="B")["server"]
    assert again == first
    w = first["window"]
    # from the scrape at 60 (the last before the first turn's start) to the one at 77 (the first after the
    # last turn's end at 76.5): 17 s, of which 1 s is outside the turns
    assert (w["from"], w["to"], w["seconds"]) == (T0 + 60.0, T0 + 77.0, 17.0)
    assert w["padding_s"] == pytest.approx(1.0) and not w["coarse"]
    assert w["generated_tps"] == pytest.approx(16 * TOKENS / 17.0)
    assert w["delivered_tps"] == pytest.approx(16 * TOKENS / 17.0)
    # the operating point: the scrapes while the turns ran, not the idle ones around them
    assert first["requests_running"]["median"] == 2 and first["requests_running"]["n"] == 16
    text = render_text(report(path, label="B"))
    assert "over 17.0 s, between the scrapes at 08:01:00.00 and 08:01:17.00 UTC" in text
    assert "1.00 s of it (6%) outside the turns" in text
    assert "server generated 188.2 tok/s" in text and "delivered to clients 188.2 tok/s" in text
    assert "server running median 2, p95 2, max 2 (at the 16 scrapes taken while these turns were in flight)" in text
    assert "\n  MAL - (no counters; " in text and "no counters over these turns yet" not in text


def test_a_scrape_sent_before_the_last_turn_ended_does_not_end_the_span(tmp_path):
    """A slow scrape: sent at 76.3, before the last turns ended (76.5), its headers came at 77.0, and its
    page counts none of the last two turns (the server built it before they finished). Stamped at 77.0
    it is the first at or after the end, yet the span must end at the next one, sent after the end (at
    78.0); else the window would miss the last turns' tokens while counting them delivered."""
    path = tmp_path / "slow.db"
    times = turn_times(T0 + 60.5)
    last = max(end for _, end in times)
    w = Writer(path)
    write_turns(w, "B", times)
    write_scrapes(w, times, 1.0, T0, T0 + 76.0)
    stale = sum(TOKENS for _, end in times if end < last)  # the page as the server built it before the end
    w.put(rows.scrape((T0 + 77.0, 77.0, "inst-1", "llamacpp", 0, 0, float(stale), 0.0, None, None, None, None,
                       None, "[]", None), latency_s=0.7))
    w.put(rows.scrape((T0 + 78.0, 78.0, "inst-1", "llamacpp", 0, 0, float(16 * TOKENS), 0.0, None, None, None,
                       None, None, "[]", None), latency_s=0.01))
    w.close()
    assert stale == 14 * TOKENS
    win = report(path, label="B")["server"]["window"]
    assert (win["from"], win["to"]) == (T0 + 60.0, T0 + 78.0)
    assert win["generated_tokens"] == win["delivered_tokens"] == 16 * TOKENS
    with SQLiteSource(path) as store:  # the load path reads through the scrape the span ends at
        assert store.scrape_time(last, after=True) == T0 + 78.0
        assert store.scrape_time(last - 1.0, after=True) == T0 + 76.0


def test_the_span_never_reads_past_until(fine):
    """--until inside the turns: the span ends at the last scrape before it, not 60 s after the turns."""
    path, times = fine
    later(path, times, T0 + 200.0)
    until = T0 + 66.0  # selects the turns that started before it: the first three of each lane
    w = report(path, label="B", until=until)["server"]["window"]
    assert w["to"] <= until and w["from"] == T0 + 60.0
    assert w["to"] == T0 + 66.0
    # the turns that ended by then: 2 lanes x 2 turns (the third ends at 66.5, after the span)
    assert w["delivered_tokens"] == 4 * TOKENS and w["generated_tokens"] == 4 * TOKENS
    assert w["cut_s"] == pytest.approx(0.5)


def test_a_coarse_scrape_interval_is_said_instead_of_a_diluted_rate(tmp_path):
    """Scrapes 10 s apart around 16 s of turns: 4 s of the 20 s span (20%) are outside them, so a rate
    over the span would be a fifth low: the counts are given, and why."""
    path = tmp_path / "coarse.db"
    times = turn_times(T0 + 62.0)
    w = Writer(path)
    write_turns(w, "B", times)
    write_scrapes(w, times, 10.0, T0, T0 + 200.0)
    w.close()
    r = report(path, label="B")
    win = r["server"]["window"]
    assert (win["from"], win["to"]) == (T0 + 60.0, T0 + 80.0)
    assert win["coarse"] and win["padding_share"] == pytest.approx(0.2)
    assert win["generated_tps"] is None and win["delivered_tps"] is None and win["accepted_draft_tps"] is None
    assert win["generated_tokens"] == win["delivered_tokens"] == 16 * TOKENS
    text = render_text(r)
    assert "the scrape interval is coarse against this window: rates over it would be diluted by up to 20%" in text
    assert "server generated 3200 tokens" in text and "tok/s | accepted" not in text
    # one scrape (at 70) while the turns ran: its value, not a median and p95 of one
    assert r["server"]["requests_running"] == {"n": 1, "median": None, "p95": None, "max": 2.0, "values": [2.0]}
    assert "server running 2 at the 1 scrape taken while these turns were in flight (too few" in text


def test_the_command_line_says_the_same_twice(fine):
    """`specproxy report --json` run twice, with more idle scrapes stored between the runs."""
    path, times = fine

    def run() -> dict:
        proc = subprocess.run([sys.executable, "-m", "specproxy.app.cli", "report", "--db", str(path), "--label",
                               "B", "--json", "--no-cache"], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["server"]

    first = run()
    later(path, times, T0 + 300.0)
    assert run() == first


def test_before_a_scrape_closes_the_span_it_says_so(tmp_path):
    """`report` run while the last turns are newer than the newest scrape (every 5 s by default): no
    counters yet, and why, instead of rates over whatever scrapes there are."""
    path = tmp_path / "open.db"
    times = turn_times(T0 + 60.5)
    w = Writer(path)
    write_turns(w, "B", times)
    write_scrapes(w, times, 5.0, T0 + 55.0, T0 + 60.0)  # the last one before the turns, none since
    w.close()
    r = report(path, label="B")
    assert "window" not in r["server"] and r["server"]["span"]["first_scrape"] == T0 + 60.0
    text = render_text(r)
    assert "Server's own counters (llamacpp; 1 scrape, 0 failed; 1 server instance)" in text
    assert "no counters over these turns yet: no two successful scrapes around them" in text
