"""Running the proxy as a service: tokenizer, writer thread, proxy, listening socket, clean shutdown.

Why apart from ``proxy.py``: the handler is the hot path and knows nothing of processes, signals or
files; this module owns their lifecycle so that ``serve``, ``demo`` and the tests start the very same
thing. On SIGTERM/SIGINT it says how many streams it is draining, stops accepting, lets in-flight
streams finish (up to Config ``drain_timeout_s``; a second signal cuts them at once), records the turns
it cut as ``shutdown``, measures what is pending and drains the writer's queue before exiting. On
SIGUSR1 it logs one line of its state (tasks, connections, file descriptors, queue, counters): the soak
test reads leaks from it.

The listening socket is opened here rather than by aiohttp's ``TCPSite`` so that every connection
gets a header deadline: a client that has not finished its first request's headers within
``header_timeout_s`` of connecting is disconnected (slowloris). Later requests on a kept-alive
connection are bounded by aiohttp's keep-alive timer, which ``proxy.py`` sets to the same value.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

from aiohttp import web

from specproxy.wire.cadence_poll import CadenceGate, cpu_quota, poll_stats
from specproxy.wire.relay_thread import relay_nice
from specproxy import __version__
from specproxy.config import Config, parse_slo
from specproxy.errors import SpecproxyError
from specproxy.serve.admin import Admin, Pages, is_loopback
from specproxy.serve.aiohttp_front import AiohttpFront
from specproxy.serve.counters import Counters
from specproxy.serve.lane import Lane, Lanes
from specproxy.serve.otlp import Otlp
from specproxy.serve.own_metrics import OwnMetrics
from specproxy.serve.watch import ServerWatch
from specproxy.serve.measuring import to_writer
from specproxy.serve.proxy import Proxy
from specproxy.record import Record
from specproxy.store.shipper import Shipper
from specproxy.store.sinks import make_sink
from specproxy.store.writer import Writer
from specproxy.measure.failures import FAILURES
from specproxy.measure.tenant import TenantRule
from specproxy.measure.tokens import Tokenizer, load_tokenizer
from specproxy.store.db import open_existing
from specproxy.store.queries import tenant_key_secret

__all__ = ["Service", "install_uvloop"]

log = logging.getLogger("specproxy")

# How long start-up waits to connect to the upstream for its one check (at most connect_timeout_s): the
# scraper's own timeout, which the first scrape already waits for, so the check adds no delay of its own.
START_CHECK_TIMEOUT_S = 2.0
CUT_S = 0.1  # then how long aiohttp's server waits for a handler it was told to stop, twice at most
CUT_WAIT_S = 5.0  # and how long the cut exchanges get to hand their turns over
AFTER_DRAIN = "a request that came after the drain"  # why such a request was cut (its record's error)


def settle_heap() -> int:
    """Collect once, then freeze every object start-up made; returns how many are frozen.

    Why: Python's full (oldest-generation) collection walks every object the collector tracks, and
    start-up (aiohttp, the tokenizer, the store, their imports) leaves tens of thousands of them. Under load
    a full collection runs on the event loop's thread and stalls it for the whole walk: every turn that
    starts meanwhile waits, and the request time the proxy stamps is late by as much. Frozen
    (``gc.freeze``), start-up's objects are never walked again, and the walk is several times shorter
    (docs/performance.md, "Design figures"). What start-up left as garbage is collected first."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class _HeadDeadline(asyncio.Protocol):
    """Wraps the per-connection protocol (the lane, or aiohttp's); closes the connection when the first
    request's headers (up to the blank line that ends them) have not all arrived within ``timeout`` of
    connecting.

    It looks at incoming bytes only until that blank line, then steps aside: the transport's protocol is
    the wrapped one from then on (``set_protocol``), so no later read of the connection passes through
    here. Requests are never parsed here (the lane or aiohttp parses them); responses never pass (they go
    straight to the transport)."""

    __slots__ = ("_handle", "_inner", "_on_expire", "_tail", "_timeout", "_transport")

    def __init__(self, inner: asyncio.Protocol, timeout: float, on_expire: Callable[[], None]) -> None:
        self._inner = inner
        self._timeout = timeout
        self._on_expire = on_expire
        self._handle: asyncio.TimerHandle | None = None
        self._tail = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._handle = asyncio.get_running_loop().call_later(self._timeout, self._expire)
        self._inner.connection_made(transport)

    def _expire(self) -> None:
        self._handle = None
        if self._transport is not None and not self._transport.is_closing():
            self._on_expire()
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._handle is not None:
            seen = self._tail + data
            if b"\r\n\r\n" in seen:
                self._handle.cancel()
                self._handle = None
                self._tail = b""
                if self._transport is not None and not self._transport.is_closing():
                    self._transport.set_protocol(self._inner)  # the deadline is met: out of the way
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._transport = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Bind (not yet listen on) every address ``host`` resolves to, as asyncio's ``create_server`` would;
    a SpecproxyError when one cannot be bound (a port in use), with nothing left open."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise SpecproxyError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sockets


def install_uvloop() -> bool:
    """Use uvloop when it is installed (it is a dependency on Linux and macOS)."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


FEW_FILES = 4096  # an open-file limit below this is said at start: connections would run out first


def raise_open_files_limit() -> int | None:
    """Raise this process's soft limit of open files to its hard limit; return the soft limit now (None
    where there is no such limit). Why: every client and upstream connection is a descriptor, and the
    common soft default (1024) is reached by a thousand slow clients, after which connections are refused
    while the machine has room for many more."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20  # Linux refuses an unlimited one (nr_open)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft
    return want


def tenant_rule(cfg: Config) -> TenantRule | None:
    """How this proxy names tenants: by ``tenant_header``, or by the API key under the fleet's shared
    secret (``tenant_secret_file``, ``SPECPROXY_TENANT_SECRET``: never written to the database), else under
    the database's own (read once here, after the writer made or upgraded the database), or not at all."""
    if cfg.tenant_header:
        return TenantRule(header=cfg.tenant_header)
    if cfg.tenant_from_key:
        if cfg.tenant_key_secret is not None:
            return TenantRule(secret=cfg.tenant_key_secret)
        with open_existing(cfg.db) as conn:
            return TenantRule(secret=tenant_key_secret(conn))
    return None


@dataclass
class Service:
    """The running proxy. ``await start()``, then ``await stop()``; ``port`` is the bound port."""

    cfg: Config
    tokenizer: Tokenizer | None = None
    extra_sinks: list[Callable[[Record], object]] = field(default_factory=list)
    writer: Writer | None = None
    proxy: Proxy | None = None
    watch: ServerWatch | None = None
    port: int = 0
    counters: Counters | None = None  # every count of the running proxy (counters.py), from start()
    lanes: Lanes = field(default_factory=Lanes)
    cadence: CadenceGate | None = None
    pages: Pages | None = None  # the live page's pictures, composed in from above (view.live); None: no page
    metrics: OwnMetrics | None = None
    admin: Admin | None = None
    shippers: list[Shipper] = field(default_factory=list)  # one per Config sink (store/shipper.py)
    otlp: Otlp | None = None  # with Config otlp_endpoint: the figures pushed over OTLP (serve/otlp.py)
    tenant_rule: TenantRule | None = None  # how turns name their tenant (Config tenant_header, tenant_from_key)
    _runner: web.ServerRunner | None = None
    _listeners: list[asyncio.AbstractServer] = field(default_factory=list)
    _sockets: list[socket.socket] = field(default_factory=list)  # bound by from_config, served by start

    def __post_init__(self) -> None:
        if self.tenant_rule is None:  # after the writer made the database, whoever made the service
            self.tenant_rule = tenant_rule(self.cfg)

    @classmethod
    def from_config(cls, cfg: Config) -> Service:
        """Bind the port, then load what can fail (tokenizer, database), so that errors come at start-up
        and a port in use is said before the database file (and its -wal, -shm) is created."""
        cfg.upstream_url  # noqa: B018 - raises ConfigError without an upstream
        sockets = bind_listeners(cfg.host, cfg.port)
        try:
            tokenizer = load_tokenizer(cfg.tokenizer)
            writer = Writer(cfg.db, queue_size=cfg.queue_size, scrape_retention_days=cfg.scrape_retention_days)
            shippers = [Shipper(cfg.db, make_sink(url), cfg.name_of_proxy) for url in cfg.sinks]
            service = cls(cfg=cfg, tokenizer=tokenizer, writer=writer, shippers=shippers, _sockets=sockets)
            try:
                service._make_otlp()  # here rather than in start(): importing the SDK reads files, off the loop
            except BaseException:
                writer.close()
                raise
            return service
        except BaseException:
            for sock in sockets:
                sock.close()
            raise

    def _make_otlp(self) -> None:
        """With Config ``otlp_endpoint``, the OTLP exporter (once): ConfigError when its SDK is missing."""
        if self.cfg.otlp_endpoint is not None and self.otlp is None:
            self.otlp = Otlp(self.cfg.otlp_endpoint, self.cfg.otlp_interval_s, self.cfg.name_of_proxy, __version__,
                             lambda: self.metrics,
                             lambda: self.counters.read_sinks() if self.counters is not None else {})

    def _identity(self, watch: ServerWatch) -> dict[str, str]:
        """Who this proxy is, for /metrics' ``specproxy_proxy_info`` only (never a label on the figures)."""
        return {"proxy_name": self.cfg.name_of_proxy, "version": __version__,
                "upstream_instance": watch.instance_id or ""}

    async def start(self) -> int:
        # a measuring worker thread holding the GIL must not delay the forwarding loop for long
        sys.setswitchinterval(0.001)
        watch = self.watch = ServerWatch(self.cfg, self.writer)
        if self.otlp is None and self.cfg.otlp_endpoint is not None:  # a Service built by hand, not from_config
            await asyncio.to_thread(self._make_otlp)  # importing its SDK reads files: not on the loop
        counters = self.counters = Counters(self.writer, lambda: watch.failures, self.shippers, self.otlp)
        self.metrics = OwnMetrics(counters.read, counters.read_sinks, lambda: self._identity(watch),
                                  slo=parse_slo(self.cfg.slo, "slo"))
        writer = self.writer
        # the live page redraws when turns land, and when the store refuses or drops (its note says so)
        self.admin = Admin(self.cfg, self.metrics, lambda: (writer.commits, writer.write_failures, writer.dropped)
                           if writer is not None else 0, self.pages)
        if not is_loopback(self.cfg.host) and self.cfg.admin_token is None:
            log.warning("listening on %s without admin_token: the live page and /_specproxy/metrics answer 401 "
                        "to every client (set admin_token to reach them)", self.cfg.host)
        # the watch only when it scrapes: without, it knows no instance and has no turn to join
        self.proxy = Proxy(self.cfg, tokenizer=self.tokenizer, counters=counters,
                           store=to_writer(writer, self.cfg.capture), metrics=self.metrics, sinks=self.extra_sinks,
                           watch=watch if self.cfg.scrape_interval_s > 0 else None, admin=self.admin.handle,
                           tenant_rule=self.tenant_rule)
        await self.proxy.start()
        for shipper in self.shippers:  # after the writer made the file: they read it forward
            shipper.start()
        if self.otlp is not None:  # exports OwnMetrics' totals from its own thread (serve/otlp.py)
            self.otlp.start()
        # side by side, so that start-up waits for the slower of the two, never their sum
        await asyncio.gather(self.watch.start(), self._check_upstream())
        mode = self.cfg.cadence_poll
        quota = await asyncio.to_thread(cpu_quota) if mode == "auto" else None  # files: not on the loop
        self.cadence = CadenceGate(mode, quota=quota)
        self.cadence.start()
        # the graceful wait is stop()'s own (drain_timeout_s); aiohttp's is only for what stop() then cuts
        self._runner = web.ServerRunner(AiohttpFront(self.proxy).make_server(), shutdown_timeout=CUT_S)
        await self._runner.setup()
        server = self._runner.server  # aiohttp's protocol factory
        assert server is not None
        timeout = self.cfg.header_timeout_s

        expired = counters.header_timed_out
        proxy, lanes = self.proxy, self.lanes
        if self.cfg.lane:  # the common request without aiohttp's server; any other goes on to it (lane.py)
            def protocol() -> asyncio.Protocol:
                return _HeadDeadline(Lane(proxy, lanes, server, timeout), timeout, expired)
        else:
            def protocol() -> asyncio.Protocol:
                return _HeadDeadline(server(), timeout, expired)

        sockets, self._sockets = self._sockets or bind_listeners(self.cfg.host, self.cfg.port), []
        loop = asyncio.get_running_loop()
        for sock in sockets:
            self._listeners.append(await loop.create_server(protocol, sock=sock, backlog=1024))
        self.port = sockets[0].getsockname()[1]
        return self.port

    async def _check_upstream(self) -> None:
        """Connect to the upstream once before serving, so that a server that is down, or a mistyped URL,
        is said at start-up rather than by the first client's 502. Only a warning: the server may well be
        starting up too, and requests are forwarded (and answered 502/504) the same either way."""
        assert self.proxy is not None
        why = await self.proxy.probe_upstream(START_CHECK_TIMEOUT_S)
        if why is not None:
            log.warning("upstream %s is not answering (%s): serving anyway; requests will get %d until it does",
                        self.cfg.upstream, why, 504 if why.timeout else 502)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def open_connections(self) -> int:
        """Client connections open now: the lane's and aiohttp's server's."""
        server = self._runner.server if self._runner is not None else None
        return (len(server.connections) if server is not None else 0) + len(self.lanes.open)

    def state(self, fds: int = -1) -> dict[str, int | float]:
        """Counters for leak hunting and operators: what is alive now and what was refused or dropped.
        ``fds``: open descriptors, counted by the caller off the event loop (``count_fds``)."""
        p = self.proxy
        return {
            **(self.counters.read() if self.counters is not None else {}),  # every count (counters.COUNTS)
            "tasks": len(asyncio.all_tasks()),
            "connections": self.open_connections(),
            "lane_requests": self.lanes.requests,  # forwarded by the lane, without aiohttp's server
            "handed_over": self.lanes.handed_over,  # connections the lane gave to aiohttp's server
            "upstream_idle": p.upstream_idle if p else 0,  # kept-alive upstream connections
            "fds": fds,
            "pending_measure": p.pending_measure if p else 0,
            "measure_failures": FAILURES.total(),  # figures left null by a step that failed (logged per cause)
            "gc_frozen": gc.get_freeze_count(),  # objects start-up left that collections skip (settle_heap)
            **poll_stats(),  # the relay thread's cadence poll: windows, tokens caught in one, seconds spent
            "relay_nice": relay_nice(),  # the relay thread's nice value: Config relay_nice where it may be lowered
        }

    def log_state(self) -> asyncio.Future:
        """Log the state line (on SIGUSR1, from the loop). Counting descriptors lists a directory, which
        blocks: that runs on a worker thread, and the line is logged on the loop once the count is back."""
        counted = asyncio.get_running_loop().run_in_executor(None, count_fds)

        def log_line(f: asyncio.Future) -> None:
            fds = f.result() if not f.cancelled() else -1
            log.info("state %s", " ".join(f"{k}={v}" for k, v in self.state(fds).items()))

        counted.add_done_callback(log_line)
        return counted

    async def stop(self, now: asyncio.Event | None = None) -> None:
        """Stop listening, let in-flight exchanges finish (up to ``drain_timeout_s``, or until ``now`` is set: a
        second Ctrl-C), cut what is left (its turns recorded as ``shutdown``), measure what is pending,
        drain the queue."""
        for listener in self._listeners:
            listener.close()  # no new connections; open ones finish their current request
        for sock in self._sockets:  # bound, never served: start() failed or never ran
            sock.close()
        self._sockets = []
        if self.admin is not None:
            self.admin.close()  # live viewers' event streams end now rather than hold up the shutdown
        self.lanes.close_idle()
        server = self._runner.server if self._runner is not None else None
        if server is not None:
            server.pre_shutdown()  # each of aiohttp's connections closes after its current request
        proxy = self.proxy
        why = AFTER_DRAIN
        if proxy is not None and proxy.counters.in_flight:
            why = await self._drain(proxy, self.cfg.drain_timeout_s, now)
        if proxy is not None:
            proxy.cutting = why  # whatever ends from here on was ended by us
        self.lanes.cut()
        if self._runner is not None:
            await self._runner.cleanup()  # cuts aiohttp's handlers still running (CUT_S)
            self._runner = None
        if proxy is not None and proxy.counters.in_flight:
            await proxy.wait_quiet(CUT_WAIT_S)  # the cut exchanges hand their turns to the measuring
        if self.cadence is not None:
            await asyncio.to_thread(self.cadence.stop)
            self.cadence = None
        if self.proxy is not None:
            await self.proxy.close()
        for listener in self._listeners:
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(listener.wait_closed(), 5)
        self._listeners = []
        if self.watch is not None:
            await self.watch.stop()
            self.watch = None
        if self.writer is not None:
            await asyncio.to_thread(self.writer.close)
        for shipper in self.shippers:  # what they have not sent stays in the file for the next run
            await asyncio.to_thread(shipper.close)
        if self.otlp is not None:  # after the writer: every turn recorded is in its last export
            await asyncio.to_thread(self.otlp.close)
            self.otlp = None

    @staticmethod
    async def _drain(proxy: Proxy, timeout: float, now: asyncio.Event | None) -> str:
        """Until no exchange is in flight, ``timeout`` passed, or ``now`` is set, whichever comes first;
        returns which, in words for the records of the turns then cut."""
        quiet = asyncio.ensure_future(proxy.wait_quiet(timeout))
        waits = {quiet}
        if now is not None:
            waits.add(asyncio.ensure_future(now.wait()))
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if quiet.done() and quiet.result():
            return AFTER_DRAIN
        return f"drain_timeout_s ({timeout:g} s) passed" if quiet.done() else "a second stop signal"

    def _on_stop_signal(self, stop: asyncio.Event, now: asyncio.Event) -> None:
        """SIGINT/SIGTERM: the first drains (one line says what and for how long), the second cuts."""
        n = self.counters.in_flight if self.counters is not None else 0
        streams = f"{n} stream{'' if n == 1 else 's'}"
        if not stop.is_set():
            stop.set()
            limit = self.cfg.drain_timeout_s
            log.info("stopping: %s", f"draining {streams}, up to {limit:g} s; Ctrl-C again to stop now" if n
                     else "no streams in flight")
        elif not now.is_set():
            now.set()
            log.info("stopping now: cutting %s (recorded as outcome shutdown)", streams)

    async def run_forever(self, ready: Callable[[Service], None] | None = None) -> None:
        # handlers first: a SIGTERM that arrives the moment we say we are ready must drain, not kill
        stop, now = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_stop_signal, stop, now)
        with suppress(NotImplementedError, RuntimeError, AttributeError):
            loop.add_signal_handler(signal.SIGUSR1, self.log_state)
        try:
            await self.start()
        except BaseException:  # close what start-up opened: the writer's database, the bound port
            await self.stop()
            raise
        settle_heap()  # here, not in start(): a process that starts services again and again (tests) keeps its GC
        if ready is not None:
            ready(self)
        try:
            await stop.wait()
        finally:
            await self.stop(now)


def count_fds() -> int:
    """Descriptors this process has open (-1 where ``/proc`` is not there). Blocks: not on the loop."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1
