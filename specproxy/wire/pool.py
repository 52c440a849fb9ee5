"""Which upstream connection carries which exchange: the pool of connections to the one upstream origin.

Idle connections are reused newest first. A connection that has carried an exchange is private to the
client connection it served (its ``owner``, as HAProxy's private connections): only that client's next
request reuses it, and it is closed once that client has gone (at release, or by the sweep). One sweep
every ``SWEEP_S``, while any connection is idle, closes those whose client has gone and those idle for
``POOL_IDLE_S`` (so between that and ``SWEEP_S`` more): one timer for the pool, none per exchange.

Why private: bytes an upstream sends after a response it framed wrongly (or past its end, in a later
segment) cannot be told from the answer to the next request on that connection, by any proxy; kept per
client, they can confuse at most the client whose own exchange the upstream misframed, never another. A fresh connection that never carried an exchange (start-up's probe)
may go to anyone. An idle connection with bytes waiting, or closed, when it is taken from the pool is
dropped (a peek; a TLS connection is not peeked). A request is sent twice only when a connection kept
alive after an exchange is closed by the upstream before one byte of the next answer (its close raced
our send): once more, on a new connection, never a third time (``exchange.Exchange.send``); nothing else
is retried.

The pool's whole surface for an exchange: ``checkout`` (an idle connection for a client, or None),
``connect`` (a new one), ``checkin`` (after an exchange that ended well) and ``discard`` (close it).
"""

from __future__ import annotations

import asyncio
import os
import select
import ssl
import time

from yarl import URL

from specproxy.errors import UpstreamError
from specproxy.wire.relay_thread import THREAD_BUILT, TurnSink
from specproxy.wire.relay_thread import last_read as thread_last_read
from specproxy.wire.upstream import ConnState, UpstreamConn

__all__ = ["POOL_IDLE_S", "SWEEP_S", "UpstreamPool"]

POOL_IDLE_S = 15.0  # an idle kept-alive connection is closed after this long (at the next sweep)
SWEEP_S = 1.0  # how often idle connections are looked at: their client gone, or idle for POOL_IDLE_S

clock = time.perf_counter  # the connections' clock (``UpstreamConn.idle_since``)

# what a zero-timeout poll reports for a socket that has bytes waiting, its end of file, or an error (a reset)
_WAITING = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP | getattr(select, "POLLRDHUP", 0)


def _pending(fd: int | None, poller: select.poll) -> bool:
    """Whether the socket under an idle connection (``fd``: its descriptor, None under TLS) has bytes
    waiting, its end of file, or an error (a reset: not one to send on); a TLS connection is not looked at
    (its records are not the exchange's bytes). One ``poll`` with no timeout on ``poller`` (the pool's, the loop's thread alone uses it).

    Why not a ``recv(1, MSG_PEEK)``: on a Python socket over the transport's descriptor it costs ~10 µs per
    checkout (the socket object, the timeout set, the ``BlockingIOError`` raised when nothing waits, the
    usual case), a poll ~1.4 µs (uvloop, this machine), and it tells the same three cases apart."""
    if fd is None:
        return False
    poller.register(fd, _WAITING)
    try:
        return bool(poller.poll(0))
    finally:
        poller.unregister(fd)


class UpstreamPool:
    """Connections to the one upstream origin, kept alive between exchanges: each one that has carried an
    exchange for the client connection that exchange came from, the fresh ones for anyone."""

    def __init__(self, url: URL, *, connect_timeout_s: float, idle_timeout_s: float, relay: str = "thread",
                 relay_slice_us: int = 100, relay_nice: int = 0, reuse: bool = True,
                 send_timeout_s: float = 60.0) -> None:
        """``relay``: ``thread`` (a chunked body passed through goes to the relay thread where it can) or
        ``python`` (every body relayed on the loop); Config's ``relay``, ``relay_slice_us``, ``relay_nice``
        and ``send_timeout_s`` (how long a client may take nothing more of a body: ``exchange.py``). ``reuse``
        False (Config ``upstream_reuse = "off"``): a connection that carried an exchange is closed after
        it, never kept for anyone."""
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"the upstream must be an http:// or https:// URL, not {url.scheme}://")
        self.loop = asyncio.get_running_loop()
        self.host = url.host
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if url.scheme == "https" else None
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.send_timeout_s = send_timeout_s
        self.relay_thread = relay == "thread" and THREAD_BUILT
        self.relay_slice_us = relay_slice_us
        self.relay_nice = relay_nice
        self.reuse = reuse
        self.fresh: list[UpstreamConn] = []  # idle, never carried an exchange: for any client
        self.kept: dict[asyncio.BaseTransport, list[UpstreamConn]] = {}  # idle, by the client they served
        self.active: set[UpstreamConn] = set()
        self.closed = False
        self.last_read = 0.0  # the latest read on the loop, any connection (perf_counter)
        self._turn_sink: TurnSink | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._poller = select.poll()  # checkout's look at an idle connection's socket (_pending)

    @property
    def idle(self) -> list[UpstreamConn]:
        """Every idle connection, fresh or kept for a client (oldest first within each)."""
        return [*self.fresh, *(c for conns in self.kept.values() for c in conns)]

    @property
    def thread_turns(self) -> int:
        """Bodies handed to the relay thread on this loop so far."""
        return self._turn_sink.started if self._turn_sink is not None else 0

    def turn_sink(self) -> TurnSink:
        """This loop's mailbox for the relay thread (made on first use)."""
        if self._turn_sink is None:
            self._turn_sink = TurnSink(self.loop, self.relay_slice_us, self.relay_nice)
        return self._turn_sink

    def activity(self) -> float:
        """The latest read of any body, on the loop or by the relay thread (the measuring worker waits for a gap)."""
        return max(self.last_read, thread_last_read())

    def checkout(self, owner: asyncio.BaseTransport | None) -> UpstreamConn | None:
        """An idle connection for the client connection ``owner`` (None: a client that will not send
        another request), now this exchange's: the newest kept for ``owner``, else a fresh one; never one
        another client's exchange went over. None when there is none: ``connect``. One that has bytes
        waiting (the loop has not read them yet) or has been closed by the upstream is dropped: whatever
        waits there is no answer to the request about to be sent."""
        mine = self.kept.pop(owner, None) if owner is not None else None
        try:
            for conns in (mine, self.fresh):
                while conns:
                    conn = conns.pop()
                    transport = conn.transport
                    if transport is not None and not transport.is_closing() and conn.state is ConnState.IDLE:
                        if not _pending(conn.fd, self._poller):
                            self._lend(conn, owner)
                            return conn
                    conn.close()
            return None
        finally:
            if mine:  # the owner's others stay kept for it
                self.kept[owner] = mine

    async def connect(self, owner: asyncio.BaseTransport | None) -> UpstreamConn:
        """A new connection, for the client connection ``owner``'s exchange. Raises ``UpstreamError``."""
        conn = await self._connect()
        self._lend(conn, owner)
        return conn

    def _lend(self, conn: UpstreamConn, owner: asyncio.BaseTransport | None) -> None:
        self.active.add(conn)
        conn.owner = owner

    async def probe(self, timeout_s: float) -> UpstreamError | None:
        """Connect once: None when the upstream accepts a connection within ``timeout_s``, else why not, in
        the words a request's 502 or 504 would use. Nothing is sent. For start-up's check. The connection
        joins the fresh idle ones, for the first request to use: the check costs the upstream no connection."""
        try:
            conn = await self._connect(min(timeout_s, self.connect_timeout_s))
        except UpstreamError as exc:
            return exc
        if self.closed:
            conn.close()
            return None
        self._idle(conn)
        self.fresh.append(conn)
        return None

    async def _connect(self, timeout_s: float | None = None) -> UpstreamConn:
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: UpstreamConn(self), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except TimeoutError:
            within = f"connect_timeout_s ({timeout_s:g} s)" if timeout_s == self.connect_timeout_s else f"{timeout_s:g} s"
            raise UpstreamError(f"no connection within {within}", timeout=True) from None
        except (OSError, ssl.SSLError) as exc:
            # the system's words for the errno ("Connection refused"), the same on every event loop
            # (asyncio's own loop says "Connect call failed (...)" where uvloop says "Connection refused")
            errno = getattr(exc, "errno", None)
            detail = (os.strerror(errno) if isinstance(errno, int) and errno > 0 else None) or \
                getattr(exc, "strerror", None) or type(exc).__name__
            raise UpstreamError(f"cannot connect to the upstream: {detail}") from None
        return conn

    def checkin(self, conn: UpstreamConn) -> None:
        """After an exchange that ended well: kept for the client connection it served, if that is still
        there; else closed."""
        self.active.discard(conn)
        owner = conn.owner
        if self.closed or not self.reuse or conn.transport is None or owner is None or owner.is_closing():
            self.discard(conn)
            return
        self._idle(conn)
        self.kept.setdefault(owner, []).append(conn)

    def discard(self, conn: UpstreamConn) -> None:
        """Forget a connection and close it (idempotent: also what a connection that was lost calls)."""
        self.active.discard(conn)
        if conn in self.fresh:
            self.fresh.remove(conn)
        conns = self.kept.get(conn.owner) if conn.owner is not None else None
        if conns is not None and conn in conns:
            conns.remove(conn)
            if not conns:
                del self.kept[conn.owner]
        conn.close()

    def _idle(self, conn: UpstreamConn) -> None:
        conn.make_idle()
        if self._sweep is None:
            self._sweep = self.loop.call_later(SWEEP_S, self._sweep_idle)

    def _sweep_idle(self) -> None:
        """Close the idle connections kept for clients that have gone, and those idle for ``POOL_IDLE_S``;
        again in ``SWEEP_S`` while any are idle."""
        self._sweep = None
        stale = clock() - POOL_IDLE_S
        for conn in self.idle:
            owner = conn.owner
            if conn.idle_since <= stale or (owner is not None and owner.is_closing()):
                self.discard(conn)
        if (self.fresh or self.kept) and not self.closed:
            self._sweep = self.loop.call_later(SWEEP_S, self._sweep_idle)

    def close(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in [*self.idle, *self.active]:
            self.discard(conn)
        self.fresh.clear()
        self.kept.clear()
        if self._turn_sink is not None:
            self._turn_sink.close()
