"""One streamed chat turn's path from socket to row: the modules it enters, and its thread hand-offs.

Why: the layers are judged by how much of the package one request makes a reader walk through, and by
how many threads a turn's data passes between (each one a queue, a wake-up and a cache gone cold). Both
are counted here on a real ``specproxy serve``, not read off the source: one turn, traced in every
Python thread of the proxy, after two turns that warmed it up.

How: the proxy runs under this file as its interpreter (``python turn_path.py --probe OUT -m
specproxy.app.cli serve ...``), which installs a profile function in every thread (``sys.setprofile``
and ``threading.setprofile``) before the proxy starts any. SIGUSR2 starts the recording of Python calls
into ``specproxy`` and, sent again, writes them to ``OUT`` (JSON). The driver (this file without
``--probe``) starts the package's scripted upstream, the proxy, sends the turns, waits for each turn's
row in the proxy's database and reads ``OUT``. Scrapes are off, so the traced calls are the turn's.

The hand-offs are read from who did what: the event loop's thread takes the request; the relay thread
(C, invisible to a profile function) has the body between ``TurnSink.start`` and ``TurnSink._collect``
in ``wire/relay_thread.py``; the turn is built by whichever thread enters ``measure/``'s build; its
record is put in the store's queue by whichever thread calls ``Writer.put``, and written by the thread
that runs ``Writer._write``. A thread that differs from the one before it is a hand-off.

``--python`` runs another checkout's proxy (its virtualenv's interpreter, with that checkout installed
in it: ``pip install -e .``), for a before and after on the same turn. The probe uses the standard
library alone, so it runs under any version of the package.

    python scripts/turn_path.py [--python /path/to/other/.venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["TurnPath", "path_of"]

WIRE_SERVE = ("specproxy/serve/", "specproxy/wire/")
RELAY_FILE = "specproxy/wire/relay_thread.py"
LOOP = "MainThread"


# --- the probe: runs as the proxy's interpreter -------------------------------------------------------

def _probe(out: str, argv: list[str]) -> None:
    """Record every Python call into ``specproxy`` between two SIGUSR2, then write them to ``out``; run
    ``-m MODULE ARGS`` meanwhile."""
    import runpy

    calls: list[tuple[str, str, str]] = []
    state = {"on": False}

    def profile(frame, event, arg):
        if event != "call" or not state["on"]:
            return
        f = frame.f_code.co_filename
        i = f.rfind("/specproxy/")
        if i >= 0:
            calls.append((threading.current_thread().name, f[i + 1:], frame.f_code.co_qualname))

    def toggle(signum, frame) -> None:
        if not state["on"]:
            state["on"] = True
            return
        state["on"] = False
        tmp = out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(calls[:], fh)  # a copy: a thread past its check of "on" may still append
        os.replace(tmp, out)

    signal.signal(signal.SIGUSR2, toggle)
    threading.setprofile(profile)
    sys.setprofile(profile)
    if argv[:1] != ["-m"] or len(argv) < 2:
        raise SystemExit("turn_path.py --probe OUT -m MODULE [ARGS]")
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


# --- reading a trace ---------------------------------------------------------------------------------

class TurnPath:
    """What one turn's trace shows: the serve and wire modules it entered (in order of first entry), the
    Python calls into them, every ``specproxy`` module it entered, and its threads from socket to row."""

    def __init__(self, modules: dict[str, int], all_modules: list[str], threads: list[str]) -> None:
        self.modules, self.all_modules, self.threads = modules, all_modules, threads  # module -> its calls

    @property
    def calls(self) -> int:
        return sum(self.modules.values())

    @property
    def hand_offs(self) -> int:
        return len(self.threads) - 1


def path_of(calls: list[tuple[str, str, str]]) -> TurnPath:
    """Read one turn's calls (thread name, module file from ``specproxy/``, qualified name), in order."""
    modules: dict[str, int] = {}
    every: list[str] = []
    for _, module, _ in calls:
        if module not in every:
            every.append(module)
        if module.startswith(WIRE_SERVE):
            modules[module] = modules.get(module, 0) + 1
    relayed = any(m == RELAY_FILE and q.endswith("start") and q.startswith("TurnSink") for _, m, q in calls)
    builder = next((t for t, m, q in calls if m.startswith("specproxy/measure/build") and t != LOOP), None)
    putter = next((t for t, m, q in calls if m == "specproxy/store/writer.py" and q == "Writer.put"), None)
    writer = next((t for t, m, q in calls if m == "specproxy/store/writer.py" and q == "Writer._write"), None)
    threads = [LOOP]
    if relayed:
        threads += ["relay thread (C)", LOOP]
    for t in (builder, putter, writer):
        if t is not None and t != threads[-1]:
            threads.append(t)
    return TurnPath(modules, every, threads)


# --- the driver --------------------------------------------------------------------------------------

def _post(conn, body: bytes) -> None:
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    if resp.status != 200:
        raise SystemExit(f"turn_path: the proxy answered {resp.status}")


def _rows(db: Path) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as c:
            return c.execute('SELECT count(*) FROM "turns"').fetchone()[0]
    except sqlite3.Error:  # not created yet
        return 0


def _until(what: str, ok, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if proc.poll() is not None:
            raise SystemExit(f"turn_path: the proxy exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"turn_path: no {what} within {timeout:.0f} s")
        time.sleep(0.05)


def trace(python: str, workdir: Path) -> TurnPath:
    """Run ``python``'s specproxy in front of a scripted upstream; trace its third turn."""
    import asyncio

    from overhead_procs import free_port, stop, wait_port

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from specproxy.app.fake_upstream import FakeUpstream, Script

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    upstream = FakeUpstream(Script(pieces=["tok"] * 40, interval_s=0.001))
    asyncio.run_coroutine_threadsafe(upstream.start(), loop).result(30)
    port = free_port()
    db, out = workdir / "turns.db", workdir / "trace.json"
    cmd = [python, str(Path(__file__).resolve()), "--probe", str(out), "-m", "specproxy.app.cli", "serve",
           "--upstream", upstream.url, "--port", str(port), "--db", str(db), "--tokenizer", "tiktoken:o200k_base",
           "--scrape-interval", "0"]
    log = open(workdir / "serve.log", "w")
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=log)
    try:
        wait_port(port, proc, timeout=60)
        body = json.dumps({"model": "m", "stream": True, "stream_options": {"include_usage": True},
                           "messages": [{"role": "system", "content": "You are terse. " * 40},
                                        {"role": "user", "content": "Say something."}]}).encode()
        import http.client

        # one connection, kept alive, as chat clients and SDKs keep theirs: the traced turn is a request on
        # it, not a connection's first
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for i in range(2):  # warm: the first turns load the tokenizer, fill caches, start threads
            _post(conn, body)
            _until(f"turn {i + 1}'s row", lambda i=i: _rows(db) >= i + 1, proc)
        proc.send_signal(signal.SIGUSR2)
        _post(conn, body)
        _until("the traced turn's row", lambda: _rows(db) >= 3, proc)
        proc.send_signal(signal.SIGUSR2)
        _until("the trace", out.exists, proc)
        calls = [tuple(c) for c in json.loads(out.read_text())]
        conn.close()
    finally:
        stop(proc, timeout=30)
        log.close()
        asyncio.run_coroutine_threadsafe(upstream.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
    return path_of(calls)


def render(name: str, p: TurnPath) -> str:
    short = [f"{m.removeprefix('specproxy/')} ({n})" for m, n in p.modules.items()]
    return (f"{name}: {len(p.modules)} serve and wire modules entered, {p.calls} Python calls into them; "
            f"{len(p.all_modules)} specproxy modules in all\n  {' '.join(short)}\n"
            f"  threads from socket to row: {' -> '.join(p.threads)} ({p.hand_offs} hand-offs)")


def main() -> None:
    if sys.argv[1:2] == ["--probe"]:
        _probe(sys.argv[2], sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", default=[], metavar="PATH",
                    help="also trace the proxy of this interpreter (another checkout's .venv/bin/python)")
    args = ap.parse_args()
    for python in [sys.executable, *args.python]:
        with tempfile.TemporaryDirectory(prefix="turn-path-") as tmp:
            try:
                p = trace(python, Path(tmp))
            except RuntimeError as exc:  # the proxy did not start (overhead_procs.wait_port)
                raise SystemExit(f"turn_path: {exc}") from None
        print(render("this checkout" if python == sys.executable else python, p))


if __name__ == "__main__":
    main()
