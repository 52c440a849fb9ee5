"""The cadence poll: the relay thread learns the server's decode clock and polls around each next token.

What must hold: the predictor (``_cadence.h``, through ``_relayc.Cadence``) gives a window around the
next tick only for a regular clock, counts a batch's burst of reads as one tick, widens with the clock's
jitter but never past a tenth of the period, and forgets; the leave to poll (``cadence_poll.py``) follows
the mode and, in ``auto``, the machine's idle cores; and through a real proxy on real sockets the thread
polls for one stream of a ticking upstream (and the tokens arrive inside its windows), not when the
setting is ``off``, and not with more than ``POLL_MAX_TURNS`` streams, while the bytes arrive unchanged.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from click.testing import CliRunner
from faultkit import chunk, post_head, wait_until
from serveproc import LoopThread, ServeProcess
from relaykit import give_back_what_the_turns_kept  # noqa: F401 (an autouse fixture: turns relayed by hand)

from specproxy.wire import cadence_poll
from specproxy.wire import relay_thread
from specproxy.app.cli import main
from specproxy.config import load_config
from specproxy.errors import ConfigError

relayc = relay_thread._relayc
needs_thread = pytest.mark.skipif(relayc is None, reason="specproxy.wire._relayc is not built")


# ---- the predictor ---------------------------------------------------------------------------------

def ticks(c, times) -> list[bool]:
    return [c.read(t) for t in times]


@needs_thread
def test_a_regular_clock_gives_a_window_around_the_next_tick_once_four_periods_agree():
    c = relayc.Cadence()
    step = 0.020
    for k in range(5):
        assert c.window() is None, f"a window after {k} ticks ({k - 1} periods): too soon"
        assert c.read(10.0 + k * step)
    start, end = c.window()
    nxt = 10.0 + 5 * step
    assert start < nxt < end
    assert end - start <= 0.1 * step + 1e-12, "more than a tenth of the period spent polling"
    assert nxt - start > end - nxt, "the window must open early enough for the timer's own wake-up"


@needs_thread
def test_a_batchs_burst_of_reads_is_one_tick():
    c = relayc.Cadence()
    for k in range(6):
        t = 5.0 + k * 0.025
        # four streams' tokens of one decode step, read within half a millisecond
        assert ticks(c, [t, t + 0.0001, t + 0.0003, t + 0.0005]) == [True, False, False, False]
    start, end = c.window()
    assert start < 5.0 + 6 * 0.025 < end, "the period is tick to tick (25 ms), not read to read"


@needs_thread
def test_jitter_widens_the_window_up_to_a_tenth_of_the_period():
    steady, jittery, wild = relayc.Cadence(), relayc.Cadence(), relayc.Cadence()
    t_s = t_j = t_w = 1.0
    for k in range(6):
        steady.read(t_s)
        jittery.read(t_j)
        wild.read(t_w)
        t_s += 0.020
        t_j += 0.020 + (0.0003 if k % 2 else -0.0003)  # ±0.3 ms
        t_w += 0.020 + (0.002 if k % 2 else -0.002)  # ±2 ms: 4 ms of spread, within a quarter of 20
    width = [w[1] - w[0] for w in (steady.window(), jittery.window(), wild.window())]
    assert width[0] < width[1] < 0.1 * 0.020 + 1e-12
    assert width[2] == pytest.approx(0.1 * 0.020), "the cap: a tenth of the period"


@needs_thread
@pytest.mark.parametrize("periods, why", [
    ([0.020, 0.020, 0.020, 0.030], "one period 50% longer: not a clock"),
    ([0.0015] * 4, "shorter than 2 ms: the thread is busy anyway"),
    ([2.0] * 4, "longer than a second: not a decode clock"),
])
def test_no_window_for_what_is_not_a_regular_decode_clock(periods, why):
    c = relayc.Cadence()
    t = 100.0
    c.read(t)
    for p in periods:
        t += p
        c.read(t)
    assert c.window() is None, why


@needs_thread
def test_an_irregular_period_turns_the_window_off_until_four_regular_ones_again():
    c = relayc.Cadence()
    t = 1.0
    for p in [0.02] * 4 + [0.08]:  # the clock, then a long pause (a prompt's processing)
        c.read(t)
        t += p
    c.read(t)
    assert c.window() is None
    for k in range(3):
        t += 0.02
        c.read(t)
        assert c.window() is None, f"the pause is still among the last four periods after {k + 1}"
    t += 0.02
    c.read(t)
    assert c.window() is not None


@needs_thread
def test_forget_starts_the_clock_anew():
    c = relayc.Cadence()
    for k in range(6):
        c.read(k * 0.02 + 1)
    assert c.window() is not None
    c.forget()
    assert c.window() is None
    assert c.read(50.0), "after forget, the first read starts a tick"


@needs_thread
def test_the_thread_counts_the_turns_it_relays_down_each_way_one_ends():
    """The poll's gate counts the turns in flight (``active``): up at each turn, down once however it ends
    (its end, a cancel, the client gone), never below what it was."""
    from relaykit import Ends, wait_done

    def active() -> int:
        return relayc.pump_stats()["active"]

    base = active()
    sink = relayc.Sink()
    ended, cancelled, gone = Ends(), Ends(), Ends()
    turns = [e.turn(sink) for e in (ended, cancelled, gone)]
    assert active() == base + 3
    ended.up_server.sendall(b"0\r\n\r\n")
    assert wait_done(sink) == [turns[0].id]
    assert active() == base + 2
    assert turns[1].cancel() and not turns[1].cancel()
    assert active() == base + 1
    gone.cl_client.close()
    gone.up_server.sendall(b"5\r\nhello\r\n")
    assert wait_done(sink) == [turns[2].id]
    assert turns[2].outcome[0] == "client_gone"
    assert active() == base
    for e in (ended, cancelled, gone):
        e.close()


# ---- the leave to poll ------------------------------------------------------------------------------

def proc_stat(idle: int, busy: int, cpus: int = 2) -> str:
    """A /proc/stat text whose total line has ``idle`` idle and ``busy`` user jiffies."""
    lines = [f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0"]
    lines += [f"cpu{i} 0 0 0 0 0 0 0 0 0 0" for i in range(cpus)]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 42"]) + "\n"


def test_idle_cores_are_the_idle_share_of_the_interval_times_the_cpus():
    texts = iter([proc_stat(1000, 1000), proc_stat(1150, 1050), proc_stat(1160, 1240)])
    idle = cadence_poll.IdleCores(read=lambda: next(texts))
    assert idle.sample() is None, "one sample has no interval"
    assert idle.sample() == pytest.approx(2 * 150 / 200)  # 1.5 cores idle
    assert idle.sample() == pytest.approx(2 * 10 / 200)  # 0.1


def test_idle_cores_without_a_readable_proc_stat_is_unknown():
    def unreadable() -> str:
        raise OSError("no /proc")

    assert cadence_poll.IdleCores(read=unreadable).sample() is None
    assert cadence_poll.IdleCores(read=lambda: "intr 1\n").sample() is None


def poll_setting() -> bool:
    was = relayc.set_cadence_poll(False)
    relayc.set_cadence_poll(was)
    return was


@needs_thread
@pytest.mark.parametrize("mode, idle_cores, expected", [
    ("on", 0.0, True), ("off", 2.0, False),
    ("auto", 1.5, True), ("auto", 0.4, False), ("auto", None, False),
])
def test_the_gate_follows_the_mode_and_in_auto_the_idle_cores(mode, idle_cores, expected):
    class FixedIdle:
        def sample(self):
            return idle_cores

    relayc.set_cadence_poll(False)
    gate = cadence_poll.CadenceGate(mode, FixedIdle(), interval_s=3600)
    gate.start()
    if mode == "auto":
        gate.update()  # what its thread does each second
    assert (gate.allowed, poll_setting()) == (expected, expected)
    gate.stop()
    assert (gate.allowed, poll_setting()) == (False, False), "stopping withdraws the leave"


@needs_thread
def test_auto_samples_in_its_own_thread_and_stops_it():
    samples = []

    class CountingIdle:
        def sample(self):
            samples.append(1)
            return 1.5

    gate = cadence_poll.CadenceGate("auto", CountingIdle(), interval_s=0.01)
    gate.start()
    wait_until(lambda: gate.allowed, 10, what="the sampling thread to allow polling")
    gate.stop()
    assert not gate.allowed and not poll_setting()
    n = len(samples)
    assert not any(t.name == "specproxy-cadence" for t in threading.enumerate())
    assert len(samples) == n, "sampled after stop()"


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v2_quota_is_the_tightest_of_the_cgroup_and_its_parents(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpu memory\n")
    write(root / "cpu.max", "max 100000\n")
    write(root / "kubepods" / "cpu.max", "150000 100000\n")  # a parent's limit: 1.5 cores
    write(root / "kubepods" / "pod1" / "cpu.max", "max 100000\n")
    write(tmp_path / "self-cgroup", "0::/kubepods/pod1\n")
    assert cadence_poll.cpu_quota(root, tmp_path / "self-cgroup") == pytest.approx(1.5)
    write(root / "kubepods" / "pod1" / "cpu.max", "50000 100000\n")
    assert cadence_poll.cpu_quota(root, tmp_path / "self-cgroup") == pytest.approx(0.5)


def test_a_cgroup_v1_quota_and_none(tmp_path):
    root = tmp_path / "cgroup"
    cpu = root / "cpu,cpuacct"
    write(cpu / "cpu.cfs_quota_us", "-1\n")
    write(cpu / "cpu.cfs_period_us", "100000\n")
    write(cpu / "docker" / "c1" / "cpu.cfs_quota_us", "200000\n")
    write(cpu / "docker" / "c1" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "self-cgroup", "4:memory:/docker/c1\n2:cpu,cpuacct:/docker/c1\n0::/\n")
    assert cadence_poll.cpu_quota(root, tmp_path / "self-cgroup") == pytest.approx(2.0)
    write(tmp_path / "self-cgroup", "2:cpu,cpuacct:/\n0::/\n")  # the root: no quota
    assert cadence_poll.cpu_quota(root, tmp_path / "self-cgroup") is None
    assert cadence_poll.cpu_quota(root, tmp_path / "missing") is None


@needs_thread
def test_under_a_cpu_quota_auto_never_polls_and_says_why():
    class Idle:
        def sample(self):
            return 2.0  # a whole idle host: not the container's to spend

    relayc.set_cadence_poll(False)
    gate = cadence_poll.CadenceGate("auto", Idle(), interval_s=0.01, quota=0.5)
    gate.start()
    gate.update()
    assert gate._thread is None and not gate.allowed and not poll_setting()
    gate.stop()
    assert cadence_poll.describe("auto", True, 0.5) == (
        "auto, off: this process has a CPU quota of 0.50 cores (--cadence-poll on to poll anyway)")


def test_the_start_up_line_says_what_the_setting_does_here():
    assert cadence_poll.describe("auto", True) == "auto (polls for the next token while a core is idle)"
    assert cadence_poll.describe("on", True) == "on (polls for the next token)"
    assert cadence_poll.describe("off", True) == "off"
    assert cadence_poll.describe("on", False) == "off (no relay thread)"  # relay = "python", or not built


def test_a_bad_mode_is_a_clear_error():
    with pytest.raises(ConfigError, match="cadence_poll must be one of auto, on, off, not 'sometimes'"):
        load_config(env={"SPECPROXY_CADENCE_POLL": "sometimes"})
    result = CliRunner().invoke(main, ["serve", "--upstream", "http://127.0.0.1:9", "--cadence-poll", "x"])
    assert result.exit_code == 2 and "'x' is not one of 'auto', 'on', 'off'" in result.output


# ---- through the proxy -----------------------------------------------------------------------------

# A step of 100 ms (a slow decode): a period is regular within a quarter of it, 25 ms, which a loaded machine's
# oversleeping upstream thread rarely crosses four times in a row; at 25 ms steps it often did
STEP_S = 0.1
CHUNKS = 24
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def event(stream: int, k: int) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"s%d t%d "}}]}\n\n' % (stream, k)


def body(stream: int) -> bytes:
    return b"".join(chunk(event(stream, k)) for k in range(CHUNKS)) + b"0\r\n\r\n"


class TickingUpstream:
    """A batched decode clock on a thread of its own: once ``streams`` requests are in, every stream gets
    one chunk per step, all in the same tick, for ``CHUNKS`` steps, all ending in the same tick, as an
    engine's batch does. The ticks are absolute times slept to with ``time.sleep`` (tens of µs late at
    most, as regular as a GPU's steps; an asyncio timer is up to a millisecond late)."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self.error: BaseException | None = None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(10)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name="ticking-upstream", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def join(self) -> None:
        self._thread.join(10)
        assert not self._thread.is_alive(), "the ticking upstream did not finish"
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        conns: list[socket.socket] = []
        try:
            while len(conns) < self.streams:
                conn, _ = self._listener.accept()
                conn.settimeout(10)
                conns.append(conn)
                read_whole_request(conn)
            for conn in conns:
                conn.sendall(HEAD)
            t0 = time.monotonic() + 2 * STEP_S
            for k in range(CHUNKS):
                time.sleep(max(0.0, t0 + k * STEP_S - time.monotonic()))
                for i, conn in enumerate(conns):
                    conn.sendall(chunk(event(i, k)) + (b"0\r\n\r\n" if k == CHUNKS - 1 else b""))
        except BaseException as exc:  # noqa: BLE001 - the test reads it in join()
            self.error = exc
        finally:
            for conn in conns:
                conn.close()
            self._listener.close()


def read_whole_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        assert more, "the proxy closed before a whole request"
        data += more
    head, rest = data.split(b"\r\n\r\n", 1)
    length = int(next((ln.split(b":", 1)[1] for ln in head.split(b"\r\n")
                       if ln.lower().startswith(b"content-length:")), b"0"))
    while len(rest) < length:
        more = conn.recv(65536)
        assert more, "the proxy closed before a whole request body"
        rest += more


async def one_stream(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post_head("/v1/chat/completions", b'{"model":"m","stream":true,"messages":[]}'))
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200")
    got = b""
    while not got.endswith(b"0\r\n\r\n"):
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data, "the proxy closed before the end of the body"
        got += data
    writer.close()
    return got


def run_streams(make_stack, streams: int, mode: str) -> tuple[dict, list[bytes]]:
    """``streams`` streams of a ticking upstream through a proxy with ``--cadence-poll mode``: the relay
    thread's poll counters over them (deltas), and the bodies the clients got."""
    up = TickingUpstream(streams)
    stack = make_stack(None, scrape_interval_s=0, cadence_poll=mode, upstream=up.url)
    before = cadence_poll.poll_stats()

    async def go():
        return await asyncio.gather(*(one_stream(stack.service.port) for _ in range(streams)))

    bodies = stack.run(go())
    after = cadence_poll.poll_stats()
    up.join()
    stack.settle()
    return {k: after[k] - before[k] for k in before}, bodies


def stream_of(got: bytes) -> int:
    return int(got.split(b'"content":"s', 1)[1].split(b" ", 1)[0])


@pytest.mark.alone
@needs_thread
def test_one_stream_on_a_clock_is_polled_for_and_its_tokens_arrive_in_the_windows(make_stack):
    stats, (got,) = run_streams(make_stack, 1, "on")
    assert got == body(stream_of(got)), "the bytes must arrive as the upstream sent them"
    # 24 ticks: the first 5 teach the clock, then a window before each of the rest while the periods agree
    # within a quarter. How many agree is the machine's doing (the upstream's thread oversleeps on a loaded
    # machine, and an irregular period closes the windows until four regular ones again: the predictor's
    # unit tests above hold that rule and each window's place exactly); that the thread learns a clock of
    # this stream at all, and polls within the windows' bounds, is specproxy's.
    assert stats["poll_windows"] >= 1, stats
    assert 0 <= stats["poll_hits"] <= stats["poll_windows"], stats
    # bounded by the windows (a tenth of the period each), with room for the thread being preempted
    assert 0 < stats["poll_s"] < stats["poll_windows"] * 0.1 * STEP_S * 2 + 0.05, stats


@needs_thread
def test_off_never_polls(make_stack):
    stats, (got,) = run_streams(make_stack, 1, "off")
    assert got == body(stream_of(got))
    assert stats == {"poll_windows": 0, "poll_hits": 0, "poll_s": 0.0}


@pytest.mark.alone
@needs_thread
def test_up_to_poll_max_turns_streams_are_polled_for_and_more_are_not(make_stack):
    n = relayc.POLL_MAX_TURNS
    few, bodies = run_streams(make_stack, n, "on")
    assert sorted(bodies) == sorted(body(i) for i in range(n))
    assert few["poll_windows"] >= 1, few  # how many: the machine's doing (above)
    many, bodies = run_streams(make_stack, n + 1, "on")
    assert sorted(bodies) == sorted(body(i) for i in range(n + 1))
    assert many["poll_windows"] == 0, many


@pytest.mark.alone
@needs_thread
def test_serve_polls_with_the_flag_and_says_so(tmp_path):
    """The real ``specproxy serve`` process: its start-up line names the setting, and its state line
    (SIGUSR1) counts the windows it polled for one stream of a ticking upstream."""
    loop = LoopThread()
    up = TickingUpstream(1)
    proc = ServeProcess(tmp_path, up.url, tmp_path / "turns.db", "--cadence-poll", "on")
    try:
        assert "cadence poll on (polls for the next token)" in proc.stderr()
        assert loop.run(one_stream(proc.port)) == body(0)
        up.join()
        state = proc.state()
    finally:
        assert proc.stop() == 0
        loop.close()
    assert state["poll_windows"] >= 1 and 0 <= state["poll_hits"] <= state["poll_windows"], state
    assert state["poll_s"] > 0, state
