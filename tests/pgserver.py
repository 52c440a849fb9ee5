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
