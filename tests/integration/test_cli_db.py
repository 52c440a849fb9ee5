"""Every read command on every kind of wrong database file: one line naming the file, exit status 2,
no traceback, and the file left as it was (a missing one is not created)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from specproxy.app.cli import main
from specproxy.store.db import open_store

COMMANDS = {
    "report": ["report"],
    "report --json": ["report", "--json"],
    "report --no-cache": ["report", "--no-cache"],
    "export jsonl": ["export"],
    "export csv": ["export", "--format", "csv"],
    "compare": ["compare", "a", "b"],
    "compare --negative-control": ["compare", "a", "--negative-control"],
    "audit": ["audit"],
    "audit --no-cache": ["audit", "--no-cache"],
    "prune --turns": ["prune", "--before", "2025-01-01", "--turns"],  # after every turn: reads them all
}


def _turns_db(path: Path, n: int = 0) -> Path:
    conn = open_store(path)
    conn.executemany("INSERT INTO turns (id, t_wall, method, path, outcome, label) "
                     "VALUES (?, ?, 'POST', '/v1/chat/completions', 'ok', ?)",
                     [(f"{i:032x}", 1.7e9 + i, "ab"[i % 2]) for i in range(n)])
    conn.close()
    return path


def _missing(p: Path) -> None:
    pass


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _junk(p: Path) -> None:
    p.write_bytes(bytes(range(256)) * 16)


def _foreign(p: Path) -> None:  # another program's SQLite database
    conn = sqlite3.connect(p)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.commit()
    conn.close()


def _directory(p: Path) -> None:
    p.mkdir()


def _newer(p: Path) -> None:
    conn = open_store(p)
    conn.execute("INSERT INTO _migrations VALUES ('999_from_the_future', 0)")
    conn.close()


def _corrupt(p: Path) -> None:
    """A specproxy database whose schema pages are intact and whose turn pages are not: it opens, and
    fails only once the turns are read."""
    _turns_db(p, 3000)
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xa5" * (size - size // 2))


def _unreadable(p: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads a file whatever its mode")
    _turns_db(p)
    p.chmod(0)


KINDS = {
    "missing": (_missing, "database does not exist"),
    "empty": (_empty, "not a specproxy database: an empty file (0 bytes)"),
    "junk": (_junk, "not an SQLite database"),
    "foreign": (_foreign, "not a specproxy database: an SQLite database without a turns table"),
    "directory": (_directory, "is a directory"),
    "newer": (_newer, "written by a newer specproxy (schema step 999_from_the_future is unknown here)"),
    "corrupt": (_corrupt, "database: database disk image is malformed"),
    "unreadable": (_unreadable, "cannot"),
}


def _fingerprint(p: Path) -> str | None:
    if p.is_dir():
        return "dir:" + ",".join(sorted(os.listdir(p)))
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_database_is_one_line_and_left_alone(tmp_path, kind, command):
    make, message = KINDS[kind]
    db = tmp_path / "specproxy.db"
    make(db)
    before = _fingerprint(db)
    result = CliRunner().invoke(main, [*COMMANDS[command], "--db", str(db)])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert lines == [lines[0]] and lines[0].startswith(f"specproxy: error: {db}: ") and message in lines[0], lines
    assert "Traceback" not in result.output
    if kind != "corrupt":  # export streams: rows before the bad page may be out already
        assert result.stdout == ""
    assert _fingerprint(db) == before  # never created, never changed
    assert not (tmp_path / "specproxy.db.cache").exists()


@pytest.mark.parametrize("command", ["report", "export", "compare"])
def test_an_older_database_is_upgraded_in_place_and_read(tmp_path, command):
    """A database an older specproxy wrote (its first three migrations, one turn) is not refused: the read
    command applies the later migrations and reads the turn."""
    from specproxy.store.db import MIGRATIONS, connect

    db = tmp_path / "old.db"
    conn = connect(db)
    conn.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at REAL)")
    for name, statements in MIGRATIONS[:3]:
        for sql in statements:
            conn.execute(sql)
        conn.execute("INSERT INTO _migrations VALUES (?, 0)", (name,))
    conn.execute("INSERT INTO turns (id, t_wall, method, path, outcome, label, streamed) "
                 "VALUES ('old', 1.7e9, 'POST', '/v1/chat/completions', 'ok', 'a', 1)")
    conn.close()
    args = {"report": ["report", "--json"], "export": ["export"], "compare": ["compare", "a", "--negative-control"]}
    result = CliRunner().invoke(main, [*args[command], "--db", str(db)])
    if command == "compare":  # one turn cannot be split: the error is about the data, not the file
        assert "written by an older" not in result.output and f"{db}:" not in result.stderr, result.output
    else:
        assert result.exit_code == 0, (result.output, result.exception)
        assert ('"turns": 1' in result.stdout) if command == "report" else ('"id":"old"' in result.stdout)
    conn = connect(db)
    assert [r[0] for r in conn.execute("SELECT name FROM _migrations ORDER BY name")] == [n for n, _ in MIGRATIONS]
    conn.close()


def test_a_bad_database_through_the_real_entry_point(tmp_path):
    """The same, as a user runs it: a separate process, its stderr as written (no traceback at all)."""
    import subprocess
    import sys

    db = tmp_path / "junk.db"
    _junk(db)
    proc = subprocess.run([sys.executable, "-m", "specproxy.app.cli", "export", "--db", str(db)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [f"specproxy: error: {db}: not an SQLite database (file is not a database)"]


def test_a_good_database_still_reads(tmp_path):
    db = _turns_db(tmp_path / "ok.db", 40)
    for command in COMMANDS.values():
        result = CliRunner().invoke(main, [*command, "--db", str(db)])
        assert result.exit_code == 0, (command, result.output, result.exception)


def _serve_on_a_busy_port(db: Path, *args: str, env: dict | None = None):
    """serve on a port another socket holds; ``args`` replace ``--upstream``."""
    import socket
    import subprocess
    import sys

    if not args and env is None:
        args = ("--upstream", "http://127.0.0.1:9")
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "specproxy.app.cli", "serve", *args, "--port", str(port),
                               "--db", str(db)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, **(env or {})})
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"specproxy: error: cannot listen on 127.0.0.1:{port}: ") and "in use" in lines[0].lower()


def test_serve_on_a_port_in_use_creates_no_database(tmp_path):
    _serve_on_a_busy_port(tmp_path / "fresh.db")
    assert sorted(os.listdir(tmp_path)) == []  # no fresh.db, -wal, -shm


def test_serve_on_a_port_in_use_leaves_an_existing_database_as_it_was(tmp_path):
    db = _turns_db(tmp_path / "kept.db", 10)
    before = db.read_bytes()
    _serve_on_a_busy_port(db)
    assert db.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["kept.db"]


def test_the_upstream_may_come_from_the_config_file_or_the_environment(tmp_path):
    """--upstream is required only when neither gives it: serve gets as far as binding the port."""
    config = tmp_path / "c.toml"
    config.write_text('upstream = "http://127.0.0.1:9"\n')
    _serve_on_a_busy_port(tmp_path / "a.db", "--config", str(config))
    _serve_on_a_busy_port(tmp_path / "b.db", env={"SPECPROXY_UPSTREAM": "http://127.0.0.1:9"})


def test_a_start_that_fails_closes_the_database_and_the_port(tmp_path):
    """Whatever fails in start(), run_forever closes what was opened: the writer's database (so its -wal
    and -shm go) and the bound port."""
    import asyncio

    from specproxy.config import load_config
    from specproxy.serve.service import Service

    cfg = load_config(env={}, overrides={"upstream": "http://127.0.0.1:9", "port": 0, "db": str(tmp_path / "s.db")})
    service = Service.from_config(cfg)
    bound = list(getattr(service, "_sockets", []))

    async def fail() -> int:
        raise RuntimeError("start-up failed")

    service.start = fail
    with pytest.raises(RuntimeError, match="start-up failed"):
        asyncio.run(service.run_forever())
    assert sorted(os.listdir(tmp_path)) == ["s.db"]  # closed: no -wal, -shm
    assert all(sock.fileno() == -1 for sock in bound)


def _cli(*args: str, prefix: tuple[str, ...] = ()):
    import subprocess
    import sys

    return subprocess.run([*prefix, sys.executable, "-m", "specproxy.app.cli", *args], capture_output=True, text=True,
                          timeout=60)


def test_serve_on_a_directory_says_it_is_one(tmp_path):
    """As the read commands say it (issue #31: serve said "unable to open database file")."""
    d = tmp_path / "a-directory"
    d.mkdir()
    proc = _cli("serve", "--upstream", "http://127.0.0.1:9", "--port", "0", "--db", str(d))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"specproxy: error: {d}: is a directory, not a "
                                                                  "database file"], proc.stderr
    assert os.listdir(d) == []


def _read_only_mount(src: Path, dst: Path) -> tuple[str, ...]:
    """A command prefix that runs a command with ``dst`` a read-only bind mount of ``src``, in a mount
    namespace of its own (nothing outside sees it); the test is skipped where that takes privileges
    this machine does not give."""
    import shutil
    import subprocess

    script = 'mount --bind "$0" "$1" && mount -o remount,ro,bind "$1" && shift && exec "$@"'
    prefix = ("unshare", "-m", "sh", "-c", script, str(src), str(dst))
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("no private read-only bind mount here (needs unshare -m and mount)")
    return prefix


def test_a_database_on_a_read_only_mount_says_why_it_cannot_be_opened(tmp_path):
    """SQLite must create the WAL database's -shm file even to read it, which a read-only file system
    refuses: its "unable to open database file" alone does not say so (issue #31)."""
    src, dst = tmp_path / "data", tmp_path / "mnt"
    src.mkdir()
    dst.mkdir()
    _turns_db(src / "t.db", 3)
    prefix = _read_only_mount(src, dst)
    db = dst / "t.db"
    why = f"({dst} is on a read-only file system: SQLite must create t.db-shm beside a WAL database, even to read it)"
    for args in (["report", "--db", str(db)], ["serve", "--upstream", "http://127.0.0.1:9", "--port", "0",
                                                "--db", str(db)]):
        proc = _cli(*args, prefix=prefix)
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"specproxy: error: {db}: "), lines
        assert lines[0].endswith(why), lines
    assert sorted(os.listdir(src)) == ["t.db"]


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "replay"])
def test_export_to_a_file_that_cannot_be_written_is_one_line(tmp_path, fmt):
    """A missing directory and a read-only file system: `cannot write PATH: reason`, as `report --html`
    says it, no traceback (issue #31)."""
    db = _turns_db(tmp_path / "t.db", 3)
    out = tmp_path / "no-such-dir" / "x.jsonl"
    result = CliRunner().invoke(main, ["export", "--db", str(db), "--format", fmt, "-o", str(out)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.splitlines() == [f"specproxy: error: cannot write {out}: No such file or directory"]

    src, dst = tmp_path / "out", tmp_path / "ro"
    src.mkdir()
    dst.mkdir()
    proc = _cli("export", "--db", str(db), "--format", fmt, "-o", str(dst / "x.out"), prefix=_read_only_mount(src, dst))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"specproxy: error: cannot write {dst / 'x.out'}: Read-only file system"], proc.stderr
    assert os.listdir(src) == []


def test_every_report_counts_the_same_turns_and_other_paths(tmp_path):
    """One report said "the database holds 38 turns", another "37 turns" and "1 other path" for the same
    file (issue #31): a turn is a measured row in both, the other paths' rows are said apart; and one of
    each is singular."""
    db = _turns_db(tmp_path / "t.db", 37)
    conn = sqlite3.connect(db)
    conn.execute("UPDATE turns SET measured = 1")
    conn.execute("INSERT INTO turns (id, t_wall, method, path, outcome, measured) "
                 "VALUES ('other', 1.7e9, 'GET', '/v1/models', 'ok', 0)")
    conn.commit()
    conn.close()
    whole = CliRunner().invoke(main, ["report", "--db", str(db)]).stdout
    assert ": 37 turns (37 ok)" in whole and "other paths: 1 request forwarded" in whole, whole
    empty = CliRunner().invoke(main, ["report", "--db", str(db), "--label", "none-such"]).stdout
    assert "the database holds 37 turns (" in empty and " UTC) and 1 other-path request" in empty, empty
    held = orjson.loads(CliRunner().invoke(main, ["report", "--db", str(db), "--label", "none-such", "--json"]).stdout)
    assert (held["database_turns"]["n"], held["database_turns"]["other"]) == (37, 1)

    one = _turns_db(tmp_path / "one.db", 1)
    text = CliRunner().invoke(main, ["report", "--db", str(one)]).stdout
    assert ": 1 turn (1 ok)" in text, text
