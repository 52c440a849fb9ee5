"""``bench_overhead.py``'s two peers, each run as its own process: the fake upstream (``--role upstream``)
and the load generator (``--role loadgen``), both on raw asyncio Protocols (no aiohttp, no JSON per
chunk), so that what the benchmark measures is the path between them and not them.

The upstream is a batched decode-step engine: every step period each active stream gets one chunk, all
of them in one burst (``smooth`` mode: each stream on its own clock with a random phase). Every chunk
ends with ``"t_send": time.perf_counter_ns()`` taken just before it is written. The load generator runs
C keep-alive connections turn after turn, decodes the chunked framing, finds ``"t_send":`` by a byte
search and records ``receive - send`` per chunk (one machine, one CLOCK_MONOTONIC); it prints one JSON
line with the window's counts and percentiles.
"""

from __future__ import annotations

import asyncio
import json
import random
import resource
import signal
import socket
import sys
import time
from array import array

now_ns = time.perf_counter_ns

CHAT_PATH = "/v1/chat/completions"  # where the load generator asks, unless told another path (--request-path)

WORDS = (
    b" the of and to in is that for it as was with be by on not he this are or his from at which but"
    b" have an they you were their one all we can her has there been if more when will would who so no"
    b" model token server stream latency decode prefill cache batch request response speculative draft"
    b" accepted proxy measure turn chunk engine kernel memory bandwidth throughput percentile median"
).split(b" ")[1:]
WORDS = [b" " + w for w in WORDS]


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def use_uvloop() -> str:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return "uvloop"
    except ImportError:
        return "asyncio"


def _nodelay(transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


# ================================================================================================
# the upstream: a batched decode-step engine on raw Protocols
# ================================================================================================

CHUNK_HEAD = (
    b'data: {"id":"chatcmpl-5f0c8e2a9b7d4c1e8a6f3b2d1c0e9f8a","object":"chat.completion.chunk",'
    b'"created":1700000000,"model":"bench-model","system_fingerprint":"fp_bench","choices":[{"index":0,'
)
ROLE_BODY = b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"t_send":'
CONTENT_A = b'"delta":{"content":"'
CONTENT_B = b'"},"logprobs":null,"finish_reason":null}],"t_send":'
FINAL_BODY = (
    b'"delta":{},"logprobs":null,"finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":1000,"completion_tokens":%d,"total_tokens":%d},"t_send":'
)
DONE_FRAMES = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
RESPONSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


def _frame(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


class Upstream:
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.active: dict[UpConn, None] = {}  # streams on the shared step clock (insertion ordered)
        self.loop = asyncio.get_running_loop()
        self.next_tick = self.loop.time() + step_s
        self.loop.call_at(self.next_tick, self.tick)

    def tick(self) -> None:
        now = self.loop.time()
        self.next_tick = max(self.next_tick + self.step_s, now + self.step_s / 4)
        self.loop.call_at(self.next_tick, self.tick)
        for conn in list(self.active):  # one decode step: every active stream gets its chunk
            conn.emit()


class UpConn(asyncio.Protocol):
    def __init__(self, up: Upstream) -> None:
        self.up = up
        self.buf = bytearray()
        self.tr = None
        self.n = 0
        self.seq = 0
        self.word = random.randrange(len(WORDS))
        self.smooth_handle = None
        self.next_t = 0.0

    def connection_made(self, tr) -> None:
        self.tr = tr
        _nodelay(tr)

    def connection_lost(self, exc) -> None:
        self.up.active.pop(self, None)
        if self.smooth_handle is not None:
            self.smooth_handle.cancel()
        self.tr = None

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(buf[:i]).lower()
            cl = 0
            k = head.find(b"content-length:")
            if k >= 0:
                cl = int(head[k + 15 : head.find(b"\r\n", k) if head.find(b"\r\n", k) > 0 else None])
            if len(buf) < i + 4 + cl:
                return
            body = bytes(buf[i + 4 : i + 4 + cl])
            del buf[: i + 4 + cl]
            if not head.startswith(b"post "):
                self.tr.write(NOT_FOUND)
                continue
            self.start(body)

    def start(self, body: bytes) -> None:
        import orjson

        req = orjson.loads(body)
        self.n = int(req.get("max_tokens") or 100)
        self.seq = 0
        self.tr.write(RESPONSE_HEAD)
        if req.get("bench_mode") == "smooth":
            loop = self.up.loop
            self.next_t = loop.time() + random.uniform(0, self.up.step_s)
            self.smooth_handle = loop.call_at(self.next_t, self.smooth_emit)
        else:
            self.up.active[self] = None  # joins the next decode step

    def smooth_emit(self) -> None:
        self.smooth_handle = None
        if self.tr is None:
            return
        if self.emit():
            self.next_t += self.up.step_s
            self.smooth_handle = self.up.loop.call_at(self.next_t, self.smooth_emit)

    def emit(self) -> bool:
        """Write this stream's next chunk; False when the stream has ended."""
        tr = self.tr
        if tr is None:
            self.up.active.pop(self, None)
            return False
        seq = self.seq
        self.seq = seq + 1
        if seq == 0:
            tr.write(_frame(CHUNK_HEAD + ROLE_BODY + b"%d}\n\n" % now_ns()))
            return True
        if seq <= self.n:
            self.word = (self.word + 7) % len(WORDS)
            tr.write(_frame(CHUNK_HEAD + CONTENT_A + WORDS[self.word] + CONTENT_B + b"%d}\n\n" % now_ns()))
            return True
        final = CHUNK_HEAD + (FINAL_BODY % (self.n, self.n + 1000)) + b"%d}\n\n" % now_ns()
        tr.write(_frame(final) + DONE_FRAMES)
        self.up.active.pop(self, None)
        return False


async def upstream_main(args) -> None:
    up = Upstream(args.step_ms / 1000.0)
    server = await up.loop.create_server(lambda: UpConn(up), "127.0.0.1", args.port, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    print(port, flush=True)
    stop = asyncio.Event()
    up.loop.add_signal_handler(signal.SIGTERM, stop.set)
    up.loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()


# ================================================================================================
# the load generator: raw HTTP/1.1 client Protocol
# ================================================================================================

MARK = b'"t_send":'
LMARK = len(MARK)


class Load:
    def __init__(self, args) -> None:
        self.args = args
        self.t_start = args.t_start
        self.t_end = args.t_end
        self.lat = array("q")
        self.lat_first = array("q")  # a turn's first chunk alone: it crosses the proxy's per-turn path
        self.chunks = 0
        self.turns = 0
        self.turns_all = 0  # completed at any time, warm-up included: what a proxy should have recorded as ok
        self.errors = 0
        self.error_kinds: dict[str, int] = {}
        self.conns: list[LoadConn] = []
        self.stopping = False
        rng = random.Random(args.seed)
        words = b"".join(rng.choice(WORDS) for _ in range(args.prompt_bytes // 6)).decode()
        self.requests = []
        for i in range(64):  # pre-built requests with varied lengths
            lo, hi = args.tokens
            n = rng.randint(lo, hi)
            self.requests.append(self._request(n, words, i))
        self.first = [self._request(rng.randint(1, args.tokens[1]), words, i) for i in range(64)]

    def _request(self, n: int, system: str, i: int) -> bytes:
        body = json.dumps(
            {
                "model": "bench-model",
                "stream": True,
                "max_tokens": n,
                "bench_mode": self.args.stream_mode,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"question {i}: tell me about speculative decoding"},
                ],
            }
        ).encode()
        host = f"127.0.0.1:{self.args.port}".encode()
        return (
            b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%b"
            % (self.args.request_path.encode(), host, len(body), body)
        )

    def error(self, kind: str) -> None:
        if not self.stopping:
            self.errors += 1
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


class LoadConn(asyncio.Protocol):
    __slots__ = ("ld", "tr", "state", "hbuf", "cbuf", "pbuf", "rng", "first")

    def __init__(self, ld: Load, seed: int) -> None:
        self.ld = ld
        self.tr = None
        self.state = 0
        self.first = True  # the next chunk is its turn's first
        self.hbuf = bytearray()
        self.cbuf = bytearray()
        self.pbuf = bytearray()
        self.rng = random.Random(seed)

    def connection_made(self, tr) -> None:
        self.tr = tr
        _nodelay(tr)
        self.send(self.ld.first)  # a random first length de-synchronises the streams quickly

    def send(self, pool) -> None:
        self.state = 0
        self.first = True
        self.hbuf.clear()
        self.cbuf.clear()
        self.pbuf.clear()
        self.tr.write(pool[self.rng.randrange(len(pool))])

    def connection_lost(self, exc) -> None:
        self.tr = None
        self.ld.error("connection lost")

    def data_received(self, data: bytes) -> None:
        now = now_ns()
        ld = self.ld
        if self.state == 0:
            hb = self.hbuf
            hb += data
            i = hb.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(hb[:i])
            if not head.startswith(b"HTTP/1.1 200"):
                ld.error(head.split(b"\r\n", 1)[0].decode(errors="replace"))
                self.tr.close()
                return
            if b"chunked" not in head.lower():
                ld.error("response not chunked")
                self.tr.close()
                return
            data = bytes(hb[i + 4 :])
            self.state = 1
            if not data:
                return
        cb = self.cbuf
        cb += data
        pb = self.pbuf
        pos = 0
        n = len(cb)
        done = False
        while True:  # chunked transfer decoding
            j = cb.find(b"\r\n", pos)
            if j < 0:
                break
            size = int(cb[pos:j].split(b";", 1)[0], 16)
            if size == 0:
                if n < j + 4:
                    break
                done = True
                pos = j + 4
                break
            end = j + 2 + size
            if n < end + 2:
                break
            pb += cb[j + 2 : end]
            pos = end + 2
        if pos:
            del cb[:pos]
        last = pb.rfind(b"\n\n")
        if last >= 0:
            inside = ld.t_start <= now < ld.t_end
            k = pb.find(MARK, 0, last)
            while k >= 0:
                e = k + LMARK
                m = pb.find(b"}", e)
                if inside:
                    ld.lat.append(now - int(pb[e:m]))
                    if self.first:
                        ld.lat_first.append(now - int(pb[e:m]))
                self.first = False
                k = pb.find(MARK, m, last)
            del pb[: last + 2]
        if done:
            ld.turns_all += 1
            if ld.t_start <= now < ld.t_end:
                ld.turns += 1
            if not ld.stopping:
                self.send(ld.requests)


async def loadgen_main(args) -> None:
    loop = asyncio.get_running_loop()
    ld = Load(args)
    delay = (args.t0 - now_ns()) / 1e9
    if delay > 0:
        await asyncio.sleep(delay)
    for i in range(args.conns):
        try:
            _, proto = await loop.create_connection(lambda i=i: LoadConn(ld, args.seed * 100003 + i), "127.0.0.1", args.port)
        except OSError as exc:
            ld.error(f"connect: {exc}")
            continue
        ld.conns.append(proto)
    await asyncio.sleep(max(0.0, (args.t_end - now_ns()) / 1e9))
    ld.stopping = True
    for c in ld.conns:
        if c.tr is not None:
            c.tr.close()
    await asyncio.sleep(0.05)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    import numpy as np

    lat = np.frombuffer(ld.lat, dtype=np.int64) / 1000.0 if len(ld.lat) else np.empty(0)
    pct = {f"p{q}": float(np.percentile(lat, q)) for q in (50, 90, 99, 99.9)} if len(lat) else {}
    first = np.frombuffer(ld.lat_first, dtype=np.int64) / 1000.0 if len(ld.lat_first) else np.empty(0)
    window = (args.t_end - args.t_start) / 1e9
    out = {
        "chunks": int(len(lat)),
        "chunks_per_s": len(lat) / window,
        "turns": ld.turns,
        "turns_all": ld.turns_all,
        "errors": ld.errors,
        "error_kinds": ld.error_kinds,
        "lat_us": pct,
        "first_lat_us": {f"p{q}": float(np.percentile(first, q)) for q in (50, 99)} if len(first) else {},
        "lat_max_us": float(lat.max()) if len(lat) else None,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "maxrss_kb": ru.ru_maxrss,
    }
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


def otlp_receiver() -> tuple[str, list[int], object]:
    """``--with-otlp``: an OTLP/HTTP metrics endpoint in a thread of the orchestrator (the load side's CPU),
    answering every export 200 without decoding it. Returns its URL, a one-item list counting the exports
    it took, and the server (``shutdown()`` it)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    took = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            took[0] += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1/metrics", took, server
