"""The forwarding path: one exchange with the one configured upstream, from either front.

Why it looks like this: a measuring tool must not disturb what it measures. Two fronts read requests:
the lane (``lane.py``) takes the common, plainly well-formed request straight from the socket, and hands
any other, from its first byte, to aiohttp's low-level server (``aiohttp_front.py``), which parses and
vets it (``refusals.py``); both call ``Proxy.exchange`` with an ``Incoming`` and a ``Client`` once the
request's body is whole. Each request is one ``wire.exchange.Exchange``: per read of the upstream's
body, inside the socket callback (or the relay thread), its relay takes a monotonic timestamp, writes the
bytes to the client's transport (chunk framing passed verbatim), takes another timestamp and appends to
the turn's ``TurnRecorder`` (the wire's ``Recorder``). The handler's task only waits: for the end, or for a slow
client to drain (backpressure). No parsing, tokenizing or database work happens on the event loop; once
the response has ended, the turn is handed to a worker thread that makes the ``Record`` and puts it
in the store's queue (``store``: a put that never blocks); the loop hears of it after (``heard``).
Request and response bodies pass byte-identical; the header rules are ``headers.py``'s. A request of any method, POST included, is sent twice in one case only:
the upstream closed a kept-alive connection before a byte of the answer (``UpstreamPool.request``: once
more, on a new connection, never a third time); nothing else is retried.

Nothing a client sent (headers, query, body) reaches the logs or a record's ``error``: errors are
described by their type and our own words, with any URL removed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from specproxy.config import Config
from specproxy.measure.apis import is_measured
from specproxy.measure.turn_recorder import TurnRecorder
from specproxy.measure.chunk_gaps import StreamTiming
from specproxy.measure.tenant import TenantRule
from specproxy.measure.tokens import Tokenizer
from specproxy.record import Record, new_conn_id
from specproxy.serve.headers import LABEL_HEADER, host_header, request_head, response_head
from specproxy.serve.incoming import Client, Incoming
from specproxy.serve.counters import Counters
from specproxy.serve.measuring import Built, MeasuringWorker, Store, where
from specproxy.serve.refusals import Refusal, busy, error_response
from specproxy.wire import memory
from specproxy.wire.exchange import Exchange
from specproxy.wire.pool import UpstreamPool
from specproxy.wire.upstream import UpstreamError

__all__ = ["Proxy", "Sink", "TurnMetrics", "TurnWatch", "conn_id", "where"]

log = logging.getLogger("specproxy.serve.proxy")

MAX_PENDING_BUILDS = 10000  # turns waiting to be measured; past this a turn is forwarded but not measured
# The memory budget's shares (docs/operations.md, "Memory"): a request body over SMALL_BODY, and kept
# response bytes, may fill LARGE_SHARE of it; the rest is for small bodies, so that large ones cannot lock
# ordinary requests out. Turns waiting to be measured may hold BACKLOG_SHARE of it; past that a finished
# turn lets go of its request body (its prompt is not counted), then of its response, before it queues.
SMALL_BODY = 1 << 20
LARGE_SHARE = 0.75
BACKLOG_SHARE = 0.5

clock = time.perf_counter

# each client connection's id, by its transport: one object per connection whichever front reads it
# (the lane hands its transport to aiohttp's server), dropped with the connection
_CONN_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def conn_id(transport: asyncio.BaseTransport | None) -> int | None:
    """The ``conn_id`` of the client connection ``transport`` is: the same for every request it
    carries, drawn at its first. None without a transport (or one that cannot be weakly referenced:
    keying on ``id()`` could give a later connection a closed one's id)."""
    if transport is None:
        return None
    try:
        found = _CONN_IDS.get(transport)
        if found is None:
            found = _CONN_IDS[transport] = new_conn_id()
        return found
    except TypeError:
        return None


# What the service gives the proxy, each at construction (``service.py`` composes them):
class TurnWatch(Protocol):
    """Who watches the upstream's own counters beside the turns (``watch.ServerWatch``)."""

    # the upstream instance a turn starting now is stamped with (None: not known); read once a turn
    instance_id: str | None

    def turn_ended(self, turn_id: str, t_request: float, prev_done: float) -> object:
        """A measured turn that ran alone ended (its id, when its request was read, when the measured turn
        before it ended): to join it with the server's counter deltas over it."""


class TurnMetrics(Protocol):
    """What hears of each measured record the store took, on the loop (``own_metrics.OwnMetrics``)."""

    def record(self, r: Record, timing: StreamTiming | None) -> object: ...


# each measured record, on the loop, whether the store took it or not (tests, ``bench``); one that raises is
# logged by its exception's type alone, and the others still hear of the record
Sink = Callable[[Record], object]
# specproxy's own pages (``admin.Admin.handle``), answered by aiohttp's front: the lane declines them
AdminPages = Callable[[Any], Awaitable[Any]]


class Proxy:
    """Holds the upstream pool, the measuring worker and what it was given: the counters it and the fronts
    keep (``counters.Counters``), where records go (``store``, in the measuring thread; ``metrics`` and
    ``sinks``, on the loop), who watches the upstream beside the turns (``watch``) and who answers the
    reserved pages (``admin``). ``instance_override``, when set, stamps every turn instead of the watch's
    instance (``bench``, whose restarts name their own)."""

    def __init__(
        self,
        cfg: Config,
        *,
        tokenizer: Tokenizer | None,
        counters: Counters,
        store: Store,
        metrics: TurnMetrics | None = None,
        sinks: Sequence[Sink] = (),
        watch: TurnWatch | None = None,
        admin: AdminPages | None = None,
        tenant_rule: TenantRule | None = None,
    ) -> None:
        self.cfg = cfg
        self.upstream = cfg.upstream_url
        # requests go to the upstream's path prefix (if any; a trailing /v1 is not one: config.server_root)
        # + the client's path and query, as sent
        self._base_path = self.upstream.raw_path.rstrip("/").encode()
        self._host_header = host_header(self.upstream)
        self._client_header = cfg.client_header.strip().lower().encode()
        self.tokenizer = tokenizer
        self.counters = counters
        self._store = store
        self.metrics = metrics
        self.sinks = sinks
        self.watch = watch
        self.instance_override: str | None = None
        self.admin = admin
        self.tenant_rule = tenant_rule
        self.turns_started = 0
        self.last_turn_done = 0.0  # monotonic time the latest measured turn ended
        self.budget = cfg.memory_budget_bytes or memory.default_budget(cfg.max_body_bytes)
        counters.memory_budget = self.budget
        self._backlog_bytes = 0  # budget held by turns waiting to be measured
        # why, once the service's shutdown cuts what is still in flight (its drain limit passed, or a second
        # Ctrl-C): those turns are the proxy's doing, recorded as ``shutdown``, not as the client's abort
        self.cutting: str | None = None
        self._quiet: asyncio.Event | None = None  # set when in_flight falls to 0 (``wait_quiet``)
        self._pending_builds = 0
        self._pool: UpstreamPool | None = None
        self._exchanges: set[Exchange] = set()  # in progress (``_busy`` looks at them only at max_concurrent)
        self._measurer: MeasuringWorker | None = None
        self._idle = asyncio.Event()

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Before the first request: the upstream pool and the measuring worker (they need the loop)."""
        # kept response bytes (and large bodies) stop at LARGE_SHARE: the relay thread checks this limit
        memory.set_limit(int(self.budget * LARGE_SHARE), self.budget)
        memory.release_large_at_once()
        pool = self._pool = UpstreamPool(self.upstream, connect_timeout_s=self.cfg.connect_timeout_s,
                                         idle_timeout_s=self.cfg.idle_timeout_s, relay=self.cfg.relay,
                                         relay_slice_us=self.cfg.relay_slice_us,
                                         relay_nice=self.cfg.relay_nice,
                                         reuse=self.cfg.upstream_reuse != "off",
                                         send_timeout_s=self.cfg.send_timeout_s)
        self._measurer = MeasuringWorker(self.tokenizer, pool.activity, asyncio.get_running_loop(),
                                         self._built, store=self._store, keep_bodies=self.cfg.capture)

    async def close(self) -> None:
        """After the last request: close the pool, measure what is pending, stop the worker. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        await self.drain_measurements()
        measurer, self._measurer = self._measurer, None
        if measurer is not None:
            await asyncio.to_thread(measurer.stop)  # joining a thread blocks: not on the loop

    async def probe_upstream(self, timeout_s: float) -> UpstreamError | None:
        """Whether the upstream accepts a connection now (None) or why not (``UpstreamPool.probe``)."""
        assert self._pool is not None
        return await self._pool.probe(timeout_s)

    @property
    def pending_measure(self) -> int:
        """Finished turns handed to the measuring worker and not yet built."""
        return self._pending_builds

    @property
    def upstream_idle(self) -> int:
        """Kept-alive upstream connections waiting for a request."""
        return len(self._pool.idle) if self._pool is not None else 0

    async def drain_measurements(self, timeout: float = 30.0) -> None:
        """Wait until every finished turn has been measured, stored and heard of."""
        deadline = time.monotonic() + timeout
        while self._pending_builds and time.monotonic() < deadline:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), max(deadline - time.monotonic(), 0.01))
            except TimeoutError:
                break

    async def wait_quiet(self, timeout: float) -> bool:
        """Until no request is in flight (True), or ``timeout`` passed (False). For the shutdown's drain."""
        if self._quiet is None:
            self._quiet = asyncio.Event()
        self._quiet.clear()
        if not self.counters.in_flight:
            return True
        try:
            await asyncio.wait_for(self._quiet.wait(), timeout)
        except TimeoutError:
            return not self.counters.in_flight
        return True

    def _busy(self) -> bool:
        """``max_concurrent`` reached, not counting exchanges whose response waits on a client that is not
        reading (``held_by_client``): clients that never read must not lock the readers out until their
        ``send_timeout_s``. Up to twice ``max_concurrent`` in flight in all, whoever holds them."""
        cap = self.cfg.max_concurrent
        in_flight = self.counters.in_flight
        if in_flight < cap:
            return False
        if in_flight >= 2 * cap or self._pool is None:
            return True
        return in_flight - self.held_by_clients >= cap

    @property
    def held_by_clients(self) -> int:
        """Exchanges whose body waits on its client alone (``Exchange.held_by_client``): a look at each one in
        progress, made only when ``max_concurrent`` is reached."""
        return sum(1 for ex in self._exchanges if ex.held_by_client)

    # --- the memory budget ------------------------------------------------------------------------

    def admit_body(self, n: int, *, large: bool = False) -> bool:
        """Charge ``n`` bytes of a request body to the memory budget, before they are read: False (nothing
        charged) when they do not fit, and the front refuses the body (``memory_full``). A body over
        ``SMALL_BODY`` (``large``: the rest of one already past it) may fill only ``LARGE_SHARE``."""
        return memory.take(n, not large and n <= SMALL_BODY)  # the limits set in start

    def release_body(self, n: int) -> None:
        """Give back ``admit_body``'s charge of a body that will not reach ``exchange`` (refused, cut)."""
        memory.give(n)

    def memory_full(self, n: int) -> Refusal:
        self.counters.rejected("memory")
        return error_response(503, "memory_budget", f"memory budget full: a request body of {n} bytes is "
                              "refused before it is read; try again later", close=True)

    # --- the handler ------------------------------------------------------------------------------

    async def exchange(self, req: Incoming, body: bytes, client: Client) -> Refusal | None:
        """A request whose body is whole, from either front, its ``len(body)`` already charged to the memory
        budget (``admit_body``; the charge is this exchange's from here): 503 past ``max_concurrent``
        (counted from here: a request still sending its body holds no one's place), else ``forward``."""
        if self._busy():
            self.counters.rejected("busy")
            memory.give(len(body))
            return busy(self.cfg)
        if req.label is not None and req.label.startswith("@"):
            # compare reads an arm beginning with "@" as a time window: such a label could never be named
            self.counters.rejected("bad")
            memory.give(len(body))
            return error_response(400, "bad_label", f"{LABEL_HEADER} {req.label[:64]!r} begins with '@', which "
                                  "compare reads as a time window (@START..END): choose a label that does not")
        counters = self.counters
        counters.in_flight += 1
        try:
            return await self.forward(req, body, client)
        finally:
            counters.in_flight -= 1
            if not counters.in_flight and self._quiet is not None:
                self._quiet.set()

    async def forward(self, req: Incoming, body: bytes, client: Client) -> Refusal | None:
        """One exchange with the upstream, from either front, the request read whole and vetted: relayed to
        ``client`` (None), or a refusal when the upstream gave no response. Every exchange gets a ``TurnRecorder``,
        handed to the measuring worker at the end whatever happened: a measured path's is measured, any
        other path's keeps no body and becomes a row of what the forwarding path saw (``measured`` false)."""
        t_request = clock()
        measured = is_measured(req.method, req.path)
        counters = self.counters
        if measured:
            counters.measured_in_flight += 1  # the operating point the upstream sees rises
            self.turns_started += 1
        started_before = self.turns_started
        prev_done = self.last_turn_done
        # every exchange gets a row; another path's turn keeps no body bytes (``measured=False``)
        turn = TurnRecorder(
            method=req.method,
            path=req.path,
            body=body,
            t_wall=time.time(),
            t_request=t_request,
            concurrency=counters.measured_in_flight,
            label=req.label or self.cfg.label,
            instance_id=self._instance(),
            conn_id=conn_id(client.transport),
            store_text=self.cfg.store_text,
            request_encoding=req.content_encoding,
            headers=req.raw_headers,
            client_header=self._client_header,
            max_bytes=self.cfg.max_measured_bytes,
            measured=measured,
            take=memory.take,
            let_go=memory.trim,
            body_charge=len(body),
            max_counted=self.cfg.max_counted_bytes,
            proxy_name=self.cfg.name_of_proxy,
            tenant_rule=self.tenant_rule,
        )
        try:
            return await self._relay(req, body, turn, client)
        except Exception as exc:  # a bug of ours, not the client's nor the upstream's: still one record
            if not turn.ended:
                reason = f"{type(exc).__name__} ({where(exc)})"  # its message might quote the request
                if turn.t_upstream_headers is None:
                    turn.fail(clock(), "proxy_error", None, reason)
                else:
                    turn.finish(clock(), "proxy_error", reason)
            raise
        finally:
            if measured:
                counters.measured_in_flight -= 1
            self._submit(turn)
            if measured:
                self.last_turn_done = clock()
                # a turn that ran alone can be joined with the server's counter deltas over it
                if turn.concurrency == 1 and self.turns_started == started_before and self.watch is not None:
                    self.watch.turn_ended(turn.id, t_request, prev_done)

    def _instance(self) -> str | None:
        if self.instance_override is not None:
            return self.instance_override
        watch = self.watch
        return watch.instance_id if watch is not None else None

    async def _relay(self, req: Incoming, body: bytes, b: TurnRecorder, client: Client) -> Refusal | None:
        assert self._pool is not None
        exchange = Exchange(self._pool, b)
        self._exchanges.add(exchange)
        try:
            return await self._carry(exchange, req, body, b, client)
        finally:
            self._exchanges.discard(exchange)

    async def _carry(self, exchange: Exchange, req: Incoming, body: bytes, b: TurnRecorder,
                     client: Client) -> Refusal | None:
        try:
            head_bytes = request_head(self._base_path, self._host_header, req, body)
            # the upstream connection stays this client connection's (none if it will not send another)
            owner = client.transport if req.http11 and req.keep_alive else None
            # a large body is written after the head as it is: joining them would copy it
            data = head_bytes + body if len(body) < SMALL_BODY else (head_bytes, body)
            head = await exchange.send(req.method, data, owner)
        except UpstreamError as exc:
            # refused, reset or malformed: 502; no connection within connect_timeout_s, or no response
            # head within idle_timeout_s: 504. Either way the upstream gave no response to relay.
            status = 504 if exc.timeout else 502
            kind = "upstream_timeout" if status == 504 else "upstream_unreachable"  # stored as the client is told
            b.fail(clock(), kind, status, str(exc))
            return error_response(status, kind, f"no response from the upstream: {exc}")
        try:
            raw, mode, keep = response_head(head, req)
            await client.start(head.status, raw, keep)
            transport = client.transport
            if transport is None:  # the client left while we waited for the upstream
                exchange.abandon("client_abort", "client disconnected")
                return None
            exchange.attach(transport, mode)
            while exchange.outcome is None:
                await exchange.wait()
                if exchange.paused:  # the client reads slower than the upstream sends: wait for it to drain
                    await client.drain()
                    exchange.resume()
            return None
        except asyncio.CancelledError:  # the client hung up (its front cancels the handler): keep the turn
            exchange.abandon("client_abort", "client disconnected")
            raise
        except Exception as exc:  # a bug of ours: the turn is recorded as such, the client sees a cut
            exchange.abandon("proxy_error", f"{type(exc).__name__} ({where(exc)})")
            client.abort()
            raise

    # --- measuring, off the forwarding path -----------------------------------------------------------

    def _submit(self, turn: TurnRecorder) -> None:
        if not turn.ended:  # e.g. cancelled while reading: still one record per turn
            turn.fail(clock(), "client_abort", None, "client disconnected before the response")
        if self.cutting and turn.outcome == "client_abort":  # the client did not leave: the proxy cut it
            turn.outcome, turn.error = "shutdown", f"cut by specproxy's shutdown: {self.cutting}"
        if self._pending_builds >= MAX_PENDING_BUILDS:
            self.counters.measure_dropped_one()
            memory.give(turn.let_go())
            return
        if not turn.measured:  # nothing reads an unmeasured turn's body or response: let go of them now
            memory.give(turn.let_go())
        charge = turn.charged()
        if charge and self._backlog_bytes + charge > self.budget * BACKLOG_SHARE:
            # measuring is behind: measure this turn less rather than hold more (the record says so)
            # the larger of its prompt and its response first, the other only if that was not enough
            self.counters.measure_shed_one()
            sheds = [turn.shed_prompt, turn.shed_response]
            if turn.body_charge * 2 < charge:
                sheds.reverse()
            freed = sheds[0]()
            if self._backlog_bytes + charge - freed > self.budget * BACKLOG_SHARE:
                freed += sheds[1]()
            memory.give(freed)
            charge -= freed
        self._backlog_bytes += charge
        turn.backlog_charge = charge
        self._pending_builds += 1
        assert self._measurer is not None
        self._measurer.submit(turn, more_in_flight=self.counters.measured_in_flight > 0)

    def _built(self, results: list[Built]) -> None:
        """On the loop, once per batch the measuring worker built and handed to the store: each measured
        record to ``metrics`` (when the store took it: /metrics counts the store's rows, not those it
        dropped) and to the ``sinks``. The turns stay pending until they have been heard of: another thread
        that reads ``pending_measure`` as 0 (a test, a drain) must find every record already with the store
        and the listeners, and the interpreter may switch threads between any two lines here."""
        metrics, sinks = self.metrics, self.sinks
        try:
            for built in results:
                record = built.record
                if built.error is not None:
                    # measuring failed (a bug, e.g. on input nobody foresaw): the turn still got its row, made
                    # by the measuring thread (``unmeasured_record``)
                    self.counters.measure_failed()
                    log.error("measuring a turn failed: %s", f"{type(built.error).__name__} ({where(built.error)})")
                if not record.measured:  # another path's row: stored, not a turn of the figures
                    continue
                if metrics is not None and built.stored:
                    metrics.record(record, built.turn.timing if built.error is None else None)  # a failed build's: no times
                for sink in sinks:
                    try:
                        sink(record)
                    except Exception as exc:  # a broken observer must not cost the record
                        log.error("sink failed: %s", type(exc).__name__)  # the message may quote the record
        finally:
            for built in results:
                self._backlog_bytes -= built.turn.backlog_charge
            self._pending_builds -= len(results)
            if not self._pending_builds:
                self._idle.set()

