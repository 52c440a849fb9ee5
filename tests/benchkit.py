"""What the bench tests share: the command line as a subprocess, the one-line error rule, a fake upstream
on its own loop thread for a bench subprocess to talk to, and request bodies as a client wrote them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specproxy.app.fake_upstream import FakeUpstream, Script

ROOT = Path(__file__).resolve().parents[1]
SPECPROXY = [sys.executable, "-m", "specproxy.app.cli"]

BODIES = [
    # key order, spacing and escapes as a client chose them: what must come back byte for byte
    b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "Z\\u00fcrich \xf0\x9f\x9a\x80"}]}',
    b'{\n  "messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}],\n'
    b'  "stream": true,  "max_tokens": 8\n}',
    b'{"prompt":"Once upon","stream":true,"model":"m"}',
]


def specproxy(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*SPECPROXY, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("specproxy: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def upstream_thread():
    """A fake upstream on its own loop thread, for a bench subprocess to talk to."""
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    ups: list[FakeUpstream] = []

    def start(script=Script(pieces=["a", " b", " c"] * 4)) -> FakeUpstream:
        up = FakeUpstream(script)
        asyncio.run_coroutine_threadsafe(up.start(), loop).result(10)
        ups.append(up)
        return up

    yield start
    for up in ups:
        asyncio.run_coroutine_threadsafe(up.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)



def workload(tmp_path: Path) -> Path:
    work = tmp_path / "w.jsonl"
    work.write_bytes(b"\n".join([BODIES[0]] * 6) + b"\n")
    return work



def bench_with_second_line(tmp_path: Path, up: FakeUpstream, line: bytes, name: str) -> tuple[subprocess.CompletedProcess, Path]:
    """bench over a file whose first line is a good body and whose second is ``line``: the run and the file."""
    work = tmp_path / name
    work.write_bytes(BODIES[0] + b"\n" + line + b"\n")
    return specproxy("bench", "--upstream", up.url, "--from", str(work), "--db", str(tmp_path / "x.db")), work
