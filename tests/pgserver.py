"""The fleet's tests' PostgreSQL: one server (``tests/pgcluster.py``: ``initdb`` and ``pg_ctl`` in a temporary
directory on 127.0.0.1) per test worker, a session fixture; each test makes its own database in it.
Without the binaries the tests skip, except where ``SPECPROXY_REQUIRE_POSTGRES=1`` (``.ci/run``) makes
that a failure.
"""

from __future__ import annotations

import os

import pytest
from pgcluster import PgServer, pg_bin

__all__ = ["pg_server"]


def pg_count(url: str, table: str = "turns") -> int | None:
    """Rows of ``table`` in the fleet's database at ``url``; None before the first shipper made its tables
    (what the fleet's tests wait on: a shipper's rows arriving). ``turns``' key holds its id, so its count
    is that of distinct turns."""
    import psycopg

    try:
        with psycopg.connect(url, autocommit=True) as conn:
            return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    except psycopg.errors.UndefinedTable:
        return None


@pytest.fixture(scope="session")
def pg_server():
    bindir = pg_bin()
    if bindir is None:
        if os.environ.get("SPECPROXY_REQUIRE_POSTGRES") == "1":
            pytest.fail("PostgreSQL's binaries are not installed (apt-get install postgresql) and "
                        "SPECPROXY_REQUIRE_POSTGRES=1")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql): the fleet's tests need it")
    server = PgServer(bindir)
    yield server
    server.close()
