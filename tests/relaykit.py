"""Socket pairs and a bounded wait for tests that drive the relay thread directly."""

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


class Ends:
    """An upstream socket pair and a client socket pair; the turn gets ``up_theirs`` and ``cl_ours``."""

    def __init__(self, family=socket.AF_UNIX) -> None:
        if family == socket.AF_UNIX:
            self.up_server, self.up_proxy = socket.socketpair()
        else:
            self.up_server, self.up_proxy = tcp_pair()
        self.cl_proxy, self.cl_client = socket.socketpair()

    def turn(self, sink, framing=None):
        return relayc.Turn(sink, self.up_proxy.fileno(), self.cl_proxy.fileno(), framing or relayc.ChunkedEnd())

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
