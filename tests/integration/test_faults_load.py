"""Never break what it measures: load and a sick database. Past the concurrency cap a request is
refused at once; below it, 500 streams at once all succeed. A database that is locked or full costs
records (counted), never traffic, and writing resumes when it recovers.

Issue 6, items 12 and 13.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time

import aiohttp
import pytest

from faultkit import ScriptedUpstream, chunk, fill_filesystem, tiny_tmpfs, wait_until
from stream_shapes import delta_event
from specproxy.serve.measuring import MAX_BATCH

CHAT = "/v1/chat/completions"
BODY = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [delta_event(f" w{n}", b"\n") for n in range(5)] + [b"data: [DONE]\n\n"]
STREAM = b"".join(EVENTS)


def _held_upstream(box: dict):
    """Each request waits at the upstream until ``box["go"]`` is set, then streams ``EVENTS``."""

    async def respond(_req, writer, _i):
        box["arrived"] += 1
        async with box["cond"]:
            box["cond"].notify_all()
        await asyncio.wait_for(box["go"].wait(), 30)
        writer.write(SSE)
        for ev in EVENTS:
            writer.write(chunk(ev))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    return ScriptedUpstream(respond)


async def _post(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes, float]:
    t0 = time.monotonic()
    async with session.post(url + CHAT, data=BODY, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.read(), time.monotonic() - t0


# --- 12. concurrency --------------------------------------------------------------------------------------


def test_one_over_the_cap_gets_an_immediate_503(make_stack):
    box: dict = {"arrived": 0}
    upstream = _held_upstream(box)
    stack = make_stack(raw_script=upstream.serve, max_concurrent=8, scrape_interval_s=0)

    async def go():
        box["go"], box["cond"] = asyncio.Event(), asyncio.Condition()
        async with aiohttp.ClientSession() as s:
            held = [asyncio.ensure_future(_post(s, stack.url)) for _ in range(8)]
            async with box["cond"]:
                await asyncio.wait_for(box["cond"].wait_for(lambda: box["arrived"] == 8), 10)
            t0 = time.monotonic()
            async with s.post(stack.url + CHAT, data=BODY, timeout=aiohttp.ClientTimeout(total=30)) as r:
                over = r.status, await r.json(), time.monotonic() - t0
            box["go"].set()
            return over, await asyncio.gather(*held)

    (status, err, elapsed), held = stack.run(go())
    assert status == 503 and err["error"]["type"] == "busy"
    # at once, not after waiting for a slot: the held requests end only after this answer (box["go"]), so a
    # proxy that queued it would have waited for the client's 30 s give-up
    assert elapsed < 20
    assert all(st == 200 and body == STREAM for st, body, _ in held)
    assert len(upstream.requests) == 8  # the one over the cap never reached the upstream
    assert stack.service.counters.rejected_busy == 1


@pytest.mark.slow
def test_500_streams_at_once_with_zero_errors(make_stack, tiktoken_tok):
    """500 streams held open together at the upstream (it answers none until all 500 have arrived),
    then all streamed: every one succeeds, byte for byte, and is measured at concurrency 500."""
    n = 500
    box: dict = {"arrived": 0}
    upstream = _held_upstream(box)
    stack = make_stack(tiktoken_tok, raw_script=upstream.serve, scrape_interval_s=0)

    async def go():
        box["go"], box["cond"] = asyncio.Event(), asyncio.Condition()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as s:
            tasks = [asyncio.ensure_future(_post(s, stack.url)) for _ in range(n)]
            async with box["cond"]:
                await asyncio.wait_for(box["cond"].wait_for(lambda: box["arrived"] == n), 60)
            in_flight = stack.service.counters.in_flight
            box["go"].set()
            return in_flight, await asyncio.gather(*tasks, return_exceptions=True)

    in_flight, results = stack.run(go(), timeout=120)
    errors = [r for r in results if isinstance(r, BaseException) or r[0] != 200 or r[1] != STREAM]
    assert not errors, errors[:3]
    assert in_flight == n
    stack.settle()
    assert len(stack.records) == n and all(r.outcome == "ok" for r in stack.records)
    assert max(r.concurrency for r in stack.records) == n
    assert all(r.content_tokens == tiktoken_tok.count(" w0 w1 w2 w3 w4") for r in stack.records)


# --- 13. a locked or full database -------------------------------------------------------------------------


def _rows(db: str) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute("SELECT count(*) FROM turns").fetchone()[0]
    finally:
        conn.close()


# the writer's queue in the store-fault tests: room for a few measuring batches (records reach the writer
# up to MAX_BATCH at a time, so one client never overflows it), far less than a fault window piles up
SMALL_QUEUE = 8 * MAX_BATCH


async def _load(url: str, seconds: float, concurrency: int = 8) -> list[tuple[int, bytes, float]]:
    """Clients sending turns back to back for ``seconds``. (Before and after a fault one client is
    enough, and cannot outrun the writer's small queue even on a busy machine: no drop there is the
    fault's.)"""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    out: list = []

    async def client(s):
        for _ in range(10_000):
            if loop.time() > end:
                return
            out.append(await _post(s, url))

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(client(s) for _ in range(concurrency)))
    return out


def _load_until(stack, cond, *, at_most_s: float = 30.0) -> list[tuple[int, bytes, float]]:
    """Load in 1 s slices until ``cond()`` holds (bounded): how long a fault takes to cost a record
    depends on how fast this machine fills the writer's queue, not on a fixed window."""
    out: list = []
    deadline = time.monotonic() + at_most_s
    while True:
        out += stack.run(_load(stack.url, 1.0))
        if cond() or time.monotonic() > deadline:
            return out


def _assert_traffic_unaffected(results, *, reference: float) -> None:
    assert results and all(status == 200 and body.endswith(b"data: [DONE]\n\n") for status, body, _ in results)
    latencies = sorted(latency for _, _, latency in results)
    # A turn held up by the database would wait out the writer's busy timeout (2 s) or a failed write, and so
    # would every turn whose record met the fault: the median and the 95th percentile tell that apart from a
    # busy machine's scheduling, which can cost a single turn a second or more but not one turn in twenty.
    median, p95 = latencies[len(latencies) // 2], latencies[int(0.95 * (len(latencies) - 1))]
    assert median < max(1.0, 10 * reference) and p95 < max(1.5, 10 * reference), (
        f"turns took median {median:.3f} s, p95 {p95:.3f} s (unloaded: {reference:.3f} s)")


def test_database_locked_under_load_costs_records_not_traffic(make_stack):
    """Another process holds the database's write lock while clients keep streaming, until records have
    been dropped (at least a second, past the writer's busy timeout of 2 s in all; at most 30 s):
    no turn is slowed or failed, records beyond the queue are dropped and counted, and every queued
    record is written once the lock is released."""
    stack = make_stack(queue_size=SMALL_QUEUE, scrape_interval_s=0)
    writer = stack.service.writer
    warm = stack.run(_load(stack.url, 0.3, concurrency=1))
    wait_until(lambda: writer.written == len(warm), 10, what="the warm-up rows")
    reference = sorted(lat for _, _, lat in warm)[len(warm) // 2]
    locker = sqlite3.connect(stack.cfg.db, timeout=5, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        during = _load_until(stack, lambda: writer.dropped > 0 and writer.retries >= 1)
        assert writer.retries >= 1 and "locked" in (writer.last_error or "")
        assert writer.dropped > 0
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    _assert_traffic_unaffected(during, reference=reference)
    wait_until(lambda: not writer.pending, 10, what="the writer to drain its queue after the lock")
    dropped_in_lock = writer.dropped
    after = stack.run(_load(stack.url, 0.3, concurrency=1))
    total = len(warm) + len(during) + len(after)
    wait_until(lambda: writer.written + writer.dropped == total and not writer.pending, 20,
               what="the writer to catch up")
    assert _rows(stack.cfg.db) == writer.written == total - writer.dropped
    assert writer.dropped == dropped_in_lock <= len(during)  # only turns from the locked window were lost


@pytest.mark.parametrize("how", ["tmpfs", "max_page_count"])
def test_full_disk_costs_records_not_traffic(make_stack, tmp_path, how):
    """``tmpfs``: the database lives on a 16 MiB tmpfs that a filler file makes full (root only).
    ``max_page_count``: the writer's connection may not grow the database past its current size, which
    SQLite reports exactly like a full disk (SQLITE_FULL). Either way traffic is untouched, records are
    dropped and counted, and writing resumes once space is back."""
    with contextlib.ExitStack() as cleanup:
        if how == "tmpfs":
            mount = cleanup.enter_context(tiny_tmpfs(tmp_path / "tiny"))
            stack = make_stack(db=str(mount / "turns.db"), queue_size=SMALL_QUEUE, scrape_interval_s=0)
        else:
            stack = make_stack(queue_size=SMALL_QUEUE, scrape_interval_s=0)
        writer = stack.service.writer
        warm = stack.run(_load(stack.url, 0.3, concurrency=1))
        wait_until(lambda: writer.written == len(warm) and not writer.pending, 10, what="the warm-up rows")
        reference = sorted(lat for _, _, lat in warm)[len(warm) // 2]
        if how == "tmpfs":
            filler = fill_filesystem(mount)
        else:
            pages = writer._conn.execute("PRAGMA page_count").fetchone()[0]
            writer._conn.execute(f"PRAGMA max_page_count = {pages}")
        during = _load_until(stack, lambda: writer.dropped > 0)
        wait_until(lambda: writer.retries >= 1, 10, what="a refused write")
        assert writer.dropped > 0
        _assert_traffic_unaffected(during, reference=reference)
        if how == "tmpfs":
            filler.unlink()
        else:
            writer._conn.execute("PRAGMA max_page_count = 1073741823")
        wait_until(lambda: not writer.pending, 10, what="the writer to drain its queue")
        after = stack.run(_load(stack.url, 0.3, concurrency=1))
        total = len(warm) + len(during) + len(after)
        wait_until(lambda: writer.written + writer.dropped == total and not writer.pending, 20,
                   what="the writer to catch up")
        assert _rows(stack.cfg.db) == writer.written == total - writer.dropped
        integrity = sqlite3.connect(stack.cfg.db).execute("PRAGMA integrity_check").fetchone()[0]
        assert integrity == "ok"
        stack.close()  # before the tmpfs goes away
        stack.close = lambda: None


def test_writer_reports_why_a_write_failed(tmp_path):
    from specproxy.store.writer import Writer
    from specproxy.app.fake_upstream import make_record

    writer = Writer(tmp_path / "turns.db", queue_size=10)
    try:
        pages = writer._conn.execute("PRAGMA page_count").fetchone()[0]
        writer._conn.execute(f"PRAGMA max_page_count = {pages}")
        for _ in range(5):
            writer.put(make_record(prompt_text="x" * 20000))
        wait_until(lambda: writer.retries >= 1, 10, what="a refused write")
        assert "full" in (writer.last_error or ""), writer.last_error
    finally:
        writer._conn.execute("PRAGMA max_page_count = 1073741823")
        writer.close()
