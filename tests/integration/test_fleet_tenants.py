"""Tenants across a fleet: two real ``specproxy serve`` processes, each with a database of its own, name
one API key the same tenant when they share a secret (``--tenant-secret-file``, or
``SPECPROXY_TENANT_SECRET``), and differently without one (each database's own secret). The shared secret
is in no file either proxy wrote (database, write-ahead log, logs), nor is the key. Issue 34.
"""

from __future__ import annotations

import hashlib
import hmac
import sqlite3
import urllib.request
from pathlib import Path

from serveproc import LoopThread, ServeProcess
from specproxy.app.fake_upstream import FakeUpstream, Script

CHAT = "/v1/chat/completions"
KEY = "sk-proj-fleet34sharedTENANTkeyAAAAAAAAAA"
OTHER_KEY = "sk-ant-api03-fleet34otherTENANTBBBBBBBBBB"
SECRET = "fleet34-shared-secret-0123456789abcdef"


def chat(url: str, key: str) -> None:
    body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    req = urllib.request.Request(url + CHAT, body, {"Content-Type": "application/json",
                                                    "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        assert resp.status == 200


def tenants_of(tmp: Path, upstream: str, db: Path, *args: str, env: dict | None = None) -> list[str | None]:
    """Serve two turns of KEY and one of OTHER_KEY through a proxy of its own, stop it (its writer commits
    every turn before it exits), and read the tenants its database holds, in order."""
    proc = ServeProcess(tmp, upstream, db, "--tenant-from-key", *args, env=env, name=db.stem)
    try:
        for key in (KEY, OTHER_KEY, KEY):
            chat(proc.url, key)
    finally:
        assert proc.stop() == 0, proc.stderr()
    conn = sqlite3.connect(db)
    try:
        return [t for (t,) in conn.execute("SELECT tenant FROM turns ORDER BY t_wall")]
    finally:
        conn.close()


def fingerprint(secret: str, key: str) -> str:
    return "key:" + hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()[:16]


def test_a_shared_secret_names_a_key_alike_on_every_proxy_and_is_never_written(tmp_path):
    lt = LoopThread()
    up = FakeUpstream(Script(pieces=["a", "b"]))
    lt.run(up.start())
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")  # as `openssl rand -hex 32 > FILE` leaves it: the newline is dropped
    run = tmp_path / "run"
    run.mkdir()
    try:
        by_file = tenants_of(run, up.url, run / "a.db", "--tenant-secret-file", str(secret_file))
        by_env = tenants_of(run, up.url, run / "b.db", env={"SPECPROXY_TENANT_SECRET": SECRET})
        own_c = tenants_of(run, up.url, run / "c.db")
        own_d = tenants_of(run, up.url, run / "d.db")
    finally:
        lt.run(up.close())
        lt.close()
    expected = [fingerprint(SECRET, KEY), fingerprint(SECRET, OTHER_KEY), fingerprint(SECRET, KEY)]
    assert by_file == expected and by_env == expected
    # without one, each database's own secret: the same key is another tenant on each proxy
    assert own_c[0] == own_c[2] and own_d[0] == own_d[2] and own_c[0] != own_d[0] and own_c[0] != expected[0]
    assert all(t is not None and t.startswith("key:") for t in own_c + own_d)
    # every file the four proxies wrote: databases, their -wal and -shm, the logs
    written = [p for p in run.iterdir() if p.is_file()]
    assert any(p.suffix == ".log" for p in written) and any(p.suffix == ".db" for p in written)
    for path in written:
        data = path.read_bytes()
        for text in (SECRET, SECRET[:16], KEY, KEY[8:24], OTHER_KEY):
            assert text.encode() not in data and text.encode().hex().encode() not in data, (path, text)


def test_an_empty_or_unreadable_secret_file_is_one_line_at_start(tmp_path):
    from click.testing import CliRunner

    from specproxy.app.cli import main

    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, said in ((empty, "is empty"), (tmp_path / "missing", "cannot read tenant_secret_file")):
        result = CliRunner().invoke(main, ["serve", "--upstream", "http://127.0.0.1:9", "--db",
                                           str(tmp_path / "x.db"), "--tenant-from-key", "--tenant-secret-file",
                                           str(path)], env={})
        assert result.exit_code == 2, result.output
        assert said in result.output and result.output.strip().count("\n") == 0, result.output
    assert not (tmp_path / "x.db").exists()  # refused before any file was made
