"""Socket pairs and their fixtures, reads from them, and a bounded wait: for tests driving the relay thread."""

import select
import socket
import time

import pytest

from specproxy.wire import memory
from specproxy.wire.relay_thread import _relayc as relayc


@pytest.fixture(autouse=True)
def give_back_what_the_turns_kept():
    """The thread charges the process's memory budget for the bytes each turn keeps (``wire/memory.py``);
    in the proxy, measuring the turn gives them back. Turns relayed by hand are never measured, so the
    test gives their charge back, or a later test in this worker would find the budget spent (one that
    checks the budget's refusals, or that it starts from nothing, did). Autouse in every module that
    imports it."""
    before = memory.used()
    yield
    kept = memory.used() - before
    if kept > 0:
        memory.give(kept)


def wait_done(sink, timeout: float = 5.0) -> list[int]:
    """The ids the thread reports next (bounded: fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    ids: list[int] = []
    while not ids:
        left = deadline - time.monotonic()
        assert left > 0, "the relay thread reported no turn"
        select.select([sink.fileno()], [], [], left)
        ids = sink.done()
    return ids


@pytest.fixture
def sink():
    return relayc.Sink()


@pytest.fixture
def ends():
    """Unix socket pairs for both sides of a turn (closed after the test, whatever it asserted)."""
    e = Ends()
    yield e
    e.close()


@pytest.fixture
def tcp_ends():
    """As ``ends``, with TCP on the upstream side (resets, send buffers)."""
    e = Ends(socket.AF_INET)
    yield e
    e.close()


class Ends:
    """An upstream socket pair and a client socket pair; the turn gets ``up_theirs`` and ``cl_ours``."""

    def __init__(self, family=socket.AF_UNIX) -> None:
        if family == socket.AF_UNIX:
            self.up_server, self.up_proxy = socket.socketpair()
        else:
            self.up_server, self.up_proxy = tcp_pair()
        self.cl_proxy, self.cl_client = socket.socketpair()

    def turn(self, sink, framing=None, keep=None, first=None):
        """A turn over these ends; ``first``: reads that came with the head, relayed before it returns."""
        args = [sink, self.up_proxy.fileno(), self.cl_proxy.fileno(), framing or relayc.ChunkedEnd()]
        if keep is not None or first is not None:
            args.append(keep if keep is not None else 1 << 40)
        if first is not None:
            args.append(first)
        return relayc.Turn(*args)

    def close(self) -> None:
        for s in (self.up_server, self.up_proxy, self.cl_proxy, self.cl_client):
            s.close()


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    return a, b


def recv_until(sock: socket.socket, n: int, timeout: float = 5.0) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (bounded)."""
    sock.settimeout(timeout)
    got = bytearray()
    while len(got) < n:
        data = sock.recv(n - len(got))
        assert data, f"the peer closed after {len(got)} of {n} bytes"
        got += data
    return bytes(got)


def taken(turn) -> tuple[list[bytes], list[float], list[float]]:
    """The reads a turn kept since the last take, with their read and write times."""
    reads: list[bytes] = []
    rtimes: list[float] = []
    wtimes: list[float] = []
    turn.take(reads, rtimes, wtimes)
    return reads, rtimes, wtimes
