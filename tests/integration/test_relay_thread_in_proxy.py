"""The relay thread inside a running proxy: what only the whole exchange shows.

A client hanging up right after the body's end leaves the turn as the thread saw it end; the thread's
reads become Python objects in the measuring thread, not on the event loop; and the thread asks the
kernel for a short scheduler slice (Config ``relay_slice_us``) and, where the process may, a lower nice
value than Python's threads (Config ``relay_nice``). The thread on its own, on real sockets, is tested
in test_relay_thread.py.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from specproxy.wire import relay_thread
from specproxy.wire import exchange

pytestmark = pytest.mark.skipif(relay_thread._relayc is None, reason="specproxy.wire._relayc is not built")


def body_after_head_stack(make_stack, tok, body: bytes):
    """A proxy in front of an upstream that sends a stream's head, then ``body`` (chunked) only once the
    client has the head: by then the loop has handed the body to the relay thread, and the thread reads
    every byte of it (bytes that came with the head are relayed as the turn begins, on the loop's thread:
    test_a_body_that_came_with_its_head_goes_to_the_thread_with_it). Returns the stack and ``fetch(hold)``, a coroutine for the
    stack's loop: one chat request, the head, then the body to its end; returns the client's writer
    (``hold()`` runs just before the request is sent)."""
    import asyncio

    from faultkit import ScriptedUpstream, post_head

    box: dict = {}

    async def respond(_req, writer, _i):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(box["head_seen"].wait(), 5)
        writer.write(body)
        await writer.drain()
        return True

    stack = make_stack(tok, raw_script=ScriptedUpstream(respond).serve, scrape_interval_s=0)

    async def fetch(hold=lambda: None):
        box["head_seen"] = asyncio.Event()
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        hold()
        writer.write(post_head("/v1/chat/completions", b'{"model":"m","stream":true,"messages":[]}'))
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        box["head_seen"].set()
        got = b""
        while not got.endswith(body):
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data, "the proxy closed before the end of the body"
            got += data
        return writer

    return stack, fetch


def sse_body(texts: list[str]) -> bytes:
    from faultkit import chunk

    events = [b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % t.encode() for t in texts]
    return b"".join(chunk(e) for e in events) + b"0\r\n\r\n"


def test_a_client_hanging_up_right_after_the_end_leaves_an_ok_turn(make_stack, tiktoken_tok, monkeypatch):
    """The thread sends a body's last bytes; the client reads them and hangs up before the loop has heard
    from the thread. The turn ended as the thread saw it (ok: no [DONE] in this stream to say so), not as
    a client abort. To make that order certain, the loop's collecting is held back until the handler has
    been told the client left (at most 5 s)."""
    from faultkit import db_records

    abandoned = threading.Event()
    real_abandon = exchange.Exchange.abandon

    def abandon(self, *args):
        abandoned.set()
        return real_abandon(self, *args)

    real_collect = relay_thread.TurnSink._collect
    hold_until = [0.0]

    def late_collect(self):
        if not abandoned.is_set() and time.monotonic() < hold_until[0]:
            return  # the eventfd stays readable: the loop calls again, after its other events
        real_collect(self)

    monkeypatch.setattr(exchange.Exchange, "abandon", abandon)
    monkeypatch.setattr(relay_thread.TurnSink, "_collect", late_collect)
    stack, fetch = body_after_head_stack(make_stack, tiktoken_tok, sse_body(["Hel", "lo"]))

    async def go():
        writer = await fetch(hold=lambda: hold_until.__setitem__(0, time.monotonic() + 5))
        writer.transport.abort()

    stack.run(go())
    (rec,) = db_records(stack, 1)
    assert abandoned.is_set(), "the handler was not told the client left: the test did not test the race"
    assert rec["outcome"] == "ok" and rec["saw_done"] == 0 and rec["chunks"] == 2
    assert relay_thread.last_read() >= rec["t_first_token"]  # the thread read the body



def test_the_reads_become_python_objects_in_the_measuring_thread(make_stack, tiktoken_tok, monkeypatch):
    """The loop hands the builder the thread's turn as it is; the bytes and floats of each read are made
    when the turn is measured, off the loop."""
    from faultkit import db_records

    from specproxy.measure.turn_recorder import TurnRecorder

    takers: list[tuple[int, int]] = []
    real_take = TurnRecorder.take_relayed

    def take_relayed(self):
        had = self.relayed is not None
        real_take(self)
        if had:
            takers.append((threading.get_ident(), len(self.reads)))

    monkeypatch.setattr(TurnRecorder, "take_relayed", take_relayed)
    stack, fetch = body_after_head_stack(make_stack, tiktoken_tok, sse_body([f"a{i}" for i in range(20)]))

    async def go():
        (await fetch()).close()
        return threading.get_ident()

    loop_thread = stack.run(go())
    (rec,) = db_records(stack, 1)
    assert rec["outcome"] == "ok" and rec["chunks"] == 20
    assert takers and all(ident != loop_thread and n > 0 for ident, n in takers)


@pytest.mark.parametrize("whole", [True, False], ids=["whole body with the head", "first chunks with the head"])
def test_a_body_that_came_with_its_head_goes_to_the_thread_with_it(make_stack, tiktoken_tok, monkeypatch, whole):
    """The upstream writes the head and the body's first chunks (or all of it) at once: the loop reads them
    with the head, and the exchange hands them to the thread's turn with the body; the loop's relay is never
    made, and the record is the same as when the thread read every byte."""
    import asyncio

    from faultkit import ScriptedUpstream, db_records, post_head

    from specproxy.wire import relay

    made: list[str] = []  # the relays made, by kind
    real_init, real_start = relay.PythonRelay.__init__, relay_thread.TurnSink.start

    def counted_init(self, *args, **kwargs):
        made.append("loop")
        real_init(self, *args, **kwargs)

    def counted_start(self, *args, **kwargs):
        turn = real_start(self, *args, **kwargs)
        made.append("thread")
        return turn

    monkeypatch.setattr(relay.PythonRelay, "__init__", counted_init)
    monkeypatch.setattr(relay_thread.TurnSink, "start", counted_start)
    body = sse_body([f"w{i}" for i in range(6)])
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    cut = len(body) if whole else body.index(b"w3") - 40  # mid-chunk: the thread takes the framing from there

    async def respond(_req, writer, _i):
        writer.write(head + body[:cut])
        await writer.drain()
        if not whole:
            await asyncio.sleep(0.05)  # a scripted server's next decoding step
            writer.write(body[cut:])
            await writer.drain()
        return True

    stack = make_stack(tiktoken_tok, raw_script=ScriptedUpstream(respond).serve, scrape_interval_s=0)

    async def go():
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.service.port)
        writer.write(post_head("/v1/chat/completions", b'{"model":"m","stream":true,"messages":[]}'))
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        got = b""
        while not got.endswith(body):
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data, "the proxy closed before the end of the body"
            got += data
        writer.close()
        return got

    assert stack.run(go()) == body
    (rec,) = db_records(stack, 1)
    assert rec["outcome"] == "ok" and rec["chunks"] == 6 and rec["completion_tokens"] > 0
    assert made == ["thread"]


# --- the thread's scheduler slice -------------------------------------------------------------------------


def _kernel_has_task_slices() -> bool:
    """EEVDF's per-task slice (``sched_attr.sched_runtime`` for SCHED_OTHER) came with Linux 6.12."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 12) and os.path.exists("/proc/self/sched")


def _relay_slice_ns(pid: int) -> int | None:
    """``se.slice`` of the process's relay thread, once it runs (``/proc/PID/task/TID/sched``)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() != "specproxy-relay":
                    continue
            with open(f"/proc/{pid}/task/{tid}/sched") as f:
                for line in f:
                    if line.startswith("se.slice"):
                        return int(line.split(":")[1])
        except OSError:
            continue
    return None


def _nice_of(pid: int, name: str | None = None) -> int | None:
    """The nice value of the process's thread named ``name`` (its main thread, the event loop's, for None):
    field 19 of ``/proc/PID/task/TID/stat``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if name is None and int(tid) != pid:
                continue
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if name is not None and f.read().strip() != name:
                    continue
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[16])
        except OSError:
            continue
    return None


def _nices_and_state(proc) -> tuple[int | None, int | None, dict]:
    """The relay thread's nice value, the event loop's (the main thread's) and serve's state line."""
    return _nice_of(proc.proc.pid, "specproxy-relay"), _nice_of(proc.proc.pid), proc.state()


def _may_lower_nice() -> bool:
    """Whether a process started as this one is may lower a nice value to -10: CAP_SYS_NICE (bit 23 of
    its effective capabilities; root has it) or an RLIMIT_NICE of at least 30 (20 - 30 = -10)."""
    import resource

    with open("/proc/self/status") as f:
        caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return bool(caps >> 23 & 1) or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 30


def _after_one_streamed_turn(tmp_path, read, *args, env=None, wrap=()):
    """Start serve (``args``, ``env``, run by ``wrap``) before a scripted upstream whose body comes after its
    head, so that the relay thread carries it (bytes that come with the head are relayed by the event loop,
    and a body that came whole with it would never start the thread); send one streamed chat turn; return
    ``read(proc)`` once the relay thread runs, before serve stops."""
    import json
    import urllib.request

    from faultkit import wait_until
    from serveproc import LoopThread, ServeProcess
    from specproxy.app.fake_upstream import FakeUpstream, Script

    loop = LoopThread()
    upstream = FakeUpstream(Script(pieces=["a", "b", "c"], ttft_s=0.05, interval_s=0.01))
    loop.run(upstream.start())
    proc = ServeProcess(tmp_path, upstream.url, tmp_path / "turns.db", *args, env=env, wrap=wrap)
    try:
        body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        req = urllib.request.Request(proc.url + "/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert b"[DONE]" in resp.read()  # a streamed body: the relay thread carried it
        # the thread sets its nice value and slice before its first event: it relayed the body, so both are set
        wait_until(lambda: _nice_of(proc.proc.pid, "specproxy-relay") is not None, 10, 0.02, "the relay thread")
        return read(proc)
    finally:
        assert proc.stop() == 0
        loop.run(upstream.close())
        loop.close()


@pytest.mark.skipif(not _kernel_has_task_slices(), reason="this kernel has no per-task scheduler slice")
@pytest.mark.parametrize("setting", [None, "0", "250"])
def test_the_relay_thread_asks_for_a_short_scheduler_slice(tmp_path, setting):
    """Its reads must preempt Python at once, not after a Python thread's slice: 0.1 ms by default
    (Config ``relay_slice_us``, here from ``SPECPROXY_RELAY_SLICE_US``; 0 leaves the kernel's default)."""
    env = {} if setting is None else {"SPECPROXY_RELAY_SLICE_US": setting}
    got = _after_one_streamed_turn(tmp_path, lambda proc: _relay_slice_ns(proc.proc.pid), env=env)
    if setting == "0":
        assert got != 100_000 and got != 250_000  # the kernel's default, whatever it is here
    else:
        assert got == (100_000 if setting is None else 250_000)


# --- the thread's weight against Python ----------------------------------------------------------------


@pytest.mark.parametrize("args, asked", [((), -10), (("--relay-nice", "-5"), -5), (("--relay-nice", "0"), 0)])
def test_the_relay_thread_lowers_its_nice_value_where_the_process_may(tmp_path, args, asked):
    """When a decode step's tokens and the turns it ended come at once, the relay must win its core from
    Python's threads: nice -10 by default (Config ``relay_nice``), where the process may lower it; Python's
    threads keep the process's value (Linux's nice is per thread); the state line says the relay's."""
    relay, main, state = _after_one_streamed_turn(tmp_path, _nices_and_state, *args)
    base = os.getpriority(os.PRIO_PROCESS, 0)  # serve inherits this process's nice value
    expected = min(asked, base) if asked < 0 and _may_lower_nice() else base
    assert relay == expected
    assert main == base
    assert state["relay_nice"] == expected


@pytest.mark.skipif(not _may_lower_nice(), reason="this process may not lower a nice value anyway")
@pytest.mark.skipif(not shutil.which("setpriv"), reason="setpriv (util-linux) is not installed")
def test_without_the_privilege_the_relay_keeps_the_processes_nice_value(tmp_path):
    """Where the process may not lower a nice value (run here without CAP_SYS_NICE and with an RLIMIT_NICE
    of 0, as an unprivileged user or a container is), asking is refused and the thread relays as before."""
    import resource

    wrap = ("setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice")
    soft, hard = resource.getrlimit(resource.RLIMIT_NICE)
    resource.setrlimit(resource.RLIMIT_NICE, (0, hard))  # inherited by serve; this process's own is put back
    try:
        relay, main, state = _after_one_streamed_turn(tmp_path, _nices_and_state, wrap=wrap)
    finally:
        resource.setrlimit(resource.RLIMIT_NICE, (soft, hard))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert relay == main == state["relay_nice"] == base
