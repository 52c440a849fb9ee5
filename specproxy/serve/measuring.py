"""The measuring worker: one thread that turns finished turns into Records while the relay is quiet.

Why a policy and not a plain thread pool: measuring is Python, and the relay is Python on the same
interpreter lock. Inference servers send in bursts (one chunk per stream per decoding step, all
streams at once), so a worker that builds whenever a turn ends competes with the relay exactly when
a burst is being forwarded, and every chunk of the burst waits longer. This worker takes what has
queued, waits for a gap in the relay's reads (``QUIET_S`` without one), and builds then, looking
again before each turn of the batch (a burst that began during a build goes first). Under
traffic that never pauses it waits at most ``MAX_DEFER_S`` per batch and builds the batch anyway, so
measuring keeps up (a batch is every turn that ended meanwhile) and records arrive at most that much
later; when turns queue faster than that (``MAX_BATCH`` waiting), it stops waiting until it has caught
up. Each batch's records go from this thread straight to the store's queue (``store``: a put that never
blocks), in the order they were built; then the event loop hears of the batch once (``done``: /metrics,
the proxy's count of turns being measured), not once per turn.

Batches are gathered: after the first turn of a batch arrives the worker waits, and then takes every
turn that queued meanwhile, until one of: ``MAX_BATCH`` turns are waiting; a turn ended with no other
in flight (nothing more is coming soon: a lone chat's turn is measured at once); ``GATHER_S`` passed;
``stop``. Many builds in a row run with warm caches, the interpreter lock changes hands once per batch
instead of once per turn, the loop gets one callback per batch and the writer one burst; a submit wakes
the worker only to end a gathering. Under steady traffic a record reaches the store up to ``GATHER_S``
later; a lone turn's, at once. Gathering longer than ``GATHER_S`` is not better: longer runs of builds
hold the interpreter lock while a turn's head and first chunks, written by the event loop, wait for it.
The figures behind both choices are in docs/performance.md ("Design figures").

Large turns go aside. A turn whose request body and kept response come to ``LARGE_TURN_BYTES`` or more
(a near-``max_counted_bytes`` prompt is about a second of tokenizer) is held apart from the others, and
built alone, one after each batch of the others (or alone, when none waits): a small turn waits behind
at most one large turn's build, never behind a backlog of them, and a large turn waits at most one
batch of small ones per large turn ahead of it (none starves).

``activity()`` is the relay's clock of its latest read (``UpstreamPool.activity``: the loop's reads and
the relay thread's); reading two floats is all the worker does to the relay. With the relay thread
(the default) the bodies' reads do not need the interpreter lock at all, so a build does not delay
them; the wait still keeps builds off the loop's per-turn work in a burst of new turns.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from specproxy.measure.build import build_record, unmeasured_record
from specproxy.measure.prefix import PrefixTracker
from specproxy.measure.tokens import Tokenizer
from specproxy.measure.turn_recorder import TurnRecorder
from specproxy.record import Record
from specproxy.store.captures import capture_item
from specproxy.wire import memory
from specproxy.wire.os_thread import name_os_thread

__all__ = ["MAX_DEFER_S", "QUIET_S", "Built", "MeasuringWorker", "RecordQueue", "Store", "to_writer", "where"]

log = logging.getLogger("specproxy.serve.measuring")

clock = time.perf_counter

QUIET_S = 0.001  # a gap this long in the relay's reads is a moment to measure
MAX_DEFER_S = 0.02  # never wait longer than this for a gap before building a batch
# how often to look for that gap: each look takes the interpreter lock from the relay in mid-burst, so
# seldom (docs/performance.md, "Design figures")
POLL_S = 0.004
MAX_BATCH = 32  # turns built per batch (and records handed on at once: the writer's queue sees bursts no larger)
GATHER_S = 0.1  # after a batch's first turn, wait at most this long for more before building (see above)
TRIM_BYTES = 16 << 20  # a batch that let go of (or parsed) this much gives the heaps' free pages back to the system
LARGE_TURN_BYTES = 1 << 20  # a turn holding this much (body and kept response) is built apart (see above)


class Built(NamedTuple):
    """One turn the worker built: its record (made unmeasured when measuring failed: ``error``), and
    whether the store took it (its queue may be full)."""

    turn: TurnRecorder
    record: Record
    error: BaseException | None
    stored: bool


# a finished turn's record (with ``capture``, its request body too) into the store's queue: called in this
# thread, never blocks; True when the store took the record (``to_writer``, or a test's own)
Store = Callable[[TurnRecorder, Record], bool]
Done = Callable[[list[Built]], None]
# a finished turn's Record, with the worker's tokenizer and the sessions' previous turns (``build_record``)
Build = Callable[[TurnRecorder, Tokenizer | None, PrefixTracker], Record]


class RecordQueue(Protocol):
    """The store's queue (``store.writer.Writer``): a put that never blocks; False when it dropped the item."""

    def put(self, item: Any) -> bool: ...


def to_writer(writer: RecordQueue | None, capture: bool) -> Store:
    """The measuring thread's ``Store``: each record straight into the writer's queue, and with ``capture``
    a measured turn's request body as the client sent it, beside its record (``store/captures.py``). No
    writer: records go nowhere, taken."""
    if writer is None:
        return lambda turn, record: True

    def store(turn: TurnRecorder, record: Record) -> bool:
        stored = writer.put(record)
        if capture and record.measured:
            writer.put(capture_item(turn.id, turn.t_wall, turn.method, turn.path, turn.request_encoding, turn.body))
        return stored

    return store


class MeasuringWorker:
    def __init__(self, tokenizer: Tokenizer | None, activity: Callable[[], float],
                 loop: asyncio.AbstractEventLoop, done: Done, *, store: Store,
                 gather_s: float | None = None, keep_bodies: bool = False, build: Build | None = None) -> None:
        """``keep_bodies``: ``store`` reads each turn's request body (``capture``): keep it until the turn is
        stored. ``build``: what makes a turn's Record (``build_record``; a test's own, to slow or break it). Every byte a turn held (its body, its kept response) is let go of here, right after its
        build (the body kept, after ``store``), and given back to the memory budget (``wire.memory``)."""
        self.tokenizer = tokenizer
        self.prefixes = PrefixTracker()  # each session's previous turn, compared with its next (this thread's)
        self._gather_s = GATHER_S if gather_s is None else gather_s
        self._gathered = threading.Event()  # ends a gathering: a full batch, nothing more in flight, stop
        self._holding = 0  # 1 while the worker holds a batch's first turn, taken off the queue, gathering
        self._activity = activity
        self._loop = loop
        self._done = done
        self._store = store
        self._build_record = build if build is not None else build_record
        self._keep_bodies = keep_bodies
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="specproxy-measure", daemon=True)
        self._thread.start()
        self.batches = 0
        self.deferred_s = 0.0  # time spent waiting for the relay to pause

    def submit(self, turn: TurnRecorder, *, more_in_flight: bool) -> None:
        """From the event loop: never blocks (an in-memory queue). ``more_in_flight``: other turns are
        still running, so more may end soon and join this one's batch."""
        queue = self._queue
        queue.put(turn)
        # the turns waiting: those queued and the first the worker took off the queue to gather behind
        if (not more_in_flight or queue.qsize() + self._holding >= MAX_BATCH) and not self._gathered.is_set():
            self._gathered.set()

    def stop(self) -> None:
        """Build what is queued, then end the thread. Blocks: call from a thread, not the loop."""
        self._gathered.set()
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        name_os_thread()
        stopping = False
        large: deque[TurnRecorder] = deque()  # large turns taken from the queue, built one per batch
        while not (stopping and not large):
            batch: list[TurnRecorder] = []
            if not large and not stopping:
                first = self._queue.get()
                if first is not None and self._gather_s > 0:
                    # counted by submit from here (a submit before this line is counted by the check below)
                    self._holding = 1
                    if self._queue.qsize() + 1 < MAX_BATCH:
                        self._gathered.wait(self._gather_s)  # let the batch gather (see the module's docstring)
                    self._holding = 0
                if first is None:
                    stopping = True
                else:
                    self._sort(first, batch, large)
            self._gathered.clear()  # before taking the batch: a later end of gathering is for the next
            while len(batch) < MAX_BATCH and not stopping:  # what has queued meanwhile, up to a batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                self._sort(more, batch, large)
            behind = stopping or self._queue.qsize() >= MAX_BATCH  # then build now, do not wait
            if batch and not self._build(batch, behind):
                return
            if large and not self._build([large.popleft()], behind):  # one large turn per round
                return

    @staticmethod
    def _sort(turn: TurnRecorder, batch: list, large: deque) -> None:
        if _cost(turn) >= LARGE_TURN_BYTES:
            large.append(turn)
        else:
            batch.append(turn)

    def _build(self, batch: list[TurnRecorder], behind: bool) -> bool:
        """Build a batch, put its records in the store's queue, and tell the loop once; False when the loop is
        gone."""
        deadline = clock() + MAX_DEFER_S
        made = []
        released = 0
        for turn in batch:
            if not behind:  # before each build: a burst that began meanwhile goes first
                self._wait_for_quiet(deadline)
            try:
                made.append((turn, self._build_record(turn, self.tokenizer, self.prefixes), None))
            except Exception as exc:  # measuring failed: the proxy records the turn unmeasured
                why = f"{type(exc).__name__} ({where(exc)})"
                made.append((turn, unmeasured_record(turn, f"measuring failed: {why}"), exc))
            freed = turn.let_go(body=not self._keep_bodies)
            memory.give(freed)
            # what parsing and counting made of the body (objects several times its size, never charged)
            # is freed too: counted here, or a backlog of such turns would never trim
            released += freed + turn.request_bytes
        results = []
        for turn, record, exc in made:  # the batch to the store at once: the writer wakes once for it
            try:
                stored = self._store(turn, record)
            except Exception as error:  # a bug of ours: the turn is lost, this thread is not
                log.error("storing a turn failed: %s", f"{type(error).__name__} ({where(error)})")
                stored = False
            results.append(Built(turn, record, exc, stored))
            if self._keep_bodies:
                freed = turn.let_go()
                memory.give(freed)
                released += freed
        if released >= TRIM_BYTES:
            memory.trim()  # the heaps' free pages back to the system (large blocks went back on free)
        self.batches += 1
        try:
            self._loop.call_soon_threadsafe(self._done, results)
        except RuntimeError:  # the loop is closed: nobody is left to take the records
            return False
        return True

    def _wait_for_quiet(self, deadline: float) -> None:
        t0 = clock()
        while True:
            now = clock()
            since = now - self._activity()
            if since >= QUIET_S or now >= deadline:
                break
            time.sleep(min(max(QUIET_S - since, POLL_S), deadline - now))
        self.deferred_s += clock() - t0


def _cost(turn: TurnRecorder) -> int:
    """What building a turn will read: its request body and its kept response (the relay thread's too)."""
    relayed = turn.relayed
    return len(turn.body) + sum(map(len, turn.reads)) + (relayed.kept if relayed is not None else 0)


def where(exc: BaseException) -> str:
    """Where an exception was raised (file:line), for logs and records that must not quote its message."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"raised at {frames[-1].filename}:{frames[-1].lineno}" if frames else "raised at ?"
