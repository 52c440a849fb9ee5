"""Socket pairs and a bounded wait for tests that drive the relay thread directly."""

import select
import socket
import time

from specproxy.wire.relay_thread import _relayc as relayc


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
