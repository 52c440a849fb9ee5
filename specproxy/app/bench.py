"""``specproxy bench``: send a workload at each concurrency, through the real proxy, into the database.

Why through the proxy: every figure of a benchmark must mean what it means for the users' traffic, so
bench runs the very ``Service`` that ``serve`` runs (in this process, on 127.0.0.1, an ephemeral port,
in front of ``--upstream``) and sends its requests through it, labelled with the arm. The turns are
measured, stored and summarised exactly as proxied ones are; ``report`` and ``compare`` read them
like any others.

The run: for each block (one server instance of one arm; with ``--restart-cmd`` the server is
restarted before each, arms interleaved A B B A ..., and the turns stamped with the block's instance so
that ``compare`` gets its interval over instances), wait until the server is ready, send the warm-up
requests straight to it (not through the proxy: they are not recorded), then for each repeat and each
concurrency a round: closed loop (that many streams, each sending its next request when the previous
ended) over the workload once, or for ``duration_s``; or open loop (``rate`` requests a second,
exponential gaps, at most that many in flight; or, with ``timing`` "recorded", each request at its own
recorded offset divided by ``speed``: the same open loop, fed the recorded arrivals). A round ends when every request it sent has its
record. Anything that goes wrong (a restart that fails, a server that never comes back, a round whose
every request failed) ends the run with one line, after what was measured is stored and summarised;
so does Ctrl-C (the interrupted round counts with the turns that ended before it).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp

from specproxy.analyze.bench import Round
from specproxy.app.probes import NONCE
from specproxy.app.progress import BenchProgress, Quiet
from specproxy.app.replay import Request
from specproxy.app.restarts import look, new_process, restart_command, run_restart, wait_ready
from specproxy.config import Config
from specproxy.errors import SpecproxyError
from specproxy.record import Record
from specproxy.serve.headers import LABEL_HEADER
from specproxy.serve.service import Service

__all__ = ["BenchError", "BenchPlan", "BenchRun", "run_bench", "schedule"]

clock = time.perf_counter  # the proxy's clock: a round's window and its records' stamps compare
RECORD_WAIT_S = 30.0  # after a round's last response, how long its records may take to be measured
UNREACHABLE_STOP = 10  # failures to reach the server in a row that end a round: it went away


class BenchError(SpecproxyError):
    """The run stopped; ``rounds`` holds what was measured before (stored and summarised anyway)."""


@dataclass(frozen=True)
class BenchPlan:
    workloads: list[tuple[int | None, list[Request]]]  # (prefill probe's prompt length or None, requests)
    levels: tuple[int, ...] = (1,)
    repeats: int = 1
    duration_s: float | None = None
    rate: float | None = None
    arms: tuple[str, ...] = ("bench",)
    instances: int = 1
    restart_cmd: str | None = None
    ready_timeout_s: float = 300.0
    warmup: int = 1
    request_timeout_s: float = 600.0
    seed: int = 0
    timing: str = "loop"  # "recorded": each request sent at its recorded offset (Request.offset_s), open loop
    speed: float = 1.0  # recorded offsets divided by this (2: twice as fast)
    warmup_requests: list[Request] | None = None  # instead of the workload's first (a trace's: none of its blocks)

    def round_size(self, requests: list[Request], level: int) -> int:
        """Requests in a round without a duration: the workload once, at least one per stream (a recorded
        timing's round: the workload once)."""
        return len(requests) if self.timing == "recorded" else max(len(requests), level)

    def planned_rounds(self) -> int:
        return len(self.workloads) * len(self.levels) * self.repeats * self.instances * len(self.arms)

    def planned_turns(self) -> int | None:
        if self.duration_s is not None:
            return None
        per_instance = sum(self.round_size(reqs, level) for _, reqs in self.workloads for level in self.levels)
        return per_instance * self.repeats * self.instances * len(self.arms)


def schedule(arms: tuple[str, ...], instances: int) -> list[tuple[str, int]]:
    """(arm, instance number) per block, interleaved so that no arm always goes first: A B, B A, A B..."""
    out = []
    for k in range(1, instances + 1):
        order = arms if k % 2 else tuple(reversed(arms))
        out.extend((arm, k) for arm in order)
    return out


@dataclass
class BenchRun:
    """What a run measured so far, kept whatever stops it."""

    rounds: list[Round] = field(default_factory=list)
    run_id: str = field(default_factory=lambda: time.strftime("%Y%m%dT%H%M%S") + "-" + os.urandom(2).hex())
    instance_ids: dict[tuple[str, int], str] = field(default_factory=dict)
    # per block with a restart: True when the server showed it was a new process, None when it cannot tell
    verified: dict[tuple[str, int], bool | None] = field(default_factory=dict)
    interrupted: bool = False  # Ctrl-C: no request is sent after it, whatever await it found the run in


class _Collector:
    """The proxy's records, as its sink hands them over (on the event loop)."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self._arrived = asyncio.Event()

    def __call__(self, record: Record) -> None:
        self.records.append(record)
        self._arrived.set()

    async def take(self, t0: float, t1: float, expected: int, timeout: float = RECORD_WAIT_S) -> list[Record]:
        """The records of turns started in [t0, t1], once there are ``expected`` of them (or the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            mine = [r for r in self.records if r.t_request is not None and t0 <= r.t_request <= t1]
            if len(mine) >= expected or time.monotonic() >= deadline:
                keep = set(map(id, mine))
                self.records = [r for r in self.records if id(r) not in keep]
                return mine
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), max(deadline - time.monotonic(), 0.01))
            except TimeoutError:
                pass


async def _send(session: aiohttp.ClientSession, url: str, req: Request, label: str | None,
                timeout_s: float) -> tuple[int | None, bytes]:
    """One request, its response read to the end: (status, the start of the body) or (None, why)."""
    headers = {"Content-Type": "application/json"}
    if label is not None:
        headers[LABEL_HEADER] = label
    if req.content_encoding:
        headers["Content-Encoding"] = req.content_encoding
    body = req.body.replace(NONCE, os.urandom(6).hex().encode()) if req.fresh else req.body
    try:
        async with session.post(url + req.path, data=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout_s)) as resp:
            head = b""
            async for data in resp.content.iter_any():
                if len(head) < 300:
                    head += data[: 300 - len(head)]
            return resp.status, head
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return None, f"{type(exc).__name__}: {exc}".encode()


def _session(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=False),
                                 auto_decompress=False, trust_env=False)


async def _closed_loop(url, requests, label, level, n, end, timeout_s, on_done, halted) -> int:
    """``level`` workers, each sending its next request when its last one ended. Each worker keeps its
    own connection for the round, so the proxy records its turns as one lane (``conn_id``): the chain
    whose schedule compare replays for aggregate throughput. A shared pool would hand a worker whichever
    connection is idle, and a round's chains would not be its workers."""
    counter = itertools.count()
    sent = 0

    async def stream() -> None:
        nonlocal sent
        async with _session(limit=1) as own:
            while True:
                i = next(counter)
                if (end is None and i >= n) or (end is not None and clock() >= end) or halted():
                    return
                sent += 1
                status, head = await _send(own, url, requests[i % len(requests)], label, timeout_s)
                on_done(status, head)

    await asyncio.gather(*(stream() for _ in range(level)))
    return sent


def _poisson(rate: float, rng: random.Random) -> Iterator[float]:
    """``--rate``'s arrivals: offsets from the round's start with exponential gaps, the first at once."""
    return itertools.accumulate((rng.expovariate(rate) for _ in itertools.count()), initial=0.0)


async def _open_loop(session, url, requests, label, level, n, end, arrivals: Iterator[float], timeout_s, on_done,
                     halted, late: list[float] | None = None) -> int:
    """Request i starts at the round's start + the i-th of ``arrivals`` (seconds), at most ``level`` in flight;
    how late each one went (the loop busy, or every slot taken) is appended to ``late``."""
    slots = asyncio.Semaphore(level)
    tasks: set[asyncio.Task] = set()
    sent = 0
    start = clock()
    for i in itertools.count():
        next_at = start + next(arrivals, 0.0)
        if (end is None and i >= n) or (end is not None and clock() >= end) or halted():
            break
        await asyncio.sleep(max(next_at - clock(), 0))  # the schedule of arrivals, not a wait for an event
        await slots.acquire()
        if halted():
            slots.release()
            break
        sent += 1
        if late is not None:
            late.append(max(clock() - next_at, 0.0))

        async def one(req: Request) -> None:
            try:
                status, head = await _send(session, url, req, label, timeout_s)
                on_done(status, head)
            finally:
                slots.release()

        task = asyncio.create_task(one(requests[i % len(requests)]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    return sent


def _warmup_request(plan: BenchPlan) -> list[Request]:
    first = plan.warmup_requests or plan.workloads[0][1]
    return [first[i % len(first)] for i in range(plan.warmup)]


async def _warm_up(session: aiohttp.ClientSession, base: str, plan: BenchPlan) -> None:
    """Straight to the server, not through the proxy: warm-up turns are not recorded."""
    for req in _warmup_request(plan):
        status, head = await _send(session, base, req, None, plan.request_timeout_s)
        if status is None or status >= 400:
            what = f"HTTP {status}: {_snippet(head)}" if status is not None else head.decode("utf-8", "replace")
            raise BenchError(f"the warm-up request ({req.where}) failed: {what}")


def _snippet(head: bytes) -> str:
    return " ".join(head.decode("utf-8", "replace").split())[:160]


def _stderr_note(line: str) -> None:
    print(f"specproxy bench: {line}", file=sys.stderr, flush=True)


async def run_bench(cfg: Config, plan: BenchPlan, run: BenchRun, *, progress: BenchProgress | None = None,
                    tokenizer=None, on_block: Callable[[str, int], None] | None = None,
                    note: Callable[[str], None] = _stderr_note) -> BenchRun:
    """Run ``plan`` through a proxy configured by ``cfg`` (its upstream, database, tokenizer); every
    measured round is appended to ``run.rounds`` as it ends, so a BenchError leaves them there. ``note``
    gets the lines worth saying while it runs (a wait for the server, restarts that cannot be checked)."""
    progress = progress or Quiet()
    service = Service.from_config(cfg) if tokenizer is None else None
    if service is None:
        from specproxy.store.writer import Writer

        service = Service(cfg=cfg, tokenizer=tokenizer,
                          writer=Writer(cfg.db, queue_size=cfg.queue_size,
                                        scrape_retention_days=cfg.scrape_retention_days))
    collector = _Collector()
    service.extra_sinks.append(collector)
    base = str(cfg.upstream_url).rstrip("/")
    rng = random.Random(plan.seed)
    progress.start(plan.planned_turns(), rounds=plan.planned_rounds(), round_s=plan.duration_s)
    watching = _on_ctrl_c(run)
    try:
        await _run_blocks(service, collector, plan, run, base, rng, progress, on_block, note)
    except asyncio.CancelledError:
        if run.interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        progress.stop()
        try:
            await service.stop()  # drains the writer: every record measured so far is stored
        finally:
            if watching:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
    if run.interrupted:  # the cancel met an await that let it go: the sending stopped all the same
        raise KeyboardInterrupt
    return run


def _on_ctrl_c(run: BenchRun) -> bool:
    """SIGINT, handled on the loop itself: mark the run interrupted (no round sends another request) and
    cancel it. Both, because a cancel that lands as an awaited call completes can be lost (a wait_for whose
    inner future finished at that moment), and Ctrl-C then went unheard for the rest of a --duration.
    False where the loop cannot take signals (not the main thread): the default KeyboardInterrupt stands."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()

    def interrupt() -> None:
        run.interrupted = True
        if task is not None and not task.done():
            task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, interrupt)
    except (ValueError, RuntimeError, NotImplementedError):
        return False
    return True


async def _run_blocks(service: Service, collector: _Collector, plan: BenchPlan, run: BenchRun, base: str,
                      rng: random.Random, progress: BenchProgress, on_block: Callable[[str, int], None] | None,
                      note: Callable[[str], None]) -> None:
    """Every block of the schedule (arm, instance): restart, warm up, then its rounds."""
    await service.start()
    assert service.proxy is not None
    async with _session() as session:
        for arm, k in schedule(plan.arms, plan.instances):
            if run.interrupted:
                break
            label = arm
            if plan.restart_cmd is not None:
                progress.phase(f"{arm} #{k}: restarting the server")
                before = await look(session, base)
                command = restart_command(plan.restart_cmd, arm, k)
                await asyncio.to_thread(run_restart, command, arm, k, plan.ready_timeout_s)
                instance = f"bench-{run.run_id}-{arm}-{k}"
                run.instance_ids[(arm, k)] = instance
                service.proxy.instance_override = instance
            else:
                service.proxy.instance_override = None
            progress.phase(f"{arm} #{k}: waiting for the server")
            await wait_ready(base, plan.ready_timeout_s, arm=arm, instance=k, fail_fast=plan.restart_cmd is None,
                             note=note)
            if plan.restart_cmd is not None:
                await _check_restarted(session, base, before, run, arm, k, note)
            if on_block is not None:
                on_block(arm, k)
            progress.phase(f"{arm} #{k}: warm-up")
            await _warm_up(session, base, plan)
            for repeat in range(1, plan.repeats + 1):
                for prompt_len, requests in plan.workloads:
                    for level in plan.levels:
                        if run.interrupted:
                            break
                        what = f"{arm} #{k}: concurrency {level}, repeat {repeat}/{plan.repeats}"
                        progress.phase(what + (f", prompt {prompt_len} words" if prompt_len else ""))
                        rnd = Round(arm=arm, instance=k, level=level, repeat=repeat, prompt_len=prompt_len)
                        progress.begin_round()
                        try:
                            await _round(session, service, collector, plan, rnd, requests, label, rng,
                                         progress, lambda: run.interrupted)
                        except asyncio.CancelledError:  # Ctrl-C: the round so far is part of the summary
                            if rnd.records:
                                run.rounds.append(rnd)
                            raise
                        run.rounds.append(rnd)
                        _check_round(rnd, what, base)
        await service.proxy.drain_measurements()


async def _round(session, service: Service, collector: _Collector, plan: BenchPlan, rnd: Round,
                 requests: list[Request], label: str, rng: random.Random, progress: BenchProgress,
                 interrupted: Callable[[], bool] = lambda: False) -> None:
    responses = 0
    unreachable = 0  # failures to reach the server in a row (the proxy's 502 upstream_unreachable)
    first_error: list[str] = []

    def done(status: int | None, head: bytes) -> None:
        nonlocal responses, unreachable
        responses += status is not None  # a response came through the proxy: its turn has a record
        if (status is None or status >= 400) and not first_error:
            first_error.append(f"HTTP {status}: {_snippet(head)}" if status is not None
                               else head.decode("utf-8", "replace")[:160])
        if status is None or (status == 502 and b'"upstream_unreachable"' in head):
            unreachable += 1
            if unreachable == UNREACHABLE_STOP:
                rnd.gone = f"HTTP {status}: {_snippet(head)}" if status is not None else \
                    head.decode("utf-8", "replace")[:160]
        elif not rnd.gone:
            unreachable = 0
        progress.advance()

    def halted() -> bool:  # the server went away (or Ctrl-C): stop sending rather than record failures
        return rnd.gone is not None or interrupted()

    n = plan.round_size(requests, rnd.level)
    t0 = clock()
    end = t0 + plan.duration_s if plan.duration_s is not None else None
    try:
        if plan.timing == "recorded":
            arrivals = iter([(r.offset_s or 0.0) / plan.speed for r in requests])
            rnd.sent = await _open_loop(session, service.url, requests, label, rnd.level, n, None, arrivals,
                                        plan.request_timeout_s, done, halted, rnd.late_s)
        elif plan.rate is not None:
            rnd.sent = await _open_loop(session, service.url, requests, label, rnd.level, n, end,
                                        _poisson(plan.rate, rng), plan.request_timeout_s, done, halted)
        else:
            rnd.sent = await _closed_loop(service.url, requests, label, rnd.level, n, end, plan.request_timeout_s,
                                          done, halted)
    except asyncio.CancelledError:  # interrupted: the turns that ended so far, as measured by now
        rnd.records = [r for r in collector.records if r.outcome == "ok" and r.t_request is not None
                       and r.t_request >= t0]
        rnd.sent = len(rnd.records)
        raise
    rnd.records = await collector.take(t0, clock(), responses)
    rnd.first_error = first_error[0] if first_error else None


def _check_round(rnd: Round, what: str, base: str) -> None:
    """A round in which no request succeeded ends the run: the server is down or refuses the workload; so
    does a round whose server went away (every later round would only collect failures)."""
    ok = sum(r.outcome == "ok" for r in rnd.records)
    if rnd.sent and not ok:
        why = rnd.first_error or "no response"
        raise BenchError(f"{what}: none of {rnd.sent} requests succeeded (first: {why})")
    if rnd.gone is not None:
        raise BenchError(f"{what}: the server at {base} went away ({UNREACHABLE_STOP} requests in a row could not "
                         f"reach it: {rnd.gone}); the round stopped sending, its {ok} completed turns are kept")


async def _check_restarted(session, base: str, before, run: BenchRun, arm: str, k: int,
                           note: Callable[[str], None]) -> None:
    """After a restart: the server must be a new process, or the interval "over instances" would be a lie.
    The same process ends the run; a server that cannot tell says so once, and the run's instances are
    marked unverified."""
    now = await look(session, base)
    if now is None:  # ready a moment ago, gone now: the next request will say so
        run.verified[(arm, k)] = None
        return
    new, why = new_process(before, now)
    if new is False:
        raise BenchError(f"the restart command for arm {arm} (instance {k}) returned, but the server at {base} is "
                         f"the same process as before it ({why}): the command must stop the running server and "
                         "start a new one")
    if new is None and None not in run.verified.values():
        note(f"cannot check that the restarts start new server processes ({why}): the instances are marked "
             "unverified")
    run.verified[(arm, k)] = new
