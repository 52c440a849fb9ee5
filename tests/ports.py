"""Ports for the servers the tests start: free when picked, and outside the kernel's ephemeral range.

Why: a port bound to 0 and closed is free for the kernel to hand out again, to the next ``bind(("", 0))``
(another test's listener) or as the local end of any outgoing connection, and a suite of several workers
opening thousands of connections does take one so, between the pick and the server's bind. A port
below ``net.ipv4.ip_local_port_range`` is never handed out by the kernel itself; each pytest-xdist worker
draws from its own slice of them, so two workers never pick the same one. What is left is the suite's
own servers, which the bind check here sees (and a server that loses the port anyway retries: the
callers say how).
"""

from __future__ import annotations

import os
import random
import socket

__all__ = ["free_port"]

FIRST = 10_000  # above the well-known and registered ports the suite's servers use by default (5432, 9090)
SLICES = 16  # the xdist workers' slices (a worker's index modulo this)


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bound(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 free a moment ago, which the kernel gives no one else meanwhile (see above)."""
    top = _ephemeral_start()
    span = (top - FIRST) // SLICES
    if span >= 100:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        index = int(worker[2:]) if worker[2:].isdigit() else 0
        lo = FIRST + (index % SLICES) * span
        rng = random.Random()
        for _ in range(200):
            port = rng.randrange(lo, lo + span)
            if _bound(port):
                return port
    with socket.socket() as s:  # no room below the ephemeral range (a machine set up so): the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
