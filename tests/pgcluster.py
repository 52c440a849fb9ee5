"""A real PostgreSQL server of Debian's ``postgresql``, made by ``initdb`` in a temporary directory and
started by ``pg_ctl`` on 127.0.0.1 (as ``nobody`` when run as root, which PostgreSQL refuses to run as).

Why a module of its own, without pytest: the test suite's fixture (``tests/pgserver.py``) and the
benchmarks (``scripts/bench_ship.py``, ``scripts/bench_report_pg.py``, ``scripts/bench_overhead.py
--with-sink``) start the same server the same way, and a script should not need pytest to do it (as
``tests/real/server.py`` is to ``tests/real/fixtures.py``).

Roles: ``fleet`` (the superuser, trusted on loopback), ``locked`` (its password is ``LOCKED_PASSWORD``:
wrong credentials), ``reader`` (trusted, but may create nothing: missing permissions).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from ports import free_port  # noqa: F401 (callers import it from here too)

LOCKED_PASSWORD = "right-password-for-locked"


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


PORT_TRIES = 3  # a port free when picked may be taken before the server binds it (another test's listener,
# or the local end of any outgoing connection): a first start picks another


def port_taken(log: str) -> bool:
    """The server said it could not listen because its port was in use."""
    return "address already in use" in log.lower()


class PgServer:
    """``root``: a directory to keep the server in (a benchmark's data, reused by the next run: started
    again when it holds one, made there when it does not); None: a temporary one, removed by ``close``."""

    def __init__(self, bindir: Path, root: Path | None = None) -> None:
        self.bindir = bindir
        self.kept = root is not None
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="specproxy-pg-")) if root is None else root
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self._user: dict = {}
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(self.root, nobody.pw_uid, nobody.pw_gid)
            self._user = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
        if (self.data / "PG_VERSION").exists():  # a kept server: its roles are there already
            (self.data / "postmaster.pid").unlink(missing_ok=True)  # left by a run that was killed
            self._first_start()
            return
        self._run("initdb", "-D", str(self.data), "-U", "fleet", "--auth=trust", "-E", "UTF8", "--no-sync")
        (self.data / "pg_hba.conf").write_text(
            "local all all trust\n"
            "host all fleet,reader 127.0.0.1/32 trust\n"
            "host all all 127.0.0.1/32 scram-sha-256\n")
        self._first_start()
        self.admin(f"CREATE ROLE locked LOGIN PASSWORD '{LOCKED_PASSWORD}'", "CREATE ROLE reader LOGIN")

    def _run(self, tool: str, *args: str) -> None:
        out = subprocess.run([str(self.bindir / tool), *args], capture_output=True, text=True, timeout=120,
                             cwd=self.root, **self._user)
        if out.returncode != 0:
            raise RuntimeError(f"{tool} failed: {out.stderr.strip()} {self.log.read_text() if self.log.exists() else ''}")

    def _first_start(self) -> None:
        """Start on a port of its own: another when the one picked was taken meanwhile (a restart keeps
        its port: what it serves points there)."""
        for attempt in range(PORT_TRIES):
            try:
                return self.start()
            except RuntimeError as exc:
                if attempt == PORT_TRIES - 1 or not port_taken(str(exc)):
                    raise
                self.port = free_port()

    def start(self) -> None:
        """Start (again), on the same port; returns once it accepts connections (``pg_ctl -w``, bounded)."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o",
                  f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
                  "-c synchronous_commit=off -c full_page_writes=off -c shared_buffers=32MB", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    @property
    def pid(self) -> int:
        """The postmaster's process id (the first line of ``postmaster.pid``); its backends are its children.
        A benchmark counts their CPU apart from the proxy's."""
        return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])

    def url(self, db: str = "postgres", user: str = "fleet") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{db}"

    def admin(self, *statements: str, db: str = "postgres") -> list:
        import psycopg

        with psycopg.connect(self.url(db), autocommit=True) as conn:
            rows = []
            for statement in statements:
                cur = conn.execute(statement)
                rows = cur.fetchall() if cur.description else []
            return rows

    def new_database(self) -> str:
        """A fresh database; its URL for ``fleet``."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.admin(f"CREATE DATABASE {name}")
        return name

    def close(self) -> None:
        try:
            self.stop("fast" if self.kept else "immediate")  # fast: a checkpoint, so the last commits are kept
        except RuntimeError:
            pass
        if not self.kept:
            shutil.rmtree(self.root, ignore_errors=True)
