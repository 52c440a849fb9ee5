"""Run a real ``llama-server`` as a subprocess for tests.

Why a helper: every real-tier test needs the same careful lifecycle — a free
loopback port, a readiness check that waits for the model to be *loaded* (the
HTTP socket opens before that and ``/health`` answers 503 meanwhile), the
server's own log when anything goes wrong, and a shutdown that cannot hang the
test session.  Only the standard library is used so this works before any of
specproxy's HTTP stack is importable.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Sequence

from ports import free_port  # noqa: F401 (callers import it from here too)

HOST = "127.0.0.1"


class LlamaServerError(RuntimeError):
    pass


# Servers still running at interpreter exit (a test that forgot to stop one, or
# an exception between start and the context manager) are stopped here, so a
# crashed session does not leave llama-server processes holding ports and RAM.
_live: "weakref.WeakSet[LlamaServer]" = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for srv in list(_live):
        srv.stop()


class LlamaServer:
    """A ``llama-server`` process bound to 127.0.0.1.

    Use as a context manager::

        with LlamaServer(binary, model, extra_args=["--spec-type", "ngram-mod"]) as srv:
            urllib.request.urlopen(srv.url + "/health")

    ``restart()`` keeps the same port, so a proxy configured with ``.url``
    keeps pointing at the new process. One compute thread by default: on a 2-core machine the
    proxy and the test clients need the other core, or timing comparisons measure contention.
    """

    def __init__(self, binary: Path | str, model: Path | str, *, extra_args: Sequence[str] = (),
                 n_ctx: int = 32768, threads: int = 1, parallel: int = 1, metrics: bool = True,
                 port: int | None = None, startup_deadline_s: float = 120.0,
                 stop_deadline_s: float = 10.0, log_path: Path | str | None = None) -> None:
        self.binary = Path(binary)
        self.model = Path(model)
        self.extra_args = list(extra_args)
        self.n_ctx, self.threads, self.parallel, self.metrics = n_ctx, threads, parallel, metrics
        self.port = port
        self.startup_deadline_s = startup_deadline_s
        self.stop_deadline_s = stop_deadline_s
        self._fixed_port = port is not None
        self._log_path = Path(log_path) if log_path else None
        self._own_log = log_path is None
        self._log_offset = 0
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    # ----------------------------------------------------------------- props
    @property
    def url(self) -> str:
        if self.port is None:
            raise LlamaServerError("server not started")
        return f"http://{HOST}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    def log_text(self, tail_lines: int | None = None, *, current_only: bool = False) -> str:
        """The server's combined stdout/stderr (all runs, or only the current one)."""
        if not self._log_path or not self._log_path.exists():
            return ""
        with open(self._log_path, "rb") as fh:
            fh.seek(self._log_offset if current_only else 0)
            text = fh.read().decode("utf-8", errors="replace")
        if tail_lines is not None:
            text = "\n".join(text.splitlines()[-tail_lines:])
        return text

    def command(self) -> list[str]:
        cmd = [str(self.binary), "-m", str(self.model), "--host", HOST, "--port", str(self.port),
               "-c", str(self.n_ctx), "-t", str(self.threads), "-np", str(self.parallel)]
        if self.metrics:
            cmd.append("--metrics")
        return cmd + self.extra_args

    # ------------------------------------------------------------- lifecycle
    def start(self) -> "LlamaServer":
        """Start and block until ``/health`` says ok (up to 3 ports if one is lost to a race)."""
        if self.proc is not None and self.proc.poll() is None:
            raise LlamaServerError("already running")
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            if not self._fixed_port:
                self.port = free_port()
            self._spawn()
            try:
                self._wait_healthy()
                return self
            except LlamaServerError:
                lost_race = "bind" in self.log_text(tail_lines=30, current_only=True).lower()
                self.stop()
                if not lost_race or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        # One log file across restarts; remember where this process's part starts.
        self._log_offset = self._log_path.stat().st_size if self._log_path.exists() else 0
        # Drop LLAMA_ARG_* from the environment: llama-server reads every flag
        # from them too, so a developer's shell could silently change tests.
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        with open(self._log_path, "ab") as log:
            # The log goes to a file, not a pipe: llama-server is chatty and a
            # pipe nobody drains would eventually block it mid-request.
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._t_spawn = time.monotonic()
        _live.add(self)

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = self._t_spawn + self.startup_deadline_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise LlamaServerError(
                    f"llama-server exited with code {rc} during startup; last log lines:\n"
                    + self.log_text(tail_lines=40, current_only=True))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    body = json.loads(r.read() or b"{}")
                    if r.status == 200 and body.get("status") == "ok":
                        self.startup_seconds = time.monotonic() - self._t_spawn
                        return
                    last = f"HTTP {r.status} {body}"
            except urllib.error.HTTPError as e:  # 503 while the model loads
                last = f"HTTP {e.code}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            # Readiness is a condition we poll; 50 ms keeps startup latency low.
            time.sleep(0.05)
        raise LlamaServerError(
            f"llama-server not healthy after {self.startup_deadline_s:.0f}s ({last}); last log lines:\n"
            + self.log_text(tail_lines=40, current_only=True))

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``stop_deadline_s``; returns the exit code."""
        proc, self.proc = self.proc, None
        _live.discard(self)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_deadline_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=self.stop_deadline_s)
        return proc.returncode

    def restart(self) -> "LlamaServer":
        """Stop and start again on the same port (so ``.url`` stays valid)."""
        was_fixed = self._fixed_port
        self._fixed_port = self.port is not None
        try:
            self.stop()
            return self._start_same_port()
        finally:
            self._fixed_port = was_fixed

    def _start_same_port(self) -> "LlamaServer":
        # The old socket may linger briefly; retry the bind until the deadline.
        deadline = time.monotonic() + self.startup_deadline_s
        while True:
            try:
                return self.start()
            except LlamaServerError:
                if "bind" not in self.log_text(tail_lines=30, current_only=True).lower() or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def cleanup_log(self) -> None:
        if self._own_log and self._log_path is not None:
            self._log_path.unlink(missing_ok=True)

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if exc[0] is None:
            self.cleanup_log()

    # --------------------------------------------------------------- helpers
    def get_json(self, path: str, timeout: float = 30) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def post_json(self, path: str, payload: dict, timeout: float = 60) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def metrics_text(self, timeout: float = 10) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=timeout) as r:
            return r.read().decode()

    def stream_chat(self, payload: dict, timeout: float = 60) -> list[dict]:
        """POST a streaming chat completion; return the parsed SSE ``data:`` chunks."""
        req = urllib.request.Request(self.url + "/v1/chat/completions",
                                     data=json.dumps({**payload, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        chunks = []
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:  # bounded by the response; the socket timeout bounds each read
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunks.append(json.loads(data))
        return chunks
