"""Reading the inference server's own ``/metrics``, and knowing which server process said it.

Why: specproxy's own numbers are what users receive; the server's counters say what the engine
did (emitted tokens, drafts, accepted drafts, requests running). Put side by side they explain
gaps like a server logging 40.7 tok/s while 29.4 are accepted and 27.8 delivered, give MAL from
the counters, and give the operating point from ``num_requests_running``. And because restarts
change results (docs/metrics.md: "Restarts count"), every scrape carries the ``instance_id`` of the
process that produced it.

This module is the ``Scraper`` poller; ``specproxy.observe.instance`` tells server processes apart.
Parsing and the arithmetic are pure and live in ``specproxy.observe.server_metrics``; the names a
caller needs are re-exported here, so ``from specproxy.observe.scrape import ...`` is the one import.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import aiohttp
# parse_exposition imports its parser where it is used (the analysis never parses): imported here, with the
# scraper, so that a page parsed inline on the event loop never waits for that import
import prometheus_client.parser  # noqa: F401

from specproxy.observe.counters import (
    CounterDelta,
    ScrapeSample,
    delta,
    restart_reason,
    running_distribution,
    window_counters,
)
from specproxy.observe.instance import START_HEADER, Instance, float_or_none, identify_instance, identity_changed
from specproxy.observe.server_metrics import RawSample, ScrapeError, ServerKind, Snapshot, parse_exposition

__all__ = [
    "PARSE_INLINE_MAX_BYTES",
    "CounterDelta",
    "Instance",
    "RawSample",
    "ScrapeError",
    "ScrapeSample",
    "Scraper",
    "ServerKind",
    "Snapshot",
    "delta",
    "identify_instance",
    "parse_exposition",
    "running_distribution",
    "window_counters",
]

log = logging.getLogger(__name__)

#: Pages larger than this are parsed in a worker thread: about the most parsing the event loop may
#: take at once (a llama.cpp page stays under it, a vLLM page with histograms does not; docs/performance.md,
#: "Design figures").
PARSE_INLINE_MAX_BYTES = 4096

#: While scrapes keep failing, a line at the 1st, 2nd, 4th, 8th... failure in a row, and at least this
#: often: a dead server is said at once without a line every ``interval_s`` for as long as it stays dead.
FAIL_LOG_EVERY_S = 300.0


def _worth_a_line(failing: int, since_last_line_s: float | None) -> bool:
    """Whether the ``failing``-th failure in a row is logged (the back-off of ``Scraper``'s log)."""
    if failing & (failing - 1) == 0:  # a power of two
        return True
    return since_last_line_s is not None and since_last_line_s >= FAIL_LOG_EVERY_S


class Scraper:
    """Polls ``base_url + path`` every ``interval_s`` and hands each parsed scrape to
    ``on_sample`` as a ``ScrapeSample``.

    Lifecycle: ``start()`` (inside a running loop) launches one task; ``await stop()`` ends it
    promptly (the wait between polls is a wait on the stop event, not a sleep). The poller
    never raises into the caller: a timeout, a refused connection, a non-200 status or text
    that does not parse adds one to ``failures`` and sets ``last_error``, and polling goes on; a
    run of failures is logged with a back-off (``FAIL_LOG_EVERY_S``), and its end too.
    If the very first answer is 404 (no such endpoint) or 501 (llama.cpp started without
    ``--metrics``), the scraper turns itself off and says why in ``disabled_reason``; after a
    success, those statuses count as failures like any other.

    ``on_sample`` is called on the event loop and must not block (a ``Queue.put_nowait`` is
    the intended use); an exception from it is logged, counted in ``callback_failures``, and
    does not stop the poller.

    Restarts: before handing a sample over, the scraper compares it with the previous one
    (``server_metrics.restart_reason``: counters that went down, a changed start time or kind),
    watches the model labels on the page, and every ``identify_every_s`` re-reads the identity
    (models, build). On any of these it re-identifies; if the server gave away nothing that
    tells the two processes apart, it stamps ``restart_epoch`` so the id still changes. The
    first sample of the new instance has ``restart=True``.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        path: str = "/metrics",
        interval_s: float = 5.0,
        on_sample: Callable[[ScrapeSample], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        timeout_s: float = 2.0,
        wall_clock: Callable[[], float] = time.time,
        identify_every_s: float = 60.0,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.path = path if path.startswith("/") else "/" + path
        self.interval_s = float(interval_s)
        self.on_sample = on_sample
        self.clock = clock
        self.wall_clock = wall_clock
        # Not clamped to the interval: a slow poll only makes the loop skip ticks, while a
        # timeout shorter than the server's answer time would turn every poll into a failure.
        self.timeout_s = float(timeout_s)
        self.identify_every_s = float(identify_every_s)

        self.failures = 0
        self.failing = 0  # failures in a row since the last success (the log's back-off counts these)
        self._fail_logged_at: float | None = None
        self.callback_failures = 0
        self.last_error: str | None = None
        self.disabled_reason: str | None = None
        self.samples = 0
        self.restarts = 0
        self.instance: Instance | None = None
        self.last_sample: ScrapeSample | None = None

        self._identified_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    @property
    def url(self) -> str:
        return self.base_url + self.path

    @property
    def instance_id(self) -> str | None:
        return self.instance.instance_id if self.instance else None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start polling (idempotent). Must be called with an event loop running."""
        if self.running or self.disabled_reason is not None:
            return
        self._stop = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"scrape {self.url}")

    async def stop(self) -> None:
        """Stop polling and wait for the poll in flight to end (it is cancelled if it takes
        longer than its own timeout)."""
        self._stop.set()
        task = self._task
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=self.timeout_s + 1.0)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def wait(self) -> None:
        """Return when the poller has ended: stopped, or turned itself off."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        next_t = self.clock()
        while not self._stop.is_set():
            await self.scrape_once()
            if self.disabled_reason is not None:
                log.warning("%s", self.disabled_reason)
                return
            next_t += self.interval_s
            now = self.clock()
            if next_t < now:  # fell behind (slow server): skip the missed ticks, keep cadence
                next_t = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=max(0.0, next_t - now))

    def _fail(self, message: str) -> None:
        self.failures += 1
        self.failing += 1
        self.last_error = message
        now = self.clock()
        if _worth_a_line(self.failing, now - self._fail_logged_at if self._fail_logged_at is not None else None):
            self._fail_logged_at = now
            log.warning("scrape of %s failed (%d in a row): %s; traffic is unaffected, scraping goes on",
                        self.url, self.failing, message)

    def _succeeded(self) -> None:
        if self.failing:
            log.info("scrape of %s recovered after %d failure%s in a row", self.url, self.failing,
                        "s" if self.failing != 1 else "")
        self.failing = 0
        self._fail_logged_at = None

    async def scrape_once(self) -> ScrapeSample | None:
        """One poll: fetch, parse, identify, hand over. Returns the sample, or ``None`` on
        failure (counted) or when disabled. Never raises (cancellation excepted)."""
        if self.disabled_reason is not None:
            return None
        t_sent = self.clock()
        try:
            async with self.session.get(
                self.url, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                # The page was built before the headers left the server: stamp now, not after
                # reading and parsing the body.
                t_mono, t_wall = self.clock(), self.wall_clock()
                status = resp.status
                if status in (404, 501) and self.samples == 0:
                    hint = " (llama.cpp: start llama-server with --metrics)" if status == 501 else ""
                    self.disabled_reason = (
                        f"GET {self.url} answered {status} on the first scrape: the server does not "
                        f"expose Prometheus metrics there{hint}; server-side scraping is off"
                    )
                    return None
                if status != 200:
                    raise ScrapeError(f"HTTP {status}")
                body = await resp.read()
                header = resp.headers.get(START_HEADER)
            text = body.decode("utf-8", errors="replace")
            if len(body) > PARSE_INLINE_MAX_BYTES:
                snapshot = await asyncio.to_thread(parse_exposition, text)
            else:
                snapshot = parse_exposition(text)
            start_header = float_or_none(header)
            if start_header is not None:
                snapshot = dataclasses.replace(snapshot, start_time_header=start_header)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the poller must survive anything the network does
            self._fail(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            return None

        restart = await self._track_instance(snapshot, t_mono, t_wall)
        sample = ScrapeSample(
            t_mono=t_mono,
            t_wall=t_wall,
            snapshot=snapshot,
            instance_id=self.instance_id or "",
            restart=restart,
            latency_s=t_mono - t_sent,
        )
        self.samples += 1
        self.last_sample = sample
        self._succeeded()
        if self.on_sample is not None:
            try:
                self.on_sample(sample)
            except Exception:  # a broken consumer must not stop measurement
                self.callback_failures += 1
                log.exception("on_sample callback failed for %s", self.url)
        return sample

    async def _identify(self, snapshot: Snapshot, t_mono: float) -> Instance:
        self._identified_at = t_mono
        return await identify_instance(
            self.session, self.base_url, snapshot=snapshot, timeout_s=self.timeout_s
        )

    async def _track_instance(self, snapshot: Snapshot, t_mono: float, t_wall: float) -> bool:
        """Keep ``self.instance`` current; return True when this snapshot starts a new one."""
        if self.instance is None or self.last_sample is None:
            self.instance = await self._identify(snapshot, t_mono)
            return False
        prev = self.last_sample.snapshot
        reason = restart_reason(prev, snapshot)
        if reason is None and prev.model_names and snapshot.model_names and prev.model_names != snapshot.model_names:
            reason = "model labels changed"
        due = self._identified_at is None or t_mono - self._identified_at >= self.identify_every_s
        if reason is None and not due:
            return False
        new = await self._identify(snapshot, t_mono)
        old = self.instance
        if reason is None:
            reason = identity_changed(old, new)
            if reason is None:
                # Same process; keep the id stable but learn parts an earlier look-up missed.
                self.instance = dataclasses.replace(
                    old,
                    models=old.models if old.models is not None else new.models,
                    build=old.build or new.build,
                    model_path=old.model_path or new.model_path,
                    total_slots=old.total_slots if old.total_slots is not None else new.total_slots,
                )
                return False
        if identity_changed(old, new) is None:
            # Nothing the server exposes tells the two processes apart (no start time, same
            # models and build): the counters are the only witness, so mark the time we saw it.
            # Always from the fresh identity, so a second restart cannot fall back to the
            # first instance's id.
            new = new.rehashed(restart_epoch=round(t_wall, 3))
        log.info("server %s restarted (%s): instance %s -> %s", self.base_url, reason, old.instance_id, new.instance_id)
        self.instance = new
        self.restarts += 1
        return True
