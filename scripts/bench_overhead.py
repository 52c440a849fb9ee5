"""What specproxy costs on the wire: direct vs nginx vs specproxy, in one run, on this machine.

    python scripts/bench_overhead.py                         # C = 1, 64, 256, 512; 3 rounds (~4 min)
    python scripts/bench_overhead.py --concurrency 1,256 --rounds 3 --measure 4
    python scripts/bench_overhead.py --stream-mode smooth    # streams on their own phase, no bursts
    python scripts/bench_overhead.py --json out.json         # also write every round's raw numbers

Three processes besides this orchestrator, all on 127.0.0.1:

* an upstream (``--role upstream``, its own process): a fake OpenAI-compatible engine on raw asyncio
  Protocols. ``batched`` mode (the default) is a decode-step clock like a real engine: every step
  period each active stream gets one chunk, all of them in one burst. ``smooth`` mode gives each stream
  its own clock with a random phase, so chunks arrive evenly spread. Every chunk carries, as its last
  JSON field, ``"t_send": time.perf_counter_ns()`` taken just before the chunk is written.
* a load generator (``--role loadgen``): C keep-alive HTTP/1.1 connections on a raw asyncio/uvloop
  Protocol (chunked decoding and a byte search for ``"t_send":``, no JSON, no aiohttp), each running
  turn after turn. Per chunk it records ``receive - send`` (same machine, same CLOCK_MONOTONIC).
* the path under test: nothing (direct), nginx (installed from Debian when missing; ``proxy_buffering
  off``, HTTP/1.1 keepalive upstream, one worker, a non-daemon child), or specproxy
  (``python -m specproxy.cli serve`` with ``--tokenizer tiktoken:o200k_base`` and a temp database:
  full measurement on).

The proxy under test is pinned to the last CPU; the upstream, the load generator and this script to the
others. For each concurrency C one nginx and one specproxy are started; then ``--rounds`` rounds run the
three paths in rotating order, each with a warm-up and a measured window of the same absolute length.
Over the window: chunks/s received, per-chunk latency percentiles (added = path's percentile - direct's
percentile in the same round), the proxy's CPU (utime+stime from /proc/PID/stat, and on-CPU ns from
/proc/PID/task/*/schedstat; all its threads, with specproxy's measuring child process and nginx's master + worker) per chunk relayed, and its peak
RSS (VmHWM, max over the rounds at that C). Before the runs it measures the machine's cross-CPU wake-up
latency, a floor under any proxy's added latency (large on VMs whose idle vCPUs halt).
"""

from __future__ import annotations
import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from benchlib import cpu_model  # noqa: E402


import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import random
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
now_ns = time.perf_counter_ns

WORDS = (
    b" the of and to in is that for it as was with be by on not he this are or his from at which but"
    b" have an they you were their one all we can her has there been if more when will would who so no"
    b" model token server stream latency decode prefill cache batch request response speculative draft"
    b" accepted proxy measure turn chunk engine kernel memory bandwidth throughput percentile median"
).split(b" ")[1:]
WORDS = [b" " + w for w in WORDS]


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _use_uvloop() -> str:
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
        self.chunks = 0
        self.turns = 0
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
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%b" % (host, len(body), body)
        )

    def error(self, kind: str) -> None:
        if not self.stopping:
            self.errors += 1
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


class LoadConn(asyncio.Protocol):
    __slots__ = ("ld", "tr", "state", "hbuf", "cbuf", "pbuf", "rng")

    def __init__(self, ld: Load, seed: int) -> None:
        self.ld = ld
        self.tr = None
        self.state = 0
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
                k = pb.find(MARK, m, last)
            del pb[: last + 2]
        if done:
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
    window = (args.t_end - args.t_start) / 1e9
    out = {
        "chunks": int(len(lat)),
        "chunks_per_s": len(lat) / window,
        "turns": ld.turns,
        "errors": ld.errors,
        "error_kinds": ld.error_kinds,
        "lat_us": pct,
        "lat_max_us": float(lat.max()) if len(lat) else None,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "maxrss_kb": ru.ru_maxrss,
    }
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


# ================================================================================================
# the orchestrator
# ================================================================================================


def _pin(cores: set[int] | None):
    def fn() -> None:
        _raise_nofile()
        if cores:
            os.sched_setaffinity(0, cores)

    return fn


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of the whole process (all threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


def _proc_sched_s(pid: int) -> float:
    """On-CPU time of all the process's threads in ns precision (/proc/PID/task/*/schedstat)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def wake_floor(cpu_a: int, cpu_b: int, period_s: float = 0.01, n: int = 200) -> tuple[float, float, float]:
    """This machine's cross-CPU wake-up latency: a pipe write on one CPU every ``period_s`` (the reader on
    the other CPU idles in between, as a proxy does between decode steps); p50, p99, max in µs."""
    import struct

    r, w = os.pipe()
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reader
        try:
            os.sched_setaffinity(0, {cpu_b})
            lats = []
            for _ in range(n):
                d = os.read(r, 8)
                lats.append(now_ns() - struct.unpack("q", d)[0])
            lats.sort()
            os.write(res_w, json.dumps([lats[n // 2] / 1e3, lats[int(n * 0.99)] / 1e3, lats[-1] / 1e3]).encode())
        finally:
            os._exit(0)
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu_a})
    try:
        for _ in range(n):
            time.sleep(period_s)
            os.write(w, struct.pack("q", now_ns()))
        os.waitpid(pid, 0)
        out = json.loads(os.read(res_r, 4096))
    finally:
        os.sched_setaffinity(0, mask)
        for fd in (r, w, res_r, res_w):
            os.close(fd)
    return tuple(out)


def _threads_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """utime and stime (seconds) of each thread of a process."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK)
        except (OSError, ValueError, IndexError):
            pass
    return out


def _thread_names(pid: int) -> dict[int, str]:
    """Thread names by OS thread id: Python's from ``py-spy dump`` when it is installed, else the OS's
    (``/proc/PID/task/TID/comm``: native threads such as specproxy's relay thread name themselves)."""
    names = {}
    for tid in _listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm.startswith("specproxy"):
            names[int(tid)] = comm
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        return names
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return names
    for line in out.splitlines():
        if line.startswith("Thread "):
            parts = line.split()
            try:
                tid = int(parts[1], 0)
            except ValueError:
                continue
            names[tid] = line.split('"')[1] if '"' in line else parts[1]
    return names


def _machine_busy_s() -> float:
    """CPU seconds all CPUs spent not idle (user+nice+system+irq+softirq+steal), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / CLK_TCK


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    """Child processes of every thread of ``pid`` (a child started from a worker thread is listed under
    that thread, not under the main one)."""
    out: list[int] = []
    for tid in _listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            pass
    return out


def _hwm_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_model() -> str:
    return cpu_model()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout} s")


def _stop(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def ensure_nginx() -> str | None:
    """The nginx binary; installed from Debian (nginx-light, else nginx) when missing."""
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print("nginx is missing and cannot be installed here (needs root and apt-get): skipping nginx", file=sys.stderr)
        return None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print("installing nginx from Debian (apt-get install -y nginx-light)...", file=sys.stderr)
    for attempt in range(2):
        for pkg in ("nginx-light", "nginx"):
            r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", pkg], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
            if r.returncode == 0:
                break
        else:
            if attempt == 0:
                subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=600)
                continue
        break
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


NGINX_CONF = """\
worker_processes 1;
worker_rlimit_nofile 65536;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 16384; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    upstream up {{ server 127.0.0.1:{up}; keepalive 1024; keepalive_requests 1000000; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_cache off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def start_nginx(binary: str, tmp: Path, up_port: int, cores) -> tuple[subprocess.Popen, int]:
    d = tmp / f"nginx-{time.monotonic_ns()}"
    d.mkdir()
    os.chmod(d, 0o777)
    port = _free_port()
    (d / "nginx.conf").write_text(NGINX_CONF.format(d=d, up=up_port, port=port))
    proc = subprocess.Popen(
        [binary, "-p", str(d), "-e", str(d / "error.log"), "-c", str(d / "nginx.conf"), "-g", "daemon off;"],
        preexec_fn=_pin(cores), stdout=subprocess.DEVNULL, stderr=open(d / "stderr.log", "w"),
    )
    _wait_port(port, proc)
    return proc, port


def start_specproxy(tmp: Path, up_port: int, cores, extra: list[str]) -> tuple[subprocess.Popen, int, Path]:
    port = _free_port()
    db = tmp / f"specproxy-{time.monotonic_ns()}.db"
    cmd = [sys.executable, "-m", "specproxy.cli", "serve", "--upstream", f"http://127.0.0.1:{up_port}",
           "--port", str(port), "--db", str(db), "--tokenizer", "tiktoken:o200k_base", *extra]
    log = open(tmp / f"specproxy-{port}.log", "w")
    proc = subprocess.Popen(cmd, preexec_fn=_pin(cores), stdout=log, stderr=log, cwd=str(tmp))
    _wait_port(port, proc, timeout=60)
    return proc, port, db


def _sleep_until(t_ns: int) -> None:
    d = (t_ns - now_ns()) / 1e9
    if d > 0:
        time.sleep(d)


_QUIET_WAITED = [0.0]


def wait_quiet(our_pids: list[int], limit_s: float, threshold: float = 0.15) -> float:
    """Wait (bounded) until processes other than ours use < threshold of a CPU; return the seconds waited."""
    t_begin = time.monotonic()
    budget = max(0.0, limit_s - _QUIET_WAITED[0])
    while True:
        pids = [p for pid in our_pids for p in (pid, *_children(pid))]
        m0, o0, t0 = _machine_busy_s(), sum(_proc_cpu_s(p) for p in pids if os.path.exists(f"/proc/{p}")), time.monotonic()
        time.sleep(0.3)
        m1, o1, t1 = _machine_busy_s(), sum(_proc_cpu_s(p) for p in pids if os.path.exists(f"/proc/{p}")), time.monotonic()
        other = ((m1 - m0) - (o1 - o0)) / (t1 - t0)
        waited = time.monotonic() - t_begin
        if other < threshold or waited >= budget:
            _QUIET_WAITED[0] += waited
            return waited
        time.sleep(0.7)


def run_window(args, path: str, port: int, conns: int, pids: list[int], load_pids: list[int], load_cores, seed: int) -> dict:
    if getattr(args, "quiet_wait", 0) and getattr(args, "_our_pids", None):
        wait_quiet(args._our_pids, args.quiet_wait)
    t0 = now_ns() + int(0.35e9)  # the load generator's interpreter starts before t0
    t_start = t0 + int(args.warmup * 1e9)
    t_end = t_start + int(args.measure * 1e9)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", "loadgen", "--port", str(port),
           "--conns", str(conns), "--t0", str(t0), "--t-start", str(t_start), "--t-end", str(t_end),
           "--tokens", f"{args.tokens[0]}-{args.tokens[1]}", "--prompt-bytes", str(args.prompt_bytes),
           "--stream-mode", args.stream_mode, "--seed", str(seed)]
    lg = subprocess.Popen(cmd, preexec_fn=_pin(load_cores), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    all_pids = lambda: [p for pid in pids for p in (pid, *_children(pid))]  # noqa: E731
    _sleep_until(t_start)
    proxy_pids = all_pids()
    m0 = _machine_busy_s()
    c0 = sum(_proc_cpu_s(p) for p in proxy_pids)
    s0 = sum(_proc_sched_s(p) for p in proxy_pids)
    l0 = sum(_proc_cpu_s(p) for p in (*load_pids, lg.pid))
    th0 = {tid: v for p in proxy_pids for tid, v in _threads_cpu(p).items()}
    w0 = now_ns()
    _sleep_until(t_end)
    c1 = sum(_proc_cpu_s(p) for p in proxy_pids)
    s1 = sum(_proc_sched_s(p) for p in proxy_pids)
    l1 = sum(_proc_cpu_s(p) for p in (*load_pids, lg.pid))
    th1 = {tid: v for p in proxy_pids for tid, v in _threads_cpu(p).items()}
    m1 = _machine_busy_s()
    w1 = now_ns()
    out, err = lg.communicate(timeout=60)
    if lg.returncode != 0:
        raise RuntimeError(f"load generator failed: {err.decode()[-2000:]}")
    res = json.loads(out.decode().strip().splitlines()[-1])
    res["path"] = path
    res["conns"] = conns
    res["proxy_cpu_s"] = c1 - c0 if pids else None
    res["cpu_us_per_chunk"] = (c1 - c0) / res["chunks"] * 1e6 if pids and res["chunks"] else None
    res["sched_us_per_chunk"] = (s1 - s0) / res["chunks"] * 1e6 if pids and res["chunks"] else None
    res["load_cpu_util"] = (l1 - l0) / ((w1 - w0) / 1e9) / max(1, len(load_cores or {0}))
    res["proxy_cpu_util"] = (c1 - c0) / ((w1 - w0) / 1e9) if pids else None
    # CPU used on this machine by anything but the benchmark's processes (other users, builds...)
    res["other_cpu_util"] = max(0.0, ((m1 - m0) - (c1 - c0) - (l1 - l0)) / ((w1 - w0) / 1e9))
    if pids and res["chunks"]:
        res["threads"] = {
            str(tid): [(th1[tid][0] - th0[tid][0]) / res["chunks"] * 1e6, (th1[tid][1] - th0[tid][1]) / res["chunks"] * 1e6]
            for tid in th1 if tid in th0 and (th1[tid][0] + th1[tid][1]) > (th0[tid][0] + th0[tid][1])
        }
    return res


def _med(xs):
    xs = [x for x in xs if x is not None]
    return (statistics.median(xs), min(xs), max(xs)) if xs else None


def _fmt(stat, spec: str = "{:.0f}", mm: bool = True) -> str:
    if stat is None:
        return "-"
    m, lo, hi = stat
    s = spec.format(m)
    if mm and (lo != hi):
        s += f" ({spec.format(lo)}–{spec.format(hi)})"
    return s


def summarize(runs: list[dict], cs: list[int], paths: list[str]) -> dict:
    """Per (C, path): medians and min-max over rounds; ratios computed within each round."""
    by: dict[tuple[int, str], list[dict]] = {}
    for r in runs:
        by.setdefault((r["conns"], r["path"]), []).append(r)
    out = {}
    for c in cs:
        direct = {r["round"]: r for r in by.get((c, "direct"), [])}
        nginx = {r["round"]: r for r in by.get((c, "nginx"), [])}
        for p in paths:
            rs = by.get((c, p), [])
            if not rs:
                continue
            row = {"rounds": len(rs)}
            row["chunks_per_s"] = _med([r["chunks_per_s"] for r in rs])
            row["x_direct"] = _med([r["chunks_per_s"] / direct[r["round"]]["chunks_per_s"] for r in rs if r["round"] in direct])
            for q in ("p50", "p99", "p99.9"):
                row[q] = _med([r["lat_us"].get(q) for r in rs])
                row["added_" + q] = _med(
                    [r["lat_us"][q] - direct[r["round"]]["lat_us"][q] for r in rs if r["round"] in direct]
                ) if p != "direct" else None
            row["cpu_us"] = _med([r["cpu_us_per_chunk"] for r in rs])
            row["sched_us"] = _med([r["sched_us_per_chunk"] for r in rs])
            row["cpu_util"] = _med([r["proxy_cpu_util"] for r in rs])
            for key, col in (("cpu_x_nginx", "cpu_us_per_chunk"), ("sched_x_nginx", "sched_us_per_chunk")):
                row[key] = _med(
                    [r[col] / nginx[r["round"]][col] for r in rs
                     if r["round"] in nginx and r[col] and nginx[r["round"]][col]]
                ) if p != "direct" else None
            row["load_util"] = _med([r["load_cpu_util"] for r in rs])
            row["errors"] = sum(r["errors"] for r in rs)
            row["turns"] = sum(r["turns"] for r in rs)
            row["rss_mib"] = max((r.get("rss_kb") or 0) for r in rs) / 1024 or None
            out[(c, p)] = row
    return out


def render(summary: dict, cs: list[int], paths: list[str], meta: dict, held: dict[int, bool]) -> str:
    L = []
    L.append(f"### specproxy overhead: {meta['date']}, nproc {meta['nproc']}, {meta['cpu']}")
    L.append("")
    L.append(f"`{meta['command']}` (specproxy {meta['git']}, Python {meta['python']})")
    L.append("")
    L.append(f"Upstream: {meta['stream_mode']} decode-step clock, {meta['step_ms']:g} ms per step, "
             f"{meta['tokens'][0]}–{meta['tokens'][1]} chunks per turn, ~{meta['prompt_bytes']} B prompts; "
             f"{meta['rounds']} rounds of {meta['warmup']:g} s warm-up + {meta['measure']:g} s measured, paths in rotating order; "
             f"proxy pinned to CPU {meta['proxy_cores']}, upstream + load generator to CPU {meta['load_cores']}. "
             f"specproxy: full measurement (tiktoken:o200k_base, SQLite); nginx {meta['nginx_version']}: 1 worker, "
             f"proxy_buffering off. Median over rounds (min–max). Added latency = the path's per-chunk latency "
             f"percentile minus direct's in the same round. CPU: utime+stime from /proc/PID/stat (10 ms ticks: "
             f"coarse at C=1) and on-CPU time from /proc/PID/task/*/schedstat (ns), all threads, nginx master + worker, "
             f"÷ chunks received in the window. This machine's cross-CPU wake-up latency (pipe write every 10 ms, "
             f"reader idle in between): p50 {meta['wake'][0]:.0f} µs, p99 {meta['wake'][1]:.0f} µs, max {meta['wake'][2]:.0f} µs: "
             f"a floor under any proxy's added latency here.")
    L.append("")
    L.append("| C | path | chunks/s | × direct | latency p50 / p99 (µs) | added p50 (µs) | added p99 (µs) "
             "| CPU µs/chunk (stat) | × nginx | CPU µs/chunk (schedstat) | × nginx | proxy CPU (cores) | peak RSS (MiB) |")
    L.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in cs:
        for p in paths:
            row = summary.get((c, p))
            if row is None:
                continue
            lat = f"{_fmt(row['p50'], mm=False)} / {_fmt(row['p99'], mm=False)}"
            cflag = "" if held.get(c, True) else " †"
            L.append(
                f"| {c}{cflag} | {p} | {_fmt(row['chunks_per_s'])} | {_fmt(row['x_direct'], '{:.3f}')} | {lat} "
                f"| {_fmt(row['added_p50'])} | {_fmt(row['added_p99'])} | {_fmt(row['cpu_us'], '{:.1f}')} "
                f"| {_fmt(row['cpu_x_nginx'], '{:.2f}')} | {_fmt(row['sched_us'], '{:.1f}')} "
                f"| {_fmt(row['sched_x_nginx'], '{:.2f}')} | {_fmt(row['cpu_util'], '{:.2f}', mm=False)} "
                f"| {('%.0f' % row['rss_mib']) if row['rss_mib'] else '-'} |"
            )
    if not all(held.values()):
        L.append("")
        L.append("† the load side (upstream + load generator) could not hold the nominal rate at this C on this "
                 "machine even direct: read those rows as indicative.")
    return "\n".join(L)


def _git_state() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "specproxy"],
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
        changed = sorted(line[3:].split("/")[-1] for line in dirty if line.strip())
        return f"{head}" + (f" + uncommitted {', '.join(changed)}" if changed else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def render_threads(runs: list[dict], c: int) -> str:
    """Per-thread user/system CPU per chunk of the proxies at concurrency c (median over rounds)."""
    L = [f"Where the proxy's CPU goes at C={c} (µs per chunk, median over rounds; user = in the process, "
         "sys = in the kernel for it: its syscalls, and the loopback TCP delivery they trigger):", "",
         "| path | thread | user | sys | total |", "|---|---|---:|---:|---:|"]
    for path in ("nginx", "specproxy"):
        rs = [r for r in runs if r["conns"] == c and r["path"] == path and r.get("threads")]
        if not rs:
            continue
        per: dict[str, list[tuple[float, float]]] = {}
        for r in rs:
            agg: dict[str, list[float]] = {}
            for tid, (u, sy) in r["threads"].items():
                name = r.get("thread_names", {}).get(tid, f"tid {tid}")
                a = agg.setdefault(name, [0.0, 0.0])
                a[0] += u
                a[1] += sy
            for name, (u, sy) in agg.items():
                per.setdefault(name, []).append((u, sy))
        rows = sorted(((name, statistics.median(u for u, _ in v), statistics.median(sy for _, sy in v))
                       for name, v in per.items()), key=lambda x: -(x[1] + x[2]))
        for name, u, sy in rows:
            if u + sy >= 0.05:
                L.append(f"| {path} | {name} | {u:.1f} | {sy:.1f} | {u + sy:.1f} |")
        L.append(f"| {path} | **all** | {sum(r[1] for r in rows):.1f} | {sum(r[2] for r in rows):.1f} | "
                 f"**{sum(r[1] + r[2] for r in rows):.1f}** |")
    return "\n".join(L)


CATEGORIES = (
    ("socket send: transport.write -> send()", lambda f: "http_writer.py" in f and ("_writelines" in f or "StreamWriter._write " in f)),
    ("event loop core (uvloop C: epoll, recv, callbacks, Task steps)", lambda f: f.startswith(("Runner.run ", "run_until_complete ", "run_forever "))),
    ("aiohttp response write layers (StreamResponse/StreamWriter, chunked framing)", lambda f: "web_response.py" in f or "http_writer.py" in f),
    ("aiohttp client read layers (parser callback, StreamReader, wake-ups, timeouts)", lambda f: any(x in f for x in ("client_proto.py", "streams.py", "base_protocol.py", "aiohttp/helpers.py"))),
    ("specproxy hot loop (_pump, on_bytes)", lambda f: "_pump" in f or "on_bytes" in f),
)


def profile_window(args, target: tuple[int, list[int]], c: int, load_pids, load_cores, out_path: str) -> str | None:
    """One extra window (not in the tables) with py-spy sampling specproxy: --gil --nonblocking, raw."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        return "py-spy is not installed (pip install py-spy): no profile"
    port, pids = target
    names = _thread_names(pids[0])
    dur = max(2, int(args.measure))
    delay = args.warmup + 0.45
    spy_cmd = [spy, "record", "--pid", str(pids[0]), "--rate", "250", "--gil", "--nonblocking", "--format", "raw",
               "--duration", str(dur), "-o", out_path]
    import threading

    def later() -> None:
        time.sleep(delay)
        subprocess.run(spy_cmd, preexec_fn=_pin(load_cores), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    th = threading.Thread(target=later)
    th.start()
    r = run_window(args, "specproxy", port, c, pids, load_pids, load_cores, seed=99)
    th.join()
    try:
        lines = Path(out_path).read_text().splitlines()
    except OSError:
        return "py-spy produced no profile"
    by_cat: dict[str, int] = {}
    total = 0
    leaves: dict[str, int] = {}
    for line in lines:
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        n = int(n)
        total += n
        joined = ";".join(frames)
        if "concurrent/futures/thread.py" in joined:
            cat = "measuring worker thread (RecordBuilder.build: SSE, JSON, tiktoken)"
        elif "Writer._run" in joined:
            cat = "SQLite writer thread"
        else:
            leaf = frames[-1]
            cat = next((name for name, match in CATEGORIES if match(leaf)),
                       "per-request work (routing, headers, upstream request, pool, submit)")
        by_cat[cat] = by_cat.get(cat, 0) + n
        leaves[frames[-1]] = leaves.get(frames[-1], 0) + n
    L = [f"py-spy (--gil --nonblocking, 250 Hz) on specproxy at C={c}, one extra window "
         f"({r['cpu_us_per_chunk'] or 0:.1f} µs/chunk, raw profile in {out_path}): share of the samples in which a "
         "thread held the GIL (Python and the C it calls; idle waits are not counted)", "",
         "| where | share |", "|---|---:|"]
    for cat, n in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        L.append(f"| {cat} | {100 * n / total:.0f}% |")
    L += ["", "Top leaf frames:", "", "| frame | share |", "|---|---:|"]
    for leaf, n in sorted(leaves.items(), key=lambda kv: -kv[1])[:12]:
        L.append(f"| `{leaf}` | {100 * n / total:.1f}% |")
    del names
    return "\n".join(L)


def render_targets(summary: dict, cs: list[int]) -> str:
    L = ["| target (issue 7) | measured | verdict |", "|---|---:|---|"]

    def add(name, stat, limit, spec, better="le"):
        if stat is None:
            L.append(f"| {name} | - | not measured |")
            return
        ok = stat[0] <= limit if better == "le" else stat[0] >= limit
        L.append(f"| {name} | {_fmt(stat, spec)} | {'met' if ok else '**not met**'} |")

    c_hi = 256 if 256 in cs else max(cs)
    sp = summary.get((c_hi, "specproxy"))
    if sp:
        add(f"C={c_hi}: CPU per chunk ≤ 1.5× nginx (utime+stime)", sp["cpu_x_nginx"], 1.5, "{:.2f}×")
        add(f"C={c_hi}: CPU per chunk ≤ 1.5× nginx (schedstat)", sp["sched_x_nginx"], 1.5, "{:.2f}×")
        add(f"C={c_hi}: added p99 per chunk ≤ 1000 µs", sp["added_p99"], 1000, "{:.0f} µs")
        add(f"C={c_hi}: chunks/s ≥ 0.99× direct", sp["x_direct"], 0.99, "{:.3f}×", "ge")
    s1 = summary.get((1, "specproxy")) if 1 in cs else None
    if s1:
        add("C=1: added p50 ≤ 150 µs", s1["added_p50"], 150, "{:.0f} µs")
    return "\n".join(L)


def orchestrate(args) -> None:
    _raise_nofile()
    meta_cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, os.getcwd()), *sys.argv[1:]])
    t_begin = time.monotonic()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        proxy_cores, load_cores = {cores[-1]}, set(cores[:-1])
    else:
        proxy_cores, load_cores = None, None
        print("only one CPU: nothing is pinned, the proxy shares the CPU with the load", file=sys.stderr)
    if load_cores:
        os.sched_setaffinity(0, load_cores)
    wake = wake_floor(min(load_cores), min(proxy_cores)) if proxy_cores else (float("nan"),) * 3
    print(f"cross-CPU wake-up latency: p50 {wake[0]:.0f} µs, p99 {wake[1]:.0f} µs, max {wake[2]:.0f} µs", file=sys.stderr)
    paths = ["direct", "nginx", "specproxy"]
    nginx_bin = None if args.no_nginx else ensure_nginx()
    if nginx_bin is None:
        paths.remove("nginx")
    nginx_version = "-"
    if nginx_bin:
        v = subprocess.run([nginx_bin, "-v"], capture_output=True, text=True)
        nginx_version = (v.stderr or v.stdout).strip().split("/")[-1]
    cs = [int(x) for x in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    env_cores = ",".join(map(str, sorted(load_cores))) if load_cores else "any"
    up = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--role", "upstream",
                           "--step-ms", str(args.step_ms)], preexec_fn=_pin(load_cores), stdout=subprocess.PIPE)
    runs: list[dict] = []
    held: dict[int, bool] = {}
    profile_c = 256 if 256 in cs else max(cs)
    profile = None
    try:
        up_port = int(up.stdout.readline())
        for c in cs:
            nginx = specproxy = None
            try:
                targets = {"direct": (up_port, [])}
                if "nginx" in paths:
                    nginx, nport = start_nginx(nginx_bin, tmp, up_port, proxy_cores)
                    targets["nginx"] = (nport, [nginx.pid])
                specproxy, sport, db = start_specproxy(tmp, up_port, proxy_cores, args.specproxy_arg)
                targets["specproxy"] = (sport, [specproxy.pid])
                args._our_pids = [os.getpid(), up.pid] + [t[1][0] for t in targets.values() if t[1]]
                for rnd in range(args.rounds):
                    order = paths[rnd % len(paths):] + paths[: rnd % len(paths)]
                    for p in order:
                        port, pids = targets[p]
                        r = run_window(args, p, port, c, pids, [up.pid], load_cores, seed=rnd * 7 + 1)
                        r["round"] = rnd
                        runs.append(r)
                        print(f"C={c:<4} round {rnd + 1}/{args.rounds} {p:9}: {r['chunks_per_s']:9.0f} chunks/s "
                              f"p50 {r['lat_us'].get('p50', float('nan')):8.0f} µs  p99 {r['lat_us'].get('p99', float('nan')):8.0f} µs"
                              + (f"  cpu {r['cpu_us_per_chunk']:6.1f} (stat) {r['sched_us_per_chunk']:6.1f} (schedstat) µs/chunk, {r['proxy_cpu_util']:.2f} cores" if r["cpu_us_per_chunk"] is not None else "")
                              + f"  load side {r['load_cpu_util']:.2f} cores"
                              + (f"  errors {r['errors']} {r['error_kinds']}" if r["errors"] else ""),
                              file=sys.stderr, flush=True)
                sp_children = _children(specproxy.pid)
                names = {"specproxy": {**_thread_names(specproxy.pid),
                                       **{int(t): "measuring process" for c in sp_children
                                          for t in _listdir(f"/proc/{c}/task")}},
                         "nginx": ({nginx.pid: "master", **{k: "worker" for k in _children(nginx.pid)}} if nginx else {})}
                if c == profile_c and args.py_spy:
                    profile = profile_window(args, targets["specproxy"], c, [up.pid], load_cores, args.py_spy)
                hwm = {"nginx": sum(_hwm_kb(p) for p in ([nginx.pid, *_children(nginx.pid)] if nginx else [])),
                       "specproxy": sum(_hwm_kb(p) for p in (specproxy.pid, *sp_children))}
                for r in runs:
                    if r["conns"] == c and r["path"] in names and "threads" in r:
                        r["thread_names"] = {tid: names[r["path"]].get(int(tid), f"tid {tid}") for tid in r["threads"]}
                for r in runs:
                    if r["conns"] == c and r["path"] in hwm:
                        r["rss_kb"] = hwm[r["path"]]
                nominal = c * 1000.0 / args.step_ms * (args.tokens[0] + args.tokens[1]) / (args.tokens[0] + args.tokens[1] + 2)
                directs = [r["chunks_per_s"] for r in runs if r["conns"] == c and r["path"] == "direct"]
                held[c] = bool(directs) and statistics.median(directs) >= 0.9 * nominal
            finally:
                _stop(specproxy)
                _stop(nginx)
            if specproxy is not None:
                import sqlite3

                try:
                    n = sqlite3.connect(db).execute("SELECT count(*), sum(outcome = 'ok') FROM turns").fetchone()
                    print(f"C={c}: specproxy recorded {n[0]} turns ({n[1]} ok) in {db.name}", file=sys.stderr)
                except sqlite3.Error as exc:
                    print(f"C={c}: cannot read specproxy's database: {exc}", file=sys.stderr)
    finally:
        _stop(up)
    summary = summarize(runs, cs, paths)
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(), "cpu": _cpu_model(), "command": meta_cmd,
        "stream_mode": args.stream_mode, "step_ms": args.step_ms, "tokens": args.tokens,
        "prompt_bytes": args.prompt_bytes, "rounds": args.rounds, "warmup": args.warmup, "measure": args.measure,
        "proxy_cores": ",".join(map(str, sorted(proxy_cores))) if proxy_cores else "any", "load_cores": env_cores,
        "nginx_version": nginx_version, "wake": wake, "git": _git_state(), "python": platform.python_version(),
    }
    print()
    print(render(summary, cs, paths, meta, held))
    print()
    print(render_targets(summary, cs))
    print()
    for c in cs:  # where each C's CPU goes, C=256 (the targets') included
        if c > 1 or len(cs) == 1:  # at C=1 a window holds ~200 chunks: per-thread splits are noise
            print(render_threads(runs, c))
            print()
    if profile:
        print(profile)
        print()
    loads = [r["load_cpu_util"] for r in runs]
    others = [r["other_cpu_util"] for r in runs]
    print(f"Load side (upstream + load generator) used at most {max(loads):.2f} of its "
          f"{len(load_cores or [0])} CPU(s) in any window; errors in all windows: {sum(r['errors'] for r in runs)}; "
          f"total time {time.monotonic() - t_begin:.0f} s. CPU used by other processes on this machine during the "
          f"windows: median {statistics.median(others):.2f}, max {max(others):.2f} cores"
          + (" -- NOT a quiet machine: rerun when it is" if max(others) > 0.15 else " (quiet)")
          + f"; waited {_QUIET_WAITED[0]:.0f} s in all for other processes to go quiet.")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


def _tokens(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition("-")
    return int(lo), int(hi or lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,64,256,512", help="comma-separated C values [1,64,256,512]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds before each measured window [1.5]")
    ap.add_argument("--measure", type=float, default=4.0, help="seconds measured per window [4]")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the upstream's decode step period [20 ms]")
    ap.add_argument("--stream-mode", choices=("batched", "smooth"), default="batched")
    ap.add_argument("--tokens", type=_tokens, default=(50, 150), help="chunks per turn, LO-HI [50-150]")
    ap.add_argument("--prompt-bytes", type=int, default=4000, help="size of each request's system prompt [4000]")
    ap.add_argument("--no-nginx", action="store_true", help="skip the nginx baseline")
    ap.add_argument("--specproxy-arg", action="append", default=[], help="extra argument for specproxy serve")
    ap.add_argument("--json", help="write every window's raw numbers here")
    ap.add_argument("--quiet-wait", type=float, default=60.0, help="before each window wait until other processes "
                    "use < 0.15 CPU, at most this many seconds in all [60]; 0: never wait")
    ap.add_argument("--py-spy", metavar="PATH", help="add one window at C=256 with py-spy sampling specproxy; "
                    "raw profile to PATH, summary printed")
    # internal roles
    ap.add_argument("--role", choices=("orchestrate", "upstream", "loadgen"), default="orchestrate", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--conns", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--t-start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--t-end", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "orchestrate":
        sys.path.insert(0, str(ROOT))
        orchestrate(args)
        return
    _raise_nofile()
    _use_uvloop()
    asyncio.run(upstream_main(args) if args.role == "upstream" else loadgen_main(args))


if __name__ == "__main__":
    main()
