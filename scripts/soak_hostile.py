"""The hostile half of ``scripts/soak.py --duration`` (its long mode): clients that misbehave beside the
soak's normal streaming turns, for as long as the run lasts, and the proxy's RSS sampled meanwhile.

Kinds, each a few loops at once (``KINDS``):
  * slow heads: a request head sent a byte a second (the proxy must cut it at ``header_timeout_s``);
  * partial bodies: a head that announces 1 MB, 1 kB of it, then nothing (408 at ``header_timeout_s``);
  * non-readers: ask for a 20 MB stream and never read (the proxy must cut them at ``send_timeout_s``,
    recorded ``client_stalled``); the upstream's ``big_answer`` sends it, held back by the proxy;
  * malformed: requests the proxy must refuse (400 or a close), never forward.
Every wait has a deadline; everything binds or connects to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections import Counter

import orjson

BIG = 20 * 1024 * 1024
_PIECE = b"data: " + b"x" * 16000 + b"\n\n"
_PIECE_CHUNK = f"{len(_PIECE):x}\r\n".encode() + _PIECE + b"\r\n"

# loops of each kind running at once
KINDS = {"slow_head": 16, "partial_body": 8, "non_reader": 8, "malformed": 2}

MALFORMED = [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET / HTTP/1.1\nHost: a\n\n",  # bare LF
    b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    b"GET /v1/models HTTP/1.1\r\nHost: a\r\nBad Header: x\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(32),  # a TLS hello
    b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX: \x00\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
]


async def big_answer(writer: asyncio.StreamWriter) -> bool:
    """The upstream's answer to a non-reader: a 20 MB stream, as fast as the proxy takes it."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    sent = 0
    while sent < BIG:
        writer.write(_PIECE_CHUNK)
        await writer.drain()
        sent += len(_PIECE)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return False


class Hostile:
    """Runs the hostile loops against ``port`` until ``deadline`` (loop time) and counts what happened."""

    def __init__(self, port: int, send_timeout_s: float, header_timeout_s: float = 30.0) -> None:
        self.port = port
        self.send_timeout_s = send_timeout_s
        self.header_timeout_s = header_timeout_s
        self.seen: Counter = Counter()  # (kind, what happened) -> times
        self.held_s: dict[str, list[float]] = {"slow_head": [], "partial_body": []}

    async def run(self, deadline: float) -> None:
        loops = [getattr(self, kind)(deadline, i) for kind, n in KINDS.items() for i in range(n)]
        await asyncio.gather(*loops)

    async def _open(self, rcvbuf: int | None = None):
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port)), 10)
        return await asyncio.open_connection(sock=sock)

    async def slow_head(self, deadline: float, i: int) -> None:
        loop = asyncio.get_running_loop()
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        while loop.time() < deadline:
            t0 = loop.time()
            reader, writer = await self._open()
            cut = False
            try:
                for k in range(int(self.header_timeout_s) + 15):  # a byte a second, past the header deadline
                    writer.write(head[k % len(head):k % len(head) + 1])
                    await writer.drain()
                    try:
                        if await asyncio.wait_for(reader.read(1024), 1.0) == b"":
                            cut = True
                            break
                    except TimeoutError:
                        continue
            except ConnectionError:
                cut = True
            finally:
                writer.transport.abort()
            self.seen["slow_head", "cut" if cut else "NOT cut"] += 1
            self.held_s["slow_head"].append(loop.time() - t0)

    async def partial_body(self, deadline: float, i: int) -> None:
        loop = asyncio.get_running_loop()
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000\r\n\r\n")
        while loop.time() < deadline:
            t0 = loop.time()
            reader, writer = await self._open()
            try:
                writer.write(head + b"{" + b" " * 999)
                await writer.drain()
                line = await asyncio.wait_for(reader.readline(), self.header_timeout_s + 30)
                what = line.split(b" ")[1].decode() if line.startswith(b"HTTP/1.1 ") else "closed"
            except (ConnectionError, TimeoutError) as exc:
                what = type(exc).__name__
            finally:
                writer.transport.abort()
            self.seen["partial_body", what] += 1
            self.held_s["partial_body"].append(loop.time() - t0)

    async def non_reader(self, deadline: float, i: int) -> None:
        loop = asyncio.get_running_loop()
        body = orjson.dumps({"model": "soak", "stream": True, "big": True, "soak": -1,
                             "messages": [{"role": "user", "content": "a long answer, please"}]})
        req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
               b"X-Specproxy-Label: hostile-stall\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        while loop.time() < deadline:
            reader, writer = await self._open(rcvbuf=4096)
            try:
                writer.write(req)
                await writer.drain()
                # never read while the proxy's deadline runs, then read what the kernel holds: a proxy that cut
                # us ends it with EOF or a reset; one that did not still has bytes coming
                # the client's own behaviour, not a wait for an event: past the deadline and its last look
                await asyncio.sleep(self.send_timeout_s * 1.25 + 5)
                what = "NOT cut"
                end = loop.time() + 10
                while loop.time() < end:
                    if await asyncio.wait_for(reader.read(1 << 20), 10) == b"":
                        what = "cut"
                        break
            except ConnectionError:
                what = "cut"
            except TimeoutError:
                what = "NOT cut"
            finally:
                writer.transport.abort()
            self.seen["non_reader", what] += 1

    async def malformed(self, deadline: float, i: int) -> None:
        loop = asyncio.get_running_loop()
        rng = random.Random(i)
        while loop.time() < deadline:
            reader, writer = await self._open()
            try:
                writer.write(rng.choice(MALFORMED))
                await writer.drain()
                line = await asyncio.wait_for(reader.readline(), self.header_timeout_s + 15)
                what = line.split(b" ")[1].decode() if line.startswith(b"HTTP/1.") else "closed"
            except (ConnectionError, TimeoutError) as exc:
                what = type(exc).__name__
            finally:
                writer.transport.abort()
            self.seen["malformed", what] += 1
            await asyncio.sleep(rng.uniform(0.05, 0.2))  # a pace, not a stand-in for an event

    def lines(self) -> list[str]:
        out = []
        for kind in KINDS:
            got = {what: n for (k, what), n in sorted(self.seen.items()) if k == kind}
            held = self.held_s.get(kind)
            extra = f", held {sum(held) / len(held):.1f} s on average" if held else ""
            out.append(f"    {kind}: {got}{extra}")
        return out

    def failed(self) -> list[str]:
        """What the proxy let through that it must not have."""
        bad = []
        for (kind, what), n in self.seen.items():
            if what == "NOT cut" or (kind == "malformed" and what.startswith("2")):
                bad.append(f"{kind} {what} x{n}")
        return bad


class RssSampler:
    """The proxy's state every ``every_s`` seconds (its SIGUSR1 line and /proc, in a thread)."""

    def __init__(self, state, every_s: float) -> None:
        self.state = state
        self.every_s = every_s
        self.samples: list[tuple[float, dict]] = []

    async def run(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        while loop.time() < deadline:
            st = await asyncio.to_thread(self.state)
            self.samples.append((time.monotonic() - t0, st))
            await asyncio.sleep(max(min(self.every_s, deadline - loop.time()), 0))  # the sampling pace

    def slope_mib_per_hour(self, since: float = 0.0) -> float | None:
        """Least-squares slope of RSS over the samples from ``since`` of the run (0.5: its second half),
        in MiB per hour; None with fewer than 3."""
        if not self.samples:
            return None
        start = self.samples[-1][0] * since
        pts = [(t, s["rss_kib"] / 1024) for t, s in self.samples if t >= start]
        if len(pts) < 3:
            return None
        n = len(pts)
        mt = sum(t for t, _ in pts) / n
        mr = sum(r for _, r in pts) / n
        var = sum((t - mt) ** 2 for t, _ in pts)
        return 3600 * sum((t - mt) * (r - mr) for t, r in pts) / var if var else None
