"""The report's prompt make-up: a share is what its label says, and the shares add up, in the text and
in --json. They were each part's median over the median prompt: medians of parts need not add up to the
median prompt, and a report's shares added up to about 70%."""

from __future__ import annotations

import re
import sqlite3

import pytest

from specproxy.store.sqlite_source import SQLiteSource
from specproxy.analyze.report_data import PROMPT_PARTS, build_report
from specproxy.analyze.report import render_text
from specproxy.app.fake_upstream import make_record
from specproxy.store.dataset import load_turns
from specproxy.store.writer import Writer

# (system, tools, history, new) per turn: an agent whose history grows and whose tools come and go, so the
# parts' medians (10, 0, 100, 7) are far from adding up to the median prompt (380)
PARTS = [(10, 0, 0, 40), (10, 600, 100, 5), (10, 0, 200, 7), (10, 600, 300, 3), (10, 0, 400, 9),
         (12, 600, 50, 8), (10, 0, 60, 6)]


@pytest.fixture
def report(tmp_path) -> dict:
    path = tmp_path / "p.db"
    w = Writer(path)
    for i, (system, tools, history, new) in enumerate(PARTS):
        w.put(make_record(t_wall=1000.0 + 10 * i, prompt_tokens=system + tools + history + new,
                          prompt_system_tokens=system, prompt_tools_tokens=tools, prompt_history_tokens=history,
                          prompt_new_tokens=new))
    w.close()
    conn = sqlite3.connect(path)
    try:
        return build_report(SQLiteSource(conn).load(server=True, context=True), source="t")
    finally:
        conn.close()


def test_the_prompt_shares_are_shares_of_all_prompt_tokens_and_add_up(report):
    p = report["prompt"]
    total = sum(sum(parts) for parts in PARTS)
    for k, part in enumerate(PROMPT_PARTS):
        assert p[part]["tokens"] == sum(parts[k] for parts in PARTS)
        assert p[part]["share_of_prompt_tokens"] == pytest.approx(p[part]["tokens"] / total)
    assert sum(p[part]["share_of_prompt_tokens"] for part in PROMPT_PARTS) == pytest.approx(1.0)
    assert p["split_turns"] == len(PARTS) and p["split_tokens"] == total
    text = render_text(report)
    head = text.index("Prompt make-up")
    assert "share of all prompt tokens" in text[head:head + 120]
    percents = [int(m) for m in re.findall(r"^  (?:system|tools|history|new message) +\d+ +(\d+)%$",
                                           text[head:], re.M)]
    assert len(percents) == 4 and sum(percents) == 100
