"""Never break what it measures: the process. ``specproxy serve`` runs as a real subprocess here.

SIGKILL under load loses no record whose commit completed and leaves a database that passes
``integrity_check``; SIGTERM stops accepting, lets in-flight streams finish and drains the queue; and
a secret sent in any of the usual places, or echoed back by the upstream, reaches neither the database
(its WAL and shared-memory files included) nor the logs.

Issue 6, items 14 and 15.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sqlite3
import time
import uuid
from pathlib import Path

import aiohttp
import orjson
import pytest

from faultkit import ScriptedUpstream, blackhole_listener, chunk, db_rows, parse_response, wait_until
from serveproc import LoopThread, ServeProcess
from stream_shapes import delta_event
from specproxy.app.fake_upstream import FakeUpstream, Script

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


def _integrity(db: Path) -> str:
    conn = sqlite3.connect(db, timeout=10)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


async def _stream(session: aiohttp.ClientSession, url: str, content: str = "hi") -> tuple[int, bytes]:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}]}
    async with session.post(url + CHAT, json=body) as r:
        return r.status, await r.read()


# --- 14. SIGKILL and SIGTERM ---------------------------------------------------------------------------


def test_sigkill_under_load_loses_no_committed_record(tmp_path, loop_thread):
    """Three rounds: load, a reader collecting the ids it sees committed, SIGKILL mid-load. After each
    kill a fresh ``serve`` recovers the database; it passes ``integrity_check`` and holds every id the
    reader had seen. (SQLite's WAL with synchronous=NORMAL: durable against a process crash, which is
    what SIGKILL is; an OS crash or power loss may lose the last commits, and this test says nothing
    about that.)"""
    upstream = FakeUpstream(Script(pieces=["tok"] * 8, interval_s=0.002))
    loop_thread.run(upstream.start())
    db = tmp_path / "turns.db"
    seen: set[str] = set()
    for round_ in range(3):
        proc = ServeProcess(tmp_path, upstream.url, db, name=f"kill{round_}")
        running = {"on": True, "ok": 0, "failed": 0}

        async def load():
            async with aiohttp.ClientSession() as s:
                async def client():
                    for _ in range(100_000):
                        if not running["on"]:
                            return
                        try:
                            status, _ = await _stream(s, proc.url)
                            running["ok" if status == 200 else "failed"] += 1
                        except (aiohttp.ClientError, OSError):
                            running["failed"] += 1  # the proxy was killed under this request
                            await asyncio.sleep(0.01)
                await asyncio.gather(*(client() for _ in range(16)))

        fut = asyncio.run_coroutine_threadsafe(load(), loop_thread.loop)
        before = len(seen)

        def enough():
            seen.update(r[0] for r in db_rows(db))
            return len(seen) >= before + 300

        wait_until(enough, 60, 0.02, "300 new committed rows")
        proc.kill()  # SIGKILL, with clients mid-stream and the writer busy
        seen.update(r[0] for r in db_rows(db))  # what is visible now was committed before the kill
        running["on"] = False
        fut.result(60)
        assert running["ok"] >= 300
        restarted = ServeProcess(tmp_path, upstream.url, db, name=f"restart{round_}")
        assert restarted.stop() == 0
        assert _integrity(db) == "ok"
        ids = {r[0] for r in db_rows(db)}
        assert seen <= ids, f"round {round_}: {len(seen - ids)} committed records are missing"
    assert len(seen) >= 900


def test_sigterm_drains_in_flight_streams_and_the_queue(tmp_path, loop_thread):
    upstream = FakeUpstream(Script(pieces=["tok"] * 30, interval_s=0.05))  # ~1.5 s streams
    loop_thread.run(upstream.start())
    db = tmp_path / "turns.db"
    proc = ServeProcess(tmp_path, upstream.url, db)
    k = 12
    started = {"n": 0}

    async def one(session):
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(proc.url + CHAT, json=body) as r:
            data = await r.content.readany()
            started["n"] += 1
            async for more in r.content.iter_any():
                data += more
            return r.status, data

    async def streams():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(one(s) for _ in range(k)))

    fut = asyncio.run_coroutine_threadsafe(streams(), loop_thread.loop)
    wait_until(lambda: started["n"] == k, 20, 0.005, "every stream to start")
    proc.signal(signal.SIGTERM)
    t_term = time.monotonic()

    def refused():
        with socket.socket() as s:
            s.settimeout(1)
            try:
                s.connect(("127.0.0.1", proc.port))
            except ConnectionRefusedError:
                return True
            return False

    wait_until(refused, 5, 0.01, "the proxy to stop accepting")
    results = fut.result(30)
    assert proc.wait(30) == 0
    truth = [bytes(s.body) for s in upstream.sent]
    assert len(truth) == k
    for status, data in results:
        assert status == 200 and data.endswith(b"data: [DONE]\n\n") and data in truth
    assert time.monotonic() - t_term < 20
    rows = db_rows(db, "SELECT outcome, saw_done, chunks FROM turns")
    assert rows == [("ok", 1, 30)] * k  # the queue was drained before the process exited
    assert "Traceback" not in proc.stderr()


# --- 15. secrets -------------------------------------------------------------------------------------------


def _files(db: Path) -> list[Path]:
    return [p for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists()]


def _occurrences(canary: bytes, *blobs: bytes) -> int:
    return sum(b.count(canary) for b in blobs)


def test_secrets_reach_neither_the_database_nor_the_logs(tmp_path, loop_thread):
    canary = f"sk-canary-{uuid.uuid4().hex}"
    cb = canary.encode()

    async def respond(req, writer, _i):
        key = (req.header("Authorization") or "").removeprefix("Bearer ")
        if req.header("X-Fail") == "auth":  # the upstream echoes the key it refused, as OpenAI's API does
            body = orjson.dumps({"error": {"message": f"Incorrect API key provided: {key}", "code": "invalid_api_key"}})
            writer.write(f"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
                         f"WWW-Authenticate: Bearer error_description=\"{key}\"\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        elif req.header("X-Fail") == "midstream":  # repeats the secret, then dies
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + chunk(delta_event(f"your key is {key}", b"\n")))
            await writer.drain()
            writer.transport.abort()
            return False
        else:  # the model repeats the secret, and an error event carries it too
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + chunk(delta_event(f"your key is {key}", b"\n"))
                         + chunk(b'data: {"error": {"message": "' + key.encode() + b'"}}\n\n')
                         + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        return True

    upstream = ScriptedUpstream(respond)
    loop_thread.run(upstream.start())
    lst, fillers = blackhole_listener()
    headers = {"Authorization": f"Bearer {canary}", "api-key": canary, "x-api-key": canary}
    prompt = f"please remember {canary}"

    async def traffic(url: str) -> list[int]:
        statuses = []
        async with aiohttp.ClientSession() as s:
            for fail in ("", "auth", "midstream"):
                body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": prompt}]}
                try:
                    async with s.post(f"{url}{CHAT}?api_key={canary}", json=body,
                                      headers={**headers, "X-Fail": fail}) as r:
                        await r.read()
                        statuses.append(r.status)
                except aiohttp.ClientPayloadError:
                    statuses.append(-1)
        # malformed requests carrying the secret: aiohttp logs the offending bytes of such requests
        for raw in (f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {canary}\x00\r\n\r\n",
                    f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {canary}{'a' * 20000}\r\n\r\n",
                    f"POST {CHAT}?key={canary} HTTP/1.1\r\nHost: p\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
            writer.write(raw.encode())
            data = await asyncio.wait_for(reader.read(65536), 5)
            statuses.append(parse_response(data)[0].status)
            writer.close()
        return statuses

    try:
        dbs = {name: tmp_path / f"{name}.db" for name in ("plain", "timeout", "stored")}
        plain = ServeProcess(tmp_path, upstream.url, dbs["plain"], name="plain")
        timeout = ServeProcess(tmp_path, f"http://127.0.0.1:{lst.getsockname()[1]}", dbs["timeout"],
                               env={"SPECPROXY_CONNECT_TIMEOUT_S": "0.3"}, name="timeout")
        stored = ServeProcess(tmp_path, upstream.url, dbs["stored"], "--store-text", name="stored")
        assert loop_thread.run(traffic(plain.url)) == [200, 401, -1, 400, 400, 400]
        assert loop_thread.run(traffic(timeout.url))[:3] == [504, 504, 504]
        loop_thread.run(traffic(stored.url))
        for proc, db in ((plain, dbs["plain"]), (timeout, dbs["timeout"]), (stored, dbs["stored"])):
            wait_until(lambda db=db: len(db_rows(db)) == 3, 20, 0.02, "three rows")
        # while running: the WAL and shared-memory files hold the fresh rows
        running_plain = [p.read_bytes() for p in _files(dbs["plain"]) + _files(dbs["timeout"])]
        running_stored = [p.read_bytes() for p in _files(dbs["stored"])]
        for proc in (plain, timeout, stored):
            assert proc.stop() == 0
        stopped_plain = [p.read_bytes() for p in _files(dbs["plain"]) + _files(dbs["timeout"])]
        logs = [plain.stderr().encode(), timeout.stderr().encode(), stored.stderr().encode()]
    finally:
        for s in fillers:
            s.close()
        lst.close()
    assert len(upstream.requests) == 6 and all(cb in r.head for r in upstream.requests)  # it was sent
    assert _occurrences(cb, *running_plain, *stopped_plain) == 0
    assert _occurrences(cb, *logs) == 0, "a secret reached the logs"
    # the control: with --store-text the prompt (and the model's repetition of it) is stored, and found
    assert _occurrences(cb, *running_stored) > 0
    stored_rows = db_rows(dbs["stored"], "SELECT prompt_text, response_text FROM turns")
    assert any(canary in (p or "") for p, _ in stored_rows)
    plain_rows = db_rows(dbs["plain"], "SELECT prompt_text, response_text, error, path FROM turns")
    assert all(p is None and r is None for p, r, _, _ in plain_rows)
    assert all(path == CHAT for *_, path in plain_rows)  # the query string is not stored


def test_serve_freezes_what_start_up_made(tmp_path, loop_thread):
    """``serve`` freezes start-up's objects (``service.settle_heap``) before it says it is ready: a full
    collection under load then walks only what was made since, not the imports' ~54,000 objects (a
    20-23 ms stall of the event loop about once a minute at 256 streams, before; 2.7 ms after). Its state
    line says how many are frozen; without the call there are none."""
    upstream = FakeUpstream(Script(pieces=["tok"]))
    loop_thread.run(upstream.start())
    proc = ServeProcess(tmp_path, upstream.url, tmp_path / "turns.db")
    try:
        state = proc.state()
    finally:
        assert proc.stop() == 0
    assert state["gc_frozen"] > 10_000, state
    # and, idle, what is pending or failed in measuring, through the proxy's public counters
    assert state["pending_measure"] == state["measure_failures"] == 0, state
    assert state["upstream_idle"] <= 1, state  # at most the start-up check's connection, kept alive


def _open_files_limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return tuple(-1 if v == "unlimited" else int(v) for v in (soft, hard))  # RLIM_INFINITY is -1
    raise AssertionError("no open-files line in /proc/<pid>/limits")


def test_serve_raises_its_open_files_limit_to_the_hard_one(tmp_path, loop_thread):
    """A thousand slow clients would pass a soft limit of 1024 open files: ``serve``, started with that
    soft limit, raises it to the hard one (each connection is a descriptor; the hard limit is the real bound)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit of open files is {hard}: nothing to raise to")
    upstream = FakeUpstream(Script(pieces=["tok"]))
    loop_thread.run(upstream.start())
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what serve inherits, as from a default shell
    try:
        proc = ServeProcess(tmp_path, upstream.url, tmp_path / "turns.db")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        got_soft, got_hard = _open_files_limits(proc.proc.pid)
    finally:
        assert proc.stop() == 0
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20  # Linux refuses an unlimited soft one
    assert (got_soft, got_hard) == (want, hard)
    assert "open files" not in proc.stderr()  # no warning: the limit is ample


def test_settle_heap_collects_start_up_garbage_before_freezing():
    """What start-up left as cyclic garbage is freed, not frozen for the life of the process."""
    import gc
    import weakref

    from specproxy.serve.service import settle_heap

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector can free it
    gone = weakref.ref(a)
    del a, b
    try:
        frozen = settle_heap()
        assert gone() is None, "a garbage cycle was frozen instead of collected"
        # other threads of this worker (a previous test's) may free frozen objects meanwhile, never freeze more
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()  # this pytest process goes on making and dropping objects
