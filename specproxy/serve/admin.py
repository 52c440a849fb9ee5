"""The reserved prefix ``/_specproxy/``: specproxy's own pages, answered by the proxy, never forwarded.

Why in the proxy's own port rather than a second one: one address to open, and nothing more to expose.
Both fronts keep the prefix from the upstream: the lane declines a request under it (``lane.py``),
and aiohttp's handler (``Proxy.handle``) sends it here before anything is forwarded.

Routes: ``/_specproxy/`` the live page, ``/_specproxy/events`` its server-sent events,
``/_specproxy/metrics`` Prometheus text, each at exactly that path. Any other path that is, or may mean
to the proxy or a server behind it, something under the prefix (``reserved``: escapes decoded, doubled
slashes and dot segments read both ways) is answered 404 here: never forwarded, and never a route by
way of dot segments. The page's pictures come from above this layer (``Pages``,
composed in by ``view.live``): serve does not import the analysis.

Who may read them (``allowed``): with ``admin_token`` set, a request that presents it (``Authorization:
Bearer`` or ``?token=``); without, only a loopback client of a proxy that listens on loopback. Anything
else gets 401.

Why the events cannot slow traffic or grow memory: a viewer has no queue. Each wakes twice a second,
and when the store has committed something since its last message it is sent the newest picture,
rendered once for every viewer (off the loop, at most once per ``MIN_RENDER_S``, and never more than
``RENDER_SHARE`` of one core: under heavy traffic the 15-minute window holds many turns, and the page
waits longer between pictures rather than take CPU from the proxy). A viewer that does
not read for ``WRITE_TIMEOUT_S`` is disconnected; at most ``MAX_VIEWERS`` at once (both parameters of
``Admin``, so a test can use a short timeout).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import posixpath
import re
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import unquote

import orjson
from aiohttp import web

from specproxy.config import Config
from specproxy.serve.own_metrics import CONTENT_TYPE, OwnMetrics

__all__ = ["PREFIX", "Admin", "Pages", "allowed", "is_loopback", "reserved"]

log = logging.getLogger("specproxy.serve.admin")

PREFIX = "/_specproxy"
MAX_VIEWERS = 16
TICK_S = 0.5
MIN_RENDER_S = 1.0
RENDER_SHARE = 0.005  # of one core, at most, spent drawing pictures: the wait after one is 1/share its time
FORMAT_SHARE = 0.005  # and formatting /metrics: a scrape sooner than 1/share its last cost gets that page again,
MAX_REUSE_S = 2.0  # if it is at most this old
WRITE_TIMEOUT_S = 10.0
KEEPALIVE_S = 15.0


def reserved(raw_path: str) -> bool:
    """Whether a request path (as sent: percent-escapes kept, no query) is or may mean something under the
    prefix, to the proxy or to any server behind it: read with every escape decoded (``%2F`` and
    ``%2E`` too), segment parameters dropped (``/_specproxy;x/metrics``, ``/v1/..;/_specproxy/``: servlet
    containers read ``;`` so), runs of slashes as one, and both as written and with dot segments resolved.
    Such a path is answered here (``Admin.handle``: 404 unless it is exactly a route), never forwarded."""
    path = unquote(raw_path) if "%" in raw_path else raw_path
    if ";" in path:
        path = _PARAMS.sub("", path)
    if "//" in path:
        path = _SLASHES.sub("/", path)
    if path == PREFIX or path.startswith(PREFIX + "/"):
        return True
    if "/." in path:
        norm = posixpath.normpath(path)
        return norm == PREFIX or norm.startswith(PREFIX + "/")
    return False


# the routes, by the exact path as sent: a path that only normalizes to one (dot segments, escapes, doubled
# slashes) is reserved, and answered 404
ROUTES = {PREFIX: "page", PREFIX + "/": "page", PREFIX + "/events": "events", PREFIX + "/metrics": "metrics"}
_SLASHES = re.compile("/{2,}")
_PARAMS = re.compile(";[^/]*")  # a path segment's parameters, up to the next slash


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.split("%")[0].strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def allowed(listen_host: str, peer: str | None, token: str | None, presented: str | None) -> bool:
    """May this request read the reserved pages? See the module's docstring."""
    if token is not None:  # header bytes that are not UTF-8 come as surrogates: compared as the bytes they were
        return presented is not None and hmac.compare_digest(presented.encode("utf-8", "surrogateescape"),
                                                             token.encode())
    return is_loopback(listen_host) and is_loopback(peer)


class Pages(Protocol):
    """The live page's pictures (``view.live.LivePages``). Both methods block: called in a thread."""

    def document(self) -> str:
        """The whole page, its first picture included."""

    def fragment(self) -> str:
        """The newest picture: what replaces the page's content on each event."""


class Admin:
    """Answers every request under the prefix (aiohttp's handler hands them here)."""

    def __init__(self, cfg: Config, metrics: OwnMetrics, version: Callable[[], Any],
                 pages: Pages | None = None, *, write_timeout_s: float = WRITE_TIMEOUT_S,
                 max_viewers: int = MAX_VIEWERS) -> None:
        self.cfg = cfg
        self.write_timeout_s = write_timeout_s
        self.max_viewers = max_viewers
        self.metrics = metrics
        self.pages = pages
        self._version = version  # changes when the store committed something: a new picture to send
        self.viewers = 0
        self._closing = asyncio.Event()
        self._picture: tuple[Any, str] | None = None
        self._rendering: asyncio.Task | None = None
        self._rendered_at = 0.0
        self._render_s = 0.0  # CPU the latest picture took to draw
        self._metrics_page: bytes | None = None
        self._formatted_at = 0.0
        self._format_s = 0.0  # CPU the latest metrics page took to format

    def close(self) -> None:
        """End every event stream (before the server shuts down: they would hold it up)."""
        self._closing.set()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        presented = _presented(request)
        if not allowed(self.cfg.host, peer[0] if peer else None, self.cfg.admin_token, presented):
            why = ("send the admin_token" if self.cfg.admin_token is not None else
                   "set admin_token to reach it from here (only loopback clients of a loopback proxy may without)")
            return _json(401, {"error": {"message": f"specproxy: {PREFIX}/ needs a token: {why}",
                                         "type": "unauthorized", "code": 401}},
                         {"WWW-Authenticate": 'Bearer realm="specproxy"'})
        if request.method not in ("GET", "HEAD"):
            return _json(405, {"error": {"message": "specproxy: only GET here", "type": "method_not_allowed",
                                         "code": 405}}, {"Allow": "GET, HEAD"})
        route = ROUTES.get(request.rel_url.raw_path)
        if route == "metrics":
            return web.Response(body=await self._metrics_text(),
                                headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"})
        if route in ("page", "events") and self.pages is None:
            return _json(404, {"error": {"message": "specproxy: no live page in this process",
                                         "type": "not_found", "code": 404}})
        if route == "page":
            body = await asyncio.to_thread(self.pages.document)
            return web.Response(text=body, content_type="text/html",
                                headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})
        if route == "events":
            return await self._events(request)
        return _json(404, {"error": {"message": f"specproxy: nothing at that path under {PREFIX}/ (the routes: "
                                                f"{PREFIX}/, {PREFIX}/events, {PREFIX}/metrics)",
                                     "type": "not_found", "code": 404}})

    async def _events(self, request: web.BaseRequest) -> web.StreamResponse:
        if self.viewers >= self.max_viewers:
            return _json(503, {"error": {"message": f"specproxy: more than {self.max_viewers} live viewers",
                                         "type": "busy", "code": 503}})
        self.viewers += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        try:
            await resp.prepare(request)
            await self._send(resp, b": specproxy live\n\n")
            sent, quiet = None, time.monotonic()
            while not self._closing.is_set():
                version = self._version()
                if version != sent:
                    shown, picture = await self._picture_for(version)
                    if self._closing.is_set():
                        break
                    await self._send(resp, b"data: " + orjson.dumps({"html": picture}) + b"\n\n")
                    sent, quiet = shown, time.monotonic()
                elif time.monotonic() - quiet > KEEPALIVE_S:  # a comment keeps intermediaries from timing out
                    await self._send(resp, b": keep-alive\n\n")
                    quiet = time.monotonic()
                try:
                    await asyncio.wait_for(self._closing.wait(), TICK_S)
                except TimeoutError:
                    pass
        except (TimeoutError, ConnectionError):
            pass  # the viewer stopped reading or left
        finally:
            self.viewers -= 1
        return resp

    async def _send(self, resp: web.StreamResponse, data: bytes) -> None:
        async with asyncio.timeout(self.write_timeout_s):
            await resp.write(data)

    async def _metrics_text(self) -> bytes:
        """The Prometheus page, formatted afresh (in a thread: it grows with the series) unless the last
        one was formatted so recently that formatting again would take more than ``FORMAT_SHARE`` of a
        core: then that page again, at most ``format_gap`` of its cost old (``MAX_REUSE_S`` at most). A
        Prometheus server scrapes every 15 s or so, and is served fresh; a scrape every second of many
        series reads some pages twice."""
        if self._metrics_page is not None and time.monotonic() < self._formatted_at + format_gap(self._format_s):
            return self._metrics_page
        body, self._format_s = await asyncio.to_thread(_timed, self.metrics.exposition)
        self._metrics_page, self._formatted_at = body, time.monotonic()
        return body

    async def _picture_for(self, version: Any) -> tuple[Any, str]:
        """The newest picture, and the version it shows: rendered once for every viewer, in a thread."""
        if self._picture is None or self._picture[0] != version:
            if self._rendering is None:
                self._rendering = asyncio.get_running_loop().create_task(self._render())
            await asyncio.shield(self._rendering)
        assert self._picture is not None
        return self._picture

    async def _render(self) -> None:
        try:
            wait = self._rendered_at + render_gap(self._render_s) - time.monotonic()
            if wait > 0:  # under busy traffic the newest is drawn, no more often than that
                await asyncio.sleep(wait)
            version = self._version()
            assert self.pages is not None
            try:
                html, self._render_s = await asyncio.to_thread(_timed, self.pages.fragment)
            except Exception as exc:  # a bug in drawing must not end the viewers' streams
                log.error("drawing the live page failed: %s", type(exc).__name__)
                html = f'<p class="error">specproxy could not draw this picture ({type(exc).__name__})</p>'
            self._picture = (version, html)
            self._rendered_at = time.monotonic()
        finally:
            self._rendering = None


def render_gap(render_s: float) -> float:
    """Seconds from one picture to the next: ``MIN_RENDER_S``, or longer when a picture costs more than
    ``RENDER_SHARE`` of a core at that pace."""
    return max(MIN_RENDER_S, render_s / RENDER_SHARE)


def format_gap(format_s: float) -> float:
    """Seconds a metrics page is served again after one that took ``format_s`` of CPU to format: as long
    as it takes for formatting to stay within ``FORMAT_SHARE`` of a core (0 when it is cheap), and never
    more than ``MAX_REUSE_S``: a page is never older than that, however many series it has."""
    return min(format_s / FORMAT_SHARE, MAX_REUSE_S)


def _timed(draw: Any) -> tuple[Any, float]:
    """``draw()`` and the CPU time this thread spent on it."""
    t0 = time.thread_time()
    html = draw()
    return html, time.thread_time() - t0


def _presented(request: web.BaseRequest) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.rel_url.query.get("token")


def _json(status: int, body: dict, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json",
                        headers={"Cache-Control": "no-store", **(headers or {})})
