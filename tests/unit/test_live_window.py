"""The live page's window: the last 15 minutes, but at most the newest ``max_turns`` of them, so that a
picture's cost stays bounded under heavy traffic; the window drawn is said on the page and is the one
``report --since`` reads."""

from __future__ import annotations

import re
import time

from specproxy.app.fake_upstream import make_record
from specproxy.store.writer import Writer
from specproxy.view.live import LivePages


def _fill(db: str, starts: list[float]) -> None:
    w = Writer(db)
    for t in starts:
        w.put(make_record(t_wall=t, seed=int(t * 10) % 1000))
    w.close()


def _drawn(html: str) -> tuple[int, float | None]:
    turns = len(re.findall(r'<g class="turn ', html))
    since = re.search(r'data-window-since="([^"]+)"', html)
    return turns, float(since.group(1)) if since else None


def test_the_page_draws_the_newest_turns_of_its_window_and_says_from_when(tmp_path):
    db = str(tmp_path / "turns.db")
    now = time.time()
    starts = [now - 3600.0, now - 1000.0] + [now - 300.0 + i for i in range(30)]  # two before the 15 minutes
    _fill(db, starts)
    html = LivePages(db, max_turns=12).fragment()
    turns = int(re.search(r'data-figure="turns" data-value="(\d+)"', html).group(1))
    assert turns == 12 and _drawn(html) == (12, starts[-12])  # the 12 newest; since the 12th newest started
    html = LivePages(db, max_turns=1000).fragment()
    turns = int(re.search(r'data-figure="turns" data-value="(\d+)"', html).group(1))
    since = _drawn(html)[1]
    assert turns == 30 and starts[1] < now - 15 * 60 <= since < starts[2]  # under the cap: the 15 minutes
