"""``specproxy serve`` as a real subprocess (its logs in a file, its state lines parsed), and a background
event loop for the servers such tests talk to from other threads or processes. For the tests whose
point is the process itself: signals, restarts, the relay thread's scheduling, the command line."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from faultkit import wait_until

ROOT = Path(__file__).resolve().parent.parent


# --- a background loop, for servers the tests talk to from other threads or processes ---------------


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def cancel_leftovers() -> None:
    """End what a test left running on the loop it runs on (a scripted peer's connections still open or
    waiting for a request), so that nothing is torn down by garbage collection after the loop stopped."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=5)


# --- specproxy serve as a subprocess -------------------------------------------------------------------

_READY = re.compile(r"forwarding http://127\.0\.0\.1:(\d+) ->")


class ServeProcess:
    """``python -m specproxy.app.cli serve`` with stderr in a file (to read its logs afterwards)."""

    def __init__(self, tmp: Path, upstream: str, db: Path, *args: str, env: dict | None = None, name: str = "serve",
                 wrap: tuple[str, ...] = ()):
        """``wrap``: a command that runs serve (``setpriv ...``, say), put before it."""
        self.log_path = tmp / f"{name}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env = {k: v for k, v in full_env.items() if not k.startswith("SPECPROXY_") or k in (env or {})}
        cmd = [*wrap, sys.executable, "-m", "specproxy.app.cli", "serve", "--upstream", upstream, "--port", "0",
               "--db", str(db), "--scrape-interval", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._log, env=full_env, cwd=ROOT)
        self.port = int(wait_until(self._ready_port, 30, 0.02, "specproxy serve to listen"))

    def _ready_port(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"serve exited with {self.proc.returncode}: {self.stderr()}")
        m = _READY.search(self.stderr())
        return m.group(1) if m else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.log_path.read_bytes().decode("utf-8", "replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait(10)

    def state(self, timeout: float = 10) -> dict[str, int | float]:
        """Ask for a state line (SIGUSR1) and parse the newest one, once its end is written (read while the
        process was still writing it, a line's last field came cut off)."""
        def whole() -> list[str]:
            text = self.stderr()
            return [ln for ln in text[:text.rfind("\n") + 1].splitlines() if " state " in ln]

        before = len(whole())
        self.proc.send_signal(signal.SIGUSR1)
        wait_until(lambda: len(whole()) > before, timeout, 0.02, "a state line")
        line = whole()[-1]
        return {k: _number(v) for k, v in (kv.split("=") for kv in line.split(" state ", 1)[1].split())}


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def chat(url: str) -> int:
    """One small streamed chat turn through the serve at ``url``, read to its end; its status."""
    body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        return resp.status
