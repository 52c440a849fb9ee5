"""Run inside a private network namespace (``unshare -rn``) by ``test_admin_beyond_loopback.py``: the
namespace's loopback device also carries a non-loopback address (``NON_LOOPBACK``), so a real client can
connect from an address that is not loopback while nothing is reachable from outside the namespace.

Starts the scripted upstream and ``specproxy serve`` (the real command, its token from a config file)
listening on each address in turn, asks for the reserved pages and for a chat turn from each source
address, and prints one JSON object: the statuses and the paths the upstream received."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specproxy.app.fake_upstream import FakeUpstream, Script

NON_LOOPBACK = "192.0.2.77"
TOKEN = "a-token-for-the-namespace-test-0123"
_READY = re.compile(r"forwarding http://[^ ]+:(\d+) ->")


def _status(port: int, source: str, target: str, path: str, headers: str = "", body: bytes = b"") -> int:
    """One request from ``source`` to ``target``; the response's status code."""
    method = "POST" if body else "GET"
    extra = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n" if body else ""
    with socket.create_connection((target, port), timeout=10, source_address=(source, 0)) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{headers}{extra}Connection: close\r\n\r\n".encode() + body)
        head = b""
        while b"\r\n" not in head:
            data = s.recv(4096)
            if not data:
                break
            head += data
    return int(head.split(b" ")[1])


def _serve(tmp: Path, upstream: str, host: str, token: str | None, front: str) -> tuple[subprocess.Popen, int]:
    config = tmp / f"{host}-{bool(token)}.toml"
    config.write_text(f'admin_token = "{token}"\n' if token else "")
    log = tmp / f"{host}-{bool(token)}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specproxy.app.cli", "serve", "--config", str(config), "--upstream", upstream,
         "--host", host, "--port", "0", "--db", str(tmp / f"{host}-{bool(token)}.db"), "--scrape-interval", "0",
         "--tokenizer", "none", "--lane" if front == "lane" else "--no-lane"],
        stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = _READY.search(log.read_text(errors="replace"))
        if m:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.02)  # polling a log file for the start-up line: no event to wait on across processes
    proc.kill()
    raise SystemExit(f"serve did not start: {log.read_text(errors='replace')}")


async def main(front: str) -> dict:
    upstream = await FakeUpstream(Script(pieces=["Hi", " there"], interval_s=0.001)).start()
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        configs = (("0.0.0.0", TOKEN), ("0.0.0.0", None), ("127.0.0.1", None))
        started = await asyncio.gather(*(asyncio.to_thread(_serve, Path(d), upstream.url, host, token, front)
                                         for host, token in configs), return_exceptions=True)  # at once
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:  # none left running
            for r in started:
                if not isinstance(r, BaseException):
                    r[0].kill()
            raise failed[0]
        for (host, token), (proc, port) in zip(configs, started):
            target = "127.0.0.1"
            try:
                seen = {}
                for source in (NON_LOOPBACK, "127.0.0.1"):
                    for name, headers in (("none", ""), ("wrong", "Authorization: Bearer not-the-token-at-all\r\n"),
                                          ("bearer", f"Authorization: Bearer {TOKEN}\r\n")):
                        for page in ("/_specproxy/", "/_specproxy/metrics"):
                            seen[f"{source} {page} {name}"] = await asyncio.to_thread(
                                _status, port, source, target, page, headers)
                    seen[f"{source} chat"] = await asyncio.to_thread(
                        _status, port, source, target, "/v1/chat/completions", "", chat)
                out[f"{host} token={bool(token)}"] = seen
            finally:
                proc.terminate()
                await asyncio.to_thread(proc.wait, 30)
    out["upstream paths"] = sorted({s.path for s in upstream.sent})
    await upstream.close()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
