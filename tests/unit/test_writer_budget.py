"""The writer's queue within the memory budget (issue 32): records' texts and captured bodies that wait
for a database refusing writes are charged, past the queue's share stored without them, and given back
when written or dropped."""

from __future__ import annotations

import logging
import sqlite3
import sys

from faultkit import wait_until
from specproxy.app.fake_upstream import make_record
from specproxy.store import writer as writer_mod
from specproxy.store.captures import capture_item
from specproxy.store.writer import Writer
from specproxy.wire import memory

MB = 1_000_000
BUDGET = 16 << 20
SHARE = BUDGET // 4  # the queue's (writer.QUEUE_SHARE): room for three 1 MB texts and not for more


def _full(w: Writer) -> None:
    pages = w._conn.execute("PRAGMA page_count").fetchone()[0]
    w._conn.execute(f"PRAGMA max_page_count = {pages}")  # a full disk: every write is refused


def _room(w: Writer) -> None:
    w._conn.execute("PRAGMA max_page_count = 1073741823")


def _limited():
    before, old = memory.used(), memory.limit()
    assert before == 0  # (this process charges nothing else: the share is of the budget, not of what is left)
    memory.set_limit(int(BUDGET * 0.75), BUDGET)
    return before, old


def test_queued_texts_and_captures_are_charged_and_shed_past_the_share(tmp_path):
    before, old = _limited()
    w = Writer(tmp_path / "t.db")
    try:
        _full(w)
        records = [make_record(prompt_text="x" * MB, response_text="y" * 1000) for _ in range(8)]
        for r in records:
            assert w.put(r)
            w.put(capture_item(r.id, r.t_wall, r.method, r.path, "", b"b" * MB))
        wait_until(lambda: w.retries >= 1, 10, what="a refused write")
        # charged: what waits, never past the queue's share of the budget
        assert 3 * MB < memory.used() - before <= SHARE
        assert memory.used() - before == w.held_total
        assert w.text_shed >= 4 and w.captures_shed >= 4, (w.text_shed, w.captures_shed)
        assert w.text_shed + w.captures_shed + 3 <= 16  # what fits was kept whole
        _room(w)
        wait_until(lambda: w.written == 8 and not w.pending, 20, what="the queue written")
        assert memory.used() == before and w.held_total == 0  # given back as written
    finally:
        _room(w)
        w.close()
        memory.set_limit(*old)
    conn = sqlite3.connect(tmp_path / "t.db")
    texts = dict(conn.execute("SELECT id, prompt_text FROM turns"))
    assert sum(t is None for t in texts.values()) == w.text_shed  # the record kept, its text not
    assert all(t == "x" * MB for t in texts.values() if t is not None)
    assert conn.execute("SELECT count(*) FROM captures").fetchone()[0] == 8 - w.captures_shed


def test_what_is_dropped_at_shutdown_is_given_back_and_said_as_turns_and_captures(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(writer_mod, "STOP_RETRY_S", 0.2)
    before, old = _limited()
    w = Writer(tmp_path / "t.db")
    try:
        _full(w)
        r = make_record(prompt_text="x" * MB)
        w.put(r)
        w.put(capture_item(r.id, r.t_wall, r.method, r.path, "", b"b" * MB))
        w.put(make_record())
        assert memory.used() - before == sys.getsizeof(r.prompt_text) + MB
        with caplog.at_level(logging.ERROR, "specproxy"):
            w.close()
        assert memory.used() == before and w.dropped == 3
        lost = [m for m in caplog.messages if "before shutdown" in m]
        assert len(lost) == 1 and "3 records" in lost[0] and "2 turns, 1 captured body, 0 scrapes" in lost[0], lost
    finally:
        w.close()  # (closed already, unless an assertion above failed first)
        memory.set_limit(*old)
