"""Running the proxy as a service: tokenizer, writer thread, proxy, listening socket, clean shutdown.

Why apart from ``proxy.py``: the handler is the hot path and knows nothing of processes, signals or
files; this module owns their lifecycle so that ``serve``, ``demo`` and the tests start the very same
thing. On SIGTERM/SIGINT it stops accepting, lets in-flight streams finish (bounded), measures what
is pending and drains the writer's queue before exiting.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

from aiohttp import web

from .config import Config
from .observe import ServerWatch
from .proxy import Proxy
from .record import Record
from .store import Writer
from .tokens import Tokenizer, load_tokenizer

__all__ = ["Service", "install_uvloop"]

log = logging.getLogger("specproxy")


def install_uvloop() -> bool:
    """Use uvloop when it is installed (it is a dependency on Linux and macOS)."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


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
    _runner: web.AppRunner | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> Service:
        """Load what can fail (tokenizer, database) before listening, so errors come at start-up."""
        cfg.upstream_url  # noqa: B018 - raises ConfigError without an upstream
        tokenizer = load_tokenizer(cfg.tokenizer)
        return cls(cfg=cfg, tokenizer=tokenizer, writer=Writer(cfg.db, queue_size=cfg.queue_size))

    def _sink(self, record: Record) -> None:
        if self.writer is not None:
            self.writer.put(record)
        for sink in self.extra_sinks:
            try:
                sink(record)
            except Exception as exc:  # a broken observer must not cost the record
                log.error("sink failed: %s", exc)

    async def start(self) -> int:
        # a measuring worker thread holding the GIL must not delay the forwarding loop for long
        sys.setswitchinterval(0.001)
        self.watch = ServerWatch(self.cfg, self.writer)
        await self.watch.start()
        self.proxy = Proxy(self.cfg, tokenizer=self.tokenizer, sink=self._sink,
                           instance_id=lambda: self.watch.instance_id if self.watch else None)
        self.proxy.on_turn_end = self.watch.turn_ended
        app = self.proxy.make_app()
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=30.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, backlog=1024)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    async def stop(self) -> None:
        """Stop listening, let streams finish (bounded), measure what is pending, drain the queue."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.watch is not None:
            await self.watch.stop()
            self.watch = None
        if self.writer is not None:
            await asyncio.to_thread(self.writer.close)

    async def run_forever(self, ready: Callable[[Service], None] | None = None) -> None:
        await self.start()
        if ready is not None:
            ready(self)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await self.stop()
