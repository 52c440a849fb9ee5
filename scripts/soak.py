"""A bounded soak of the real proxy: ``specproxy serve`` in a subprocess, a scripted upstream and many
clients in this process, a fixed number of turns, then a verdict.

    python scripts/soak.py                 # 20000 turns, concurrency 64, 20% client aborts, 10% truncations
    python scripts/soak.py --turns 2000    # a shorter run
    python scripts/soak.py --long          # an hour of normal turns among hostile clients; RSS drift
    python scripts/soak.py --duration 120 --concurrency 16    # the same, for two minutes

The long mode (``--long`` or ``--duration SECONDS``) runs normal streaming turns for that long beside
hostile clients (soak_hostile.py: slow heads, partial bodies, clients that never read, malformed
requests), samples the proxy's RSS, and reports its drift: idle after the warm-up against idle after the
run, and the slope over the run's samples. It also fails when a hostile client was not cut or a
malformed request was answered 2xx.

What it checks, and prints:
  * bytes differing: every byte a client read must equal what the upstream wrote for that turn (a whole
    stream, or a prefix of it when the client aborted or the upstream truncated) -- must be 0;
  * records lost: every turn must have its row, with the outcome the soak caused (ok, client_abort,
    upstream_truncated), except the ones the writer says it dropped (counted, normally 0); and every
    row a concurrent reader saw committed must still be there at the end -- must be 0;
  * leaks: the proxy's RSS, open file descriptors, threads and asyncio tasks, idle after a warm-up
    and idle after the soak (tasks come from the proxy's own state line, logged on SIGUSR1; so does
    ``upstream_idle``, the kept-alive upstream connections, each one file descriptor, that account for
    a change in fds).

Exit status 0 when bytes differing and records lost are both 0, else 1. Bounded: every phase has a
deadline; the upstream and the proxy bind 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import orjson

from soak_hostile import Hostile, RssSampler, big_answer

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["Hello", " world", ",", " café", " 日本語", " 🚀", " naïve", "\n", " tokens", " é", "!", " Ω"]


# --- what the upstream sends for turn n (deterministic, so the client knows the truth) -----------------


def stream_events(n: int) -> list[bytes]:
    rng = random.Random(n)
    nl = b"\r\n" if n % 5 == 0 else b"\n"
    out = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}' + nl + nl]
    for i in range(rng.randint(4, 16)):
        if rng.random() < 0.1:
            out.append(b": ping" + nl + nl)
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        out.append(b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}) + nl + nl)
    out.append(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
               b'"usage":{"prompt_tokens":5,"completion_tokens":9}}' + nl + nl)
    out.append(b"data: [DONE]" + nl + nl)
    return out


def plan(n: int, abort_rate: float, truncate_rate: float) -> str:
    r = random.Random(n * 7919).random()
    return "abort" if r < abort_rate else "truncate" if r < abort_rate + truncate_rate else "ok"


# --- the scripted upstream ------------------------------------------------------------------------------


class Upstream:
    def __init__(self, abort_rate: float, truncate_rate: float) -> None:
        self.abort_rate, self.truncate_rate = abort_rate, truncate_rate
        self.port = 0
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0, backlog=1024)
        self.port = self.server.sockets[0].getsockname()[1]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for _ in range(100_000):
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                body = orjson.loads(await asyncio.wait_for(reader.readexactly(length), 30))
                if body.get("big"):  # the long mode's clients that never read
                    return await big_answer(writer)
                n = body["soak"]
                if not await self.respond(n, writer):
                    return
        except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def respond(self, n: int, writer: asyncio.StreamWriter) -> bool:
        rng = random.Random(n * 31)
        events = stream_events(n)
        body = b"".join(events)
        how = plan(n, self.abort_rate, self.truncate_rate)
        truncate = how == "truncate"
        cut = rng.randint(1, len(body) - 1) if truncate else len(body)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        pos = 0
        while pos < cut:
            sizes = [1, 7, 40] if how == "abort" else [1, 7, 40, 200, 4096]  # abandoned turns stream longer
            step = min(rng.choice(sizes), cut - pos)
            piece = body[pos : pos + step]
            writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            pos += step
            await writer.drain()
            if how == "abort" or rng.random() < 0.05:
                # a server taking its time (simulated); for turns the client will abandon, always, so
                # that the client hangs up while the stream is still running
                await asyncio.sleep(rng.uniform(0.0005, 0.003))
        if truncate:
            writer.transport.abort()  # dies mid-stream: no terminating chunk
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


# --- the clients ------------------------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.done = 0
        self.bytes_differing = 0
        self.mismatched_turns: list[int] = []
        self.client_saw: dict[str, int] = {"complete": 0, "aborted": 0, "truncated": 0, "error": 0}
        self.errors: list[str] = []


async def client_turn(session: aiohttp.ClientSession, url: str, n: int, args, tally: Tally) -> None:
    truth = b"".join(stream_events(n))
    how = plan(n, args.abort_rate, args.truncate_rate)
    rng = random.Random(n * 17)
    stop_after = rng.randint(1, len(truth) - 1) if how == "abort" else None
    got = bytearray()
    body = orjson.dumps({"model": "soak", "stream": True, "soak": n,
                         "messages": [{"role": "user", "content": f"turn {n}"}]})
    try:
        async with session.post(url + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json", "X-Specproxy-Label": f"soak-{n}"}) as r:
            if r.status != 200:
                tally.client_saw["error"] += 1
                tally.errors.append(f"turn {n}: status {r.status}")
                return
            try:
                async for data in r.content.iter_any():
                    got += data
                    if stop_after is not None and len(got) >= stop_after:
                        r.close()  # the client hangs up mid-stream
                        tally.client_saw["aborted"] += 1
                        break
                else:
                    tally.client_saw["complete"] += 1
            except aiohttp.ClientPayloadError:
                tally.client_saw["truncated"] += 1
    except (aiohttp.ClientError, OSError) as exc:
        tally.client_saw["error"] += 1
        tally.errors.append(f"turn {n}: {type(exc).__name__}")
    finally:
        tally.done += 1
    if how == "ok" and bytes(got) != truth or not truth.startswith(bytes(got)):
        tally.bytes_differing += sum(a != b for a, b in zip(got, truth)) + abs(len(got) - len(truth)) * (how == "ok")
        tally.mismatched_turns.append(n)


async def run_clients(url: str, first: int, count: int | None, args, tally: Tally, until: float | None = None) -> None:
    """Turns ``first``... (``count`` of them, or as many as start before loop time ``until``)."""
    queue = iter(range(first, first + count)) if count is not None else _until(first, until)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as s:
        async def worker():
            for n in queue:
                await client_turn(s, url, n, args, tally)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))


def _until(first: int, until: float):
    loop = asyncio.get_running_loop()
    n = first
    while loop.time() < until:
        yield n
        n += 1


# --- the proxy process ---------------------------------------------------------------------------------


def _number(text: str) -> int | float:
    """A state line's value: a count, or seconds (the cadence poll's ``poll_s``)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


class Proxy:
    def __init__(self, upstream: str, db: Path, log: Path, *extra: str) -> None:
        self.log = log
        self._f = open(log, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPROXY_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specproxy.app.cli", "serve", "--upstream", upstream, "--port", "0",
             "--db", str(db), "--scrape-interval", "0", *extra],
            stdout=subprocess.DEVNULL, stderr=self._f, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 30
        while True:
            m = re.search(r"forwarding (http://127\.0\.0\.1:\d+) ->", self.text())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"specproxy serve did not start:\n{self.text()}")
            time.sleep(0.05)  # polling a log file for a line, with a deadline

    def text(self) -> str:
        return self.log.read_bytes().decode("utf-8", "replace")

    def state(self) -> dict[str, float]:
        before = self.text().count(" state ")
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while self.text().count(" state ") == before:
            if time.monotonic() > deadline:
                raise SystemExit("the proxy did not answer SIGUSR1")
            time.sleep(0.02)
        line = [ln for ln in self.text().splitlines() if " state " in ln][-1]
        out = {k: _number(v) for k, v in (kv.split("=") for kv in line.split(" state ", 1)[1].split())}
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        out["rss_kib"] = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        out["threads"] = int(re.search(r"Threads:\s+(\d+)", status).group(1))
        out["fds_proc"] = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            self._f.close()


def wait_idle(proxy: Proxy, timeout: float = 60) -> dict[str, int]:
    """The proxy's state once nothing is in flight, measured and queued (polled, with a deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        st = proxy.state()
        if st["in_flight"] == 0 and st["pending_measure"] == 0 and st["queued"] == 0 and st["connections"] == 0:
            return st
        if time.monotonic() > deadline:
            return st
        time.sleep(0.2)


class CommittedWatcher(threading.Thread):
    """Reads the database as an outside reader would, collecting the ids it sees committed."""

    def __init__(self, db: Path) -> None:
        super().__init__(daemon=True)
        self.db, self.seen, self.stop = db, set(), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5)
                try:
                    self.seen.update(r[0] for r in conn.execute("SELECT id FROM turns"))
                finally:
                    conn.close()
            except sqlite3.Error:
                pass


async def _long(url: str, first: int, args, tally: Tally, hostile: Hostile, sampler: RssSampler,
                duration: float) -> None:
    until = asyncio.get_running_loop().time() + duration
    await asyncio.gather(run_clients(url, first, None, args, tally, until), hostile.run(until), sampler.run(until))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--abort-rate", type=float, default=0.2)
    ap.add_argument("--truncate-rate", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=None, help="turns before the baseline [default: 5%%, >= 200]")
    ap.add_argument("--keep", action="store_true", help="keep the database and the proxy's log")
    ap.add_argument("--duration", type=float, default=None,
                    help="the long mode: normal turns for this many seconds among hostile clients (instead of "
                         "--turns), and the proxy's RSS drift")
    ap.add_argument("--long", action="store_true", help="the long mode for an hour (--duration 3600)")
    ap.add_argument("--send-timeout", type=float, default=10.0,
                    help="the proxy's send_timeout_s in the long mode, so that clients that never read are cut "
                         "often [default: 10]")
    args = ap.parse_args()
    duration = 3600.0 if args.long and args.duration is None else args.duration
    warmup = args.warmup if args.warmup is not None else max(200, args.turns // 20)
    workdir = Path(tempfile.mkdtemp(prefix="specproxy-soak-"))
    db = workdir / "soak.db"

    loop = asyncio.new_event_loop()
    upstream = Upstream(args.abort_rate, args.truncate_rate)
    loop.run_until_complete(upstream.start())
    extra = ("--send-timeout", str(args.send_timeout)) if duration else ()
    proxy = Proxy(f"http://127.0.0.1:{upstream.port}", db, workdir / "proxy.log", *extra)
    hostile = sampler = None
    watcher = CommittedWatcher(db)
    watcher.start()
    tally = Tally()
    t0 = time.monotonic()
    try:
        loop.run_until_complete(asyncio.wait_for(run_clients(proxy.url, 0, warmup, args, tally), 600))
        base = wait_idle(proxy)
        t1 = time.monotonic()
        if duration:
            hostile = Hostile(int(proxy.url.rsplit(":", 1)[1]), args.send_timeout)
            sampler = RssSampler(proxy.state, max(5.0, duration / 30))
            loop.run_until_complete(asyncio.wait_for(
                _long(proxy.url, warmup, args, tally, hostile, sampler, duration), duration + 600))
        else:
            loop.run_until_complete(asyncio.wait_for(run_clients(proxy.url, warmup, args.turns, args, tally), 3600))
        t2 = time.monotonic()
        end = wait_idle(proxy)
    finally:
        watcher.stop.set()
        watcher.join(10)
        code = proxy.stop()
        upstream.server.close()
        leftovers = asyncio.all_tasks(loop)  # upstream connections of the stopped proxy: they see EOF
        if leftovers:
            loop.run_until_complete(asyncio.wait(leftovers, timeout=10))
        loop.close()
    total = tally.done  # warmup + args.turns, or as many as the long mode's time allowed
    normal = "WHERE label LIKE 'soak-%'"  # the long mode's hostile turns have rows of their own
    conn = sqlite3.connect(db)
    rows = dict(conn.execute(f"SELECT outcome, count(*) FROM turns {normal} GROUP BY outcome").fetchall())
    stalled = dict(conn.execute("SELECT outcome, count(*) FROM turns WHERE label = 'hostile-stall' "
                                "GROUP BY outcome").fetchall())
    every_id = {r[0] for r in conn.execute("SELECT id FROM turns")}
    ids = {r[0] for r in conn.execute(f"SELECT id FROM turns {normal}")}
    by_turn = dict(conn.execute(f"SELECT label, outcome FROM turns {normal}").fetchall())
    n_rows = len(ids)
    integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    conn.close()
    dropped = end["dropped"] + end["measure_dropped"]
    lost_committed = len(watcher.seen - every_id)
    missing = total - n_rows - dropped
    # the outcome each turn may have: an aborted turn is "ok" when the proxy had delivered every byte
    # before the client hung up (the client read slower than the proxy wrote)
    allowed = {"ok": {"ok"}, "abort": {"client_abort", "ok"}, "truncate": {"upstream_truncated"}}
    caused = {"ok": 0, "abort": 0, "truncate": 0}
    wrong = []
    for n in range(total):
        how = plan(n, args.abort_rate, args.truncate_rate)
        caused[how] += 1
        got = by_turn.get(f"soak-{n}")
        if got is not None and got not in allowed[how]:
            wrong.append((n, how, got))

    def fmt(k):
        return f"{k:>15}: {base[k]:>8} -> {end[k]:>8}  ({end[k] - base[k]:+d})"

    turns = total - warmup
    mode = f" for {duration:g} s among hostile clients (send_timeout_s {args.send_timeout:g})" if duration else ""
    print(f"specproxy soak: {turns} turns (+{warmup} warm-up) at concurrency {args.concurrency}{mode}, "
          f"{args.abort_rate:.0%} client aborts, {args.truncate_rate:.0%} upstream truncations")
    print(f"  soak phase {t2 - t1:.1f} s ({turns / (t2 - t1):.0f} turns/s); total {time.monotonic() - t0:.1f} s")
    print(f"  clients saw: {tally.client_saw}")
    print("  proxy, idle after the warm-up -> idle after the soak:")
    for k in ("rss_kib", "fds", "fds_proc", "upstream_idle", "threads", "tasks", "connections"):
        print("  " + fmt(k))
    print(f"  upstream connections opened: {upstream.connections} (for {total} turns)")
    print(f"  rows: {n_rows} of {total} turns; by outcome {rows} (caused: {caused}); "
          f"dropped and counted by the proxy: {dropped}; integrity_check: {integrity}")
    print(f"  rows seen committed by a concurrent reader: {len(watcher.seen)}; of those missing at the end: "
          f"{lost_committed}")
    print(f"  records lost: {missing + lost_committed}; rows with an outcome the soak did not cause: {len(wrong)} "
          f"{wrong[:5]}")
    print(f"  bytes differing: {tally.bytes_differing} (turns: {tally.mismatched_turns[:10]})")
    if hostile is not None:
        print("  hostile clients (what each saw):")
        print("\n".join(hostile.lines()))
        print(f"    rows of the clients that never read, by outcome: {stalled}")
        rss = [st["rss_kib"] / 1024 for _, st in sampler.samples]
        slope, late = sampler.slope_mib_per_hour(), sampler.slope_mib_per_hour(0.5)
        print(f"  RSS drift: idle after the warm-up {base['rss_kib'] / 1024:.1f} MiB -> idle after the run "
              f"{end['rss_kib'] / 1024:.1f} MiB ({(end['rss_kib'] - base['rss_kib']) / 1024:+.1f}); during the run "
              f"{len(rss)} samples, first {rss[0]:.1f}, max {max(rss):.1f}, last {rss[-1]:.1f} MiB; slope "
              + (f"{slope:+.1f} MiB/hour" if slope is not None else "n/a (too few samples)")
              + (f", over the second half {late:+.1f} MiB/hour" if late is not None else ""))
    print(f"  proxy exit status after SIGTERM: {code}; tracebacks in its log: {proxy.text().count('Traceback')}")
    if tally.errors:
        print(f"  client errors ({len(tally.errors)}): {tally.errors[:5]}")
    if args.keep:
        print(f"  kept: {workdir}")
    else:
        for p in workdir.iterdir():
            p.unlink()
        workdir.rmdir()
    ok = (tally.bytes_differing == 0 and missing + lost_committed == 0 and integrity == "ok" and code == 0
          and not tally.errors and not wrong and (hostile is None or not hostile.failed()))
    if hostile is not None and hostile.failed():
        print(f"  let through: {hostile.failed()}")
    print("  verdict:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
