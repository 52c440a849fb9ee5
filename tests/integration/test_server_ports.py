"""The test suite's own PostgreSQL and Prometheus take another port when the one they picked was taken
before they could listen on it (the port is free when picked, then bound by the server a moment later:
another test's listener, or the local end of an outgoing connection, may take it in between, and a
suite of three workers opening thousands of connections did hit that). Each test hands the server a
port held by a listener of its own first."""

from __future__ import annotations

import os
import socket
import urllib.request

import pytest

import pgcluster
import promserver
from pgcluster import PgServer, pg_bin


@pytest.fixture
def taken_first(monkeypatch):
    """``free_port`` gives a port a listener here holds, once, then free ones; the held port."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    port = held.getsockname()[1]
    ports = iter([port])
    real = pgcluster.free_port
    pick = lambda: next(ports, None) or real()  # noqa: E731
    monkeypatch.setattr(pgcluster, "free_port", pick)
    monkeypatch.setattr(promserver, "free_port", pick)
    yield port
    held.close()


def test_postgres_starts_on_another_port_when_its_first_was_taken(taken_first):
    bindir = pg_bin()
    if bindir is None:
        if os.environ.get("SPECPROXY_REQUIRE_POSTGRES") == "1":
            pytest.fail("PostgreSQL's binaries are not installed and SPECPROXY_REQUIRE_POSTGRES=1")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    server = PgServer(bindir)
    try:
        assert server.port != taken_first
        assert server.admin("SELECT 1") == [(1,)]
    finally:
        server.close()


def test_prometheus_starts_on_another_port_when_its_first_was_taken(taken_first):
    prometheus = promserver.Prometheus(["127.0.0.1:9"])
    try:
        assert prometheus.port != taken_first
        with urllib.request.urlopen(prometheus.url + "/-/ready", timeout=10) as resp:
            assert resp.status == 200
    finally:
        prometheus.close()
