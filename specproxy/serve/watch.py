"""Watching the upstream's own counters beside the traffic: store every scrape, know the instance,
and join a lone turn with the counter deltas over its lifetime.

Why apart from the proxy: the proxy sees what clients got; the server's ``/metrics`` says what it
did (drafts, accepted tokens, requests running). Scrapes go through the same writer queue as turns
(never blocking), a scrape failure is stored as a row with its error and never touches traffic, and
every turn is stamped with the server instance current when it started, so a restart shows up as a
new instance in reports and comparisons.

Lone turns: when a turn ran alone (nothing else in flight through the proxy, from start to end), an
extra scrape right after it ends, minus the latest scrape taken after the previous turn ended and
before this one started, is the server's accounting of exactly this turn (servers that credit
counters when a request finishes, like llama.cpp and SGLang, included).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Reversible

import aiohttp
import orjson

from specproxy.config import Config
from specproxy.observe.scrape import Scraper, ScrapeSample, delta
from specproxy.store import rows
from specproxy.store.writer import Writer

__all__ = ["ServerWatch", "page_between"]

log = logging.getLogger("specproxy.serve.watch")

clock = time.perf_counter  # the proxy's clock, so scrape times and turn times compare

class ServerWatch:
    """Polls the upstream's Prometheus endpoint every ``scrape_interval_s`` and on lone turns' ends."""

    def __init__(self, cfg: Config, writer: Writer | None) -> None:
        self.cfg = cfg
        self.writer = writer
        self.scraper: Scraper | None = None
        self.recent: collections.deque[ScrapeSample] = collections.deque(maxlen=256)
        self.joined = 0
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._turn_tasks: set[asyncio.Task] = set()
        # the upstream instance a turn starting now is stamped with: an attribute, kept current after each
        # scrape (the only moment it can change), so that a turn reads it without a call
        self.instance_id: str | None = None
        self._last_instance: str | None = None
        # One scrape at a time. The poller and lone turns' after-scrapes would otherwise overlap,
        # and an overlapping pair can finish in the other order than it was stamped (a big page is
        # parsed in a thread; identifying awaits the network): the scraper would then compare a
        # newer page with an older one, see counters go down, and declare a restart that never
        # happened (a new instance id, a window split in two).
        self._scrape_lock = asyncio.Lock()

    @property
    def failures(self) -> int:
        return self.scraper.failures if self.scraper is not None else 0

    async def start(self) -> None:
        if self.cfg.scrape_interval_s <= 0:
            return
        self._session = aiohttp.ClientSession(trust_env=False)
        self.scraper = Scraper(self._session, self.cfg.upstream_url.human_repr(), self.cfg.metrics_path,
                               self.cfg.scrape_interval_s, on_sample=self._store, clock=clock)
        self._stop = asyncio.Event()
        await self._scrape()  # know the instance before the first turn (bounded by the scrape timeout)
        self._task = asyncio.get_running_loop().create_task(self._poll(), name="specproxy-scrape")

    async def stop(self) -> None:
        self._stop.set()
        for task in [self._task, *self._turn_tasks]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                    await asyncio.wait_for(task, 5)
        if self._session is not None:
            await self._session.close()

    async def _poll(self) -> None:
        """Scrape on a fixed cadence until stopped; failures are stored, counted, and survived."""
        assert self.scraper is not None
        while not self._stop.is_set():
            if self.scraper.disabled_reason is not None:
                log.warning("%s", self.scraper.disabled_reason)
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.cfg.scrape_interval_s)
            if not self._stop.is_set():
                await self._scrape()

    async def scrape_now(self) -> None:
        """One scrape now, stored as the poller's are (none when scraping is off): e.g. after a run's last
        turn, so that a report's span of counters closes after it (docs/report.md)."""
        if self.scraper is not None and self.scraper.disabled_reason is None:
            await self._scrape()

    async def _scrape(self) -> ScrapeSample | None:
        assert self.scraper is not None
        async with self._scrape_lock:
            return await self._scrape_locked()

    async def _scrape_locked(self) -> ScrapeSample | None:
        assert self.scraper is not None
        failures = self.scraper.failures
        sample = await self.scraper.scrape_once()
        self.instance_id = self.scraper.instance_id
        if sample is None and self.scraper.failures > failures and self.writer is not None:
            self.writer.put(rows.failed_scrape(time.time(), clock(), self.instance_id, self.scraper.last_error))
        return sample

    def _store(self, sample: ScrapeSample) -> None:
        self.recent.append(sample)
        if self.writer is None:
            return
        s = sample.snapshot
        raw = orjson.dumps([[name, dict(labels), value] for name, labels, value in s.raw],
                           option=orjson.OPT_SERIALIZE_NUMPY, default=str).decode()
        self.writer.put(rows.scrape((
            sample.t_wall, sample.t_mono, sample.instance_id, s.server_kind, s.requests_running,
            s.requests_waiting, s.generation_tokens_total, s.prompt_tokens_total, s.spec_drafts_total,
            s.spec_draft_tokens_total, s.spec_accepted_tokens_total, s.spec_accept_length,
            s.spec_accept_rate, raw, None), prefix_cache_queries=s.prefix_cache_queries_total,
            prefix_cache_hits=s.prefix_cache_hits_total, latency_s=sample.latency_s))
        if sample.instance_id and sample.instance_id != self._last_instance:
            self._last_instance = sample.instance_id
            inst = self.scraper.instance if self.scraper is not None else None
            detail = orjson.dumps(inst.identity() if inst is not None else {}, default=str).decode()
            self.writer.put(rows.instance_seen(sample.instance_id, sample.t_wall, detail))

    # --- lone turns ---------------------------------------------------------------------------------

    def turn_ended(self, turn_id: str, t_request: float, prev_done: float) -> None:
        """Called by the proxy when a measured turn that ran alone ends (on the loop; must not block)."""
        if self.scraper is None or self.scraper.disabled_reason is not None or self._stop.is_set():
            return
        task = asyncio.get_running_loop().create_task(self._join(turn_id, t_request, prev_done))
        self._turn_tasks.add(task)
        task.add_done_callback(self._turn_tasks.discard)

    async def _join(self, turn_id: str, t_request: float, prev_done: float) -> None:
        before = page_between(self.recent, prev_done, t_request)
        after = await self._scrape()  # sent now, after the turn ended: its page counts the turn
        if before is None or after is None or after.instance_id != before.instance_id:
            return
        d = delta(before, after)
        if d.restarted or self.writer is None:
            return
        self.joined += 1
        self.writer.put(rows.turn_counters(
            turn_id, after.instance_id, d.seconds, d.generated_tokens, d.drafts, d.draft_tokens,
            d.accepted_tokens, d.mal, d.acceptance_rate))


def page_between(samples: Reversible[ScrapeSample], t0: float, t1: float) -> ScrapeSample | None:
    """The latest of ``samples`` (in the order they were taken) whose page the server built between ``t0``
    and ``t1`` (monotonic): its request sent at or after ``t0`` (a page is built after its request came),
    its headers back by ``t1`` (and before they left). A lone turn's counters start from it: one sent
    before the previous turn ended may come back after it without that turn's counts."""
    for s in reversed(samples):
        if s.t_mono <= t1 and s.t_mono - (s.latency_s or 0.0) >= t0:
            return s
    return None
