"""Stopping ``specproxy serve`` (and ``demo --stay``), as a real subprocess sent real signals.

The first SIGINT/SIGTERM says, in one line, how many streams it drains and for how long; a second one cuts
them at once; a turn cut by the proxy (the drain limit passed, or that second signal) is recorded with
its own outcome, ``shutdown``, never as the client's abort, and counted as such by the report and by
``/_specproxy/metrics``. ``demo --stay`` prints its report on SIGTERM as on Ctrl-C.

Every wait is for an event (a line in the log, the process's exit, a stream's first bytes), bounded; the
drain limit is set far beyond any wait of the tests where a second signal must cut, so a pass cannot come
from the limit. Issue 31, "Shutdown and outcomes".
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys

import aiohttp
import orjson
import pytest

from faultkit import await_until, db_rows, wait_until
from serveproc import ROOT, LoopThread, ServeProcess
from specproxy.app.fake_upstream import FakeUpstream, Script

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
ENDLESS = Script(pieces=["tok"] * 200_000, interval_s=0.01)  # a stream of over half an hour


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def endless(loop_thread):
    upstream = FakeUpstream(ENDLESS)
    loop_thread.run(upstream.start())
    yield upstream
    loop_thread.run(upstream.close())


class Streams:
    """``n`` streamed chat requests through the proxy, each on its own connection, held open until the
    proxy ends them; ``started`` counts those whose first bytes came back."""

    def __init__(self, loop_thread: LoopThread, url: str, n: int) -> None:
        self.started = 0
        self.ended: list[str] = []
        self._stop: list[asyncio.Event] = []
        self._loop = loop_thread.loop
        self.future = asyncio.run_coroutine_threadsafe(self._all(url, n), self._loop)

    async def _one(self, url: str, leave: asyncio.Event) -> None:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as s:
            try:
                async with s.post(url + CHAT, json=body) as r:
                    await r.content.readany()
                    self.started += 1
                    reading = asyncio.ensure_future(r.content.read())
                    left = asyncio.ensure_future(leave.wait())
                    await asyncio.wait({reading, left}, return_when=asyncio.FIRST_COMPLETED)
                    if left.done():  # this client hangs up mid-stream
                        reading.cancel()
                        self.ended.append("left")
                        return
                    left.cancel()
                    await reading
                    self.ended.append("whole")
            except (aiohttp.ClientError, OSError):
                self.ended.append("cut")

    async def _all(self, url: str, n: int) -> None:
        self._stop = [asyncio.Event() for _ in range(n)]
        await asyncio.gather(*(self._one(url, e) for e in self._stop))

    def leave(self, i: int) -> None:
        self._loop.call_soon_threadsafe(self._stop[i].set)


def _lines(proc: ServeProcess, pattern: str) -> list[str]:
    return [ln for ln in proc.stderr().splitlines() if re.search(pattern, ln)]


@pytest.mark.parametrize("front", ["--lane", "--no-lane"])
def test_a_first_ctrl_c_says_what_it_drains_and_a_second_stops_at_once(tmp_path, loop_thread, endless, front):
    db = tmp_path / "turns.db"
    # the drain limit far beyond every wait below: only the second Ctrl-C can end the streams
    proc = ServeProcess(tmp_path, endless.url, db, "--drain-timeout", "3600", front)
    streams = Streams(loop_thread, proc.url, 3)
    wait_until(lambda: streams.started == 3, 30, 0.01, "three streams to start")
    proc.signal(signal.SIGINT)
    wait_until(lambda: _lines(proc, "stopping: "), 30, 0.01, "the line of the first Ctrl-C")
    (line,) = _lines(proc, "stopping: ")
    assert line.endswith("stopping: draining 3 streams, up to 3600 s; Ctrl-C again to stop now"), line
    assert proc.proc.poll() is None  # draining, not stopped
    streams.leave(0)  # a client that leaves while the proxy drains: that one is the client's abort
    wait_until(lambda: proc.state()["in_flight"] == 2, 30, 0.05, "the leaving client's exchange to end")
    proc.signal(signal.SIGINT)
    assert proc.wait(60) == 0
    streams.future.result(30)
    assert sorted(streams.ended) == ["cut", "cut", "left"]
    assert _lines(proc, "stopping now: cutting 2 streams")
    rows = sorted(db_rows(db, "SELECT outcome, error, status FROM turns"))
    assert [r[0] for r in rows] == ["client_abort", "shutdown", "shutdown"], rows
    assert all(r[1] == "cut by specproxy's shutdown: a second stop signal" and r[2] == 200 for r in rows[1:]), rows
    assert "Traceback" not in proc.stderr()


@pytest.mark.parametrize("front", ["--lane", "--no-lane"])
def test_the_drain_limit_cuts_what_is_left_as_shutdown(tmp_path, loop_thread, endless, front):
    """SIGTERM with streams that will not end: after ``--drain-timeout`` they are cut, stored with the outcome
    ``shutdown``, and the report counts them as such; whichever front read the requests."""
    db = tmp_path / "turns.db"
    proc = ServeProcess(tmp_path, endless.url, db, "--drain-timeout", "0.5", front)
    streams = Streams(loop_thread, proc.url, 2)
    wait_until(lambda: streams.started == 2, 30, 0.01, "two streams to start")
    proc.signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    streams.future.result(30)
    assert streams.ended == ["cut", "cut"]
    assert _lines(proc, r"stopping: draining 2 streams, up to 0\.5 s")
    assert db_rows(db, "SELECT outcome, error FROM turns") == [
        ("shutdown", "cut by specproxy's shutdown: drain_timeout_s (0.5 s) passed")] * 2
    out = subprocess.run([sys.executable, "-m", "specproxy.app.cli", "report", "--db", str(db), "--json"],
                         capture_output=True, cwd=ROOT, timeout=120, check=True).stdout
    assert orjson.loads(out)["outcomes"] == {"shutdown": 2}


@pytest.mark.usefixtures("each_front")
def test_a_shutdown_turn_is_counted_in_the_metrics(make_stack):
    """In process, to read ``/_specproxy/metrics``'s counter after the cut: the turns cut by the drain
    limit count under ``outcome="shutdown"``."""
    stack = make_stack(None, drain_timeout_s=0.2, scrape_interval_s=0)
    stack.upstream.script = ENDLESS
    started = asyncio.Event()

    async def stream() -> None:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as s:
            try:
                async with s.post(stack.url + CHAT, json=body) as r:
                    await r.content.readany()
                    started.set()
                    await r.content.read()
            except aiohttp.ClientError:
                pass

    async def go() -> None:
        task = asyncio.ensure_future(stream())
        await asyncio.wait_for(started.wait(), 30)
        await stack.service.stop()
        await asyncio.wait_for(task, 30)
        await await_until(lambda: stack.records, 10, what="the cut turn's record")

    stack.run(go())
    assert [r.outcome for r in stack.records] == ["shutdown"]
    text = stack.service.metrics.exposition().decode()
    assert re.search(r'^specproxy_turns_total\{[^}]*outcome="shutdown"[^}]*\} 1\.0$', text, re.M), text


def test_demo_stay_prints_its_report_on_sigterm(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "specproxy.app.cli", "demo", "--stay", "--turns", "1",
                             "--db", str(tmp_path / "demo.db")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # until the demo says its traffic is done (or it exits: the loop ends)
            if "the traffic is done" in line:
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert "specproxy report:" in out and "The turns are in" in out, out
